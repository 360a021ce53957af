"""Run a plan cell by cell: engine -> one result row -> atomic append, right when the cell ends."""
from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from typing import Protocol

from ..formats import FP16_NAMES
from ..results import ResultsStore
from ..results.schema import BENCH_METRICS
from ..results.store import utc_now
from .config import Cell
from .engines.base import EngineResult
from .plan import BenchPlan
from .ratios import fp16_reference, ratios


class Listener(Protocol):
    def cell_started(self, cell: Cell, index: int) -> None: ...

    def cell_finished(self, cell: Cell, row: dict) -> None: ...


def build_row(cell: Cell, res: EngineResult, started_at: str, wall_s: float) -> dict:
    row = {"kind": "bench", "run_id": cell.run_id, "config_hash": cell.hash, "repeat": cell.repeat,
           "status": res.status, "error": res.error or "", "task": "", **cell.config.row_fields()}
    for k in BENCH_METRICS:  # every metric column exists in every part: NaN where the mode has none
        row[k] = float("nan")
    for k, v in res.metrics.items():
        try:
            row[k] = float(v) if v is not None else float("nan")
        except (TypeError, ValueError):
            row[k] = float("nan")
    for k, v in res.info.items():
        row[k] = v if isinstance(v, (str, int, float, bool)) or v is None else str(v)
    row["wall_s"] = wall_s
    row["started_at"] = started_at
    row["log_path"] = cell.log_path
    return row


@contextmanager
def _terminate_as_interrupt():
    """SIGTERM (CI cancel, `timeout`) ends the cell in flight like Ctrl-C does."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_plan(plan: BenchPlan, listener: Listener | None = None) -> list[dict]:
    """Run every todo cell; return this run's rows. Interrupts stop the cell's processes and re-raise."""
    store = ResultsStore(plan.out)
    prior = store.read("bench").to_dict("records") if plan.todo and plan.baseline_run else []
    rows: list[dict] = []
    with _terminate_as_interrupt():
        for i, cell in enumerate(plan.todo):
            if listener:
                listener.cell_started(cell, i)
            started, t0 = utc_now(), time.perf_counter()
            try:
                res = plan.engine.run(cell, plan.timeout_s)
            except KeyboardInterrupt:
                plan.engine.interrupt()
                raise
            except Exception as e:  # noqa: BLE001 - an engine bug must not lose the rest of the matrix
                res = EngineResult("failed", f"{type(e).__name__}: {e}"[:500])
            # completed first: the row's id and GPU are what later rows of this run name as their FP16 baseline
            row = store.complete_row(build_row(cell, res, started, time.perf_counter() - t0))
            if row["kv_dtype"] in FP16_NAMES and row["status"] == "ok":
                row.update(ratios(row, row))
            else:
                # this run's FP16 row only; another run's (`--baseline-run`) only when asked for
                row.update(ratios(row, fp16_reference(row, rows + prior, plan.baseline_run)))
            store.append(row, kind="bench")
            rows.append(row)
            if listener:
                listener.cell_finished(cell, row)
    return rows
