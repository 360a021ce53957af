"""Kernels that compiled during a cell's timed burst, read from its engine log: a compile under load stalls every
running request for seconds (up to 7.6 s of a KVarN burst before the warm-up covered prefill steps), so a row
whose engine compiled mid-run says so, for any format (vLLM's, TurboQuant's and our kernels alike).

kvarn's compile log (KVARN_LOG_COMPILES=1, set for bench cells) has a timed line for every compile, prefixed by vLLM
with the process that printed it; the worker marks the start of the timed burst (BURST_MARK). With tensor
parallelism every rank compiles the same kernels at the same time: the stall is the slowest rank's, not the sum.
"""
from __future__ import annotations

import math
import re

from ..engines.vllm_log import BURST_MARK, latest_attempt

_TIMED = re.compile(r"\[kvarn\] \d\d:\d\d:\d\d\.\d{3} triton compile (\S+) ([0-9.]+|\?) s")
_PROCESS = re.compile(r"^\(([^)]*?)pid=(\d+)\)")  # "(EngineCore pid=5547) ...", "(Worker_TP1 pid=7) ..."


def midrun_compiles(log_text: str) -> dict:
    """{"jit_compiles": n, "jit_compile_s": seconds, "jit_kernels": "name 4.8 s, ..."}: the compiles (disk-cache
    loads too) logged after the burst's start by the process that spent the most time compiling (seconds NaN when
    a line had no duration); {} when the log marks no start (a cell that died before its burst: unknown)."""
    lines = latest_attempt(log_text)
    marks = [i for i, ln in enumerate(lines) if BURST_MARK in ln]
    if not marks:
        return {}
    per_process: dict[str, list[tuple[str, float]]] = {}
    for ln in lines[marks[-1] + 1:]:
        m = _TIMED.search(ln)
        if m:
            p = _PROCESS.match(ln)
            secs = math.nan if m.group(2) == "?" else float(m.group(2))
            per_process.setdefault(p.group(2) if p else "", []).append((m.group(1), secs))
    found = max(per_process.values(), key=lambda c: sum(0.0 if math.isnan(s) else s for _, s in c), default=[])
    total = sum(s for _, s in found)
    return {"jit_compiles": float(len(found)), "jit_compile_s": round(total, 2) if not math.isnan(total) else total,
            "jit_kernels": ", ".join(n if math.isnan(s) else f"{n} {s:.1f} s" for n, s in found)[:500]}
