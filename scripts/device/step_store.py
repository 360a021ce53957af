"""The KV store a prefill step pays, as the vLLM backend runs it: kvarn.vllm_plugin.ops.store over a planned step of
R fresh prompts (K/V views into one qkv buffer, as vLLM hands them), once per layer, timed on the GPU. Written against
the interfaces an earlier kvarn has too (plan_step, ops.store), so before_after.sh runs it on both sides: whichever
kvarn is first on PYTHONPATH is timed.

    python3 scripts/device/step_store.py [--requests 32] [--prompt 987] [--layers 28] [--kv-heads 8] [--reps 7]

Prompts of 987 tokens (not whole tiles: each step leaves tokens in the tail, as serving does). Prints one JSON line:
the tiles the step stores, the median step time in ms (host launches included, as an eager prefill step pays them)
and every repeat.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kvarn.formats import get_format
from kvarn.vllm_plugin import ops
from kvarn.vllm_plugin.step_plan import plan_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=987)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-dtype", default="kvarn_k4v2_g128")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    dev, fmt = "cuda", get_format(a.kv_dtype)
    g, R, P, H, D = fmt.group, a.requests, a.prompt, a.kv_heads, a.head_dim
    blocks = -(-P // g)
    table = torch.arange(R * blocks, dtype=torch.int32, device=dev).view(R, blocks)
    plan = plan_step(np.arange(R + 1) * P, np.full(R, P), R, np.arange(R, dtype=np.int32), table, g, dev,
                     sink=fmt.sink_tokens, window=fmt.window_tokens)
    qkv = torch.randn(R * P, a.q_heads + 2 * H, D, device=dev).bfloat16()
    k, v = qkv[:, a.q_heads:a.q_heads + H], qkv[:, a.q_heads + H:]
    caches = [torch.zeros(R * blocks, H, fmt.record_bytes(D), dtype=torch.uint8, device=dev) for _ in range(a.layers)]
    tails = [[torch.zeros(R + 1, H, fmt.tail_rows, D, dtype=torch.bfloat16, device=dev) for _ in range(2)]
             for _ in range(a.layers)]

    def step():
        for cache, (tk, tv) in zip(caches, tails):
            ops.store(plan, k, v, cache, tk, tv, fmt)

    step()  # compiles
    torch.cuda.synchronize()
    ms = []
    for _ in range(a.reps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ms.append(1e3 * (time.perf_counter() - t))
    print(json.dumps({"tiles": plan.num_tiles * a.layers, "requests": R, "prompt": P, "layers": a.layers,
                      "step_store_ms": sorted(ms)[len(ms) // 2], "ms": [round(x, 3) for x in ms]}))


if __name__ == "__main__":
    main()
