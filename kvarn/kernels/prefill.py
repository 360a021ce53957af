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
        full tiles from records (block_table), the partial tile from tail_k/tail_v [S, Hk, g + sink, D] row
        tail_slots[i], positions below sink from that row's sink rows (as decode_attention).

It is the decode kernel (kvarn.kernels.attention) with BQ query tokens per program: M = BQ x (padded GQA group)
rows share each unpacked tile, and the causal mask is per row. No split-K (the query block already gives enough
programs). Grid (B, cdiv(max_query_len, BQ), Hk) + the query-rotation and rotate-back launches: fixed from host
ints, no sync.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton

from ..errors import KvarnError
from ..formats import KVFormat
from .decode import DecodeConfig, check_attention_args, effective_config, run_attention

ROWS_PER_PROGRAM = 64  # M rows (query tokens x group heads) per program
# 4 warps: one Hopper warpgroup for the 64-row wgmma tiles (offline sm_90 compile: 255 regs, ~950 B spill). 8 warps
# at 64 rows (e0de6e5) make Triton (3.6 and 3.9) lay the chained QK/PV dots out as warpsPerCTA [8, 1] over 64 rows
# (the second warpgroup a broadcast copy of the first) with a [4, 2] layout for the last PV dot and mma -> mma
# conversions between them; the H200 microbench (compiled) gave rel. err 1.09 with it while the 16-row decode tiles
# (mma.sync, no wgmma) were right. The interpreter has no layouts, so only the GPU tests can show it (see
# max_warps_for_rows, tests/test_kernels_gpu.py::test_gpu_prefill_microbench_shape*).
PREFILL_CONFIG = DecodeConfig(unpack=2, ksplit=2, vsplit=1, num_warps=4, num_stages=1)


def max_warps_for_rows(bm: int) -> int:
    """Most warps a program of `bm` rows may use: every warp owns >= 16 distinct rows of the dot tiles (Triton puts
    the warps of chained dots along M, 16 rows each; more warps than bm/16 broadcast whole warpgroups over the same
    rows, the layout suspected of the wrong H200 prefill output). Below 64 rows (mma.sync, decode's 16-row
    tiles) 4 warps."""
    return max(4, bm // 16)


def prefill_geometry(max_query_len: int, gp: int, cfg: DecodeConfig = PREFILL_CONFIG,
                     rows_per_program: int = ROWS_PER_PROGRAM) -> tuple[int, int, DecodeConfig]:
    """(BQ query tokens per program, BM rows, config with num_warps capped by max_warps_for_rows(BM)) for a
    prefill launch; host ints only."""
    bq = max(1, rows_per_program // gp)
    bq = min(bq, triton.next_power_of_2(max(1, int(max_query_len))))
    bm = max(16, bq * gp)
    warps = min(cfg.num_warps, max_warps_for_rows(bm))
    if warps != cfg.num_warps:
        cfg = replace(cfg, num_warps=warps)
    return bq, bm, cfg


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor, tail_slots: torch.Tensor,
                      fmt: KVFormat | str, scale: float, max_query_len: int,
                      out: torch.Tensor | None = None, sink_lens: torch.Tensor | None = None) -> torch.Tensor:
    B = seq_lens.shape[0]
    if query_start_loc.shape != (B + 1,):
        raise KvarnError(f"query_start_loc must be [B+1={B + 1}], got {tuple(query_start_loc.shape)}")
    q, out, lay, Hk, group, gp = check_attention_args(q, cache, block_table, tail_k, tail_v, fmt, B, out, "Nq")
    Nq = q.shape[0]
    if B == 0 or Nq == 0 or max_query_len <= 0:
        return out
    return _launch_prefill(q, cache, block_table, query_start_loc, seq_lens, tail_k, tail_v, tail_slots, out, lay,
                           group, gp, scale, max_query_len, PREFILL_CONFIG, ROWS_PER_PROGRAM, sink_lens=sink_lens)


def _launch_prefill(q, cache, block_table, query_start_loc, seq_lens, tail_k, tail_v, tail_slots, out, lay, group,
                    gp, scale, max_query_len, cfg: DecodeConfig, rows_per_program: int, *, cap_warps: bool = True,
                    sink_lens=None):
    """The launches behind prefill_attention with an explicit config / rows per program (GPU tests compare
    variants; cap_warps=False reproduces an uncapped layout for diagnosis only)."""
    bq, bm, capped = prefill_geometry(max_query_len, gp, cfg, rows_per_program)
    cfg = effective_config(capped if cap_warps else cfg, q.device)
    return run_attention(q, cache, block_table, seq_lens, query_start_loc, tail_k, tail_v, tail_slots, out, lay,
                         group, gp, scale, 1, cfg, prefill=True, bq=bq, q_blocks=triton.cdiv(int(max_query_len), bq),
                         sink_lens=sink_lens)
