"""flush_layers: every layer's pending tiles in one launch (layers reached through a table of buffer addresses)
writes exactly the records store_tiles writes layer by layer, skips padded entries, and leaves other blocks alone
(interpreter on a CPU)."""
from __future__ import annotations

import pytest
import torch

from kvarn.errors import KvarnError
from kvarn.formats import get_format
from kvarn.kernels import store_tiles
from kvarn.kernels.store import flush_layers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flush_layers_equals_store_tiles_per_layer(dtype):
    fmt = get_format("kvarn_k4v2_g64")
    g, D, H, L, S, nb = fmt.group, 64, 2, 3, 5, 9
    sink = fmt.sink_tokens
    gen = torch.Generator().manual_seed(7)
    tails_k = [(torch.randn(S, H, fmt.tail_rows, D, generator=gen) * 2).to(dtype) for _ in range(L)]
    tails_v = [torch.randn(S, H, fmt.tail_rows, D, generator=gen).to(dtype) for _ in range(L)]
    tails_k[1][3, 0, 5, :4] = 40.0  # an outlier channel in one layer's tile
    caches = [torch.full((nb, H, fmt.record_bytes(D)), 0xAB, dtype=torch.uint8) for _ in range(L)]
    slots = torch.tensor([3, 0, 4], dtype=torch.int32)
    blocks = torch.tensor([7, -1, 2], dtype=torch.int32)  # -1: a padded entry, nothing written
    flush_layers(tails_k, tails_v, caches, slots, blocks, fmt)
    for layer in range(L):
        ref = torch.full_like(caches[layer], 0xAB)
        live = [i for i in range(3) if blocks[i] >= 0]
        src = slots[live].long()
        store_tiles(tails_k[layer][src, :, :g], tails_v[layer][src, :, :g], ref, blocks[live], fmt)
        assert torch.equal(caches[layer], ref), layer
        assert all((caches[layer][b] == 0xAB).all() for b in range(nb) if b not in (7, 2))


def test_flush_layers_rejects_mismatched_layers_and_bad_ids():
    fmt = get_format("kvarn_k4v2_g64")
    g, D, H = fmt.group, 64, 2
    tk = [torch.zeros(2, H, fmt.tail_rows, D, dtype=torch.float16) for _ in range(2)]
    caches = [torch.zeros(4, H, fmt.record_bytes(D), dtype=torch.uint8), torch.zeros(5, H, fmt.record_bytes(D),
                                                                                     dtype=torch.uint8)]
    ids = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(KvarnError, match="same shape"):
        flush_layers(tk, tk, caches, ids, ids, fmt)
    with pytest.raises(KvarnError, match="one tail pair and one cache per layer"):
        flush_layers(tk, tk, caches[:1], ids, ids, fmt)
    with pytest.raises(KvarnError, match="int32"):
        flush_layers(tk[:1], tk[:1], caches[:1], ids.long(), ids, fmt)


def test_compile_flush_layers_launches_on_scratch_and_keeps_none_of_it(monkeypatch):
    """The backend's engine-start compile of flush_layers (KVARN_DEFER_FLUSH=1): one launch on scratch buffers of
    the serving shapes, so the first deferred flush of a run does not JIT-compile; none of the scratch buffers stays
    alive afterwards (no device memory held, no cached address table taking a real set's place), and a real flush
    afterwards still matches store_tiles."""
    import gc
    import weakref

    from kvarn.kernels import store as S

    fmt = get_format("kvarn_k4v2_g64")
    g, D, H = fmt.group, 64, 2
    made = []
    for name in ("zeros", "zeros_like", "empty", "empty_like"):
        real = getattr(torch, name)

        def spy(*a, _real=real, **kw):
            t = _real(*a, **kw)
            made.append(weakref.ref(t))
            return t

        monkeypatch.setattr(torch, name, spy)
    S.compile_flush_layers(H, D, fmt.tail_rows, torch.bfloat16, fmt, "cpu")
    monkeypatch.undo()
    gc.collect()
    assert made and all(r() is None for r in made), f"{sum(r() is not None for r in made)} scratch tensors kept"
    tk = [torch.randn(2, H, fmt.tail_rows, D).to(torch.bfloat16)]
    tv = [torch.randn_like(tk[0])]
    cache = [torch.zeros(3, H, fmt.record_bytes(D), dtype=torch.uint8)]
    one = torch.ones(1, dtype=torch.int32)
    flush_layers(tk, tv, cache, one, one, fmt)
    ref = torch.zeros_like(cache[0])
    store_tiles(tk[0][1:2, :, :g], tv[0][1:2, :, :g], ref, one, fmt)
    assert torch.equal(cache[0], ref)
