"""KVarN records -> 16-bit K / V rows in the original (unrotated) basis, for the dense prefill path
(kvarn.vllm_plugin.dense_prefill: FlashAttention over materialized K/V).

Public API:

    dequantize_to_rows(cache, block_ids, dst_rows, k_out, v_out, fmt) -> None
        cache      uint8 [num_blocks, H, record_bytes(D)]
        block_ids  int32/int64 [T]: records to decode (every head of each)
        dst_rows   int64 [T]: row of k_out / v_out where tile t's token 0 goes (tokens 0..g-1 -> dst_rows[t] + i)
        k_out      [N, H, D] fp16 / bf16 / fp32 (v_out alike)
        Writes what kvarn.method.reference.dequantize_tiles(cache[block_ids], fmt, D) gives (fp32 math, the values'
        +-1 Hadamard on tensor cores with a 3-way bf16 split of the operand as in the store kernel), cast to k_out's
        dtype.

    prepare_dequantize(cache, block_ids, dst_rows, k_out, v_out, fmt) -> launch(cache, k_out, v_out)
        the same checked once, for every layer of a step (tensors of the shapes, strides and dtypes given here)

One program per (tile, head, key token block | value byte plane). Keys are stored unrotated: byte plane j of PK
holds channels j*DP.. of every token, K^T rows j*DP.. = (codes_j * sK + zK) * rK; values: byte plane j of PV holds
tokens j*BT.., V rows = ((codes_j * sV + zV) * cV) @ Hn (the rotation back, Hn symmetric). Head dims 64, 128, 256.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ..errors import KvarnError
from ..formats import KVFormat
from .device import hadamard_pm1, x_times_h
from .records import as_format, check_cache, f16_view, layout
from .runtime import compiled, no_launch, serving_jit


@serving_jit(index_ptrs=["block_ids_ptr", "dst_ptr"])
def _dequant_kernel(cache_ptr, cache16_ptr, block_ids_ptr, dst_ptr, k_ptr, v_ptr,
                    stride_cb, stride_ch, stride_kn, stride_kh, stride_vn, stride_vh,
                    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
                    TBK: tl.constexpr,
                    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
                    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
                    COMPILED: tl.constexpr):
    # grid (T * H, G // TBK + PERV): axis 1 < G // TBK: keys of tokens [b*TBK, (b+1)*TBK); else: value plane j (its
    # BT tokens). Small independent pieces keep every program's registers low (no spills at D=128).
    pid = tl.program_id(0)
    tile = pid // H
    head = pid % H
    blk = tl.load(block_ids_ptr + tile).to(tl.int64)
    row0 = tl.load(dst_ptr + tile).to(tl.int64)
    rec = blk * stride_cb + head * stride_ch
    rec16 = rec // 2
    di = tl.arange(0, D)
    NBK: tl.constexpr = G // TBK
    part = tl.program_id(1)
    if part < NBK:
        PERK: tl.constexpr = 8 // KB
        DP: tl.constexpr = D // PERK
        MASK_K: tl.constexpr = (1 << KB) - 1
        ci = tl.arange(0, DP)
        tk = part * TBK + tl.arange(0, TBK)
        pk = tl.load(cache_ptr + rec + OFF_PK + ci[:, None] * G + tk[None, :]).to(tl.int32)  # [DP, TBK] bytes
        rk = tl.load(cache16_ptr + rec16 + OFF_RK // 2 + tk).to(tl.float32)
        for j in tl.static_range(PERK):
            sk = tl.load(cache16_ptr + rec16 + OFF_SK // 2 + j * DP + ci).to(tl.float32)
            zk = tl.load(cache16_ptr + rec16 + OFF_ZK // 2 + j * DP + ci).to(tl.float32)
            kcode = ((pk >> (j * KB)) & MASK_K).to(tl.float32)
            x = (kcode * sk[:, None] + zk[:, None]) * rk[None, :]  # K^T rows of channels j*DP.. [DP, TBK]
            kdst = k_ptr + (row0 + tk)[None, :] * stride_kn + head * stride_kh + (j * DP + ci)[:, None]
            tl.store(kdst, x.to(k_ptr.dtype.element_ty))
    else:
        PERV: tl.constexpr = 8 // VB
        BT: tl.constexpr = G // PERV
        MASK_V: tl.constexpr = (1 << VB) - 1
        j = part - NBK  # value byte plane = token sub-block j
        ti = tl.arange(0, BT)
        pv = tl.load(cache_ptr + rec + OFF_PV + ti[:, None] * D + di[None, :]).to(tl.int32)  # [BT, D] bytes
        cv = tl.load(cache16_ptr + rec16 + OFF_CV // 2 + di).to(tl.float32)
        sv = tl.load(cache16_ptr + rec16 + OFF_SV // 2 + j * BT + ti).to(tl.float32)
        zv = tl.load(cache16_ptr + rec16 + OFF_ZV // 2 + j * BT + ti).to(tl.float32)
        # (names differ from the keys branch: Triton types a name once across if / else)
        vcode = ((pv >> (j * VB)) & MASK_V).to(tl.float32)
        y = (vcode * sv[:, None] + zv[:, None]) * cv[None, :]  # rotated V rows of tokens j*BT.. [BT, D]
        vrows = x_times_h(y, hadamard_pm1(D, COMPILED), D, COMPILED)
        vdst = v_ptr + (row0 + j * BT + ti)[:, None] * stride_vn + head * stride_vh + di[None, :]
        tl.store(vdst, vrows.to(v_ptr.dtype.element_ty))


def _key_block(g: int, D: int = 128) -> int:
    # tokens per key program: K^T [D, TBK] fp32 stays at 64 x 128 values per program whatever D is
    return min(g, 64 if D <= 128 else 32)


def prepare_dequantize(cache: torch.Tensor, block_ids: torch.Tensor, dst_rows: torch.Tensor, k_out: torch.Tensor,
                       v_out: torch.Tensor, fmt: KVFormat | str):
    """dequantize_to_rows checked and prepared: returns launch(cache, k_out, v_out), the decode of these records for
    tensors of the shapes, strides and dtypes given here (every layer of a step: the checks run once)."""
    fmt = as_format(fmt)
    if k_out.dim() != 3 or v_out.shape != k_out.shape:
        raise KvarnError(f"k_out / v_out must be [N, H, D], got {tuple(k_out.shape)} and {tuple(v_out.shape)}")
    _, H, D = k_out.shape
    if D not in (64, 128, 256):
        raise KvarnError(f"dequantize_to_rows serves head dims 64, 128 and 256, got {D}")
    lay = layout(fmt, D)
    check_cache(cache, lay)
    if cache.shape[1] != H:
        raise KvarnError(f"cache has {cache.shape[1]} kv heads, k_out has {H}")
    T = block_ids.shape[0]
    if dst_rows.shape != (T,):
        raise KvarnError(f"dst_rows must be [T={T}], got {tuple(dst_rows.shape)}")
    if T == 0:
        return no_launch
    if k_out.stride(-1) != 1 or v_out.stride(-1) != 1:
        raise KvarnError("k_out / v_out must be contiguous along the head dim")
    tbk = _key_block(lay.g, D)
    grid = (T * H, lay.g // tbk + 8 // lay.vb)
    strides = (*cache.stride()[:2], *k_out.stride()[:2], *v_out.stride()[:2])
    const = dict(H=H, G=lay.g, D=D, KB=lay.kb, VB=lay.vb, TBK=tbk, **lay.offsets(), COMPILED=compiled(),
                 # D=64 fits 4 warps without spills; larger head dims need 8 (at D=256 the 256 x 256 Hadamard operand
                 # of the value planes takes most of the shared memory)
                 num_warps=4 if D == 64 else 8)

    def launch(cache, k_out, v_out):
        _dequant_kernel[grid](cache, f16_view(cache), block_ids, dst_rows, k_out, v_out, *strides, **const)

    return launch


def dequantize_to_rows(cache: torch.Tensor, block_ids: torch.Tensor, dst_rows: torch.Tensor, k_out: torch.Tensor,
                       v_out: torch.Tensor, fmt: KVFormat | str) -> None:
    """Decode records cache[block_ids[t]] (all heads) into k_out / v_out rows dst_rows[t] .. + g - 1 (see the module
    docstring). Fixed grid from shapes, no host sync."""
    prepare_dequantize(cache, block_ids, dst_rows, k_out, v_out, fmt)(cache, k_out, v_out)


__all__ = ["dequantize_to_rows", "prepare_dequantize"]
