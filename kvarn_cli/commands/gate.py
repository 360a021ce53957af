"""`kvarn gate` (placeholder until the report issue lands)."""
from __future__ import annotations

import typer

from ..console import not_ready


def register(app: typer.Typer) -> None:
    @app.command("gate", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def gate(ctx: typer.Context) -> None:
        """Not implemented yet."""
        not_ready("gate", "the report issue")
