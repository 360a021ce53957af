"""The tile store's halves timed apart: the keys and the values of the same tiles launched alone at several warp
counts, both in one launch, and `store_tiles` as this tree launches it (kvarn.kernels.store._launch_parts); with
--against, an earlier kvarn's store.py on the same inputs in the same process, and how many record bytes differ.
CUDA events, medians of repeats of 10 launches (--calls), the variants in turn; inputs: random K with per-channel
offsets (RoPE'd keys' biases), random V, a NaN in K and a constant V tile.

    PYTHONPATH=. python3 scripts/device/store_halves.py [--tiles 256] [--kv-heads 8] [--head-dims 128,64,256]
    git show BASE:kvarn/kernels/store.py > /tmp/store_base.py
    PYTHONPATH=. python3 scripts/device/store_halves.py --against /tmp/store_base.py
    PYTHONPATH=. ncu --profile-from-start off --set full -o store python3 scripts/device/store_halves.py --profile
    PYTHONPATH=. python3 scripts/device/store_halves.py --device cpu --tiles 2 --kv-heads 1 --head-dims 64 --reps 1 \
      --calls 1                                                      # a smoke test (interpreter: TRITON_INTERPRET=1)

The earlier store.py is loaded as a module of this tree's kvarn.kernels (its relative imports resolve here, so the
names it imports must still exist). --profile launches each variant once between cudaProfilerStart and Stop, each in
an NVTX range named by its label (for Nsight Compute), and times nothing. Prints a table, then one JSON line; the
column `halves_vs_store_tiles` counts the record bytes where the keys launch then the values launch differ from
`store_tiles` (0: the two launches write the same records).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch

from kvarn.formats import get_format
from kvarn.kernels import store as S
from kvarn.kernels.records import layout

# (label, half, warps): the halves alone at the warp counts worth comparing, and both halves in one launch
VARIANTS = [("both w8", S.BOTH.value, 8), ("keys w4", S.KEYS.value, 4), ("keys w8", S.KEYS.value, 8),
            ("values w8", S.VALUES.value, 8), ("values w16", S.VALUES.value, 16)]


def _inputs(T: int, H: int, D: int, device: str, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    G = 128
    k = torch.randn(T, H, G, D, device=device, generator=g) + 4 * torch.randn(1, H, 1, D, device=device, generator=g)
    v = torch.randn(T, H, G, D, device=device, generator=g)
    k[0, 0, 3, 5] = float("nan")
    v[-1, 0] = 0.5
    return k.bfloat16(), v.bfloat16()


def _load_store(path: str):
    """An earlier store.py as a module of this tree's kvarn.kernels package."""
    spec = importlib.util.spec_from_file_location("kvarn.kernels._store_against", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _launch_half(k, v, cache, ids, lay, half: int, warps: int, iters: int) -> None:
    """One launch of the tile kernel for one half (or both) at this warp count, through the store's own launcher."""
    S._launch_store(k, v, cache, lay, k.shape[0], k.shape[1], iters, S.TILES.value, block_ids=ids,
                    parts=((half, warps),))


def _time_all(runs: dict, reps: int, calls: int, cuda: bool) -> dict:
    """Median microseconds of one call per variant over `reps` rounds, each round `calls` calls of every variant in
    turn (clock drift spread over all of them)."""
    out = {label: [] for label in runs}
    for _ in range(reps):
        for label, fn in runs.items():
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            if cuda:
                e1.record()
                torch.cuda.synchronize()
                out[label].append(e0.elapsed_time(e1) * 1e3 / calls)
            else:
                out[label].append((time.perf_counter() - t) * 1e6 / calls)
    return {label: round(statistics.median(xs), 1) for label, xs in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", type=int, default=256, help="tiles per launch (256: a 32 x 1,024 prefill, one layer)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dims", default="128", help="comma-separated: 64, 128, 256")
    ap.add_argument("--kv-dtype", default="kvarn_k4v2_g128")
    ap.add_argument("--against", default=None, help="an earlier kvarn's kvarn/kernels/store.py (a file)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="launches per timed repeat")
    ap.add_argument("--profile", action="store_true", help="one launch of each variant for Nsight Compute")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the interpreter (a smoke test, not a timing)")
    a = ap.parse_args()
    cuda = torch.device(a.device).type == "cuda"
    if a.profile and not cuda:
        ap.error(f"--profile needs a CUDA device, got --device {a.device}")
    fmt = get_format(a.kv_dtype)
    iters = fmt.balance_iters
    other = _load_store(a.against) if a.against else None
    rows = []
    for D in (int(x) for x in a.head_dims.split(",")):
        lay = layout(fmt, D)
        k, v = _inputs(a.tiles, a.kv_heads, D, a.device, D)
        ids = torch.randperm(a.tiles, generator=torch.Generator().manual_seed(D)).to(a.device, torch.int32)
        cache = torch.zeros(a.tiles, a.kv_heads, fmt.record_bytes(D), dtype=torch.uint8, device=a.device)
        runs = {label: (lambda h=half, w=warps: _launch_half(k, v, cache, ids, lay, h, w, iters))
                for label, half, warps in VARIANTS}
        runs["store_tiles"] = lambda: S.store_tiles(k, v, cache, ids, fmt)
        if other is not None:
            theirs = torch.zeros_like(cache)
            runs["against"] = lambda: other.store_tiles(k, v, theirs, ids, fmt)
        for fn in runs.values():  # compiles
            fn()
        if cuda:
            torch.cuda.synchronize()
        if a.profile:
            print("profiled launches, in order: " + ", ".join(lbl for lbl, _, _ in VARIANTS), flush=True)
            torch.cuda.profiler.start()
            for label, _, _ in VARIANTS:
                with torch.cuda.nvtx.range(label):
                    runs[label]()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        row = {"head_dim": D, "tiles": a.tiles, "kv_heads": a.kv_heads, **_time_all(runs, a.reps, a.calls, cuda)}
        S.store_tiles(k, v, cache, ids, fmt)
        halves = torch.zeros_like(cache)
        for half, warps in S._launch_parts(S.TILES.value, lay, D):  # store_tiles' launches, one at a time
            _launch_half(k, v, halves, ids, lay, half, warps, iters)
        row["halves_vs_store_tiles"] = int((halves != cache).sum())
        if other is not None:
            row["bytes_differ_keys"] = int((cache[..., :lay.pv] != theirs[..., :lay.pv]).sum())
            row["bytes_differ_values"] = int((cache[..., lay.pv:] != theirs[..., lay.pv:]).sum())
        rows.append(row)
    if not rows:
        return
    cols = [c for c in rows[0] if c not in ("tiles", "kv_heads")]
    print(f"us per launch, {a.tiles} tiles x {a.kv_heads} KV heads, {a.kv_dtype}, {a.device}")
    print(" ".join(f"{c:>19}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>19}" for c in cols))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
