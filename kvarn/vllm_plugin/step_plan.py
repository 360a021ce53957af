"""The plan of one forward step of the vLLM backend, built once on the host from the CPU copies of
`query_start_loc` / `seq_lens` and shared by all layers (no vLLM import; tested on CPU). For the flattened new
tokens of the batch it says:

* which tiles complete in this step (batch row, tile index -> block id from the block table) and where their g
  16-bit tokens are: the first `old` in the request's tail row (written in earlier steps), the rest this step's new
  K/V from a token index on (the store reads them there, no gather);
* which new tokens go to which rows of the 16-bit tail buffers: those of the unfinished last tile, and also the
  sink's and the window's (a tile's last W positions, in the half of its tile's parity);
* how attention splits: rows with no prior context (first prefill chunk) attend to the raw new Q/K/V (exact, as
  FlashAttention would); decode rows (one new token) and continuation rows (several: chunked prefill, a
  prefix-cache hit, spec-decode verify) attend to the post-store cache state. Decode rows that lead the batch (vLLM
  puts them first) and continuation rows whose tokens form one range are sliced, not gathered: a prefill step is
  host-bound, and a gather is a launch per tensor per layer.

Semantics shared with the PyTorch reference cache: a tile is quantized once, when its g tokens exist; the store
runs before attention in the layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..method.paged import host_tensor, ragged_ranges, to_device


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
    tile_first: torch.Tensor | None  # int64 [T]: new-token index of the tile's position 0 (read from position old)
    tile_old: torch.Tensor | None  # int32 [T]: positions [0, old) come from the tail (earlier steps)
    tile_slot: torch.Tensor | None  # int32 [T]: the tail row of the tile's request
    # the step's writes into the 16-bit tail buffers, one copy per layer: new token tail_tok[i] -> row tail_pos[i]
    # of slot tail_slot[i]; the unfinished tiles' tokens (rows pos % g), then the sink's and the window's
    tail_tok: torch.Tensor | None  # int64 [n3]
    tail_slot: torch.Tensor | None  # int64 [n3]
    tail_pos: torch.Tensor | None  # int64 [n3]: the tail row
    # attention (device)
    tail_slots: torch.Tensor | None  # int32 [R] (a minimal decode plan: only the builder's persistent buffer)
    raw_rows: np.ndarray  # rows with no prior context
    # tokens [a, e) of the rows from the first raw row to the last: raw attention runs over each of those rows'
    # own tokens (rows of other kinds in between too: the decode and continuation outputs overwrite theirs)
    raw_span: tuple[int, int] | None
    raw_cu: torch.Tensor | None  # int32 [rows in the span + 1], relative to a
    raw_max: int
    dec_rows: np.ndarray  # rows with context and one new token
    dec_rows_t: torch.Tensor | None  # they and their tokens, where dec_prefix is 0
    dec_tok: torch.Tensor | None
    cont_rows: np.ndarray  # rows with context and several new tokens
    cont_tok: torch.Tensor | None  # their tokens, where cont_span is None
    # n > 0: the decode rows are rows [0, n) with tokens [0, n) (slices, not dec_rows_t / dec_tok gathers)
    dec_prefix: int = 0
    # the continuation rows' tokens as one range [a, e) where they are one (slices, not cont_tok gathers)
    cont_span: tuple[int, int] | None = None
    # one token per row, row b = token b, padding rows (no token) only at the end: the decode fast path
    decode_only: bool = False
    # decode_only with only the host fields (plan_step's decode_minimal): the decode kernels must run it
    minimal: bool = False
    # decode_only under the deferred flush (common.defer_flush_enabled): the builder's int32 [1] device flag (1: a
    # tile completed this step stays in the tail; 0: stored at once), read by the kernels at run time so that one
    # captured decode graph serves both; False: not deferred (the kernels' default variants)
    defer: bool | torch.Tensor = False
    # the attention sink (the first `sink` positions, 16-bit for good in tail rows g + pos) and the window (a tile's
    # last `window` positions, also in rows g + sink + (tile % 2) * window + pos % g - (g - window))
    sink: int = 0
    window: int = 0
    # int32 [R] device: sink rows each batch row may read (sink, or 0 where its slot's rows hold another request's
    # tokens: a prefix-cache hit); None = all `sink` (set by the metadata builder through update_sink_lens)
    sink_lens: torch.Tensor | None = None
    # int32 [R] device: `window` where the row's slot holds the window of its tile before the newest position's
    # (that tile's block is the one the slot's window tag names), else 0; None = all (update_window_lens)
    win_lens: torch.Tensor | None = None
    # what the step's first layer prepares and the others reuse: the kernels' checked launches (StepPlan.launch) and
    # the continuation rows' dense-attention groups (kvarn.vllm_plugin.dense_prefill)
    prepared: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def pure_prefill(self) -> bool:
        return len(self.dec_rows) == 0 and len(self.cont_rows) == 0

    def launch(self, key, prepare, *tensors) -> None:
        """One layer's launch of a kernel: prepare(*tensors) (the checks, the index and stride arguments, the
        workspaces) runs on the step's first layer whose tensors have these dtypes, shapes, strides and alignments,
        and the launch it returns is kept for the other layers, whose host work is then the launch alone (a prefill
        step's GPU waits on its host). key: what else the launch depends on (the kernel, the format). prepare may
        capture only what stays the same for the whole step (the plan's indexes, the step's block table and lengths):
        anything that differs per layer must be one of `tensors`."""
        full = (key, *[(t.dtype, t.shape, t.stride(), t.data_ptr() % 16, t.device) for t in tensors])
        fn = self.prepared.get(full)
        if fn is None:
            fn = self.prepared[full] = prepare(*tensors)
        fn(*tensors)


def plan_step(qsl_cpu, seq_lens_cpu, num_reqs: int, tail_slots_np: np.ndarray, block_table: torch.Tensor,
               group: int, device, decode_minimal: bool = False,
               tail_slots_dev: torch.Tensor | None = None, sink: int = 0, window: int = 0) -> StepPlan:
    """qsl_cpu [>= R + 1], seq_lens_cpu [>= R] (host), tail_slots_np int32 [R], block_table [R, max_blocks].

    Vectorized over rows (numpy on the host arrays, no Python loop per row; non-blocking host->device copies, no
    sync); the output equals tests/plan_reference.py (a per-row loop) field for field.
    decode_minimal: a decode_only step gets only its host fields (the decode kernels read everything else on the
    device): no host->device copies on the steps a full CUDA graph replays.
    tail_slots_dev: tail_slots_np already on the device (the builder's persistent buffer): used as the plan's
    `tail_slots` instead of another copy. sink / window: the format's 16-bit sink and window tokens (0 <= sink <
    group; the tail buffers then have group + sink + 2 * window rows)."""
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
            tile_first=None, tile_old=None, tile_slot=None,
            tail_tok=None, tail_slot=None, tail_pos=None, tail_slots=tail_slots_dev,
            raw_rows=np.zeros(0, dtype=np.int64), raw_span=None, raw_cu=None, raw_max=0,
            dec_rows=act, dec_rows_t=None, dec_tok=None, cont_rows=np.zeros(0, dtype=np.int64), cont_tok=None,
            dec_prefix=n_act, decode_only=True, minimal=True, sink=sink, window=window)
    c, s, q0, slot = ctx[act], seq[act], qsl[:-1][act], slots_r[act]

    # tiles [c // g, s // g) of each active row complete in this step, in row order then tile order
    first, last_full = c // g, s // g
    t_seg, t_cols = ragged_ranges(first, np.maximum(last_full - first, 0))
    n_tiles = len(t_seg)
    tile_block_ids = t_first = t_old = t_slot = None
    if n_tiles:
        t_rows = act[t_seg]
        rows_t = to_device(t_rows, np.int64, device)
        cols_t = to_device(t_cols, np.int64, device)
        tile_block_ids = block_table[rows_t, cols_t].to(torch.int32)
        # positions [0, old) of a tile were written in earlier steps (tail), [old, g) are new tokens from
        # t_first + old on (t_first, the index position 0 would have, is negative when old exceeds the row's first
        # new-token index q0)
        lo = t_cols * g
        tc = c[t_seg]
        t_old = np.maximum(0, tc - lo)
        t_first = q0[t_seg] + lo - tc
        t_slot = slot[t_seg]
    # new tokens of the unfinished tile: positions [max(c, last_full * g), s) -> tail rows pos % g
    start = np.maximum(c, last_full * g)
    u_seg, pos = ragged_ranges(start, np.maximum(s - start, 0))
    writes = [(q0[u_seg] + (pos - c[u_seg]), slot[u_seg], pos % g)]
    # sink: new tokens at positions [c, min(s, sink)) -> tail rows g + pos; window: new tokens in their tile's last
    # `window` positions -> rows g + sink + (tile % 2) * window + pos % g - (g - window)
    if sink:
        k_seg, k_pos = ragged_ranges(c, np.maximum(np.minimum(s, sink) - c, 0))
        writes.append((q0[k_seg] + (k_pos - c[k_seg]), slot[k_seg], g + k_pos))
        if window:
            w_seg, w_pos = ragged_ranges(c, s - c)
            # only the last two tiles' (a window is read for the tile before the newest position's; one row of
            # a half written once per step, so no copy has two writers)
            keep = (w_pos % g >= g - window) & (w_pos // g >= (s[w_seg] - 1) // g - 1)
            w_seg, w_pos = w_seg[keep], w_pos[keep]
            writes.append((q0[w_seg] + (w_pos - c[w_seg]), slot[w_seg],
                           g + sink + (w_pos // g) % 2 * window + w_pos % g - (g - window)))
    tail_tok, tail_slot, tail_pos = (np.concatenate(x) for x in zip(*writes))
    raw_rows = np.nonzero(active & (ctx == 0))[0]
    dec_rows = np.nonzero(active & (ctx > 0) & (qlen == 1))[0]
    cont_rows = np.nonzero(active & (ctx > 0) & (qlen > 1))[0]

    raw_span, raw_cu, raw_max = None, None, 0
    if len(raw_rows):  # every row from the first raw row to the last, its own tokens a segment (empty rows dropped)
        r0, r1 = int(raw_rows[0]), int(raw_rows[-1])
        raw_span = (int(qsl[r0]), int(qsl[r1 + 1]))
        raw_cu = np.unique(qsl[r0:r1 + 2]) - qsl[r0]
        raw_max = int(qlen[r0:r1 + 1].max())
    n_dec = len(dec_rows)
    dec_prefix = n_dec if n_dec and dec_rows[-1] == n_dec - 1 and qsl[n_dec] == n_dec else 0
    cont_tok, cont_span = None, None
    if len(cont_rows):
        cont_tok = ragged_ranges(qsl[cont_rows], qlen[cont_rows])[1]
        if cont_tok[-1] - cont_tok[0] == len(cont_tok) - 1:  # increasing: one range exactly when this holds
            cont_span, cont_tok = (int(cont_tok[0]), int(cont_tok[-1]) + 1), None
    return StepPlan(
        num_reqs=R, num_tokens=n_tok, group=g, qsl=qsl, seq_lens=seq, ctx_lens=ctx,
        tail_slots_np=np.asarray(tail_slots_np[:R], dtype=np.int32),
        num_tiles=n_tiles, tile_block_ids=tile_block_ids, tile_first=to_device(t_first, np.int64, device),
        tile_old=to_device(t_old, np.int32, device), tile_slot=to_device(t_slot, np.int32, device),
        tail_tok=to_device(tail_tok, np.int64, device), tail_slot=to_device(tail_slot, np.int64, device),
        tail_pos=to_device(tail_pos, np.int64, device),
        tail_slots=(tail_slots_dev if tail_slots_dev is not None else
                    host_tensor(tail_slots_np[:R], np.int32, device).to(device, non_blocking=True)),
        raw_rows=raw_rows, raw_span=raw_span, raw_cu=to_device(raw_cu, np.int32, device), raw_max=raw_max,
        dec_rows=dec_rows, dec_rows_t=None if dec_prefix else to_device(dec_rows, np.int64, device),
        dec_tok=None if dec_prefix else to_device(qsl[dec_rows], np.int64, device),  # one token per decode row
        cont_rows=cont_rows, cont_tok=to_device(cont_tok, np.int64, device), dec_prefix=dec_prefix,
        cont_span=cont_span, decode_only=decode_only, sink=sink, window=window,
    )


def continuation_plan(qsl_cpu, seq_lens_cpu, tail_slots_np: np.ndarray, block_table: torch.Tensor, group: int,
                      sink_lens: torch.Tensor | None = None, win_lens: torch.Tensor | None = None) -> StepPlan:
    """The plan of a step whose every row attends as a continuation chunk over the stored state, also a row whose
    chunk is its whole sequence or empty: the dense path alone (kvarn.vllm_plugin.dense_prefill), for its tests and
    its microbenchmark. Its other row kinds are left as planned: not a plan for ops.attention."""
    seq = np.asarray(seq_lens_cpu, dtype=np.int64)
    plan = plan_step(qsl_cpu, seq, len(seq), np.asarray(tail_slots_np, dtype=np.int32), block_table, group,
                     block_table.device)
    plan.cont_rows, plan.sink_lens, plan.win_lens = np.arange(len(seq)), sink_lens, win_lens
    return plan


def _tail_slots_dev(plan: StepPlan, device) -> torch.Tensor:
    """The rows' tail slots on the device: the plan's (the builder's persistent buffer), else copied from the host."""
    if plan.tail_slots is not None:
        return plan.tail_slots
    return to_device(plan.tail_slots_np[:plan.num_reqs], np.int32, device)


def _untag(tags: torch.Tensor, blocks: torch.Tensor) -> None:
    """Clear every tag naming one of `blocks` (an elementwise match: torch.isin may sort, which syncs on CUDA)."""
    hit = (tags.reshape(-1, 1) == blocks.reshape(1, -1)).any(1).view(tags.shape)
    tags.masked_fill_(hit, -1)


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
        rows = to_device(claim, np.int64, dev)
        slots = to_device(plan.tail_slots_np[claim], np.int64, dev)
        new = block_table[rows, 0].to(tags.dtype)
        # a block id is recycled by vLLM: a slot still tagged with a block now written as another request's first
        # tile would hand a later prefix hit on it the old request's tokens, so those tags are cleared first
        _untag(tags, new)
        tags[slots] = new
    slots_r = _tail_slots_dev(plan, dev)
    own = tags[slots_r[:R].long()] == block_table[:R, 0].to(tags.dtype)
    out[:R] = own.to(out.dtype) * plan.sink
    plan.sink_lens = out[:R]


def update_window_lens(plan: StepPlan, tags: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor) -> None:
    """The window bookkeeping of one step (after update_sink_lens; the builder runs it once, before the layers;
    device ops, no sync). tags int32 [S + 1, 2]: per tail slot and window half, the block id of the tile whose last
    `window` tokens the half holds. Rows that write window tokens of a tile this step (its last two tiles: the plan
    and the decode store write those) tag that half with the tile's block, and no other slot keeps that block id
    (vLLM recycles block ids: a stale tag would hand a later prefix hit another request's tokens). Then
    win_lens[b] = window where the half of row b's tile before its newest position's is tagged with that tile's
    block: the request wrote it, or a request with the same cached block (the same tokens) did, in that slot.
    out: int32 [>= R] (a persistent buffer: CUDA graphs); plan.win_lens becomes out[:R]."""
    R, g, W = plan.num_reqs, plan.group, plan.window
    if not W or not plan.sink or R == 0:
        return
    dev = block_table.device
    s, c = plan.seq_lens[:R], plan.ctx_lens[:R]
    newest = (s - 1) // g
    rows, tiles = [], []
    for t in (newest - 1, newest):  # the tiles whose window tokens a row writes this step
        lo, hi = np.maximum(c, t * g + g - W), np.minimum(s, t * g + g)
        w = np.nonzero((s > 0) & (t >= 0) & (hi > lo))[0]
        rows.append(w)
        tiles.append(t[w])
    rows, tiles = np.concatenate(rows), np.concatenate(tiles)
    # every block a row writes this step holds that row's tokens from now on: no other slot may name it
    live = np.nonzero(s > c)[0]
    w_seg, w_tile = ragged_ranges(c[live] // g, (s[live] - 1) // g - c[live] // g + 1)
    if len(w_seg):
        _untag(tags, block_table[to_device(live[w_seg], np.int64, dev),
                                 to_device(w_tile, np.int64, dev)].to(tags.dtype))
    if len(rows):
        r_t = to_device(rows, np.int64, dev)
        new = block_table[r_t, to_device(tiles, np.int64, dev)].to(tags.dtype)
        slot = to_device(plan.tail_slots_np[rows], np.int64, dev)
        tags[slot, to_device(tiles % 2, np.int64, dev)] = new
    wt = np.maximum(newest - 1, 0)
    slots_r = _tail_slots_dev(plan, dev)
    wt_t = to_device(wt, np.int64, dev)
    mine = tags[slots_r[:R].long(), wt_t % 2] == block_table[torch.arange(R, device=dev), wt_t].to(tags.dtype)
    ok = to_device(s > g, np.bool_, dev) & mine
    out[:R] = ok.to(out.dtype) * W
    plan.win_lens = out[:R]


def update_lens(plan: StepPlan, sink_tags: torch.Tensor, win_tags: torch.Tensor, block_table: torch.Tensor,
                sink_out: torch.Tensor, win_out: torch.Tensor, seq_lens_dev: torch.Tensor | None = None) -> None:
    """update_sink_lens, then update_window_lens. A decode-only step given its device seq_lens (the decode kernels'
    int32 [>= R]) runs both as one launch of kvarn.kernels.tags.decode_tags: the same tags and lengths from device
    data alone, no host-to-device copies (the torch form is about half a millisecond of host time per step)."""
    R = plan.num_reqs
    if seq_lens_dev is None or not plan.decode_only or not plan.sink or R == 0:
        update_sink_lens(plan, sink_tags, block_table, sink_out)
        update_window_lens(plan, win_tags, block_table, win_out)
        return
    from ..kernels.tags import decode_tags

    W = plan.window
    # decode_only: rows [0, num_tokens) have a token each, the rest none
    decode_tags(seq_lens_dev, block_table, _tail_slots_dev(plan, block_table.device), R, plan.num_tokens, sink_tags,
                sink_out, win_tags if W else None, win_out if W else None, plan.group, plan.sink, W)
    plan.sink_lens = sink_out[:R]
    if W:
        plan.win_lens = win_out[:R]
