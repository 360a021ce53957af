"""Host-side timing of the vLLM backend's per-step plan builder (`kvarn.vllm_plugin.step_plan.plan_step`), on fake
metadata shaped like a real step. Not a test: `python scripts/time_plan.py [--device cpu] [--ref]`.

Cases (g = 128, the default preset's tile): pure decode of B = 64 / 256 rows with contexts 4K-16K (some rows
completing a tile this step), and a mixed batch (a first prefill chunk, a continuation chunk spanning tiles, a
prefix-cache hit on a tile boundary, decodes, padded rows). `--ref` also times the old per-row loop builder
(`build_plan_reference`) for a before/after comparison. The block-table gather and the host->device copies
are part of the timed call (no-ops / cheap on CPU)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
import statistics
import time

import numpy as np
import torch

from kvarn.vllm_plugin import step_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the oracle lives with the tests
from tests.plan_reference import build_plan_reference  # noqa: E402

G = 128


def decode_batch(B, rng, pad_rows=0):
    seq = rng.integers(4096, 16385, size=B)
    seq[:: max(1, B // 8)] = (seq[:: max(1, B // 8)] // G) * G  # 8 rows complete a tile this step
    qlen = np.ones(B, dtype=np.int64)
    return _pack(seq, qlen, rng, pad_rows)


def mixed_batch(n_dec, rng, pad_rows=4):
    seq_d = rng.integers(4096, 16385, size=n_dec)
    seq_d[::8] = (seq_d[::8] // G) * G
    # (ctx, q): first chunk; continuation spanning tiles mid-tile; prefix hit on a tile boundary; tail-only chunk
    pre = [(0, 2048), (2000, 2048), (1024, 700), (4100, 20)]
    seq = np.concatenate([seq_d, [c + q for c, q in pre]])
    qlen = np.concatenate([np.ones(n_dec, dtype=np.int64), [q for _, q in pre]])
    return _pack(seq, qlen, rng, pad_rows)


def _pack(seq, qlen, rng, pad_rows):
    seq = np.concatenate([seq, np.zeros(pad_rows, dtype=np.int64)]).astype(np.int32)
    qlen = np.concatenate([qlen, np.zeros(pad_rows, dtype=np.int64)])
    R = len(seq)
    qsl = np.zeros(R + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(qlen)
    slots = rng.permutation(256)[:R].astype(np.int32) if R <= 256 else np.arange(R, dtype=np.int32)
    slots[R - pad_rows:] = 256
    width = int(-(-seq.max() // G))
    bt = torch.from_numpy(rng.integers(1, 200_000, size=(R, width)).astype(np.int32))
    return qsl, seq, R, slots, bt


def bench(fn, args, reps):
    fn(*args, G, "cpu")  # warm
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args, G, "cpu")
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--ref", action="store_true", help="also time the old per-row loop (build_plan_reference)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    cases = [("decode B=64", decode_batch(64, rng)), ("decode B=256", decode_batch(256, rng)),
             ("mixed 60 dec + 4 chunks + 4 pad", mixed_batch(60, rng)),
             ("mixed 250 dec + 4 chunks + 2 pad", mixed_batch(250, rng, pad_rows=2))]
    fns = [("build_plan", step_plan.plan_step)]
    if a.ref:
        fns.append(("reference loop", build_plan_reference))
    print(f"host-side time per call, CPU, median / min over {a.reps} calls (ms)")
    for name, args in cases:
        ntok = int(args[0][args[2]])
        for fname, fn in fns:
            med, mn = bench(fn, args, a.reps)
            print(f"  {name:34s} tokens={ntok:5d}  {fname:15s} {med:7.3f} / {mn:7.3f}")


if __name__ == "__main__":
    main()
