"""`kvarn gate`: compare new results with a stored baseline under a policy (exit 0 pass, 1 regression, 2 unusable)."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from kvarn.errors import KvarnError

from ..console import err


def _write(path: Path | None, text: str) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise KvarnError(f"cannot write {path}: {e}") from None


def register(app: typer.Typer) -> None:
    @app.command("gate")
    def gate(
        results: Path = typer.Argument(..., help="New results directory (written by bench / eval / suite run)."),
        baseline: Path = typer.Option(..., "--baseline", help="Stored baseline results directory."),
        policy: Path = typer.Option(None, "--policy", "-p",
                                    help="Policy YAML (default: the built-in policy, same as suites/gates.yaml)."),
        json_out: Path = typer.Option(None, "--json-out", help="Write the JSON verdict here."),
        markdown_out: Path = typer.Option(None, "--markdown-out", help="Write the Markdown summary here (CI comment)."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not print the Markdown summary."),
        min_repeats: int = typer.Option(None, "--min-repeats", metavar="N", help="Fewest repeats a cell needs "
                                        "(overrides the policy's repeats.min; 1 gates a single-repeat run, each "
                                        "cell's one run being its median)."),
    ) -> None:
        """Gate a run against a baseline: medians of odd repeats after validating every raw run, relative and
        absolute perf bounds, accuracy bounds on the paired interval. Exit 0 pass, 1 regression, 2 unusable input."""
        from kvarn.gate import load_policy, markdown, run_gate

        try:
            pol = load_policy(policy)
            verdict = run_gate(results, baseline, pol, policy_source=str(policy) if policy else "built-in",
                               min_repeats=min_repeats)
        except KvarnError as e:  # unusable input: still leave a verdict for CI to read
            v = {"verdict": "unusable", "exit_code": 2, "results": str(results), "baseline": str(baseline),
                 "problems": [{"message": str(e)}], "checks": [], "invalid_runs": [],
                 "summary": {"checks": 0, "passed": 0, "failed": 0, "invalid_runs": 0, "problems": 1}}
            _write(json_out, json.dumps(v, indent=2))
            _write(markdown_out, f"## kvarn gate: ⚠️ unusable (exit 2)\n\n- {e}\n")
            raise
        md = markdown(verdict)
        _write(json_out, json.dumps(verdict, indent=2, default=str))
        _write(markdown_out, md)
        if not quiet:
            print(md)
        if verdict["exit_code"]:
            err(f"gate: {verdict['verdict']} ({verdict['summary']['failed']} failed checks, "
                f"{verdict['summary']['problems']} unusable-input problems)")
        raise typer.Exit(verdict["exit_code"])
