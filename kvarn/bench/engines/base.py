"""The one engine interface of `kvarn bench` (and of anything else that needs "run this burst, give me numbers").

An engine checks a whole plan before anything runs (bad input -> KvarnError, nothing written), then runs one cell
at a time and returns an EngineResult; it never raises for a failing configuration: crashes, OOMs and timeouts
come back as results with that status and the error text, so the rest of the matrix still runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...errors import KvarnError, choices
from ..config import BenchConfig, Cell


@dataclass
class EngineResult:
    status: str  # ok | failed | timeout | oom | skipped (kvarn.results.STATUSES)
    error: str = ""
    metrics: dict = field(default_factory=dict)  # BENCH_METRICS names -> numbers
    info: dict = field(default_factory=dict)  # extra string/number columns (kv_block_size, attention backend...)


class Engine:
    """Base class; subclasses set `name` and implement `run`."""

    name = "base"
    modes: tuple[str, ...] = ("offline",)
    default_timeout_s: float = 600.0

    def check(self, configs: list[BenchConfig]) -> None:
        """Raise KvarnError for configurations this engine cannot run (called once, before any cell)."""
        for c in configs:
            if c.mode not in self.modes:
                raise KvarnError(f"--mode {c.mode} is not supported by the {self.name} engine; accepted: {choices(self.modes)}")

    def max_tp(self, engine_args: dict) -> tuple[int | None, str]:
        """(largest tensor-parallel size this engine runs here, why); None: no bound known before check()."""
        return None, ""

    def run(self, cell: Cell, timeout_s: float) -> EngineResult:  # pragma: no cover - interface
        raise NotImplementedError

    def interrupt(self) -> None:
        """Stop the cell in flight (Ctrl-C / SIGTERM of `kvarn bench`): free its processes and GPU memory."""


ENGINES: dict[str, Callable[[], Engine]] = {}


def register_engine(name: str):
    """Decorator: ENGINES[name] = factory. Tests register fakes the same way."""

    def deco(factory):
        ENGINES[name] = factory
        return factory

    return deco
