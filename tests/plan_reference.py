"""The per-row plan builder that kvarn.vllm_plugin.step_plan.plan_step replaced: the oracle its vectorized version is
tested against (tests/vllm_plugin/test_vllm_plugin_plan.py) and timed against (scripts/time_plan.py --ref)."""
from __future__ import annotations

import numpy as np
import torch

from kvarn.vllm_plugin.step_plan import StepPlan, to_device as _t


def _decode_only(qsl, R) -> bool:
    """Row by row: rows 0..n-1 have one token each (token i = row i), every later row none, and n >= 1."""
    n = 0
    for i in range(R):
        q = int(qsl[i + 1] - qsl[i])
        if q == 1 and n == i and int(qsl[i]) == i:
            n += 1
        elif q != 0:
            return False
    return n > 0


def build_plan_reference(qsl_cpu, seq_lens_cpu, num_reqs: int, tail_slots_np: np.ndarray, block_table: torch.Tensor,
               group: int, device) -> StepPlan:
    """The original per-row loop builder, kept as the oracle of `build_plan` (tests) and for timing."""
    g = group
    R = int(num_reqs)
    qsl = np.asarray(qsl_cpu[: R + 1], dtype=np.int64)
    seq = np.asarray(seq_lens_cpu[:R], dtype=np.int64)
    qlen = np.diff(qsl)
    ctx = seq - qlen
    n_tok = int(qsl[-1]) if R else 0

    t_rows, t_cols = [], []
    t_first, t_old, t_slot = [], [], []
    tail_tok, tail_slot, tail_pos = [], [], []
    n_tiles = 0
    for i in range(R):
        q = int(qlen[i])
        if q <= 0:
            continue
        c, s, slot, q0 = int(ctx[i]), int(seq[i]), int(tail_slots_np[i]), int(qsl[i])
        first, last_full = c // g, s // g  # tiles [first, last_full) complete in this step
        for j in range(first, last_full):
            lo = j * g
            # where each of the tile's positions is: written in an earlier step (the tail) or this step's token
            new = [q0 + (lo + o - c) for o in range(g) if lo + o >= c]
            old = g - len(new)
            assert all(lo + o < c for o in range(old)) and new == list(range(new[0], new[0] + len(new)))
            t_old.append(old)
            t_first.append(new[0] - old)  # the index position 0 would have: position old is new token new[0]
            t_slot.append(slot)
            t_rows.append(i)
            t_cols.append(j)
            n_tiles += 1
        start = max(c, last_full * g)  # new tokens of the unfinished tile
        if start < s:
            pos = np.arange(start, s)
            tail_tok.append(q0 + (pos - c))
            tail_slot.append(np.full(len(pos), slot))
            tail_pos.append(pos % g)

    def cat(parts):
        return np.concatenate(parts) if parts else None

    tile_block_ids = None
    if n_tiles:
        rows_t = _t(np.array(t_rows), np.int64, device)
        cols_t = _t(np.array(t_cols), np.int64, device)
        tile_block_ids = block_table[rows_t, cols_t].to(torch.int32)

    active = qlen > 0
    raw_rows = np.nonzero(active & (ctx == 0))[0]
    dec_rows = np.nonzero(active & (ctx > 0) & (qlen == 1))[0]
    cont_rows = np.nonzero(active & (ctx > 0) & (qlen > 1))[0]

    def toks(rows):
        return [t for r in rows for t in range(int(qsl[r]), int(qsl[r + 1]))]

    raw_span, raw_cu, raw_max = None, None, 0
    if len(raw_rows):
        span_rows = [r for r in range(int(raw_rows[0]), int(raw_rows[-1]) + 1) if qlen[r] > 0]
        raw_span = (int(qsl[span_rows[0]]), int(qsl[span_rows[-1] + 1]))
        raw_cu = np.array([0] + [int(qsl[r + 1]) - raw_span[0] for r in span_rows])
        raw_max = max(int(qlen[r]) for r in span_rows)
    dec_prefix = len(dec_rows) if list(dec_rows) == list(range(len(dec_rows))) == toks(dec_rows) else 0
    dec_tok = toks(dec_rows)
    cont_tok, cont_span = toks(cont_rows), None
    if cont_tok and cont_tok == list(range(cont_tok[0], cont_tok[-1] + 1)):
        cont_span, cont_tok = (cont_tok[0], cont_tok[-1] + 1), []
    return StepPlan(
        num_reqs=R, num_tokens=n_tok, group=g, qsl=qsl, seq_lens=seq, ctx_lens=ctx,
        tail_slots_np=np.asarray(tail_slots_np[:R], dtype=np.int32),
        num_tiles=n_tiles, tile_block_ids=tile_block_ids, tile_first=_t(np.array(t_first), np.int64, device),
        tile_old=_t(np.array(t_old), np.int32, device), tile_slot=_t(np.array(t_slot), np.int32, device),
        tail_tok=_t(cat(tail_tok), np.int64, device), tail_slot=_t(cat(tail_slot), np.int64, device),
        tail_pos=_t(cat(tail_pos), np.int64, device),
        tail_slots=torch.from_numpy(np.asarray(tail_slots_np[:R], dtype=np.int32)).to(device, non_blocking=True),
        raw_rows=raw_rows, raw_span=raw_span, raw_cu=_t(raw_cu, np.int32, device), raw_max=raw_max,
        dec_rows=dec_rows, dec_rows_t=None if dec_prefix else _t(dec_rows, np.int64, device),
        dec_tok=None if dec_prefix else _t(np.array(dec_tok), np.int64, device),
        cont_rows=cont_rows, cont_tok=_t(np.array(cont_tok), np.int64, device), dec_prefix=dec_prefix,
        cont_span=cont_span, decode_only=_decode_only(qsl, R),
    )


# ---------------------------------------------------------------------------------------------------------------
# store
