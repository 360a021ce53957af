"""The sink and window bookkeeping of a decode-only step in one launch.

    decode_tags(seq_lens, block_table, tail_slots, n, n_new, sink_tags, sink_lens, win_tags, win_lens, group, sink,
                window) -> None

kvarn.vllm_plugin.step_plan.update_sink_lens and update_window_lens say what the tags and the per-row lengths mean;
this is the same arithmetic for a step whose rows [0, n_new) have one new token each and rows [n_new, n) none, read
from the device's seq_lens, block table and tail slots. The torch form is some forty small ops and host-to-device
copies, about half a millisecond of host time in every decode step; here it is one program, in three phases split
by barriers, since a tag cleared in the first may be set again in the second and read in the third:

    1. clear every tag that names a block this step writes: a claimed first block (a row writing positions below
       the sink), a row's newest block (vLLM recycles block ids: a stale tag would hand a later prefix hit another
       request's tokens);
    2. claim: the row's slot now names its first block (sink), or the block whose window rows it writes (window);
    3. lengths: sink where the row's slot names the row's first block, window where the half of the tile before the
       newest position's names that tile's block.

One program (a barrier orders memory within a program, not across programs); a step's rows and tags are a few
hundred, so each phase is a few vector steps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KvarnError
from .runtime import serving_jit

ROWS = tl.constexpr(128)  # rows per vector step
TAGS = tl.constexpr(64)  # tail slots per vector step of the clearing phase ([TAGS, ROWS] comparisons)


@triton.jit
def _clear_naming(tag_ptrs, ok, blocks, live):
    """Tags at tag_ptrs [TAGS] (where ok) that name one of `blocks` [ROWS] (where live) become -1."""
    tag = tl.load(tag_ptrs, mask=ok, other=-1)
    hit = tl.max(((tag[:, None] == blocks[None, :]) & live[None, :]).to(tl.int32), axis=1)
    tl.store(tag_ptrs, tl.full(tag.shape, -1, tl.int32), mask=ok & (hit > 0))


@serving_jit(ints=("n", "n_new", "n_slots", "bt_stride"),
             index_ptrs=("seq_ptr", "bt_ptr", "slot_ptr", "stag_ptr", "slen_ptr", "wtag_ptr", "wlen_ptr"))
def _decode_tags_kernel(seq_ptr, bt_ptr, slot_ptr, stag_ptr, slen_ptr, wtag_ptr, wlen_ptr, n, n_new, n_slots,
                        bt_stride, G: tl.constexpr, SINK: tl.constexpr, W: tl.constexpr):
    # 1. clear the tags naming a block written now
    for r0 in range(0, n, ROWS):
        r = r0 + tl.arange(0, ROWS)
        new = r < n_new
        s = tl.load(seq_ptr + r, mask=new, other=0)
        claim = new & (s <= SINK)  # the new token's position s - 1 is below the sink
        first = tl.load(bt_ptr + r * bt_stride, mask=claim, other=-1)
        newest = tl.maximum(s - 1, 0) // G
        cur = tl.load(bt_ptr + r * bt_stride + newest, mask=new, other=-1)
        for t0 in range(0, n_slots, TAGS):
            t = t0 + tl.arange(0, TAGS)
            ok = t < n_slots
            _clear_naming(stag_ptr + t, ok, first, claim)
            if W > 0:
                for half in tl.static_range(2):
                    _clear_naming(wtag_ptr + t * 2 + half, ok, cur, new)
    tl.debug_barrier()
    # 2. the rows' claims
    for r0 in range(0, n, ROWS):
        r = r0 + tl.arange(0, ROWS)
        new = r < n_new
        s = tl.load(seq_ptr + r, mask=new, other=0)
        slot = tl.load(slot_ptr + r, mask=new, other=0)
        claim = new & (s <= SINK)
        tl.store(stag_ptr + slot, tl.load(bt_ptr + r * bt_stride, mask=claim), mask=claim)
        if W > 0:
            newest = tl.maximum(s - 1, 0) // G
            writes = new & ((s - 1) % G >= G - W)  # the new token is one of its tile's last W
            tl.store(wtag_ptr + slot * 2 + newest % 2, tl.load(bt_ptr + r * bt_stride + newest, mask=writes),
                     mask=writes)
    tl.debug_barrier()
    # 3. what each row may read
    for r0 in range(0, n, ROWS):
        r = r0 + tl.arange(0, ROWS)
        row = r < n
        s = tl.load(seq_ptr + r, mask=row, other=0)
        slot = tl.load(slot_ptr + r, mask=row, other=0)
        own = tl.load(stag_ptr + slot, mask=row, other=-1) == tl.load(bt_ptr + r * bt_stride, mask=row, other=-2)
        tl.store(slen_ptr + r, tl.where(own, SINK, 0), mask=row)
        if W > 0:
            wt = tl.maximum(tl.maximum(s - 1, 0) // G - 1, 0)  # the tile before the newest position's
            mine = (tl.load(wtag_ptr + slot * 2 + wt % 2, mask=row, other=-1)
                    == tl.load(bt_ptr + r * bt_stride + wt, mask=row, other=-2))
            tl.store(wlen_ptr + r, tl.where(mine & (s > G), W, 0), mask=row)


def decode_tags(seq_lens: torch.Tensor, block_table: torch.Tensor, tail_slots: torch.Tensor, n: int, n_new: int,
                sink_tags: torch.Tensor, sink_lens: torch.Tensor, win_tags: torch.Tensor | None,
                win_lens: torch.Tensor | None, group: int, sink: int, window: int) -> None:
    """seq_lens, tail_slots int32 [>= n]; block_table int32 [>= n, blocks]; sink_tags int32 [S]; win_tags int32
    [S, 2] (None with window 0); sink_lens, win_lens int32 [>= n] (outputs: rows [0, n) written). Rows [0, n_new)
    have one new token, the rest none (see the module docstring). The slots are not range-checked (that would
    read them back to the host): each must be below S, as the builder's persistent buffer holds them.
    Cost: the clearing phase compares every slot's tags with every row's blocks in one program, about n * S / 8192
    vector steps (a few at 256 rows)."""
    if not 0 <= n_new <= n:
        raise KvarnError(f"decode_tags: rows with a new token ({n_new}) must be within the step's rows ({n})")
    if not 0 < sink < group or not 0 <= window < group:
        raise KvarnError(f"decode_tags: sink {sink} and window {window} must lie in [1, {group}) and [0, {group})")
    if window and (win_tags is None or win_lens is None):
        raise KvarnError("decode_tags: a window needs its tags and its lengths buffer")
    ints = {"seq_lens": seq_lens, "block_table": block_table, "tail_slots": tail_slots, "sink_tags": sink_tags,
            "sink_lens": sink_lens}
    if window:
        ints.update(win_tags=win_tags, win_lens=win_lens)
    for name, t in ints.items():
        flat = name == "block_table" or t.is_contiguous()  # the block table: rows apart, checked below
        if t.dtype != torch.int32 or t.device != seq_lens.device or not flat:
            raise KvarnError(f"decode_tags: {name} must be contiguous int32 on {seq_lens.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    for name, t in (("seq_lens", seq_lens), ("tail_slots", tail_slots), ("sink_lens", sink_lens),
                    ("win_lens", win_lens if window else sink_lens)):
        if t.dim() != 1 or t.shape[0] < n:
            raise KvarnError(f"decode_tags: {name} must be [>= {n}], got {tuple(t.shape)}")
    if sink_tags.dim() != 1 or window and tuple(win_tags.shape) != (sink_tags.shape[0], 2):
        raise KvarnError(f"decode_tags: sink_tags [S] and win_tags [S, 2] must agree, got {tuple(sink_tags.shape)} "
                         f"and {None if win_tags is None else tuple(win_tags.shape)}")
    if block_table.stride(-1) != 1 or block_table.shape[0] < n:
        raise KvarnError(f"decode_tags: block_table must have >= {n} rows, contiguous along a row; got "
                         f"{tuple(block_table.shape)} {block_table.stride()}")
    if n == 0:
        return
    wt = win_tags if window else sink_tags  # a placeholder pointer where there is no window (never read)
    wl = win_lens if window else sink_lens
    _decode_tags_kernel[(1,)](seq_lens, block_table, tail_slots, sink_tags, sink_lens, wt, wl, n, n_new,
                              sink_tags.shape[0], block_table.stride(0), G=group, SINK=sink, W=window, num_warps=4)


__all__ = ["decode_tags"]
