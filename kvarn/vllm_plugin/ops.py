"""Store and attention of the vLLM backend, over plain tensors (no vLLM import; tested on CPU).

One `StepPlan` per forward step (built once on the host from the CPU copies of `query_start_loc` / `seq_lens`, shared
by all layers) says, for the flattened new tokens of the batch:

* which tiles complete in this step (batch row, tile index -> block id from the block table) and, for each of their
  g positions, where the 16-bit token comes from: this step's new K/V, or the request's tail row (earlier steps);
* which new tokens go to the tail (those of the unfinished last tile) at which tail row / position;
* how attention splits: rows with no prior context (first prefill chunk) attend to the raw new Q/K/V (exact, as
  FlashAttention would); every other row (decode, continuation chunk, prefix-cache hit) attends to the post-store
  cache state: full tiles from the records, the unfinished tile from the tail.

Semantics shared with the PyTorch reference cache: a tile is quantized once, when its g tokens exist; the store
runs before attention in the layer.

The Triton kernels of `kvarn.kernels` are used when present and the tensors live on CUDA; otherwise a slow,
exact PyTorch path built on `kvarn.method.reference` runs (CPU tests, and a GPU fallback).
"""
from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..formats import KVFormat


def _kernel(module: str, name: str):
    try:
        mod = importlib.import_module(f"kvarn.kernels.{module}")
    except Exception:  # noqa: BLE001 - a missing or broken kernel module means: use the torch path
        return None
    return getattr(mod, name, None)


def _decode_config():
    """The decode kernel variant the backend uses: the H200 sweep's best (kvarn.kernels.decode.DEFAULT_CONFIG), or
    KVARN_DECODE_CONFIG=<name> (a name from the `kvarn microbench decode --sweep` table). The kernel's own run-time
    tuner would time candidates on whatever batch comes first (in vLLM: graph-capture dummies of seq_len 1, where
    every candidate ties); KVARN_AUTOTUNE=1 turns it on anyway."""
    if os.environ.get("KVARN_AUTOTUNE") == "1":
        return None
    name = os.environ.get("KVARN_DECODE_CONFIG", "").strip()
    if name:
        cls = _kernel("decode", "DecodeConfig")
        return cls.from_name(name) if cls is not None else None
    return _kernel("decode", "DEFAULT_CONFIG")


@dataclass
class StepPlan:
    num_reqs: int
    num_tokens: int
    group: int
    # host copies
    qsl: np.ndarray  # int64 [R + 1]
    seq_lens: np.ndarray  # int64 [R]
    ctx_lens: np.ndarray  # int64 [R]
    tail_slots_np: np.ndarray  # int32 [R]
    # store (device)
    num_tiles: int
    tile_block_ids: torch.Tensor | None  # int32 [T]
    tile_new_dst: torch.Tensor | None  # int64 [n1]: flat (tile * g + offset) filled from new tokens
    tile_new_src: torch.Tensor | None  # int64 [n1]: new-token index
    tile_tail_dst: torch.Tensor | None  # int64 [n2]: flat (tile * g + offset) filled from the tail
    tile_tail_slot: torch.Tensor | None  # int64 [n2]
    tile_tail_pos: torch.Tensor | None  # int64 [n2]
    tail_tok: torch.Tensor | None  # int64 [n3]: new tokens of unfinished tiles
    tail_slot: torch.Tensor | None  # int64 [n3]
    tail_pos: torch.Tensor | None  # int64 [n3]
    # attention (device)
    tail_slots: torch.Tensor | None  # int32 [R] (a minimal decode plan: only the builder's persistent buffer)
    raw_rows: np.ndarray  # rows with no prior context
    raw_tok: torch.Tensor | None  # int64 token indexes of raw rows (compacted order)
    raw_cu: torch.Tensor | None  # int32 [n_raw + 1]
    raw_max: int
    dec_rows: np.ndarray  # rows with context and one new token
    dec_rows_t: torch.Tensor | None
    dec_tok: torch.Tensor | None
    cont_rows: np.ndarray  # rows with context and several new tokens
    cont_rows_t: torch.Tensor | None
    cont_tok: torch.Tensor | None
    cont_qsl: torch.Tensor | None  # int32 [n_cont + 1]
    cont_max_q: int
    # one token per row, row b = token b, padding rows (no token) only at the end: the decode fast path
    decode_only: bool = False
    # decode_only with only the host fields (build_plan's decode_minimal): the decode kernels must run it
    minimal: bool = False
    # decode_only under the deferred flush (common.defer_flush_enabled): the builder's int32 [1] device flag (1: a
    # tile completed this step stays in the tail; 0: stored at once), read by the kernels at run time so that one
    # captured decode graph serves both; False: not deferred (the kernels' default variants)
    defer: bool | torch.Tensor = False
    # the attention sink (the first `sink` positions, 16-bit for good in tail rows g + pos): new tokens below it
    sink: int = 0
    sink_tok: torch.Tensor | None = None  # int64 [n4]
    sink_slot: torch.Tensor | None = None  # int64 [n4]
    sink_pos: torch.Tensor | None = None  # int64 [n4]
    # int32 [R] device: sink rows each batch row may read (sink, or 0 where its slot's rows hold another request's
    # tokens: a prefix-cache hit); None = all `sink` (set by the metadata builder through update_sink_lens)
    sink_lens: torch.Tensor | None = None

    @property
    def pure_prefill(self) -> bool:
        return len(self.dec_rows) == 0 and len(self.cont_rows) == 0


def _t(a, dtype, device) -> torch.Tensor | None:
    if a is None or len(a) == 0:
        return None
    return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device, non_blocking=True)


def _ragged(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments i of counts[i] >= 0 values starts[i], starts[i] + 1, ...: (segment index, value) of every element,
    segments in order (the concatenation of np.arange(starts[i], starts[i] + counts[i]))."""
    seg = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts  # flat index of each segment's first element
    return seg, np.asarray(starts, dtype=np.int64)[seg] + (np.arange(len(seg)) - first[seg])


def decode_kernels_available() -> bool:
    """The kernels of a decode step (the full-graph path) import here."""
    return _kernel("store", "store_decode") is not None and _kernel("decode", "decode_attention") is not None


def build_plan(qsl_cpu, seq_lens_cpu, num_reqs: int, tail_slots_np: np.ndarray, block_table: torch.Tensor,
               group: int, device, decode_minimal: bool = False,
               tail_slots_dev: torch.Tensor | None = None, sink: int = 0) -> StepPlan:
    """qsl_cpu [>= R + 1], seq_lens_cpu [>= R] (host), tail_slots_np int32 [R], block_table [R, max_blocks].

    Vectorized over rows (numpy on the host arrays, no Python loop per row; the same non-blocking host->device copies
    as before, no sync); the output equals tests/plan_reference.py (the per-row loop it replaced) field for field.
    decode_minimal: a decode_only step gets only its host fields (the decode kernels read everything else on the
    device): no host->device copies on the steps a full CUDA graph replays.
    tail_slots_dev: tail_slots_np already on the device (the builder's persistent buffer): used as the plan's
    `tail_slots` instead of another copy. sink: the format's 16-bit sink tokens (0 <= sink < group; the tail
    buffers then have group + sink rows)."""
    g = group
    R = int(num_reqs)
    qsl = np.asarray(qsl_cpu[: R + 1], dtype=np.int64)
    seq = np.asarray(seq_lens_cpu[:R], dtype=np.int64)
    slots_r = np.asarray(tail_slots_np[:R], dtype=np.int64)
    qlen = np.diff(qsl)
    ctx = seq - qlen
    n_tok = int(qsl[-1]) if R else 0
    active = qlen > 0
    act = np.nonzero(active)[0]
    n_act = len(act)
    decode_only = bool(n_act > 0 and (qlen <= 1).all() and (act == np.arange(n_act)).all()
                       and (qsl[:n_act] == np.arange(n_act)).all())
    if decode_only and decode_minimal:
        return StepPlan(
            num_reqs=R, num_tokens=n_tok, group=g, qsl=qsl, seq_lens=seq, ctx_lens=ctx,
            tail_slots_np=np.asarray(tail_slots_np[:R], dtype=np.int32), num_tiles=0, tile_block_ids=None,
            tile_new_dst=None, tile_new_src=None, tile_tail_dst=None, tile_tail_slot=None, tile_tail_pos=None,
            tail_tok=None, tail_slot=None, tail_pos=None, tail_slots=tail_slots_dev,
            raw_rows=np.zeros(0, dtype=np.int64),
            raw_tok=None, raw_cu=None, raw_max=0, dec_rows=act, dec_rows_t=None, dec_tok=None,
            cont_rows=np.zeros(0, dtype=np.int64), cont_rows_t=None, cont_tok=None, cont_qsl=None, cont_max_q=0,
            decode_only=True, minimal=True, sink=sink)
    c, s, q0, slot = ctx[act], seq[act], qsl[:-1][act], slots_r[act]

    # tiles [c // g, s // g) of each active row complete in this step, in row order then tile order
    first, last_full = c // g, s // g
    t_seg, t_cols = _ragged(first, np.maximum(last_full - first, 0))
    n_tiles = len(t_seg)
    tile_block_ids = None
    new_dst = new_src = tl_dst = tl_slot = tl_pos = None
    if n_tiles:
        t_rows = act[t_seg]
        rows_t = _t(t_rows, np.int64, device)
        cols_t = _t(t_cols, np.int64, device)
        tile_block_ids = block_table[rows_t, cols_t].to(torch.int32)
        # offsets [0, old) of a tile were written in earlier steps (tail), [old, g) come from the new tokens
        lo = t_cols * g
        tc = c[t_seg]
        old = np.maximum(0, tc - lo)
        off = np.arange(g)[None, :]
        dst = np.arange(n_tiles)[:, None] * g + off  # [T, g]
        from_new = off >= old[:, None]
        new_dst = dst[from_new]
        new_src = ((q0[t_seg] + lo - tc)[:, None] + off)[from_new]
        if not from_new.all():
            from_tail = ~from_new
            tl_dst = dst[from_tail]
            tl_slot = np.broadcast_to(slot[t_seg][:, None], from_new.shape)[from_tail]
            tl_pos = np.broadcast_to(off, from_new.shape)[from_tail]
    # new tokens of the unfinished tile: positions [max(c, last_full * g), s) -> tail
    start = np.maximum(c, last_full * g)
    u_seg, pos = _ragged(start, np.maximum(s - start, 0))
    tail_tok = tail_slot = tail_pos = None
    if len(u_seg):
        tail_tok = q0[u_seg] + (pos - c[u_seg])
        tail_slot = slot[u_seg]
        tail_pos = pos % g

    # sink: new tokens at positions [c, min(s, sink)) -> tail rows g + pos
    sink_tok = sink_slot = sink_pos = None
    if sink:
        k_seg, k_pos = _ragged(c, np.maximum(np.minimum(s, sink) - c, 0))
        if len(k_seg):
            sink_tok, sink_slot, sink_pos = q0[k_seg] + (k_pos - c[k_seg]), slot[k_seg], g + k_pos
    raw_rows = np.nonzero(active & (ctx == 0))[0]
    dec_rows = np.nonzero(active & (ctx > 0) & (qlen == 1))[0]
    cont_rows = np.nonzero(active & (ctx > 0) & (qlen > 1))[0]

    def tok_of(rows):
        if len(rows) == 0:
            return None, None, 0
        lens = qlen[rows]
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        return _ragged(qsl[rows], lens)[1], cu, int(lens.max())

    raw_tok, raw_cu, raw_max = tok_of(raw_rows)
    dec_tok = qsl[dec_rows] if len(dec_rows) else None  # one token per decode row
    cont_tok, cont_cu, cont_max = tok_of(cont_rows)
    return StepPlan(
        num_reqs=R, num_tokens=n_tok, group=g, qsl=qsl, seq_lens=seq, ctx_lens=ctx,
        tail_slots_np=np.asarray(tail_slots_np[:R], dtype=np.int32),
        num_tiles=n_tiles, tile_block_ids=tile_block_ids,
        tile_new_dst=_t(new_dst, np.int64, device), tile_new_src=_t(new_src, np.int64, device),
        tile_tail_dst=_t(tl_dst, np.int64, device), tile_tail_slot=_t(tl_slot, np.int64, device),
        tile_tail_pos=_t(tl_pos, np.int64, device),
        tail_tok=_t(tail_tok, np.int64, device), tail_slot=_t(tail_slot, np.int64, device),
        tail_pos=_t(tail_pos, np.int64, device),
        tail_slots=(tail_slots_dev if tail_slots_dev is not None else
                    torch.from_numpy(np.asarray(tail_slots_np[:R], dtype=np.int32)).to(device, non_blocking=True)),
        raw_rows=raw_rows, raw_tok=_t(raw_tok, np.int64, device), raw_cu=_t(raw_cu, np.int32, device), raw_max=raw_max,
        dec_rows=dec_rows, dec_rows_t=_t(dec_rows, np.int64, device), dec_tok=_t(dec_tok, np.int64, device),
        cont_rows=cont_rows, cont_rows_t=_t(cont_rows, np.int64, device), cont_tok=_t(cont_tok, np.int64, device),
        cont_qsl=_t(cont_cu, np.int32, device), cont_max_q=cont_max, decode_only=decode_only, sink=sink,
        sink_tok=_t(sink_tok, np.int64, device), sink_slot=_t(sink_slot, np.int64, device),
        sink_pos=_t(sink_pos, np.int64, device),
    )


def update_sink_lens(plan: StepPlan, tags: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor) -> None:
    """The sink bookkeeping of one step (the metadata builder runs it once, before the layers; device ops, no sync).
    tags int32 [S + 1]: per tail slot, the block id of the first tile of the request whose first tokens its sink
    rows hold. Rows that write positions below the sink this step claim their slot (tag = their first block); then
    sink_lens[b] = sink where the slot's tag is row b's own first block, else 0. A request that starts on a
    prefix-cache hit never wrote its first tokens, so it reads them from the records (as without a sink), unless
    its slot last served a request with the same cached first block: the same tokens, the same K/V, a safe match
    (a block's content changes as a first tile only through a write at position 0, which claims: the claim clears
    every other slot's tag of that block id).
    out: int32 [>= R] (a persistent buffer: CUDA graphs); plan.sink_lens becomes out[:R]."""
    R = plan.num_reqs
    if not plan.sink or R == 0:
        return
    dev = block_table.device
    claim = np.nonzero((np.diff(plan.qsl) > 0) & (plan.ctx_lens < plan.sink))[0]
    if len(claim):
        rows = torch.from_numpy(claim).to(dev, non_blocking=True)
        slots = torch.from_numpy(plan.tail_slots_np[claim].astype(np.int64)).to(dev, non_blocking=True)
        new = block_table[rows, 0].to(tags.dtype)
        # a block id is recycled by vLLM: a slot still tagged with a block now written as another request's first
        # tile would hand a later prefix hit on it the old request's tokens, so those tags are cleared first
        tags.masked_fill_(torch.isin(tags, new), -1)
        tags[slots] = new
    slots_r = (plan.tail_slots if plan.tail_slots is not None
               else torch.from_numpy(plan.tail_slots_np[:R]).to(dev, non_blocking=True))
    own = tags[slots_r[:R].long()] == block_table[:R, 0].to(tags.dtype)
    out[:R] = own.to(out.dtype) * plan.sink
    plan.sink_lens = out[:R]


def _rows_of(x: torch.Tensor | None, rows):
    return None if x is None else x[rows]


def _host(x: torch.Tensor | None):
    return None if x is None else x.cpu().numpy()


def store(plan: StepPlan, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, tail_k: torch.Tensor,
          tail_v: torch.Tensor, fmt: KVFormat, iters: int | None = None) -> None:
    """k, v [N, Hk, D] new tokens (N >= plan.num_tokens); cache uint8 [num_blocks, Hk, R]; tails
    [S+1, Hk, g + sink, D]. Complete tiles are assembled (tail + new) and quantized first, then the unfinished
    tiles' tokens go to the tail and the sink's to its rows."""
    g = plan.group
    if tail_k.shape[2] != g + plan.sink:
        raise ValueError(f"kvarn: tail buffers of {tail_k.shape[2]} rows, the plan wants {g} + sink {plan.sink}")
    if plan.num_tiles:
        T = plan.num_tiles
        H, D = k.shape[1], k.shape[2]
        tk = k.new_empty(T * g, H, D)
        tv = v.new_empty(T * g, H, D)
        if plan.tile_new_dst is not None:
            tk[plan.tile_new_dst] = k[plan.tile_new_src].to(tk.dtype)
            tv[plan.tile_new_dst] = v[plan.tile_new_src].to(tv.dtype)
        if plan.tile_tail_dst is not None:
            tk[plan.tile_tail_dst] = tail_k[plan.tile_tail_slot, :, plan.tile_tail_pos].to(tk.dtype)
            tv[plan.tile_tail_dst] = tail_v[plan.tile_tail_slot, :, plan.tile_tail_pos].to(tv.dtype)
        tk = tk.view(T, g, H, D).transpose(1, 2).contiguous()
        tv = tv.view(T, g, H, D).transpose(1, 2).contiguous()
        store_tiles(tk, tv, cache, plan.tile_block_ids, fmt, iters)
    if plan.tail_tok is not None:
        tail_k[plan.tail_slot, :, plan.tail_pos] = k[plan.tail_tok].to(tail_k.dtype)
        tail_v[plan.tail_slot, :, plan.tail_pos] = v[plan.tail_tok].to(tail_v.dtype)
    if plan.sink_tok is not None:
        tail_k[plan.sink_slot, :, plan.sink_pos] = k[plan.sink_tok].to(tail_k.dtype)
        tail_v[plan.sink_slot, :, plan.sink_pos] = v[plan.sink_tok].to(tail_v.dtype)


def store_tiles(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, fmt: KVFormat,
                iters: int | None = None) -> None:
    """k, v [T, H, g, D] complete tiles -> records in cache at block_ids (< 0 skipped)."""
    fn = _kernel("store", "store_tiles") if k.is_cuda else None
    if fn is not None:
        fn(k, v, cache, block_ids, fmt, iters=iters)
        return
    from ..method.reference import quantize_tiles

    rec = quantize_tiles(k, v, fmt, iters=iters)  # [T, H, R]
    keep = block_ids >= 0
    if not bool(keep.all()):
        rec, block_ids = rec[keep], block_ids[keep]
    cache[block_ids.long()] = rec.to(cache.device)


# ---------------------------------------------------------------------------------------------------------------
# attention


def cached_attention_torch(q, cache, block_table, qsl, seq_lens, tail_k, tail_v, tail_slots, fmt, scale,
                           sink_lens=None):
    """Reference: each row's q tokens (the last q_len positions) attend causally over the post-store state.
    q [Nq, Hq, D]; qsl / seq_lens / tail_slots host sequences. Returns float32 [Nq, Hq, D]."""
    from ..method.reference import reference_attention

    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(len(seq_lens)):
        a, e, s = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        if e <= a or s <= 0:
            continue
        # the post-store K/V of row b, fp32, through the reference decoder (the dense path's own materialization)
        k, v, _ = materialize_dense(np.array([b]), np.array([s]), np.array([int(tail_slots[b])]), cache, block_table,
                                    tail_k, tail_v, fmt, torch.float32, use_kernels=False,
                                    sink_lens=None if sink_lens is None else torch.tensor([int(sink_lens[b])]))
        qq = q[a:e].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        o = reference_attention(qq, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), scale,
                                causal_offset=s - (e - a))
        out[a:e] = o[0].transpose(0, 1)
    return out


def raw_attention_torch(q, k, v, cu, scale):
    """Causal attention of each segment over its own raw K/V. q [N, Hq, D], k/v [N, Hk, D]. Returns float32."""
    from ..method.reference import reference_attention

    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = [int(x) for x in cu]
    for b in range(len(cu) - 1):
        a, e = cu[b], cu[b + 1]
        if e <= a:
            continue
        o = reference_attention(q[a:e].transpose(0, 1), k[a:e].transpose(0, 1), v[a:e].transpose(0, 1), scale,
                                causal_offset=0)
        out[a:e] = o.transpose(0, 1)
    return out


def attention(plan: StepPlan, q, k, v, out, cache, block_table, seq_lens_dev, tail_k, tail_v, fmt: KVFormat,
              scale: float, raw_varlen: Callable | None = None) -> None:
    """Writes out[:num_tokens] ([N, Hq, D], q's dtype). raw_varlen(q, k, v, cu, max_len) -> [n, Hq, D] is the fast
    exact path for rows without context (vLLM's flash_attn_varlen_func); None: the torch reference."""
    # 1. rows without prior context: raw Q/K/V (exact)
    if plan.raw_tok is not None:
        full = plan.pure_prefill  # every token belongs to a raw row, in order: plain slices, no gather
        n = plan.num_tokens
        if full:
            qs, ks, vs = q[:n], k[:n], v[:n]
        else:
            qs, ks, vs = q[plan.raw_tok], k[plan.raw_tok], v[plan.raw_tok]
        if raw_varlen is not None:
            o = raw_varlen(qs, ks, vs, plan.raw_cu, plan.raw_max)
        else:
            o = raw_attention_torch(qs, ks, vs, plan.raw_cu.cpu(), scale)
        if full:
            out[:n] = o.to(out.dtype)
        else:
            out[plan.raw_tok] = o.to(out.dtype)
    if plan.pure_prefill:
        return
    use_kernels = q.is_cuda
    # 2. decode rows: one new token over the post-store cache
    if plan.dec_tok is not None:
        rows = plan.dec_rows_t
        qd = q[plan.dec_tok]
        fn = _kernel("decode", "decode_attention") if use_kernels else None
        if fn is not None:
            o = fn(qd, cache, block_table[rows], seq_lens_dev[rows], tail_k, tail_v, plan.tail_slots[rows], fmt, scale,
                   config=_decode_config(), sink_lens=_rows_of(plan.sink_lens, rows))
        else:
            r = plan.dec_rows
            o = cached_attention_torch(qd, cache, block_table[rows], np.arange(len(r) + 1), plan.seq_lens[r],
                                       tail_k, tail_v, plan.tail_slots_np[r], fmt, scale,
                                       _host(_rows_of(plan.sink_lens, rows)))
        out[plan.dec_tok] = o.to(out.dtype)
    # 3. continuation chunks / prefix hits: several new tokens over the post-store cache
    if plan.cont_tok is not None:
        rows = plan.cont_rows_t
        qc = q[plan.cont_tok]
        fn = _kernel("prefill", "prefill_attention") if use_kernels else None
        mode = prefill_mode()
        if mode != "kernel" and (raw_varlen is not None or not use_kernels):
            o = dense_prefill(plan, qc, cache, block_table, tail_k, tail_v, fmt, scale, raw_varlen,
                              rotated=mode == "dense_rot", own_k=None if k is None else k[plan.cont_tok],
                              own_v=None if v is None else v[plan.cont_tok])
        elif fn is not None:
            o = fn(qc, cache, block_table[rows], plan.cont_qsl, seq_lens_dev[rows], tail_k, tail_v,
                   plan.tail_slots[rows], fmt, scale, plan.cont_max_q, sink_lens=_rows_of(plan.sink_lens, rows))
        else:
            r = plan.cont_rows
            cu = np.concatenate([[0], np.cumsum(plan.qsl[r + 1] - plan.qsl[r])])
            o = cached_attention_torch(qc, cache, block_table[rows], cu, plan.seq_lens[r], tail_k, tail_v,
                                       plan.tail_slots_np[r], fmt, scale, _host(_rows_of(plan.sink_lens, rows)))
        out[plan.cont_tok] = o.to(out.dtype)


def decode_step(plan: StepPlan, q, k, v, out, cache, block_table, seq_lens_dev, tail_slots_dev, tail_k, tail_v,
                fmt: KVFormat, scale: float, write_kv: bool = True, use_kernels: bool | None = None,
                raw_varlen: Callable | None = None) -> None:
    """A `decode_only` step: row b's one token is token b (q/k/v/out [N >= B, H, D]). On CUDA two store launches
    and the decode kernel, all reading seq_lens / block_table / tail slots on the device (no gathers, no host
    data: this is what a full CUDA graph captures); k / v are None (or write_kv False) for a layer sharing another
    layer's cache. Elsewhere the general store + attention path (same semantics)."""
    B = plan.num_reqs
    if use_kernels is None:
        use_kernels = q.is_cuda
    store_fn = _kernel("store", "store_decode") if use_kernels else None
    attn_fn = _kernel("decode", "decode_attention") if use_kernels else None
    if store_fn is None or attn_fn is None:
        if plan.defer is not False:
            raise RuntimeError("kvarn: a deferred-flush decode plan needs the decode kernels")
        if plan.minimal:
            raise RuntimeError("kvarn: a minimal decode plan needs the decode kernels (store_decode, decode_attention)")
        if write_kv and k is not None:
            store(plan, k, v, cache, tail_k, tail_v, fmt)
        attention(plan, q, k, v, out, cache, block_table, seq_lens_dev, tail_k, tail_v, fmt, scale,
                  raw_varlen=raw_varlen)
        return
    bt, sl, ts = block_table[:B], seq_lens_dev[:B], tail_slots_dev[:B]
    extra = {} if plan.defer is False else {"defer": plan.defer}  # (no bool() of a device flag: no sync)
    if write_kv and k is not None:
        store_fn(k[:B], v[:B], cache, bt, sl, tail_k, tail_v, ts, fmt, **extra)
    attn_fn(q[:B], cache, bt, sl, tail_k, tail_v, ts, fmt, scale, out=out[:B], config=_decode_config(),
            sink_lens=None if plan.sink_lens is None else plan.sink_lens[:B], **extra)


# ---------------------------------------------------------------------------------------------------------------
# continuation chunks through dense 16-bit K/V + FlashAttention ("dense" prefill)

DENSE_TILES_PER_PASS = 256  # records dequantized per torch pass (bounds the fp32 temporaries: ~134 MB at Hk 8, D 128)
DENSE_KEY_BUDGET = 65536  # keys materialized at once (16-bit K + V: 256 MiB at Hk 8, D 128)


PREFILL_MODES = ("dense", "kernel", "dense_rot")


def prefill_mode() -> str:
    """How continuation chunks / prefix hits attend over the quantized prefix. `dense` (default): the post-store K/V
    of those requests are materialized 16-bit (records dequantized, tail copied) and FlashAttention varlen runs over
    them, trading a transient buffer (<= DENSE_KEY_BUDGET keys) for FA's speed (H200, 4 x 8K context, 512-token
    chunks: 1.28 ms vs 2.37 ms for the kernel; FA3 on fp16 0.50 ms). `kernel` (KVARN_PREFILL=kernel): the fused
    Triton prefill kernel on the records, no buffer. `dense_rot` (unmeasured): like dense, but the K/V stay in the
    stored (rotated) basis, so the record decode is elementwise (no Hadamard over the whole prefix); the chunk's
    queries, the tail rows and the output are rotated instead. Same semantics (the chunk attends to the post-store
    state)."""
    mode = os.environ.get("KVARN_PREFILL", "dense").strip().lower()
    return mode if mode in PREFILL_MODES else "dense"


def dense_varlen_torch(q, k, v, cu_q, cu_k, scale):
    """Reference of FlashAttention's bottom-right causal varlen: segment i's queries are the last q_len_i positions
    of its k_len_i keys. q [Nq, Hq, D], k/v [Nk, Hk, D]; cu_* host sequences. Returns float32 [Nq, Hq, D]."""
    from ..method.reference import reference_attention

    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(len(cu_q) - 1):
        a, e, ka, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if e <= a:
            continue
        o = reference_attention(q[a:e].transpose(0, 1), k[ka:ke].transpose(0, 1), v[ka:ke].transpose(0, 1), scale,
                                causal_offset=(ke - ka) - (e - a))
        out[a:e] = o.transpose(0, 1)
    return out


def materialize_dense(rows: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray, cache, block_table, tail_k, tail_v,
                      fmt: KVFormat, dtype, use_kernels: bool | None = None, rotated: bool = False, sink_lens=None):
    """Post-store K/V of batch rows `rows` (seq_lens / slots: their lengths and tail slots, host), back to back:
    (k, v [sum seq_len, Hk, D] in `dtype`, cu_k int64 host). Full tiles come from the records, dequantized to the
    unrotated basis (kvarn.kernels.dequantize_to_rows on CUDA, else the reference decoder in passes of
    DENSE_TILES_PER_PASS records), the last seq_len % g tokens from the tail rows; rows whose first tile is
    quantized take their first `sink` positions (sink_lens[i] of them, a device tensor, where given) from the sink
    rows (tail rows g + pos). rotated=True: everything in the
    stored basis (unrotated K/V times Hn): records decoded without the Hadamard, tail rows rotated forward."""
    from ..method.hadamard import hadamard
    from ..method.reference import dequantize_tiles

    g = fmt.group
    s = np.asarray(seq_lens, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    cu_k = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(s, out=cu_k[1:])
    Hk, D = cache.shape[1], tail_k.shape[-1]
    dev = cache.device
    k = torch.empty(int(cu_k[-1]), Hk, D, dtype=dtype, device=dev)
    v = torch.empty_like(k)
    n_full = s // g
    seg, cols = _ragged(np.zeros(len(rows), dtype=np.int64), n_full)  # (row, tile index) of every full tile
    fn = _kernel("dequant", "dequantize_to_rows") if (cache.is_cuda if use_kernels is None else use_kernels) else None
    if len(seg):
        bids = block_table[torch.from_numpy(np.asarray(rows)[seg]).to(dev), torch.from_numpy(cols).to(dev)].long()
        dst0 = torch.from_numpy(cu_k[seg] + cols * g).to(dev)
        if fn is not None and D in (64, 128, 256):
            fn(cache, bids, dst0, k, v, fmt, rotated=rotated)
        else:
            off = torch.arange(g, device=dev)
            for a in range(0, len(seg), DENSE_TILES_PER_PASS):
                kd, vd = dequantize_tiles(cache[bids[a:a + DENSE_TILES_PER_PASS]], fmt, D)  # [n, Hk, g, D] fp32
                if rotated:
                    hn = hadamard(D, dev)
                    kd, vd = kd @ hn, vd @ hn
                idx = (dst0[a:a + DENSE_TILES_PER_PASS, None] + off[None, :]).reshape(-1)
                k[idx] = kd.transpose(1, 2).reshape(-1, Hk, D).to(dtype)
                v[idx] = vd.transpose(1, 2).reshape(-1, Hk, D).to(dtype)
    tseg, tpos = _ragged(np.zeros(len(rows), dtype=np.int64), s - n_full * g)
    if len(tseg):
        dst = torch.from_numpy(cu_k[tseg] + n_full[tseg] * g + tpos).to(dev)
        sl, ps = torch.from_numpy(slots[tseg]).to(dev), torch.from_numpy(tpos).to(dev)
        tk, tv = tail_k[sl, :, ps], tail_v[sl, :, ps]
        if rotated:  # at most g - 1 rows per request: a small fp32 matmul
            hn = hadamard(D, dev)
            tk, tv = tk.float() @ hn, tv.float() @ hn
        k[dst] = tk.to(dtype)
        v[dst] = tv.to(dtype)
    sink = tail_k.shape[2] - g  # rows with a quantized first tile read its first positions from the sink rows
    if sink:
        sseg, spos = _ragged(np.zeros(len(rows), dtype=np.int64), np.where(n_full > 0, sink, 0))
        if len(sseg):
            dst = torch.from_numpy(cu_k[sseg] + spos).to(dev)
            sl, ps = torch.from_numpy(slots[sseg]).to(dev), torch.from_numpy(g + spos).to(dev)
            tk, tv = tail_k[sl, :, ps], tail_v[sl, :, ps]
            if rotated:
                hn = hadamard(D, dev)
                tk, tv = tk.float() @ hn, tv.float() @ hn
            if sink_lens is not None:  # sink_lens[i] of row i's sink rows are its own (device: no sync)
                own = sink_lens.to(dev)[torch.from_numpy(sseg).to(dev)]
                use = (torch.from_numpy(spos).to(dev) < own)[:, None, None]
                tk, tv = torch.where(use, tk.to(dtype), k[dst]), torch.where(use, tv.to(dtype), v[dst])
            k[dst] = tk.to(dtype)
            v[dst] = tv.to(dtype)
    return k, v, cu_k


def _groups(lens: np.ndarray, budget: int):
    """Consecutive index ranges [a, e) whose lens sum to <= budget (a single longer one stands alone)."""
    a, tot = 0, 0
    for i, n in enumerate(lens):
        if i > a and tot + n > budget:
            yield a, i
            a, tot = i, 0
        tot += int(n)
    if a < len(lens):
        yield a, len(lens)


def dense_prefill(plan: StepPlan, qc, cache, block_table, tail_k, tail_v, fmt: KVFormat, scale: float,
                  varlen: Callable | None = None, key_budget: int | None = None, use_kernels: bool | None = None,
                  rotated: bool = False, own_k=None, own_v=None):
    """Attention of the continuation rows' queries qc [n, Hq, D] over their materialized post-store K/V, in groups
    of rows holding at most `key_budget` keys (bounds the transient 16-bit buffer): varlen(q, k, v, cu_q, max_q,
    cu_k=, max_k=) (vLLM's FlashAttention) when given, else the torch reference. Returns [n, Hq, D].
    own_k / own_v [n, Hk, D] (the chunks' new K/V, in qc's order): each chunk attends to its own tokens raw and to
    the stored cache before them (the quantized prefix plus its own raw tokens; kvarn.method.hf_cache does the
    same). Without them every position reads the stored state (tiles the chunk completed come back quantized).
    rotated=True: K/V in the stored basis; q goes in as q @ Hn and the output comes back times Hn."""
    if rotated:
        from ..method.hadamard import hadamard

        hn = hadamard(qc.shape[-1], qc.device)
        qc = (qc.float() @ hn).to(qc.dtype)
        if own_k is not None:
            own_k, own_v = (own_k.float() @ hn).to(qc.dtype), (own_v.float() @ hn).to(qc.dtype)
    rows = plan.cont_rows
    key_budget = DENSE_KEY_BUDGET if key_budget is None else key_budget
    s = plan.seq_lens[rows].astype(np.int64)
    qlen = (plan.qsl[rows + 1] - plan.qsl[rows]).astype(np.int64)
    q_cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(qlen, out=q_cu[1:])
    outs = []
    for a, e in _groups(s, key_budget):
        k, v, cu_k = materialize_dense(rows[a:e], s[a:e], plan.tail_slots_np[rows[a:e]], cache, block_table,
                                       tail_k, tail_v, fmt, qc.dtype, use_kernels, rotated,
                                       None if plan.sink_lens is None else plan.sink_lens[rows[a:e]])
        if own_k is not None:  # row i's last qlen[i] positions are its own chunk: raw
            seg, pos = _ragged(np.zeros(e - a, dtype=np.int64), qlen[a:e])
            dst = torch.from_numpy(cu_k[seg + 1] - qlen[a:e][seg] + pos).to(k.device)
            k[dst] = own_k[int(q_cu[a]):int(q_cu[e])].to(k.dtype)
            v[dst] = own_v[int(q_cu[a]):int(q_cu[e])].to(v.dtype)
        q = qc[int(q_cu[a]):int(q_cu[e])]
        cu_q = q_cu[a:e + 1] - q_cu[a]
        if varlen is not None:
            to_dev = lambda x: torch.from_numpy(x.astype(np.int32)).to(qc.device, non_blocking=True)  # noqa: E731
            outs.append(varlen(q, k, v, to_dev(cu_q), int(qlen[a:e].max()), cu_k=to_dev(cu_k),
                               max_k=int(s[a:e].max())))
        else:
            outs.append(dense_varlen_torch(q, k, v, cu_q, cu_k, scale))
    o = outs[0] if len(outs) == 1 else torch.cat(outs)
    return (o.float() @ hn).to(o.dtype) if rotated else o


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
