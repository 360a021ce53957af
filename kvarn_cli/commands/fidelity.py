"""`kvarn fidelity` (placeholder until the method issue lands)."""
from __future__ import annotations

import typer

from ..console import not_ready


def register(app: typer.Typer) -> None:
    @app.command("fidelity", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def fidelity(ctx: typer.Context) -> None:
        """Not implemented yet."""
        not_ready("fidelity", "the method issue")
