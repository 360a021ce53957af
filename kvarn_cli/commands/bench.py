"""`kvarn bench` (placeholder until the bench issue lands)."""
from __future__ import annotations

import typer

from ..console import not_ready


def register(app: typer.Typer) -> None:
    @app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def bench(ctx: typer.Context) -> None:
        """Not implemented yet."""
        not_ready("bench", "the bench issue")
