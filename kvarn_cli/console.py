"""Shared Rich consoles and small printing helpers for the CLI."""
from __future__ import annotations

import json

from rich.console import Console

out = Console(highlight=False)
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def err(msg: str) -> None:
    # the message names user input verbatim: no markup, no emoji codes (":x" in "cuda:x" is not an emoji)
    _err.print(msg, markup=False, emoji=False)


def print_json(obj) -> None:
    print(json.dumps(obj, indent=None, default=str))


def not_ready(command: str, issue: str) -> None:
    """An unfinished command says so and exits 2; it does not pretend."""
    from kvarn.errors import KvarnError

    raise KvarnError(f"`kvarn {command}` is not implemented yet ({issue})")
