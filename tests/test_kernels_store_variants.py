"""The store kernel's variants (kvarn.kernels.store: balance "mul", "mulsm", "fused", "fusedsm", "fusedsm4w",
decode grid "compact") against the PyTorch reference with the same checks as the default in test_kernels.py
(interpreter on a CPU)."""
from __future__ import annotations

import pytest
import torch

from kvarn.formats import get_format
from kvarn.kernels import store_decode, store_tiles
from tests.test_kernels import _store_and_compare, store_inputs


# every BALANCE_VARIANTS key but the default whose interpreted code differs ("fusedsm4w" / "fusedsm16w" are
# "fusedsm" on 4 / 16 warps: the interpreter has no warps, so it would rerun the same code; the offline compile and
# the device cover them)
VARIANTS = ["mul", "mulsm", "fused", "fusedsm"]
# the interpreter runs the fused-statistics kernels slowly (12 s at g64 / D=64, ~50 s at D=128, ~95 s at D=256, vs
# ~1 s for mul / mulsm): they get the small shape; the larger shapes take mul (whole rotation) and mulsm (blocked)
FAST = ["mul", "mulsm"]


def _cases():
    shapes = [("kvarn_k4v2_g64", 64, torch.float16), ("kvarn_k4v4_g128", 64, torch.bfloat16),
              ("kvarn_k2v2_g128", 64, torch.float16), ("kvarn_k4v2_g128", 128, torch.bfloat16),
              ("kvarn_k4v2_g128", 256, torch.bfloat16)]  # D=256: the channel-blocked rotation
    cases = [(n, d, t, b) for n, d, t in shapes for b in (VARIANTS if n == "kvarn_k4v2_g64" else FAST)]
    return cases + [("kvarn_k4v2_g128", 128, torch.bfloat16, "fused")]  # the shipped default at the shipped shape


@pytest.mark.parametrize("name,D,dtype,balance", _cases())
def test_store_variant_matches_reference(monkeypatch, name, D, dtype, balance):
    from kvarn.kernels import store as store_mod

    monkeypatch.setattr(store_mod, "STORE_BALANCE", balance)  # what KVARN_STORE_BALANCE=<balance> sets
    fmt = get_format(name)
    k, v = store_inputs(fmt, D, dtype)
    codes, ek, ev, _ = _store_and_compare(fmt, k, v)  # a padded slot (< 0) must not be written
    assert codes > 0.997, codes
    assert ek < 0.06 and ev < 0.06, (ek, ev)


def test_store_variants_constant_tile():
    # a constant tile: zero-variance rows and columns everywhere but one channel after rotation
    fmt = get_format("kvarn_k4v2_g64")
    k = torch.full((2, 1, 64, 64), 0.75, dtype=torch.float16)
    v = torch.full((2, 1, 64, 64), -2.0, dtype=torch.float16)
    codes, ek, ev, _ = _store_and_compare(fmt, k, v)
    assert codes > 0.997 and ek < 0.06 and ev < 0.06, (codes, ek, ev)
    from kvarn.kernels import store as store_mod

    before = store_mod.STORE_BALANCE
    for balance in VARIANTS:
        store_mod.STORE_BALANCE = balance
        try:
            codes, ek, ev, _ = _store_and_compare(fmt, k, v)
        finally:
            store_mod.STORE_BALANCE = before
        assert codes > 0.997 and ek < 0.06 and ev < 0.06, (balance, codes, ek, ev)


@pytest.mark.parametrize("balance", ["log", "mul"])  # the grid is the same for every balancing kernel
def test_store_decode_compact_grid_equals_rows_grid(balance):
    """store_decode with the compact grid writes exactly the records of the row grid (same kernel body), for
    rows that complete a tile, rows that do not, a padded row (seq_len 0) and more completions than programs."""
    fmt = get_format("kvarn_k4v2_g64")
    g, D, H = fmt.group, 64, 2
    seq = [g, 5, 0, 3 * g, 2 * g, g + 1, 4 * g]  # 4 completions > 2 compact programs per (head, K|V) on a CPU
    B = len(seq)
    S = B + 1
    tail_k = (torch.randn(S, H, g, D) * 2).to(torch.float16)
    tail_v = torch.randn(S, H, g, D).to(torch.float16)
    k = torch.randn(B, H, D, dtype=torch.float16)
    v = torch.randn(B, H, D, dtype=torch.float16)
    slots = torch.randperm(S)[:B].to(torch.int32)
    bt = torch.randperm(5 * B).to(torch.int32).reshape(B, 5)
    sl = torch.tensor(seq, dtype=torch.int32)
    out = {}
    for grid in ("rows", "compact"):
        cache = torch.full((5 * B, H, fmt.record_bytes(D)), 0xAB, dtype=torch.uint8)
        tk, tv = tail_k.clone(), tail_v.clone()
        store_decode(k, v, cache, bt, sl, tk, tv, slots, fmt, balance=balance, grid=grid)
        out[grid] = (cache, tk, tv)
    assert all(torch.equal(a, b) for a, b in zip(out["rows"], out["compact"]))
    cache, tk, tv = out["compact"]
    written = {int(bt[b, s // g - 1]) for b, s in enumerate(seq) if s > 0 and s % g == 0}
    for blk in range(5 * B):  # untouched blocks keep their bytes
        if blk not in written:
            assert (cache[blk] == 0xAB).all(), blk
    # and the written records are the tiles the tail held, as store_tiles writes them
    rows = [b for b, s in enumerate(seq) if s > 0 and s % g == 0]
    ref = torch.zeros(len(rows), H, fmt.record_bytes(D), dtype=torch.uint8)
    ids = torch.arange(len(rows), dtype=torch.int32)
    store_tiles(tk[slots[rows].long()], tv[slots[rows].long()], ref, ids, fmt, balance=balance)
    assert torch.equal(cache[[int(bt[b, seq[b] // g - 1]) for b in rows]], ref)


@pytest.mark.parametrize("balance", ["mul", "fusedsm"])
def test_store_variant_nan_inf_guard(monkeypatch, balance):
    from kvarn.kernels import store as store_mod
    from kvarn.method.reference import dequantize_tiles

    monkeypatch.setattr(store_mod, "STORE_BALANCE", balance)
    fmt = get_format("kvarn_k4v2_g64")
    k = torch.randn(2, 1, 64, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 1, 64, 64, dtype=torch.bfloat16)
    k[1, 0, 3, 4] = float("nan")
    k[1, 0, 5, 6] = float("inf")
    v[1, 0, 7, 8] = float("-inf")
    v[1, 0, 9, 9] = float("nan")
    _, ek, ev, got = _store_and_compare(fmt, k, v)
    kd, vd = dequantize_tiles(got, fmt, 64)
    assert torch.isfinite(kd).all() and torch.isfinite(vd).all()
    assert ek < 0.06 and ev < 0.06, (ek, ev)


def test_store_variant_table():
    # every variant names a known balancing kernel; "fused" ships (H200: fastest), "log" keeps the whole-tile rotation
    from kvarn.kernels import store as store_mod

    assert set(VARIANTS) | {"log", "fusedsm4w", "fusedsm16w"} == set(store_mod.BALANCE_VARIANTS)
    import os

    shipped = os.environ.get("KVARN_STORE_BALANCE", "fused")  # tests/conftest.py pins "log" on CPU-only machines
    assert store_mod.STORE_BALANCE == shipped and store_mod.BALANCE_VARIANTS["log"] == (0, None, 0, None)
    assert store_mod.BALANCE_VARIANTS["fused"] == (2, None, 0, None)
