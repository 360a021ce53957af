"""store_step_tiles (the tiles of a prefill / mixed step, read where they lie: the step's new K/V and the tail) against
store_tiles of the same tiles assembled first: the same records, byte for byte (only the addressing differs)."""
from __future__ import annotations

import pytest
import torch

from kvarn.errors import KvarnError
from kvarn.formats import get_format
from kvarn.kernels import store_step_tiles, store_tiles
from kvarn.method.paged import step_tiles_torch


def _step(fmt, D, dtype, gen):
    """A step's new tokens as vLLM hands them (K and V: views into one qkv buffer) and a tail with earlier tokens:
    tile 0 starts in the tail (old 37, its position 0 would be token -37), tile 1 is whole in the new tokens at an
    odd offset, tile 2 is padding (block -1), tile 3 is all but one position in the tail of another slot."""
    g, H = fmt.group, 2
    N = 2 * g + 5
    qkv = torch.randn(N, 3 * H + 1, D, generator=gen).to(dtype)
    k, v = qkv[:, 2:2 + H], qkv[:, 2 + H:2 + 2 * H]
    tail_k = torch.randn(4, H, fmt.tail_rows, D, generator=gen).to(dtype)
    tail_v = torch.randn(4, H, fmt.tail_rows, D, generator=gen).to(dtype)
    old = torch.tensor([37, 0, 0, g - 1], dtype=torch.int32)
    first = torch.tensor([-37, g - 37 + 3, 0, N - g], dtype=torch.int64)
    slots = torch.tensor([1, 1, 0, 3], dtype=torch.int32)
    ids = torch.tensor([2, 5, -1, 0], dtype=torch.int32)
    return k, v, tail_k, tail_v, ids, first, old, slots


def test_step_tiles_torch_reads_tail_then_new_tokens():
    fmt = get_format("kvarn_k4v2_g64")
    k, v, tail_k, tail_v, ids, first, old, slots = _step(fmt, 64, torch.float16, torch.Generator().manual_seed(1))
    tk, tv = step_tiles_torch(k, v, tail_k, tail_v, first, old, slots, fmt.group)
    assert tk.shape == (4, 2, fmt.group, 64) and tv.dtype == torch.float16
    for t in range(4):
        o, f, s = int(old[t]), int(first[t]), int(slots[t])
        for j in (0, o - 1, o, fmt.group - 1):
            if j < 0:
                continue
            want_k = tail_k[s, :, j] if j < o else k[f + j]
            want_v = tail_v[s, :, j] if j < o else v[f + j]
            assert torch.equal(tk[t, :, j], want_k) and torch.equal(tv[t, :, j], want_v), (t, j)


@pytest.mark.parametrize("name,D,dtype,rb", [
    ("kvarn_k4v2_g64", 64, torch.float16, None),
    ("kvarn_k4v2_g128", 128, torch.bfloat16, None),
    ("kvarn_k2v2_g128", 64, torch.float16, 16),  # the channel-blocked rotation (the D=256 path)
])
def test_store_step_tiles_writes_what_store_tiles_writes(monkeypatch, name, D, dtype, rb):
    from kvarn.kernels import store as store_mod

    if rb:
        monkeypatch.setitem(store_mod.ROTATION_BLOCK, D, rb)
    fmt = get_format(name)
    k, v, tail_k, tail_v, ids, first, old, slots = _step(fmt, D, dtype, torch.Generator().manual_seed(2))
    k[3, 0, 5] = float("nan")  # sanitized alike on both paths
    got = torch.full((6, 2, fmt.record_bytes(D)), 0xAB, dtype=torch.uint8)
    want = got.clone()
    store_step_tiles(k, v, tail_k, tail_v, got, ids, first, old, slots, fmt)
    tk, tv = step_tiles_torch(k, v, tail_k, tail_v, first, old, slots, fmt.group)
    store_tiles(tk, tv, want, ids, fmt)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3, 4]], torch.full_like(got[[1, 3, 4]], 0xAB)), "a padding tile wrote a record"


def test_store_step_tiles_rejects_bad_index_tensors():
    fmt = get_format("kvarn_k4v2_g64")
    k, v, tail_k, tail_v, ids, first, old, slots = _step(fmt, 64, torch.float16, torch.Generator().manual_seed(3))
    cache = torch.zeros(6, 2, fmt.record_bytes(64), dtype=torch.uint8)
    with pytest.raises(KvarnError, match="first must be torch.int64"):
        store_step_tiles(k, v, tail_k, tail_v, cache, ids, first.int(), old, slots, fmt)
    with pytest.raises(KvarnError, match="old must be torch.int32"):
        store_step_tiles(k, v, tail_k, tail_v, cache, ids, first, old[:2], slots, fmt)
