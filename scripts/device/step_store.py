"""What a prefill step's KV path costs, as the vLLM backend runs it, timed on the GPU: kvarn.vllm_plugin.ops.store
over a planned step of R fresh prompts (K/V views into one qkv buffer, as vLLM hands them), once per layer; with
--mixed, a step as chunked prefill under a burst schedules it (half the rows decodes, first in the batch as vLLM
orders it, then first chunks and continuation chunks over a stored prefix by turns, a quarter each), its plan built
on the host in every repeat as the metadata builder does, then ops.store and ops.attention per layer (first and
continuation chunks through vLLM's FlashAttention where it imports). Written against the interfaces an earlier kvarn
has too (plan_step, update_sink_lens, ops.store, ops.attention), so before_after.sh runs it on both sides: whichever
kvarn is first on PYTHONPATH is timed.

    python3 scripts/device/step_store.py [--mixed] [--requests 32] [--prompt 987] [--layers 28] [--kv-heads 8]
    python3 scripts/device/step_store.py --device cpu --requests 4 --prompt 130 --layers 2 --reps 1   # a smoke test

Prompts of 987 tokens (not whole tiles: each step leaves tokens in the tail, as serving does). Prints one JSON line:
the tiles the step stores, the median step time in ms (host work and launches included, as an eager prefill step
pays them) and every repeat; of it the host's time to launch the step (host_ms, median) and, on a GPU, the GPU's
own time for it (gpu_ms, one run of the step queued behind a sleep kernel; null where that cannot be measured):
host_ms above gpu_ms is a step whose GPU waits on the host.
"""
from __future__ import annotations

import argparse
import json
import time
from statistics import median_high

import numpy as np
import torch

from kvarn.formats import get_format
from kvarn.vllm_plugin import ops, step_plan


def _varlen(head_dim: int, scale: float):
    """vLLM's FlashAttention varlen as the backend calls it (bottom-right causal), or None without vLLM. Built here,
    not taken from the backend's impl: the script runs against earlier kvarn trees too."""
    try:
        from kvarn.vllm_plugin.backend import flash_varlen

        found = flash_varlen(head_dim)
    except Exception:  # noqa: BLE001 - no vLLM here: the torch varlen
        return None
    if found is None:
        return None
    fa, ver = found

    def run(q, k, v, cu, max_len, cu_k=None, max_k=None, out=None):
        # as the backend's: only vLLM's fork (a version) takes out=
        kw = {} if ver is None else {"fa_version": ver, "out": out}
        if out is None:
            # a tree whose ops never passes `out` is one whose backend also copied the qkv-split views first: as it
            q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
        return fa(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu if cu_k is None else cu_k, max_seqlen_q=max_len,
                  max_seqlen_k=max_len if max_k is None else max_k, softmax_scale=scale, causal=True, **kw)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixed", action="store_true", help="a chunked-prefill step: store and attention")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=987)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-dtype", default="kvarn_k4v2_g128")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the torch reference (a smoke test, not a timing)")
    a = ap.parse_args()
    dev, fmt = a.device, get_format(a.kv_dtype)
    sync = torch.cuda.synchronize if torch.device(dev).type == "cuda" else (lambda: None)
    g, R, P, H, Hq, D = fmt.group, a.requests, a.prompt, a.kv_heads, a.q_heads, a.head_dim
    scale = D ** -0.5
    if a.mixed:  # rows: first chunks of P, continuation chunks of P // 2 after P // 2, decodes after P
        # decode rows first, as vLLM orders a batch; first and continuation chunks alternate after them
        prefill = np.resize([0, 1], 2 * (R // 4))
        kinds = np.concatenate([np.full(R - len(prefill), 2), prefill])
        ctx = np.select([kinds == 0, kinds == 1], [0, P // 2], P)
        qlen = np.select([kinds == 0, kinds == 1], [P, P // 2], 1)
    else:
        ctx, qlen = np.zeros(R, dtype=np.int64), np.full(R, P)
    seq = ctx + qlen
    qsl = np.concatenate([[0], np.cumsum(qlen)])
    blocks = -(-int(seq.max()) // g)
    table = torch.arange(R * blocks, dtype=torch.int32, device=dev).view(R, blocks)
    slots = np.arange(R, dtype=np.int32)
    N = int(qsl[-1])
    qkv = torch.randn(N, Hq + 2 * H, D, device=dev).bfloat16()
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + H], qkv[:, Hq + H:]
    out = torch.empty(N, Hq, D, dtype=torch.bfloat16, device=dev)
    seq_dev = torch.from_numpy(seq.astype(np.int32)).to(dev)
    caches = [torch.zeros(R * blocks, H, fmt.record_bytes(D), dtype=torch.uint8, device=dev) for _ in range(a.layers)]
    tails = [[torch.zeros(R + 1, H, fmt.tail_rows, D, dtype=torch.bfloat16, device=dev) for _ in range(2)]
             for _ in range(a.layers)]
    sink_tags = torch.full((R + 1,), -1, dtype=torch.int32, device=dev)
    win_tags = torch.full((R + 1, 2), -1, dtype=torch.int32, device=dev)
    lens = [torch.zeros(R + 1, dtype=torch.int32, device=dev) for _ in range(2)]
    varlen = _varlen(D, scale)

    def planned():  # the metadata builder's host work of a step
        p = step_plan.plan_step(qsl, seq, R, slots, table, g, dev, sink=fmt.sink_tokens, window=fmt.window_tokens)
        step_plan.update_sink_lens(p, sink_tags, table, lens[0])
        step_plan.update_window_lens(p, win_tags, table, lens[1])
        return p

    fresh = planned()

    def step():  # the mixed step plans itself (its attention keeps per-step state on the plan); the store alone
        plan = planned() if a.mixed else fresh  # times the layers' stores, as the figures recorded for it did
        plan.prepared.clear()  # each step's first layer prepares its launches, as in a real step
        for cache, (tk, tv) in zip(caches, tails):
            ops.store(plan, k, v, cache, tk, tv, fmt)
            if a.mixed:
                ops.attention(plan, q, k, v, out, cache, table, seq_dev, tk, tv, fmt, scale, raw_varlen=varlen)
        return plan

    plan = step()  # compiles
    sync()
    ms, host = [], []
    for _ in range(a.reps):
        t = time.perf_counter()
        step()
        h = time.perf_counter()
        sync()
        ms.append(1e3 * (time.perf_counter() - t))
        host.append(1e3 * (h - t))
    gpu_ms = None
    # without FlashAttention the torch varlen reads its offsets back to the host (a sync): no GPU-only time then
    if torch.device(dev).type == "cuda" and not (a.mixed and varlen is None):
        # the GPU's own time, one run: the step queued behind a sleep kernel (2e9 cycles, 1 s or more), so the host
        # is far ahead and no gap between launches waits on it. Valid only if queueing took well under the sleep (a
        # step of more launches than the stream's queue holds makes the host wait for the GPU)
        a0, a1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        torch.cuda._sleep(int(2e9))
        a0.record()
        step()
        a1.record()
        queued = time.perf_counter() - t
        sync()
        gpu_ms = round(a0.elapsed_time(a1), 3) if queued < 0.5 else None
    print(json.dumps({"mixed": a.mixed, "tiles": plan.num_tiles * a.layers, "requests": R, "prompt": P,
                      "layers": a.layers, "tokens": N, "flash_attention": varlen is not None,
                      "step_ms": round(median_high(ms), 3), "host_ms": round(median_high(host), 3), "gpu_ms": gpu_ms,
                      "ms": [round(x, 3) for x in ms]}))


if __name__ == "__main__":
    main()
