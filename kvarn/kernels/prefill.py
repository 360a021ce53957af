"""Causal varlen attention of a chunk of queries over the KVarN cache + tail (chunked prefill continuation,
prefix-cache hits, spec-decode verify).

Public API (stable):

    prefill_attention(q, cache, block_table, query_start_loc, seq_lens, tail_k, tail_v, tail_slots, fmt, scale,
                      max_query_len, out=None) -> out
        q                [Nq, Hq, D] fp16/bf16 (not rotated), requests back to back
        query_start_loc  int32 [B+1]; request i's queries are its LAST q_len_i = qsl[i+1]-qsl[i] positions,
                         i.e. positions seq_len_i - q_len_i .. seq_len_i - 1
        seq_lens         int32 [B]: tokens in the cache after this step's store (this chunk included)
        max_query_len    python int >= every q_len_i (sizes the fixed grid; vLLM's metadata has it on the host)
        Each query attends causally to keys at positions <= its own, ALL read from the post-store cache state:
        full tiles from records (block_table), the partial tile from tail_k/tail_v [S, Hk, g, D] row tail_slots[i].

It is the decode kernel (kvarn.kernels.attention) with BQ query tokens per program: M = BQ x (padded GQA group)
rows share each unpacked tile, and the causal mask is per row. No split-K (the query block already gives enough
programs). Grid (B, cdiv(max_query_len, BQ), Hk) + the query-rotation and rotate-back launches: fixed from host
ints, no sync.
"""
from __future__ import annotations

import torch
import triton

from ..errors import KvarnError
from ..formats import KVFormat
from .common import as_format, check_cache, layout
from .decode import DecodeConfig, check_tail, effective_config, group_geometry, run_attention

ROWS_PER_PROGRAM = 64  # M rows (query tokens x group heads) per program
PREFILL_CONFIG = DecodeConfig(unpack=2, ksplit=2, vsplit=1, num_warps=8, num_stages=1)  # offline sm_90: 255 regs, 92 B spill (w4: 964 B)


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor, tail_slots: torch.Tensor,
                      fmt: KVFormat | str, scale: float, max_query_len: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    fmt = as_format(fmt)
    if q.dim() != 3:
        raise KvarnError(f"q must be [Nq, Hq, D], got {tuple(q.shape)}")
    Nq, Hq, D = q.shape
    lay = layout(fmt, D)
    check_cache(cache, lay)
    Hk = cache.shape[1]
    group, gp = group_geometry(Hq, Hk)
    check_tail(tail_k, tail_v, Hk, lay.g, D)
    B = seq_lens.shape[0]
    if query_start_loc.shape != (B + 1,):
        raise KvarnError(f"query_start_loc must be [B+1={B + 1}], got {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise KvarnError(f"block_table must be [B={B}, max_blocks], got {tuple(block_table.shape)}")
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if B == 0 or Nq == 0 or max_query_len <= 0:
        return out
    bq = max(1, ROWS_PER_PROGRAM // gp)
    bq = min(bq, triton.next_power_of_2(int(max_query_len)))
    cfg = effective_config(PREFILL_CONFIG, q.device)
    return run_attention(q, cache, block_table, seq_lens, query_start_loc, tail_k, tail_v, tail_slots, out, lay,
                         group, gp, scale, 1, cfg, prefill=True, bq=bq, q_blocks=triton.cdiv(int(max_query_len), bq))
