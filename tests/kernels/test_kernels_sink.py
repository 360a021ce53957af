"""The attention sink in the kernels (interpreter on a CPU): the first `sink` positions of a request are read
16-bit from the tail buffer's rows past the tile once the first tile is quantized (never from its record); a decode
step's store keeps them there; `sink_lens` limits a row to the sink rows that hold its own tokens."""
from __future__ import annotations

import math

import pytest
import torch

from kvarn.errors import KvarnError
from kvarn.formats import get_format
from kvarn.kernels import decode_attention, store_decode, store_tiles
from kvarn.method.reference import reference_attention
from tests.kernels.helpers import decode_reference, paged_setup, rel_err, request_kv, window_lens

SINK = 16
# padded row, inside the sink, exactly the sink, past it in the first tile, one tile, tiles + tail
LENS_G64 = [0, 5, SINK, 40, 64, 71, 197]


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_reads_the_sink_16bit(splits):
    fmt = get_format("kvarn_k4v2_g64")
    gen = torch.Generator().manual_seed(7 + splits)
    st = paged_setup(fmt, 64, 2, LENS_G64, torch.float16, gen=gen, sink=SINK)
    q = (torch.randn(len(LENS_G64), 4, 64, generator=gen) * 2).to(torch.float16)
    scale = 1 / math.sqrt(64)
    ref = decode_reference(q, st, fmt, 64, scale)
    args = (q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"], st["tail_slots"], fmt,
            scale)
    out = decode_attention(*args, num_splits=splits, out=torch.empty(q.shape, dtype=torch.float32))
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-3
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    # the same cache read without the sink rows differs: the test can see a kernel that ignores them
    plain = dict(st, tail_k=st["tail_k"][:, :, :64].contiguous(), tail_v=st["tail_v"][:, :, :64].contiguous())
    assert rel_err(decode_reference(q, plain, fmt, 64, scale), ref) > 0.05


def test_decode_sink_d128_g128_bf16():
    fmt = get_format("kvarn_k4v2_g128")
    gen = torch.Generator().manual_seed(3)
    lens = [3, 128, 300]
    st = paged_setup(fmt, 128, 1, lens, torch.bfloat16, gen=gen, sink=SINK)
    q = (torch.randn(len(lens), 4, 128, generator=gen) * 2).to(torch.bfloat16)
    ref = decode_reference(q, st, fmt, 128, 128 ** -0.5)
    out = decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                           st["tail_slots"], fmt, 128 ** -0.5, out=torch.empty(q.shape, dtype=torch.float32))
    assert rel_err(out, ref) < 1e-3


def test_store_decode_keeps_the_sink():
    """One request decoded token by token through its first tile and past it: the sink rows hold the raw first
    tokens, the first window half the first tile's last W, the tail the next tile's, and the first tile's record is
    the plain store of that tile."""
    fmt = get_format("kvarn_k4v2_g64")
    g, H, D = fmt.group, 2, 64
    gen = torch.Generator().manual_seed(5)
    n = g + 9
    k = torch.randn(n, H, D, generator=gen) * 2
    v = torch.randn(n, H, D, generator=gen)
    cache = torch.zeros(4, H, fmt.record_bytes(D), dtype=torch.uint8)
    W = fmt.window_tokens
    tk = torch.zeros(2, H, fmt.tail_rows, D)
    tv = torch.zeros_like(tk)
    bt = torch.tensor([[2, 3]], dtype=torch.int32)
    slots = torch.tensor([1], dtype=torch.int32)
    for p in range(n):
        store_decode(k[p:p + 1], v[p:p + 1], cache, bt, torch.tensor([p + 1], dtype=torch.int32), tk, tv, slots, fmt)
    assert torch.equal(tk[1, :, g:g + SINK], k[:SINK].transpose(0, 1))
    assert torch.equal(tv[1, :, g:g + SINK], v[:SINK].transpose(0, 1))
    w0 = g + SINK  # tile 0's window half; tile 1 has not reached its last W positions: its half is untouched
    assert torch.equal(tk[1, :, w0:w0 + W], k[g - W:g].transpose(0, 1)) and not tk[1, :, w0 + W:].any()
    assert torch.equal(tv[1, :, w0:w0 + W], v[g - W:g].transpose(0, 1))
    assert torch.equal(tk[1, :, :n - g], k[g:].transpose(0, 1))  # the next tile's tail
    assert not tk[0].any() and not tv[0].any()  # another slot's rows untouched
    want = torch.zeros(1, H, fmt.record_bytes(D), dtype=torch.uint8)
    store_tiles(k[:g].transpose(0, 1)[None].contiguous(), v[:g].transpose(0, 1)[None].contiguous(), want,
                torch.tensor([0], dtype=torch.int32), fmt)
    assert torch.equal(cache[2], want[0])  # the same kernel on the same tile: the same bytes
    assert not cache[0].any() and not cache[1].any() and not cache[3].any()


def test_decode_sink_lens_zero_reads_the_records():
    """A row whose slot's sink rows hold another request's tokens (sink_lens 0: a prefix-cache hit) reads its first
    positions from the records; rows in between read part of the sink."""
    fmt = get_format("kvarn_k4v2_g64")
    gen = torch.Generator().manual_seed(9)
    lens = [70, 130, 200]
    st = paged_setup(fmt, 64, 2, lens, torch.float16, gen=gen, sink=SINK)
    q = (torch.randn(3, 4, 64, generator=gen) * 2).to(torch.float16)
    sl = torch.tensor([0, SINK, 5], dtype=torch.int32)
    big = torch.tensor([0, 1000, 5], dtype=torch.int32)  # out of range: read as the whole sink, never past its rows
    ref = torch.stack([reference_attention(q[b].float()[:, None], *request_kv(st, fmt, 64, b, int(sl[b])), 0.125)[:, 0]
                       for b in range(3)])
    wl = window_lens(sl, fmt)  # the reference reads the window where the sink is the row's
    out = decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                           st["tail_slots"], fmt, 0.125, num_splits=2, out=torch.empty(q.shape), sink_lens=sl,
                           win_lens=wl)
    assert rel_err(out, ref) < 1e-3
    out = decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], st["tail_k"], st["tail_v"],
                           st["tail_slots"], fmt, 0.125, num_splits=2, out=torch.empty(q.shape), sink_lens=big,
                           win_lens=wl)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-3


def test_tail_buffer_shape_names_the_sink_rule():
    fmt = get_format("kvarn_k4v2_g64")
    st = paged_setup(fmt, 64, 2, [10], torch.float16)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    bad = torch.zeros(3, 2, 2 * 64 + 2 * fmt.window_tokens, 64, dtype=torch.float16)  # a sink as large as the tile
    with pytest.raises(KvarnError, match="0 < sink < 64"):
        decode_attention(q, st["cache"], st["block_table"], st["seq_lens"], bad, bad, st["tail_slots"], fmt, 0.125)
