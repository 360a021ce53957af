"""`kvarn suite`: declarative suites (suites/*.yaml) run through `kvarn bench` and `kvarn eval` into one results dir."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from ..console import err, out


def _show_plan(suite, steps) -> None:
    t = Table(title=f"suite {suite.name}: {len(steps)} steps, {suite.bench_cells()} bench cells"
                    f"{' x ' + str(suite.bench['repeats']) + ' repeats' if suite.bench else ''}, "
                    f"{suite.eval_cells()} eval cells", show_lines=False)
    t.add_column("#", justify="right")
    t.add_column("step", no_wrap=True)
    t.add_column("runs", justify="right")
    for i, s in enumerate(steps, 1):
        t.add_row(str(i), s.title, str(s.runs))
    out.print(t)
    for s in steps:
        print(s.command())


def register(app: typer.Typer) -> None:
    sub = typer.Typer(help="Declarative suites: list, show, run.", no_args_is_help=True)

    @sub.command("list")
    def list_() -> None:
        """Suites bundled under suites/ (a YAML with a models key)."""
        from kvarn.suite import load_suite, suite_names

        t = Table(title="suites")
        for c in ("name", "models", "formats", "TP", "bench cells", "eval cells"):
            t.add_column(c)
        for name in suite_names():
            try:
                s = load_suite(name)
            except Exception as e:  # a broken file is listed, not fatal
                t.add_row(name, f"invalid: {e}", "", "", "", "")
                continue
            t.add_row(s.name, ", ".join(m["name"] for m in s.models), ", ".join(s.formats),
                      ", ".join(str(x) for m in s.models for x in m["tp"]), str(s.bench_cells()), str(s.eval_cells()))
        out.print(t)

    @sub.command("show")
    def show(suite: str = typer.Argument(..., help="Suite name (suites/NAME.yaml) or path."),
             out_dir: Path = typer.Option(None, "--out", help="Results directory (default: the suite's results).")) -> None:
        """Validate a suite and print its expanded plan."""
        from kvarn.suite import load_suite, plan

        s = load_suite(suite)
        out.print(f"[b]{s.name}[/b] ({s.path}): {s.description}")
        out.print(f"models: {', '.join(m['name'] + (' (' + m['weights'] + ')' if m['weights'] else '') for m in s.models)}")
        out.print(f"formats: {', '.join(s.formats)}")
        if s.bench:
            out.print(f"bench: {s.bench['mode']}, bursts {s.bench['bursts']}, output {s.bench['output_len']}, "
                      f"{s.bench['requests']} requests, {s.bench['repeats']} repeats")
        if s.eval:
            out.print("eval: " + ", ".join(t["name"] + "".join(f" {k}={t[k]}" for k in ("samples", "limit", "context")
                                                                  if k in t) for t in s.eval["tasks"]))
        _show_plan(s, plan(s, out_dir))

    @sub.command("run")
    def run(
        suite: str = typer.Argument(..., help="Suite name (suites/NAME.yaml) or path."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (every command) and run nothing."),
        resume: bool = typer.Option(True, "--resume/--force", help="Skip cells already done in the results "
                                    "directory (by config hash and repeat; the default), or --force: run them again."),
        out_dir: Path = typer.Option(None, "--out", "-o", help="Results directory (default: the suite's results)."),
        only: str = typer.Option(None, "--only", help="Run only bench or only eval steps."),
        fail_fast: bool = typer.Option(False, "--fail-fast", help="Stop at the first failed step."),
    ) -> None:
        """Run the suite's Cartesian product through `kvarn bench` and `kvarn eval` into one results directory.
        Exit 0 when every step succeeded, 1 when a step failed (the others still ran), 2 for a bad suite."""
        from kvarn.errors import KvarnError
        from kvarn.suite import load_suite, plan, run_suite

        if only not in (None, "bench", "eval"):
            raise KvarnError(f"--only must be bench or eval, got {only!r}")
        s = load_suite(suite)
        dest = out_dir or Path(s.results)
        steps = plan(s, dest, resume=resume, only=only)
        if not steps:
            raise KvarnError(f"suite {s.name}: nothing to run" + (f" with --only {only}" if only else ""))
        if dry_run:
            _show_plan(s, steps)
            return
        manifest = run_suite(s, steps, dest, fail_fast=fail_fast, echo=lambda m: out.print(m, markup=False,
                                                                                            highlight=False))
        failed = manifest["failed_steps"]
        out.print(f"suite {s.name}: {len(manifest['steps']) - failed} of {len(steps)} steps ok; results in {dest}; "
                  f"manifest {dest / 'suite-manifest.json'}")
        if failed or manifest["skipped_steps"]:
            err(f"suite {s.name}: {failed} step(s) failed, {manifest['skipped_steps']} skipped")
            raise typer.Exit(1)

    app.add_typer(sub, name="suite")
