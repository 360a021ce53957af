"""`kvarn env`: versions, git sha, CUDA, driver and GPUs (the provenance every result row carries), and the KVARN_*
settings (kvarn.settings) with their values in this environment."""
from __future__ import annotations

import typer
from rich.table import Table

from kvarn.provenance import provenance

from ..console import out, print_json


def register(app: typer.Typer) -> None:
    @app.command("env")
    def env(json_: bool = typer.Option(False, "--json", help="One JSON object instead of a table.")) -> None:
        """Show kvarn, Python, torch, triton, vLLM, CUDA, driver and GPU provenance."""
        info = provenance()
        if json_:
            print_json(info)
            return
        t = Table(title="kvarn env", show_header=False)
        for k, v in info.items():
            if k == "gpus":
                v = "; ".join(f"{g['index']}: {g['name']} {g['memory_gib']} GiB" for g in v) or "none"
            t.add_row(k, "absent" if v is None else str(v))
        out.print(t)
        from kvarn import settings

        s = Table(title="KVARN_* settings (kvarn/settings.py)")
        for c in ("name", "value", "default", "changes results", "what it does"):
            s.add_column(c, overflow="fold")
        for row in settings.table():
            s.add_row(row["name"], str(settings.get(row["name"])), str(row["default"]),
                      "yes" if row["changes_results"] else "speed only" if row["changes_speed"] else "no", row["doc"])
        out.print(s)
