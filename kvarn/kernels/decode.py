"""Fused paged decode attention over a KVarN cache + 16-bit tail (split-K flash-decoding, GQA-shared tiles).

Public API (stable; the vLLM backend calls exactly this):

    decode_attention(q, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, fmt, scale,
                     num_splits=None, out=None) -> out
        q           [B, Hq, D] fp16/bf16, NOT rotated (the kernel rotates it in its prologue)
        cache       uint8 [num_blocks, Hk, record_bytes(D)]
        block_table int32 [B, max_blocks]: record row of each full tile of request b
        seq_lens    int32 [B]: tokens visible to the query; seq_len // g full tiles come from records, the last
                    seq_len % g tokens from tail_k / tail_v [S, Hk, g, D] at row tail_slots[b] (int32 [B]),
                    position pos % g. seq_len 0 rows (CUDA-graph padding) produce zeros.
        scale       softmax scale (python float)
        num_splits  context splits per (request, KV head), merged with log-sum-exp; None: a heuristic from B, Hk,
                    block_table.shape[1] and the SM count (host values only, never device data)
        out         optional [B, Hq, D] output (q's dtype, or fp32 for tests); allocated when None

Grid (B, 1, Hk * num_splits) + (B, Hq) for the merge: fixed from shapes, no host sync -> CUDA-graph capturable
(call kvarn.kernels.prepare(D, device) once before capture; with num_splits > 1 the partial buffers are
allocated per call from torch's caching allocator, which graph capture supports).
"""
from __future__ import annotations

import functools

import torch
import triton

from ..errors import KvarnError
from ..formats import KVFormat
from .attention import LOG2E, kvarn_attention_kernel, merge_splits_kernel, mma_bf16
from .common import as_format, check_cache, f16_view, hadamard_fp32, layout


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Enough programs for ~2 waves on the GPU, never more splits than tiles (host-only arithmetic)."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 4
    programs = max(1, batch * kv_heads)
    splits = max(1, -(-2 * sms // programs))
    return int(max(1, min(splits, max_blocks + 1, 64)))


def group_geometry(hq: int, hk: int) -> tuple[int, int]:
    if hq % hk:
        raise KvarnError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    group = hq // hk
    return group, triton.next_power_of_2(group)


def check_tail(tail_k, tail_v, hk: int, g: int, d: int) -> None:
    if tail_k.dim() != 4 or tuple(tail_k.shape[1:]) != (hk, g, d) or tail_v.shape != tail_k.shape:
        raise KvarnError(f"tail_k / tail_v must be [S, {hk}, {g}, {d}], got {tuple(tail_k.shape)} "
                         f"and {tuple(tail_v.shape)}")
    if tail_k.stride(-1) != 1 or tail_v.stride(-1) != 1:
        raise KvarnError("tail buffers must be contiguous along the head dim")


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     tail_k: torch.Tensor, tail_v: torch.Tensor, tail_slots: torch.Tensor, fmt: KVFormat | str,
                     scale: float, num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    fmt = as_format(fmt)
    if q.dim() != 3:
        raise KvarnError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    lay = layout(fmt, D)
    check_cache(cache, lay)
    Hk = cache.shape[1]
    group, gp = group_geometry(Hq, Hk)
    check_tail(tail_k, tail_v, Hk, lay.g, D)
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise KvarnError(f"block_table must be [B={B}, max_blocks], got {tuple(block_table.shape)}")
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if B == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(B, Hk, block_table.shape[1], q.device)
    num_splits = int(max(1, num_splits))
    bm = max(16, gp)
    hn = hadamard_fp32(D, q.device)
    if num_splits > 1:
        part_o = torch.empty(B * Hq * num_splits * D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B * Hq * num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    kvarn_attention_kernel[(B, 1, Hk * num_splits)](
        q, cache, f16_view(cache), block_table, seq_lens, seq_lens,
        tail_k, tail_v, tail_slots, hn, out, part_o, part_lse,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1), block_table.stride(0), cache.stride(0), cache.stride(1),
        tail_k.stride(0), tail_k.stride(1), tail_k.stride(2), tail_v.stride(0), tail_v.stride(1), tail_v.stride(2),
        out.stride(0), out.stride(1), Hq,
        GROUP=group, GP=gp, BQ=1, BM=bm, G=lay.g, D=D, KB=lay.kb, VB=lay.vb,
        OFF_PK=lay.pk, OFF_SK=lay.sk, OFF_ZK=lay.zk, OFF_RK=lay.rk,
        OFF_PV=lay.pv, OFF_SV=lay.sv, OFF_ZV=lay.zv, OFF_CV=lay.cv,
        NUM_SPLITS=num_splits, IS_PREFILL=False, MMA_BF16=mma_bf16(),
        num_warps=8 if D * lay.g > 8192 else 4,
    )
    if num_splits > 1:
        merge_splits_kernel[(B, Hq)](part_o, part_lse, out, out.stride(0), out.stride(1), HQ=Hq,
                                     NUM_SPLITS=num_splits, SP=triton.next_power_of_2(num_splits), D=D,
                                     num_warps=4)
    return out
