"""Kernels that compiled during a cell's timed burst, read from its engine log: a compile under load stalls every
running request for seconds (session 12: every KVarN run lost 5-13 s so), so a row whose engine compiled mid-run
says so, for any format (vLLM's, TurboQuant's and our kernels alike).

kvarn's compile log (KVARN_LOG_COMPILES=1, set for bench cells) has a timed line for every compile; the worker marks
the start of the timed burst (BURST_MARK). Without the mark (a log of an older worker), vLLM 0.26's JIT monitor line
at the end of its own warm-up is the start instead (it then also counts the bench's untimed warm-up burst).
"""
from __future__ import annotations

import re

from .engines.vllm_worker import BURST_MARK, latest_attempt

MONITOR_ON = "Kernel JIT monitor activated"
_TIMED = re.compile(r"\[kvarn\] \d\d:\d\d:\d\d\.\d{3} triton compile (\S+) ([0-9.]+) s")


def midrun_compiles(log_text: str) -> dict:
    """{"jit_compiles": n, "jit_compile_s": seconds, "jit_kernels": "name 4.8 s, ..."}: the compiles (disk-cache
    loads too) logged after the burst's start; {} when the log marks no start (a cell that died before its burst,
    another vLLM: unknown, not zero)."""
    lines = latest_attempt(log_text)
    marks = [i for i, ln in enumerate(lines) if BURST_MARK in ln]
    if not marks:
        marks = [i for i, ln in enumerate(lines) if MONITOR_ON in ln][:1]
    if not marks:
        return {}
    found = [(m.group(1), float(m.group(2))) for m in map(_TIMED.search, lines[marks[-1] + 1:]) if m]
    return {"jit_compiles": float(len(found)), "jit_compile_s": round(sum(s for _, s in found), 2),
            "jit_kernels": ", ".join(f"{n} {s:.1f} s" for n, s in found)[:500]}
