"""Kernel compiles read from a cell's engine log. During the timed burst a compile under load stalls every running
request for seconds (up to 7.6 s of a KVarN burst before the warm-up covered prefill steps), so a row whose engine
compiled mid-run says so, for any format (vLLM's, TurboQuant's and our kernels alike). Before it, they are most of
a cold engine start: `start_costs` splits the start into Triton compiles, vLLM's torch.compile, CUDA graph capture
and the plugin's kernel warm-up, so a slow start says what it paid for.

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


_TORCH_COMPILE = re.compile(r"torch\.compile took ([0-9.]+) s in total")
_GRAPHS = re.compile(r"Graph capturing finished in ([0-9.]+) secs")
_WARMUP = re.compile(r"kvarn: kernels warmed up .* in ([0-9.]+) s")
_READY = "init engine (profile, create kv cache, warmup model) took"  # vLLM's engine core, its start done


def _slowest_process(lines: list[str]) -> list[tuple[str, float]]:
    """(kernel, seconds) of the compile lines of the process that spent the most time compiling: tensor-parallel
    ranks compile the same kernels at once, so the wait is the slowest rank's, not the sum."""
    per_process: dict[str, list[tuple[str, float]]] = {}
    for ln in lines:
        m = _TIMED.search(ln)
        if m:
            p = _PROCESS.match(ln)
            secs = math.nan if m.group(2) == "?" else float(m.group(2))
            per_process.setdefault(p.group(2) if p else "", []).append((m.group(1), secs))
    return max(per_process.values(), key=lambda c: sum(0.0 if math.isnan(s) else s for _, s in c), default=[])


def _total(found: list[tuple[str, float]]) -> float:
    total = sum(s for _, s in found)
    return round(total, 2) if not math.isnan(total) else total


def start_costs(log_text: str) -> dict:
    """What the engine start spent, from the lines up to vLLM's "init engine ... took" (else up to the burst mark:
    the bench's untimed warm-up requests run between the two): {"start_jit_compiles": n,
    "start_jit_compile_s": s} (every Triton compile: TorchInductor's, vLLM's sampler, TurboQuant's, ours; the
    slowest process), and where the engine logged them "start_torch_compile_s" (vLLM's torch.compile),
    "start_graph_capture_s" and "start_kvarn_warmup_s" (the plugin's kernel warm-up, KVarN only; it includes the
    compiles of our kernels). {} when the log shows neither (a start that did not finish: unknown)."""
    lines = latest_attempt(log_text)
    ends = [i for i, ln in enumerate(lines) if _READY in ln] or [i for i, ln in enumerate(lines) if BURST_MARK in ln]
    if not ends:
        return {}
    before = lines[:ends[0]]
    found = _slowest_process(before)
    out = {"start_jit_compiles": float(len(found)), "start_jit_compile_s": _total(found)}
    for key, pat in (("start_torch_compile_s", _TORCH_COMPILE), ("start_graph_capture_s", _GRAPHS),
                     ("start_kvarn_warmup_s", _WARMUP)):
        vals = [float(m.group(1)) for ln in before for m in [pat.search(ln)] if m]
        if vals:
            out[key] = max(vals)  # one line per rank: the slowest
    return out


def midrun_compiles(log_text: str) -> dict:
    """{"jit_compiles": n, "jit_compile_s": seconds, "jit_kernels": "name 4.8 s, ..."}: the compiles (disk-cache
    loads too) logged after the burst's start by the process that spent the most time compiling (seconds NaN when
    a line had no duration); {} when the log marks no start (a cell that died before its burst: unknown)."""
    lines = latest_attempt(log_text)
    marks = [i for i, ln in enumerate(lines) if BURST_MARK in ln]
    if not marks:
        return {}
    found = _slowest_process(lines[marks[-1] + 1:])
    return {"jit_compiles": float(len(found)), "jit_compile_s": _total(found),
            "jit_kernels": ", ".join(n if math.isnan(s) else f"{n} {s:.1f} s" for n, s in found)[:500]}
