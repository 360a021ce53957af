"""The one attention kernel over a KVarN paged cache plus its 16-bit tail, shared by decode and prefill.

A program serves one request, one block of BQ query tokens and one KV head (times a split of the context):
its M rows are (query token, query head of the GQA group) pairs, so every packed tile is read and unpacked
once for the whole group, and the two dot products per tile run on tensor cores (tl.dot, M padded to 16).

Per row r the visible length L[r] is its position + 1 (decode: the whole seq_len). Tiles 0 .. seq_len//g - 1
come from records via the block table; the seq_len % g newest tokens come from the tail buffer. The scales fold
out of the inner loop (kvarn-method.md):

    score[r, t] = rK[t] * ( sum_d (q_r[r, d] * sK[d]) * qK[d, t]  +  sum_d q_r[r, d] * zK[d] )
    o_r[r, d]   = cV[d] * ( sum_t (p[r, t] * sV[t]) * qV[t, d]    +  sum_t p[r, t] * zV[t] )

where q_r = q @ Hn (fp32, in the prologue). Codes (0..15) are exact in bf16; the fp32 left operands are split into
bf16 hi + lo parts (two MMAs, ~16 mantissa bits) so the result matches fp32 math to ~1e-5. The tail tile is
in the unrotated basis: its scores use q itself and its output goes to a second accumulator, so the final output
is (acc_rot @ Hn + acc_tail) / l in one softmax. Rows with nothing visible produce zeros.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from .rotate import hadamard_pm1, x_times_h

LOG2E = 1.4426950408889634


def mma_bf16() -> bool:
    """bf16 tensor-core dots on a real GPU; exact fp32 dots under the Triton interpreter (no bf16 matmul there)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


@triton.jit
def _unpack_codes(packed, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr, MMA_BF16: tl.constexpr):
    # planar layout: byte[i, c] holds code[i + j*ROWS/PER, c] in bits [j*BITS, (j+1)*BITS)
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    shifts = (tl.arange(0, PER) * BITS)[:, None, None]
    codes = (packed.to(tl.int32)[None, :, :] >> shifts) & MASK
    codes = tl.reshape(codes, [ROWS, COLS])
    if MMA_BF16:
        return codes.to(tl.bfloat16)
    else:
        return codes.to(tl.float32)


@triton.jit
def _dot_split(a, b, MMA_BF16: tl.constexpr):
    # fp32 a @ exact-bf16 codes b with ~16-bit precision on a: a = hi + lo, two bf16 MMAs, fp32 accumulation.
    # (The Triton interpreter has no bf16 matmul: there b is fp32 and one exact fp32 dot is used.)
    if MMA_BF16:
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(hi, b, out_dtype=tl.float32)
        return tl.dot(lo, b, acc=acc, out_dtype=tl.float32)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def kvarn_attention_kernel(
    q_ptr, cache_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    tail_k_ptr, tail_v_ptr, tail_slots_ptr, hn_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
    stride_qn, stride_qh, stride_btb, stride_cb, stride_ch,
    stride_tks, stride_tkh, stride_tkg, stride_tvs, stride_tvh, stride_tvg,
    stride_on, stride_oh, HQ,
    GROUP: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr,
    G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_PREFILL: tl.constexpr, MMA_BF16: tl.constexpr,
):
    b = tl.program_id(0)
    qblk = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    S = tl.load(seq_lens_ptr + b)
    if IS_PREFILL:
        q0 = tl.load(qsl_ptr + b)
        qlen = tl.load(qsl_ptr + b + 1) - q0
    else:
        q0 = b
        qlen = 1
    m_idx = tl.arange(0, BM)
    tok = qblk * BQ + m_idx // GP
    hq = m_idx % GP
    row_ok = (hq < GROUP) & (m_idx < BQ * GP) & (tok < qlen)  # rows that exist (and get written)
    # visible keys per row (causal); a decode row with seq_len 0 (CUDA-graph padding) sees nothing -> zeros
    L = tl.where(row_ok, tl.maximum(S - qlen + tok + 1, 0), 0)
    Lmax = tl.max(L, axis=0)

    di = tl.arange(0, D)
    gi = tl.arange(0, G)
    head = kvh * GROUP + hq
    q_off = (q0 + tok).to(tl.int64) * stride_qn + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + di[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q = q * qk_scale
    hpm = hadamard_pm1(D, MMA_BF16)  # +-1 Hadamard, generated in registers (hn_ptr is unused)
    q_r = x_times_h(q, hpm, D, MMA_BF16)  # rotated query, fp32-accurate

    n_full = S // G
    n_tiles = (Lmax + G - 1) // G
    per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)

    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc_r = tl.zeros([BM, D], dtype=tl.float32)  # rotated basis (records)
    acc_t = tl.zeros([BM, D], dtype=tl.float32)  # unrotated basis (tail)

    PERK: tl.constexpr = 8 // KB
    PERV: tl.constexpr = 8 // VB
    ik = tl.arange(0, D // PERK)
    iv = tl.arange(0, G // PERV)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for t in range(t_begin, tl.minimum(t_end, n_full)):
        blk = tl.load(bt_row + t).to(tl.int64)
        rec = blk * stride_cb + kvh * stride_ch
        rec16 = rec // 2
        # ---- keys: scores with folded scales
        pk = tl.load(cache_ptr + rec + OFF_PK + ik[:, None] * G + gi[None, :])
        ck = _unpack_codes(pk, D, G, KB, MMA_BF16)
        sk = tl.load(cache16_ptr + rec16 + OFF_SK // 2 + di).to(tl.float32)
        zk = tl.load(cache16_ptr + rec16 + OFF_ZK // 2 + di).to(tl.float32)
        rk = tl.load(cache16_ptr + rec16 + OFF_RK // 2 + gi).to(tl.float32)
        s = _dot_split(q_r * sk[None, :], ck, MMA_BF16)
        qz = tl.sum(q_r * zk[None, :], axis=1)
        s = (s + qz[:, None]) * rk[None, :]
        s = tl.where((t * G + gi)[None, :] < L[:, None], s, float("-inf"))
        # ---- online softmax (exp2 domain); fully masked rows stay at m = -inf without NaN
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        # ---- values with folded scales
        pv = tl.load(cache_ptr + rec + OFF_PV + iv[:, None] * D + di[None, :])
        cvv = _unpack_codes(pv, G, D, VB, MMA_BF16)
        sv = tl.load(cache16_ptr + rec16 + OFF_SV // 2 + gi).to(tl.float32)
        zv = tl.load(cache16_ptr + rec16 + OFF_ZV // 2 + gi).to(tl.float32)
        cv = tl.load(cache16_ptr + rec16 + OFF_CV // 2 + di).to(tl.float32)
        o = _dot_split(p * sv[None, :], cvv, MMA_BF16)
        o = o + tl.sum(p * zv[None, :], axis=1)[:, None]
        acc_r = acc_r * alpha[:, None] + o * cv[None, :]
        acc_t = acc_t * alpha[:, None]

    n_tail = S - n_full * G
    if (n_full >= t_begin) & (n_full < t_end) & (n_tail > 0):
        slot = tl.load(tail_slots_ptr + b).to(tl.int64)
        tmask = gi < n_tail
        tk = tl.load(tail_k_ptr + slot * stride_tks + kvh * stride_tkh + gi[None, :] * stride_tkg + di[:, None],
                     mask=tmask[None, :], other=0.0).to(tl.float32)  # [D, g]
        s = tl.dot(q, tk, input_precision="ieee")
        s = tl.where(((n_full * G + gi)[None, :] < L[:, None]) & tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        tv = tl.load(tail_v_ptr + slot * stride_tvs + kvh * stride_tvh + gi[:, None] * stride_tvg + di[None, :],
                     mask=tmask[:, None], other=0.0).to(tl.float32)  # [g, D]
        acc_r = acc_r * alpha[:, None]
        acc_t = acc_t * alpha[:, None] + tl.dot(p, tv, input_precision="ieee")

    # rotate back once; rows that saw nothing (l = 0) give exact zeros
    o = x_times_h(acc_r, hpm, D, MMA_BF16) + acc_t
    has = l_i > 0.0
    o = o / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_off = (q0 + tok).to(tl.int64) * stride_on + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + di[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # partials [B, Hq, NUM_SPLITS, D] and log2-sum-exp [B, Hq, NUM_SPLITS]; empty splits carry -inf
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        prow = (b.to(tl.int64) * HQ + head) * NUM_SPLITS + split
        tl.store(part_o_ptr + prow[:, None] * D + di[None, :], o, mask=row_ok[:, None])
        tl.store(part_lse_ptr + prow, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_on, stride_oh, HQ: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
    """Log-sum-exp merge of the split partials of one (request, query head); all-empty rows give zeros."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    si = tl.arange(0, SP)
    di = tl.arange(0, D)
    row = (b.to(tl.int64) * HQ + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + si, mask=si < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    o = tl.load(part_o_ptr + (row + si)[:, None] * D + di[None, :], mask=(si < NUM_SPLITS)[:, None], other=0.0)
    den = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_on + h * stride_oh + di, res.to(out_ptr.dtype.element_ty))
