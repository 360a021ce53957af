"""Latency and throughput metrics with `vllm bench serve` definitions (vllm/benchmarks/serve.py, 0.26):

* TTFT: request start -> first streamed token.  E2EL: request start -> last token.
* TPOT: (E2EL - TTFT) / (output_tokens - 1), per request, only requests with more than one output token.
* ITL: every gap between consecutive streamed tokens (chunks), pooled over all requests.
* goodput: completed requests meeting every given SLO (ttft/tpot/e2el in ms; a 1-token request has TPOT 0) / duration.
* throughputs divide by the benchmark duration (first send -> last completion); percentiles are numpy-style linear.
Offline (LLM engine step loop) requests all start at submission, so the same definitions apply.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    prompt_len: int
    start: float = 0.0  # perf_counter seconds
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per token after the first
    latency: float = 0.0  # seconds (E2EL)
    output_tokens: int = 0
    success: bool = False
    error: str = ""


def percentile(values: list[float], p: float) -> float:
    """numpy.percentile(values, p) with linear interpolation, without numpy."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _add_dist(out: dict, name: str, seconds: list[float]) -> None:
    for p in PERCENTILES:
        out[f"{name}_ms_p{p}"] = percentile(seconds, p) * 1000.0
    out[f"{name}_ms_mean"] = (sum(seconds) / len(seconds) * 1000.0) if seconds else float("nan")


def summarize(records: list[RequestRecord], duration_s: float, goodput: dict | None = None,
              timings: bool = True) -> dict:
    """Row metrics from per-request records. `timings=False` (no per-token times) leaves latency columns out."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    dur = max(duration_s, 1e-9)
    m = {
        "num_requests": float(len(records)),
        "completed": float(len(ok)),
        "failed_requests": float(len(records) - len(ok)),
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur,
        "output_tok_s": out_tokens / dur,
        "total_tok_s": (in_tokens + out_tokens) / dur,
        "total_input_tokens": float(in_tokens),
        "total_output_tokens": float(out_tokens),
    }
    if not timings:
        return m
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots, all_tpots, itls = [], [], []
    for r in ok:
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(r.itl)
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        _add_dist(m, name, vals)
    # the longest gap: a stall every running request shares (a kernel compiling mid-run, a long prefill chunk) is
    # at most 1% of the gaps, so p99 can miss it while the mean moves
    m["itl_ms_max"] = max(itls) * 1000.0 if itls else float("nan")
    if goodput:
        slo = {k: v / 1000.0 for k, v in goodput.items()}
        per_req = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = sum(1 for i in range(len(ok)) if all(per_req[k][i] <= s for k, s in slo.items()))
        m["goodput_req_s"] = good / dur
    return m


def max_concurrency_at(num_blocks: float | None, block_size: float | None, context: int) -> float:
    """Requests of `context` tokens the KV pool holds at once (vLLM: num_blocks / cdiv(context, block_size))."""
    if not num_blocks or not block_size or context < 1:
        return float("nan")
    return float(num_blocks) / math.ceil(context / float(block_size))


def pool_blocks_from_log(logged_tokens: int, max_model_len: int, block_size: int) -> int:
    """The pool's block count behind vLLM 0.26's "GPU KV cache size" line, which prints
    int(num_blocks / cdiv(max_model_len, block_size) * max_model_len): fewer tokens than the pool holds when
    max_model_len is no whole number of blocks. num_blocks is the one integer in
    [logged * c / L, (logged + 1) * c / L) (an interval narrower than 1, c = cdiv(L, block) <= L / block + 1)."""
    per_request = -(-max_model_len // block_size)
    return -(-logged_tokens * per_request // max_model_len)

