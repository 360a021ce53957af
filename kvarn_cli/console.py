"""Shared Rich consoles and small printing helpers for the CLI."""
from __future__ import annotations

import json

from rich.console import Console

out = Console(highlight=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)  # messages and progress bars


def err(msg: str) -> None:
    # the message names user input verbatim: no markup, no emoji codes (":x" in "cuda:x" is not an emoji)
    err_console.print(msg, markup=False, emoji=False)


def print_json(obj) -> None:
    print(json.dumps(obj, indent=None, default=str))
