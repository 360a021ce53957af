"""`kvarn eval` (placeholder until the eval issue lands)."""
from __future__ import annotations

import typer

from ..console import not_ready


def register(app: typer.Typer) -> None:
    @app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def eval_(ctx: typer.Context) -> None:
        """Not implemented yet."""
        not_ready("eval", "the eval issue")
