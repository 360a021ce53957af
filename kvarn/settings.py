"""Every KVARN_* environment setting, as data: its type, default, what it does, and whether it changes results.

Settings are read once per process (the first `get`), parsed by one parser per type, and a bad value is a
KvarnError naming the setting and the values it accepts. Result rows record the result-changing ones
(`result_env`): a run with another value is another cell, never merged with this one. Some change only speed
(the numbers are the same): bench rows record those too, accuracy rows do not.

    from kvarn import settings
    settings.get("KVARN_SINK")      # -> 16 (int)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import KvarnError


@dataclass(frozen=True)
class Setting:
    name: str
    type: str  # "bool" | "int" | "float" | "path"
    default: object
    doc: str
    changes_results: bool = False
    # the same numbers, another speed: a throughput cell of its own, an accuracy cell shared
    changes_speed: bool = False
    # where it acts: "method" (the quantizer itself: PyTorch reference, hf engine and kernels alike), "backend"
    # (the vLLM backend only), "tools" (the CLI and bench workers)
    scope: str = "tools"
    minimum: float | None = None


SETTINGS = (
    Setting("KVARN_BALANCE_ITERS", "int", 3,
            "Sinkhorn-like balancing iterations per tile (best iterate kept); the method ships 8, 3 measure the same",
            changes_results=True, scope="method", minimum=1),
    Setting("KVARN_SINK", "int", 16,
            "first tokens of every request kept 16-bit for good (attention sinks), capped at the tile - 1",
            changes_results=True, scope="method", minimum=0),
    Setting("KVARN_DEFER_FLUSH", "bool", True,
            "decode steps leave a completed tile in the 16-bit tail; the next step flushes every layer in one launch",
            changes_results=True, scope="backend"),
    Setting("KVARN_FULL_GRAPH", "bool", True,
            "pure decode steps run as one full CUDA graph (0: attention eager between piecewise graphs)",
            changes_speed=True, scope="backend"),
    Setting("KVARN_LOG_COMPILES", "bool", False,
            "one log line per Triton compile of the process, with its duration (to match stalls to compiles)"),
    Setting("KVARN_SUITES", "path", "",
            "folder of the suite files (default: the suites/ folder beside the package)"),
    Setting("KVARN_CACHE", "path", "",
            "cache folder of the converted real models (default: $XDG_CACHE_HOME/kvarn, else ~/.cache/kvarn)"),
    Setting("KVARN_PROGRESS_S", "float", 5.0,
            "seconds between writes of a bench worker's progress file", minimum=0),
)
BY_NAME = {s.name: s for s in SETTINGS}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_bool(s: Setting, raw: str) -> bool:
    v = raw.lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise KvarnError(f"{s.name}={raw!r}: accepted values are 1 / 0 (or true / false, yes / no, on / off)")


def _parse_number(s: Setting, raw: str):
    cast = int if s.type == "int" else float
    try:
        value = cast(raw)
    except ValueError:
        value = None
    if value is None or (s.minimum is not None and value < s.minimum):
        what = "an integer" if s.type == "int" else "a number"
        bound = f" >= {s.minimum:g}" if s.minimum is not None else ""
        raise KvarnError(f"{s.name}={raw!r}: accepted values are {what}{bound}")
    return value


_PARSERS = {"bool": _parse_bool, "int": _parse_number, "float": _parse_number, "path": lambda s, raw: raw}


def parse(name: str, raw: str | None):
    """The typed value of setting `name` from its raw text (None or blank: the default)."""
    s = BY_NAME[name]
    if raw is None or not raw.strip():
        return s.default
    return _PARSERS[s.type](s, raw.strip())


_VALUES: dict[str, object] = {}


def get(name: str):
    """This process's value of a setting, read from the environment at the first call and kept."""
    if name not in _VALUES:
        _VALUES[name] = parse(name, os.environ.get(name))
    return _VALUES[name]


def reload() -> None:
    """Forget the values read so far (tests that change the environment; a process reads its settings once)."""
    _VALUES.clear()


def _text(s: Setting, value) -> str:
    if s.type == "bool":
        return "1" if value else "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


def result_env(environ=None, scopes: tuple[str, ...] = ("method", "backend"), speed: bool = False) -> str:
    """'KEY=value;...' of every result-changing setting in `scopes` with its effective value, sorted: what result
    rows record (and what tells their cells apart). speed: also the settings that change only speed (throughput
    rows). environ: a mapping to read instead of this process's settings."""
    out = []
    for s in sorted(SETTINGS, key=lambda s: s.name):
        if (s.changes_results or (speed and s.changes_speed)) and s.scope in scopes:
            value = get(s.name) if environ is None else parse(s.name, environ.get(s.name))
            out.append(f"{s.name}={_text(s, value)}")
    return ";".join(out)


def table() -> list[dict]:
    """The settings as rows (name, type, default, changes results, doc), for `kvarn env` and the docs."""
    return [{"name": s.name, "type": s.type, "default": s.default, "changes_results": s.changes_results,
             "changes_speed": s.changes_speed, "scope": s.scope, "doc": s.doc} for s in SETTINGS]
