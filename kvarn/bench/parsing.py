"""Parsing of `kvarn bench` values: token counts (`4k`, `16k`, `32768`), int lists, SLOs, engine args.

Every parser raises KvarnError with the offending value and what is accepted, so the CLI prints one line.
"""
from __future__ import annotations

import json
import re

from ..errors import KvarnError

_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")  # as `vllm bench serve --goodput` accepts them


def parse_tokens(text: str, what: str = "--burst") -> int:
    """'4k' -> 4096, '16K' -> 16384, '1m' -> 1048576, '32768' -> 32768 (binary k like vLLM's context sizes)."""
    m = _TOKENS.match(str(text))
    if not m:
        raise KvarnError(f"{what} {text!r} is not a token count; accepted: an integer or a number with k/m, e.g. 4k, 16k, 32768")
    value = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    if value != int(value) or value < 1:
        raise KvarnError(f"{what} {text!r} must be a positive whole number of tokens")
    return int(value)


def parse_token_list(spec: str, what: str = "--burst") -> list[int]:
    items = [p for p in (s.strip() for s in str(spec).split(",")) if p]
    if not items:
        raise KvarnError(f"{what} is empty; give e.g. 4k or 4k,16k")
    return list(dict.fromkeys(parse_tokens(p, what) for p in items))


def parse_int_list(spec: str, what: str, minimum: int = 1) -> list[int]:
    out: list[int] = []
    for p in (s.strip() for s in str(spec).split(",")):
        if not p:
            continue
        if not re.fullmatch(r"\d+", p) or int(p) < minimum:
            raise KvarnError(f"{what} {p!r} is not an integer >= {minimum}; accepted: e.g. 1 or 1,2,4")
        if int(p) not in out:
            out.append(int(p))
    if not out:
        raise KvarnError(f"{what} is empty")
    return out


def parse_tp(spec, what: str = "--tp", many: bool = False) -> list[int] | int:
    """`--tp` everywhere: tensor-parallel sizes as text ("2", or "1,2" where a command runs each). A command that runs
    one size (many=False) gets an int and rejects a list."""
    sizes = parse_int_list(str(spec), what)
    if many:
        return sizes
    if len(sizes) != 1:
        raise KvarnError(f"{what} {spec!r}: this command runs one tensor-parallel size; accepted: one integer >= 1, "
                         "e.g. 1 or 2 (kvarn bench and kvarn suite run several)")
    return sizes[0]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50` (also comma separated) -> {"ttft": 500.0, "tpot": 50.0}, values in milliseconds."""
    out: dict[str, float] = {}
    for item in items or []:
        for part in re.split(r"[,\s]+", item.strip()):
            if not part:
                continue
            key, sep, val = part.partition(":")
            key = key.strip().lower()
            try:
                ms = float(val)
            except ValueError:
                ms = -1.0
            if not sep or key not in GOODPUT_KEYS or ms <= 0:
                raise KvarnError(f"--goodput {part!r} is not KEY:MS; accepted keys: {', '.join(GOODPUT_KEYS)} "
                                 "with a positive number of milliseconds, e.g. ttft:500 tpot:50")
            out[key] = ms
    return out


def _coerce(value: str):
    """Engine-arg values: JSON when it parses (numbers, true/false, null, lists, dicts), else the string."""
    low = value.strip()
    if low.lower() in ("true", "false"):
        return low.lower() == "true"
    try:
        return json.loads(low)
    except ValueError:
        return value


def parse_engine_args(items: list[str] | None) -> dict:
    """`key=value` pairs (dashes or underscores) -> {"key": value} with JSON-typed values, keys normalised."""
    out: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise KvarnError(f"--engine-arg {item!r} is not key=value, e.g. --engine-arg enforce_eager=true")
        out[key] = _coerce(value)
    return out
