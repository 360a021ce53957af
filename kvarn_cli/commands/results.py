"""`kvarn results` (placeholder until the bench issue lands)."""
from __future__ import annotations

import typer

from ..console import not_ready


def register(app: typer.Typer) -> None:
    @app.command("results", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def results(ctx: typer.Context) -> None:
        """Not implemented yet."""
        not_ready("results", "the bench issue")
