"""`kvarn microbench` (placeholder until the kernels issue lands)."""
from __future__ import annotations

import typer

from ..console import not_ready


def register(app: typer.Typer) -> None:
    @app.command("microbench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def microbench(ctx: typer.Context) -> None:
        """Not implemented yet."""
        not_ready("microbench", "the kernels issue")
