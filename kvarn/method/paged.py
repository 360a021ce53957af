"""The PyTorch reference over a paged KVarN cache: what the vLLM backend's kernels compute, written plainly.

The backend runs these where its kernels cannot (CPU tests, no Triton) and the GPU tests compare the kernels with
them. The cache is the backend's: records [num_blocks, Hk, record_bytes] addressed by a block table, plus per
request a 16-bit tail buffer row [Hk, g + sink + 2W, D] holding the unfinished tile (rows [0, g)), the first `sink`
positions for good (rows g + pos) and the window: the last W = fmt.window_tokens positions of each tile, in the half
of its tile's parity (rows g + sink + (tile % 2) W + pos % g - (g - W)), read for the tile before the newest
position's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..formats import KVFormat
from .reference import dequantize_tiles, quantize_tiles, reference_attention

TILES_PER_PASS = 256  # records dequantized per torch pass (bounds the fp32 temporaries: ~134 MB at Hk 8, D 128)


def ragged_ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments i of counts[i] >= 0 values starts[i], starts[i] + 1, ...: (segment index, value) of every element,
    segments in order (the concatenation of np.arange(starts[i], starts[i] + counts[i]))."""
    seg = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts  # flat index of each segment's first element
    return seg, np.asarray(starts, dtype=np.int64)[seg] + (np.arange(len(seg)) - first[seg])


def host_tensor(a, dtype, device) -> torch.Tensor:
    """A host array as a CPU tensor to copy to `device` with non_blocking=True: pinned where that is CUDA, since a
    copy from pageable memory waits for the work already queued on the stream (mid-forward, the GPU would drain
    while the host waits, and every later launch of the step would start late)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
    return t.pin_memory() if torch.device(device).type == "cuda" else t


def to_device(a, dtype, device) -> torch.Tensor | None:
    """A host array as a tensor on `device` (None for an empty or absent one), with no sync (host_tensor)."""
    if a is None or len(a) == 0:
        return None
    return host_tensor(a, dtype, device).to(device, non_blocking=True)


def store_tiles_torch(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, fmt: KVFormat,
                      iters: int | None = None) -> None:
    """k, v [T, H, g, D] complete tiles -> records in cache at block_ids (< 0 skipped)."""
    rec = quantize_tiles(k, v, fmt, iters=iters)  # [T, H, R]
    keep = block_ids >= 0
    if not bool(keep.all()):
        rec, block_ids = rec[keep], block_ids[keep]
    cache[block_ids.long()] = rec.to(cache.device)


def step_tiles_torch(k: torch.Tensor, v: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor,
                     first: torch.Tensor, old: torch.Tensor, slots: torch.Tensor, g: int):
    """The tiles a step completes, assembled [T, H, g, D] as kvarn.kernels.store_step_tiles reads them: position
    j of tile t is new token first[t] + j of k / v [N, H, D], or tail row slots[t] at position j where j < old[t]."""
    j = torch.arange(g, device=k.device)[None, :]
    from_tail = j < old.to(k.device).long()[:, None]  # [T, g]
    tok = torch.where(from_tail, 0, first.to(k.device).long()[:, None] + j)
    slot = slots.to(tail_k.device).long()[:, None].expand_as(tok)
    out = []
    for new, tail in ((k, tail_k), (v, tail_v)):
        x = new[tok].to(tail.dtype)  # [T, g, H, D]
        x[from_tail] = tail[slot[from_tail], :, j.expand_as(tok)[from_tail]]
        out.append(x.transpose(1, 2))
    return out[0], out[1]


def _dequantize_into(cache, bids, dst0, k, v, fmt: KVFormat) -> None:
    # records cache[bids] -> rows dst0[t] .. + g - 1 of k / v (the reference decoder, in passes)
    g, Hk, D = fmt.group, k.shape[1], k.shape[2]
    off = torch.arange(g, device=k.device)
    for a in range(0, len(bids), TILES_PER_PASS):
        kd, vd = dequantize_tiles(cache[bids[a:a + TILES_PER_PASS]], fmt, D)  # [n, Hk, g, D] fp32
        idx = (dst0[a:a + TILES_PER_PASS, None] + off[None, :]).reshape(-1)
        k[idx] = kd.transpose(1, 2).reshape(-1, Hk, D).to(k.dtype)
        v[idx] = vd.transpose(1, 2).reshape(-1, Hk, D).to(v.dtype)


@dataclass
class PostStoreIndex:
    """Where each key post_store_kv returns comes from, for some batch rows of one step: the host work and the
    host-to-device copies are done once, and every layer of the step gathers through the same index."""
    cu_k: np.ndarray  # int64 [rows + 1], host: row i's keys are [cu_k[i], cu_k[i + 1])
    tile_bids: torch.Tensor | None  # int64 [T]: the record of each full tile
    tile_dst: torch.Tensor | None  # int64 [T]: the output row of its first position
    # keys read from tail rows (the unfinished tile, the sink, the window; disjoint output rows): output row, tail
    # slot, tail row, and whether the request may read it (None: every one; else sink / window rows of a slot that
    # holds another request's tokens keep the record's value)
    row_dst: torch.Tensor | None  # int64 [n]
    row_slot: torch.Tensor | None  # int64 [n]
    row_src: torch.Tensor | None  # int64 [n]
    row_use: torch.Tensor | None  # bool [n, 1, 1]

    @property
    def num_keys(self) -> int:
        return int(self.cu_k[-1])


def post_store_index(rows: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray, block_table, tail_rows: int,
                     fmt: KVFormat, sink_lens=None, win_lens=None) -> PostStoreIndex:
    """The PostStoreIndex of post_store_kv (its arguments; tail_rows: the tail buffers' row count g + sink + 2W, or g
    for tails with neither sink nor window). Host->device copies are asynchronous: no sync."""
    g = fmt.group
    dev = block_table.device
    s = np.asarray(seq_lens, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    zeros = np.zeros(len(rows), dtype=np.int64)
    cu_k = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(s, out=cu_k[1:])

    def dev_(x):
        return to_device(x, np.int64, dev)

    n_full = s // g
    seg, cols = ragged_ranges(zeros, n_full)  # (row, tile index) of every full tile
    tile_bids = tile_dst = None
    if len(seg):
        tile_bids = block_table[dev_(rows[seg]), dev_(cols)].long()
        tile_dst = dev_(cu_k[seg] + cols * g)
    W = fmt.window_tokens if tail_rows > g else 0  # [.., g, D] tails: no sink, no window
    sink = tail_rows - g - 2 * W  # rows with a quantized first tile read its first positions from the sink rows
    if W and sink > g - W:  # one gather below needs disjoint output rows; the formats keep the window clear of it
        raise ValueError(f"a sink of {sink} overlaps the window's last {W} positions of a {g}-token tile")
    # (segment, output row, tail row, position in the part that a request may not own, that part's lens)
    parts = []
    tseg, tpos = ragged_ranges(zeros, s - n_full * g)  # the unfinished tile: always the request's own
    parts.append((tseg, cu_k[tseg] + n_full[tseg] * g + tpos, tpos, None, None))
    if sink:  # sink_lens[i] of row i's sink rows are its own
        sseg, spos = ragged_ranges(zeros, np.where(n_full > 0, sink, 0))
        parts.append((sseg, cu_k[sseg] + spos, g + spos, spos, sink_lens))
        if W:  # the window half of the tile before the newest position's, where win_lens[i] > 0 (its own)
            wt = (s - 1) // g - 1
            wseg, wj = ragged_ranges(zeros, np.where(s > g, W, 0))
            parts.append((wseg, cu_k[wseg] + wt[wseg] * g + g - W + wj, g + sink + (wt[wseg] % 2) * W + wj, wj,
                          None if win_lens is None else (win_lens > 0).to(torch.int64) * W))
    parts = [p for p in parts if len(p[0])]
    if not parts:
        return PostStoreIndex(cu_k, tile_bids, tile_dst, None, None, None, None)
    # with lens given (the backend's steps), a mask always: the copy kernel then compiles one variant, whether or not
    # this step's rows have sink or window rows to read (rows shorter than a tile have none)
    use = None
    if sink_lens is not None or win_lens is not None:
        use = torch.cat([torch.ones(len(seg), dtype=torch.bool, device=dev) if lens is None else
                         dev_(j) < lens.to(dev).reshape(-1)[dev_(seg)] for seg, _, _, j, lens in parts])[:, None, None]
    def cat(i):
        return dev_(np.concatenate([p[i] for p in parts]))

    return PostStoreIndex(cu_k, tile_bids, tile_dst, cat(1), dev_(slots[np.concatenate([p[0] for p in parts])]),
                          cat(2), use)


def gather_post_store(ix: PostStoreIndex, cache, tail_k, tail_v, fmt: KVFormat, dtype,
                      dequantize: Callable | None = None, read_rows: Callable | None = None):
    """The keys and values an index names: (k, v [ix.num_keys, Hk, D] in `dtype`). Records are dequantized to the
    original basis by `dequantize(cache, block_ids, dst_rows, k, v, fmt)` (kvarn.kernels.dequantize_to_rows) or, when
    None, by the reference decoder; tail rows are copied by `read_rows(tail_k, tail_v, slot, row, k, v, dst, use)`
    (kvarn.kernels.rows.read_tail_rows) or, when None, by torch indexing."""
    k = torch.empty(ix.num_keys, cache.shape[1], tail_k.shape[-1], dtype=dtype, device=cache.device)
    v = torch.empty_like(k)
    if ix.tile_bids is not None:
        (dequantize or _dequantize_into)(cache, ix.tile_bids, ix.tile_dst, k, v, fmt)
    if ix.row_dst is not None and read_rows is not None:
        read_rows(tail_k, tail_v, ix.row_slot, ix.row_src, k, v, ix.row_dst, ix.row_use)
    elif ix.row_dst is not None:
        tk = tail_k[ix.row_slot, :, ix.row_src].to(dtype)
        tv = tail_v[ix.row_slot, :, ix.row_src].to(dtype)
        if ix.row_use is not None:
            tk, tv = torch.where(ix.row_use, tk, k[ix.row_dst]), torch.where(ix.row_use, tv, v[ix.row_dst])
        k[ix.row_dst] = tk
        v[ix.row_dst] = tv
    return k, v


def post_store_kv(rows: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray, cache, block_table, tail_k, tail_v,
                  fmt: KVFormat, dtype, sink_lens=None, dequantize: Callable | None = None, win_lens=None,
                  read_rows: Callable | None = None):
    """The K/V the attention of batch rows `rows` sees after this step's store (seq_lens / slots: their lengths and
    tail slots, host), back to back: (k, v [sum seq_len, Hk, D] in `dtype`, cu_k int64 host). Full tiles come from
    the records, dequantized to the original basis by `dequantize(cache, block_ids, dst_rows, k, v, fmt)` (the
    kernel, kvarn.kernels.dequantize_to_rows) or, when None, by the reference decoder; the last seq_len % g tokens
    from the tail rows (copied by `read_rows`, as gather_post_store says); rows whose first tile is quantized take
    their first `sink` positions (sink_lens[i] of them, a device tensor, where given) from the sink rows, and the
    window of the tile before their newest position's from its window rows (where win_lens[i] > 0, a device tensor,
    where given)."""
    ix = post_store_index(rows, seq_lens, slots, block_table, tail_k.shape[2], fmt, sink_lens, win_lens)
    k, v = gather_post_store(ix, cache, tail_k, tail_v, fmt, dtype, dequantize, read_rows)
    return k, v, ix.cu_k


def varlen_attention_torch(q, k, v, cu_q, cu_k, scale):
    """FlashAttention's bottom-right causal varlen, in torch: segment i's queries are the last q_len_i positions of
    its k_len_i keys. q [Nq, Hq, D], k/v [Nk, Hk, D]; cu_* host sequences. Returns float32 [Nq, Hq, D]."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(len(cu_q) - 1):
        a, e, ka, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if e <= a:
            continue
        o = reference_attention(q[a:e].transpose(0, 1), k[ka:ke].transpose(0, 1), v[ka:ke].transpose(0, 1), scale,
                                causal_offset=(ke - ka) - (e - a))
        out[a:e] = o.transpose(0, 1)
    return out


def raw_attention_torch(q, k, v, cu, scale):
    """Causal attention of each segment over its own raw K/V. q [N, Hq, D], k/v [N, Hk, D]. Returns float32."""
    cu = [int(x) for x in cu]
    return varlen_attention_torch(q, k, v, cu, cu, scale)


def cached_attention_torch(q, cache, block_table, qsl, seq_lens, tail_k, tail_v, tail_slots, fmt, scale,
                           sink_lens=None, win_lens=None):
    """Each row's q tokens (the last q_len positions) attend causally over the post-store state (post_store_kv).
    q [Nq, Hq, D]; qsl / seq_lens / tail_slots host sequences. Returns float32 [Nq, Hq, D]."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(len(seq_lens)):
        a, e, s = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        if e <= a or s <= 0:
            continue
        k, v, _ = post_store_kv(np.array([b]), np.array([s]), np.array([int(tail_slots[b])]), cache, block_table,
                                tail_k, tail_v, fmt, torch.float32,
                                sink_lens=None if sink_lens is None else torch.tensor([int(sink_lens[b])]),
                                win_lens=None if win_lens is None else torch.tensor([int(win_lens[b])]))
        out[a:e] = varlen_attention_torch(q[a:e], k, v, [0, e - a], [0, s], scale)
    return out
