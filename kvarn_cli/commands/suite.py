"""`kvarn suite` (placeholder until the report issue lands)."""
from __future__ import annotations

import typer

from ..console import not_ready


def register(app: typer.Typer) -> None:
    @app.command("suite", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def suite(ctx: typer.Context) -> None:
        """Not implemented yet."""
        not_ready("suite", "the report issue")
