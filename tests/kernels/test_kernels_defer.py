"""The deferred flush (interpreter on a CPU): a decode step that completes a tile can leave it in the 16-bit tail
(store_decode(defer=True) writes the token only), the step's attention reads it there (decode_attention(defer=True):
(seq_len - 1) // g tiles from records, up to g rows from the tail, the sink rule unchanged), and flush_layers writes
its record later. Rows that complete no tile read exactly as without deferral."""
from __future__ import annotations

import math

import torch

from kvarn.formats import get_format
from kvarn.kernels import decode_attention, store_decode, store_tiles
from kvarn.kernels.store import flush_layers
from tests.kernels.helpers import decode_reference, paged_setup, rel_err

SINK = 16
# padded; completes tile 0 (sink inside the tail tile); completes a later tile; mid-tile; one past a boundary
LENS = [0, 64, 192, 100, 129]


def test_decode_defer_reads_the_completed_tile_from_the_tail():
    fmt = get_format("kvarn_k4v2_g64")
    g = fmt.group
    gen = torch.Generator().manual_seed(5)
    st = paged_setup(fmt, 64, 2, LENS, torch.float16, gen=gen, sink=SINK)
    for b, s in enumerate(LENS):  # the pending tiles' records are not written yet: garbage the kernel must not read
        if s and s % g == 0:
            st["cache"][st["block_table"][b, s // g - 1].long()] = 0xAB
    q = (torch.randn(len(LENS), 4, 64, generator=gen) * 2).to(torch.float16)
    scale = 1 / math.sqrt(64)
    ref = decode_reference(q, st, fmt, 64, scale, defer=True)
    args = (q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"], st["tail_slots"], fmt,
            scale)
    out = decode_attention(*args, num_splits=2, out=torch.empty(q.shape, dtype=torch.float32), defer=True)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-3
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    # rows that complete no tile read as without deferral; the others differ (the test sees a kernel that
    # ignores the flag)
    plain = decode_attention(*args, num_splits=2, out=torch.empty(q.shape, dtype=torch.float32))
    for b, s in enumerate(LENS):
        if s % g:
            assert rel_err(out[b], plain[b]) < 1e-6, b
        elif s:
            assert rel_err(out[b], plain[b]) > 1e-2, b


def test_store_decode_defer_then_flush_layers_equals_the_immediate_store():
    """A deferred decode step + flush_layers leaves the cache and tail exactly as the immediate store_decode."""
    fmt = get_format("kvarn_k4v2_g64")
    g, D, H = fmt.group, 64, 2
    seq = [g, 5, 0, 2 * g, g + 1]
    B, S = len(seq), len(seq) + 1
    gen = torch.Generator().manual_seed(9)
    tail_k = (torch.randn(S, H, fmt.tail_rows, D, generator=gen) * 2).to(torch.float16)
    tail_v = torch.randn(S, H, fmt.tail_rows, D, generator=gen).to(torch.float16)
    k = torch.randn(B, H, D, generator=gen).to(torch.float16)
    v = torch.randn(B, H, D, generator=gen).to(torch.float16)
    slots = torch.tensor([3, 0, 5, 1, 4], dtype=torch.int32)
    bt = torch.arange(3 * B, dtype=torch.int32).reshape(B, 3)
    sl = torch.tensor(seq, dtype=torch.int32)
    ref = torch.zeros(3 * B, H, fmt.record_bytes(D), dtype=torch.uint8)
    tk_ref, tv_ref = tail_k.clone(), tail_v.clone()
    store_decode(k, v, ref, bt, sl, tk_ref, tv_ref, slots, fmt)
    cache = torch.zeros_like(ref)
    store_decode(k, v, cache, bt, sl, tail_k, tail_v, slots, fmt, defer=True)
    assert torch.count_nonzero(cache) == 0  # nothing quantized yet
    assert torch.equal(tail_k, tk_ref) and torch.equal(tail_v, tv_ref)  # the same tail writes
    done = [b for b, s in enumerate(seq) if s and s % g == 0]
    flush_layers([tail_k], [tail_v], [cache], slots[done], torch.tensor([int(bt[b, seq[b] // g - 1]) for b in done],
                                                                         dtype=torch.int32), fmt)
    assert torch.equal(cache, ref)
    # and store_tiles of the same tail rows agrees (the flush reads rows [0, g) of the slot)
    again = torch.zeros_like(ref)
    ids = torch.tensor([int(bt[b, seq[b] // g - 1]) for b in done], dtype=torch.int32)
    store_tiles(tail_k[slots[done].long(), :, :g], tail_v[slots[done].long(), :, :g], again, ids, fmt)
    assert torch.equal(again, ref)


def test_defer_flag_tensor_decides_at_run_time():
    """The backend passes an int32 device flag (one captured graph serves deferred and immediate steps): at 1 the
    kernels behave as defer=True, at 0 as without deferral, for the attention and for store_decode."""
    fmt = get_format("kvarn_k4v2_g64")
    g = fmt.group
    gen = torch.Generator().manual_seed(13)
    st = paged_setup(fmt, 64, 2, LENS, torch.float16, gen=gen, sink=SINK)
    q = (torch.randn(len(LENS), 4, 64, generator=gen) * 2).to(torch.float16)
    args = (q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"], st["tail_slots"], fmt,
            0.125)
    flag = torch.zeros(1, dtype=torch.int32)
    run = lambda d: decode_attention(*args, num_splits=2, out=torch.empty(q.shape, dtype=torch.float32),  # noqa
                                     defer=d)
    assert torch.equal(run(flag), run(False))
    flag.fill_(1)
    assert torch.equal(run(flag), run(True))
    assert not torch.equal(run(True), run(False))

    H, D = 2, 64
    seq = torch.tensor([g, 2 * g, 5], dtype=torch.int32)
    tk = torch.randn(4, H, fmt.tail_rows, D, generator=gen).to(torch.float16)
    tv = torch.randn(4, H, fmt.tail_rows, D, generator=gen).to(torch.float16)
    k = torch.randn(3, H, D, generator=gen).to(torch.float16)
    v = torch.randn(3, H, D, generator=gen).to(torch.float16)
    slots = torch.tensor([0, 2, 1], dtype=torch.int32)
    bt = torch.arange(9, dtype=torch.int32).reshape(3, 3)
    for value, written in ((1, False), (0, True)):
        flag.fill_(value)
        cache = torch.zeros(9, H, fmt.record_bytes(D), dtype=torch.uint8)
        store_decode(k, v, cache, bt, seq, tk.clone(), tv.clone(), slots, fmt, defer=flag)
        assert bool(cache[0].any()) is written and bool(cache[4].any()) is written and not cache[2].any()
