"""Where bundled data lives: `suites/` in a checkout, `kvarn.suites` once installed."""
from __future__ import annotations

from pathlib import Path


def suites_dir() -> Path:
    from .settings import get

    env = get("KVARN_SUITES")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[1] / "suites"
    if repo.is_dir():
        return repo
    try:  # installed (non-editable): setuptools maps suites/ to the package kvarn.suites
        from importlib.resources import files

        return Path(str(files("kvarn.suites")))
    except ModuleNotFoundError:
        return repo


def models_dir() -> Path:
    return suites_dir() / "models"
