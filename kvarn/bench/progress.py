"""How far a worker got, in WORKDIR/progress.json, so a cell killed by its timeout still says what it reached.

The worker (a cell, engines/vllm_cell.py) rewrites the file atomically at each phase and every few seconds of the
burst; the orchestrator reads it only when it had to kill the worker. A timed-out row then carries the capacity vLLM
reported and the partial counts (requests done, tokens generated, seconds into the burst), and its error says
them: enough to bound the configuration's throughput (the burst took longer than that) and, offline, to estimate it
(tokens generated over the burst's seconds so far) instead of knowing nothing.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from .ratios import as_float

FILE = "progress.json"
# progress fields that are result columns too (kvarn.results.schema.BENCH_METRICS), copied into a timed-out row
ROW_FIELDS = ("engine_start_s", "kv_tokens", "kv_blocks", "max_concurrency", "peak_running", "peak_waiting",
              "preemptions", "completed", "num_requests", "total_output_tokens", "kv_usage_peak")


class ProgressFile:
    """The worker's side: update(**fields) merges and writes at most every `every_s` seconds (force=True: now)."""

    def __init__(self, workdir: str | os.PathLike | None, every_s: float | None = None):
        self.path = Path(workdir) / FILE if workdir else None
        if every_s is None:  # tests set KVARN_PROGRESS_S=0: every update written
            from ..settings import get

            every_s = get("KVARN_PROGRESS_S")
        self.every_s, self.data, self._last = every_s, {}, -math.inf

    def update(self, force: bool = False, **fields) -> None:
        self.data.update(fields)
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < self.every_s):
            return
        self._last = now
        tmp = self.path.with_name(FILE + ".tmp")
        try:
            tmp.write_text(json.dumps(self.data, default=float))
            os.replace(tmp, self.path)  # a reader never sees half a file
        except OSError:
            pass  # progress is a courtesy: never fail the cell for it


def read_progress(workdir: str | os.PathLike) -> dict:
    try:
        data = json.loads((Path(workdir) / FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def describe(progress: dict, now: float | None = None) -> str:
    """One clause for a timed-out row's error: where the worker was when it was killed at `now` (epoch seconds;
    the burst's seconds count from its recorded start to then, not to the file's last write); '' when unknown."""
    phase = progress.get("phase")
    if not phase:
        return ""
    start = as_float(progress.get("engine_start_s"))
    started = f"engine start {start:.1f} s" if not math.isnan(start) else ""
    if phase == "engine start":
        return "reached: the engine start (not finished)"
    if phase == "warm-up":
        return "reached: the warm-up" + (f" ({started})" if started else "")
    done, n = as_float(progress.get("completed")), as_float(progress.get("num_requests"))
    # every token generated so far (offline), else the finished requests' (serve: a stream's count comes at its end;
    # also what the total_output_tokens column means)
    gen, fin = as_float(progress.get("generated_tokens")), as_float(progress.get("total_output_tokens"))
    secs = as_float(progress.get("burst_s"))
    t0 = as_float(progress.get("burst_started_at"))
    if now is not None and not math.isnan(t0):
        secs = now - t0
    parts = []
    if not math.isnan(secs):
        parts.append(f"{secs:.0f} s into the burst")
    if not math.isnan(done) and not math.isnan(n):
        parts.append(f"{done:.0f} of {n:.0f} requests done")
    if not math.isnan(gen):
        # tokens, seconds and rate from one write of the file (one clock: the rate is what they multiply out to),
        # apart from the seconds to the kill above; with the share of the burst's output behind it: a rate from the
        # first part of long outputs is an upper estimate (the rest decodes at longer contexts)
        so_far = as_float(progress.get("burst_s"))
        want = as_float(progress.get("burst_tokens"))
        share = f"of {want:,.0f} ({gen / want:.0%}) " if want > 0 else ""
        rate = f" in the burst's first {so_far:,.1f} s ({gen / so_far:,.0f} out tok/s)" if so_far > 0 else ""
        parts.append(f"{gen:,.0f} {share}output tokens{rate}")
    elif not math.isnan(fin):
        parts.append(f"{fin:,.0f} output tokens of finished requests")
    if started:
        parts.append(started)
    return "reached: " + ", ".join(parts) if parts else ""


def row_metrics(progress: dict) -> dict:
    """The progress fields that are result columns (numbers only)."""
    return {k: as_float(progress[k]) for k in ROW_FIELDS if k in progress and not math.isnan(as_float(progress[k]))}
