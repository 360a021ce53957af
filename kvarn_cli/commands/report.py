"""`kvarn report` (placeholder until the report issue lands)."""
from __future__ import annotations

import typer

from ..console import not_ready


def register(app: typer.Typer) -> None:
    @app.command("report", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def report(ctx: typer.Context) -> None:
        """Not implemented yet."""
        not_ready("report", "the report issue")
