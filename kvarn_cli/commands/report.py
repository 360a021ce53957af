"""`kvarn report`: a self-contained HTML report plus PNGs (frontier, capacity, throughput vs burst, latency,
accuracy) and every number with its provenance, from a results directory."""
from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from ..console import out


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        results: List[Path] = typer.Argument(None, help="Results directories (default: results/)."),
        out_dir: Path = typer.Option(None, "--out", "-o", help="Report folder (default: reports/<name of results>)."),
        task: str = typer.Option(None, "--task", help="Eval task for the frontier's accuracy axis (default: all)."),
        burst: str = typer.Option(None, "--burst", "-b", help="Burst context for the frontier, as bench takes it: "
                                  "16k, 4096 (default: 16k, else the largest)."),
        title: str = typer.Option(None, "--title", help="Page title."),
        gate_drop_pp: float = typer.Option(None, "--gate-drop-pp",
                                           help="Draw the allowed accuracy drop (pp) on the frontier."),
        demo: bool = typer.Option(False, "--demo",
                                  help="Write illustrative fixture rows (not measurements) into RESULTS, a new or "
                                       "empty directory of their own, and render them."),
    ) -> None:
        """Render the accuracy-throughput-capacity frontier and the tables behind it (HTML + PNG, offline)."""
        from kvarn.report import build_report

        from kvarn.bench.parsing import parse_tokens

        burst = parse_tokens(burst, "--burst") if burst is not None else None
        dirs = list(results) if results else [Path("results")]
        if demo:
            from kvarn.report.fixtures import write_demo_dir

            if len(dirs) != 1:
                from kvarn.errors import KvarnError

                raise KvarnError("--demo writes one results directory; give exactly one")
            write_demo_dir(dirs[0])
        dest = out_dir or Path("reports") / (dirs[0].resolve().name or "report")
        rep = build_report(dirs if len(dirs) > 1 else dirs[0], dest, task=task, burst=burst, title=title,
                           allowed_drop_pp=gate_drop_pp, illustrative=demo)
        out.print(f"report: {rep.html}")
        for p in rep.pngs:
            out.print(f"  {p}")
        for n in rep.notes:
            out.print(f"  note: {n}")
