"""The tile store's halves timed apart: the keys and the values of the same tiles launched alone at several warp
counts, both in one launch, and `store_tiles` as this tree launches it (kvarn.kernels.store._warps); with --against,
another kvarn's store module on the same inputs in the same process, and how many record bytes differ. CUDA events,
medians of repeats of 10 launches (--calls); inputs: random K with per-channel offsets (RoPE'd keys' biases), random
V, one NaN and one constant tile.

    python3 scripts/device/store_halves.py [--tiles 256] [--kv-heads 8] [--head-dims 128,64,256]
    git show BASE:kvarn/kernels/store.py > kvarn/kernels/_store_base.py     # an earlier store beside this one
    python3 scripts/device/store_halves.py --against kvarn.kernels._store_base
    ncu --profile-from-start off --set full -o store python3 scripts/device/store_halves.py --profile
    python3 scripts/device/store_halves.py --device cpu --tiles 1 --kv-heads 1 --head-dims 64 --reps 1 --calls 1

--profile launches each variant once between cudaProfilerStart and Stop (for Nsight Compute) and times nothing.
Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import torch

from kvarn.formats import get_format
from kvarn.kernels import store as S
from kvarn.kernels.records import f16_view, layout

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


def _launch_half(k, v, cache, ids, lay, half: int, warps: int) -> None:
    """One launch of the tile kernel for one half (or both) at this warp count, as _launch_store passes TILES."""
    T, H = k.shape[0], k.shape[1]
    S._store_tiles_kernel[(T * H, 2 if half == S.BOTH.value else 1)](
        k, v, k, v, cache, f16_view(cache), ids, ids, ids, ids, ids, ids, ids,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        cache.stride(0), cache.stride(1), 0, T, **S._tile_constexprs(lay, H, k.shape[-1], 3),
        SOURCE=S.TILES.value, PART=half, num_warps=warps)


def _time(fn, reps: int, calls: int, device: str) -> float:
    """Median microseconds of one call over `reps` repeats of `calls` calls."""
    cuda = device == "cuda"
    out = []
    for _ in range(reps):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            e1.record()
            torch.cuda.synchronize()
            out.append(e0.elapsed_time(e1) * 1e3 / calls)
        else:
            out.append((time.perf_counter() - t) * 1e6 / calls)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", type=int, default=256, help="tiles per launch (256: a 32 x 1,024 prefill, one layer)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dims", default="128", help="comma-separated: 64, 128, 256")
    ap.add_argument("--kv-dtype", default="kvarn_k4v2_g128")
    ap.add_argument("--against", default=None, help="a module with store_tiles (an earlier kvarn's store.py)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="launches per timed repeat")
    ap.add_argument("--profile", action="store_true", help="one launch of each variant for Nsight Compute")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the interpreter (a smoke test, not a timing)")
    a = ap.parse_args()
    fmt = get_format(a.kv_dtype)
    other = importlib.import_module(a.against) if a.against else None
    rows = []
    for D in (int(x) for x in a.head_dims.split(",")):
        lay = layout(fmt, D)
        k, v = _inputs(a.tiles, a.kv_heads, D, a.device, D)
        ids = torch.arange(a.tiles, dtype=torch.int32, device=a.device)
        cache = torch.zeros(a.tiles, a.kv_heads, fmt.record_bytes(D), dtype=torch.uint8, device=a.device)
        runs = {label: (lambda h=half, w=warps: _launch_half(k, v, cache, ids, lay, h, w))
                for label, half, warps in VARIANTS}
        runs["store_tiles"] = lambda: S.store_tiles(k, v, cache, ids, fmt)
        if other is not None:
            theirs = torch.zeros_like(cache)
            runs["against"] = lambda: other.store_tiles(k, v, theirs, ids, fmt)
        for fn in runs.values():  # compiles
            fn()
        if a.device == "cuda":
            torch.cuda.synchronize()
        if a.profile:
            torch.cuda.profiler.start()
            for label in (lbl for lbl, _, _ in VARIANTS):
                runs[label]()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        row = {"head_dim": D, "tiles": a.tiles, "kv_heads": a.kv_heads,
               **{label: round(_time(fn, a.reps, a.calls, a.device), 1) for label, fn in runs.items()}}
        if other is not None:
            S.store_tiles(k, v, cache, ids, fmt)
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
