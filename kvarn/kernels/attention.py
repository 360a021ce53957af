"""The one attention kernel over a KVarN paged cache plus its 16-bit tail, shared by decode and prefill.

A program serves one request, one block of BQ query tokens and one KV head (times a split of the context):
its M rows are (query token, query head of the GQA group) pairs, so every packed tile is read and unpacked
once for the whole group, and the dot products run on tensor cores (tl.dot, M padded to 16).

Per row r the visible length L[r] is its position + 1 (decode: the whole seq_len). Tiles 0 .. seq_len//g - 1
come from records via the block table; the seq_len % g newest tokens come from the tail buffer. The scales fold
out of the inner loop (kvarn-method.md):

    score[r, t] = rK[t] * ( sum_d (q_r[r, d] * sK[d]) * qK[d, t]  +  sum_d q_r[r, d] * zK[d] )
    o_r[r, d]   = cV[d] * ( sum_t (p[r, t] * sV[t]) * qV[t, d]    +  sum_t p[r, t] * zV[t] )

Layout of the work (planar packing, docs/format.md, makes every piece a plain 2-D load + shift/mask):
* keys: byte plane j of PK holds channels j*DP .. (j+1)*DP - 1 (DP = D*kb/8). The rotated query is produced
  directly as PERK = 8/kb column blocks q_j = q @ H[:, j*DP:(j+1)*DP] (prologue), so the score of a token block is
  sum_j dot(q_j * sK_j, plane_j) with no reshape/interleave of the codes.
* values: byte plane j of PV holds tokens j*BT .. (j+1)*BT - 1 (BT = g*vb/8). A tile is processed in PERV = 8/vb
  token sub-blocks of BT tokens (32 for k4v2_g128): the keys of sub-block j are the BT-column slice of PK, its
  values are plane j of the (once-loaded) PV bytes.
* codes are turned into fp16 (exact: 0..15) by shift/mask; on the GPU either by Triton casts (UNPACK 0), the
  0x6400 exponent trick (UNPACK 1: (c | 0x6400) as fp16 is 1024 + c, minus 1024 exactly) or inline PTX doing the
  same for 4 codes per instruction group (UNPACK 2: prmt + lop3 + sub.f16x2).
* left operands are fp16 with fp32 accumulation. The query planes are normalised once per program by their max
  |q| so q*sK never leaves the fp16 range (|q*sK| <= |sK| <= 65504); the norm is multiplied back into rK.
  KSPLIT/VSPLIT = 2 adds an fp16 lo part (a = hi + lo, ~22 mantissa bits) for keys / values.
* softmax is online per tile (scores of all sub-blocks first, one rescale of the accumulator per tile).
The tail tile is in the unrotated basis: its scores use q itself and its output goes to a second accumulator,
so the final output is (acc_rot @ Hn + acc_tail) / l in one softmax. Rows with nothing visible produce zeros.

The token-row decode kernels (DecodeConfig.layout 1 / 2) are in attention_tokrows.py; they write the same
partials, so tail_attention_kernel and finish_kernel are shared.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from .common import serving_jit
from .rotate import hadamard_pm1, x_times_h

LOG2E = 1.4426950408889634


def mma_bf16() -> bool:
    """Compiled GPU path (bf16/fp16 tensor-core dots, inline PTX allowed); False under the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


@triton.jit
def _asm_plane(packed, SHIFT: tl.constexpr, BITS: tl.constexpr):
    # 4 packed bytes per register -> 4 fp16 codes in 2 registers: prmt spreads bytes 0,1 (2,3) to the two halves,
    # shift + lop3 keep one code per half and set the fp16 exponent of 1024, sub.f16x2 removes the 1024 (exact).
    if BITS == 4:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, k; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                "lop3.b32 t0, t0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 t1, t1, 0x000F000F, 0x64006400, 0xEA; "
                "mov.b32 k, 0x64006400; sub.f16x2 $0, t0, k; sub.f16x2 $1, t1, k; }",
                "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, k; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                "shr.b32 t0, t0, 4; shr.b32 t1, t1, 4; "
                "lop3.b32 t0, t0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 t1, t1, 0x000F000F, 0x64006400, 0xEA; "
                "mov.b32 k, 0x64006400; sub.f16x2 $0, t0, k; sub.f16x2 $1, t1, k; }",
                "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
    else:
        tl.static_assert(BITS == 2, "codes are 2 or 4 bits")
        if SHIFT == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, k; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                "lop3.b32 t0, t0, 0x00030003, 0x64006400, 0xEA; lop3.b32 t1, t1, 0x00030003, 0x64006400, 0xEA; "
                "mov.b32 k, 0x64006400; sub.f16x2 $0, t0, k; sub.f16x2 $1, t1, k; }",
                "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
        elif SHIFT == 2:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, k; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                "shr.b32 t0, t0, 2; shr.b32 t1, t1, 2; "
                "lop3.b32 t0, t0, 0x00030003, 0x64006400, 0xEA; lop3.b32 t1, t1, 0x00030003, 0x64006400, 0xEA; "
                "mov.b32 k, 0x64006400; sub.f16x2 $0, t0, k; sub.f16x2 $1, t1, k; }",
                "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
        elif SHIFT == 4:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, k; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                "shr.b32 t0, t0, 4; shr.b32 t1, t1, 4; "
                "lop3.b32 t0, t0, 0x00030003, 0x64006400, 0xEA; lop3.b32 t1, t1, 0x00030003, 0x64006400, 0xEA; "
                "mov.b32 k, 0x64006400; sub.f16x2 $0, t0, k; sub.f16x2 $1, t1, k; }",
                "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, k; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                "shr.b32 t0, t0, 6; shr.b32 t1, t1, 6; "
                "lop3.b32 t0, t0, 0x00030003, 0x64006400, 0xEA; lop3.b32 t1, t1, 0x00030003, 0x64006400, 0xEA; "
                "mov.b32 k, 0x64006400; sub.f16x2 $0, t0, k; sub.f16x2 $1, t1, k; }",
                "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _plane(packed, SHIFT: tl.constexpr, BITS: tl.constexpr, UNPACK: tl.constexpr):
    """Codes of one bit plane of uint8 `packed` as exact fp16 (0 .. 2^BITS - 1)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if UNPACK == 2:
        return _asm_plane(packed, SHIFT, BITS)
    elif UNPACK == 1:
        x = ((packed.to(tl.int16) >> SHIFT) & MASK) | 0x6400
        return x.to(tl.float16, bitcast=True) - 1024.0
    else:
        return ((packed >> SHIFT) & MASK).to(tl.float16)


@triton.jit
def _split16(a, SPLIT: tl.constexpr):
    hi = a.to(tl.float16)
    if SPLIT == 2:
        lo = (a - hi.to(tl.float32)).to(tl.float16)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _dot16(hi, lo, c, acc, SPLIT: tl.constexpr):
    acc = tl.dot(hi, c, acc=acc, out_dtype=tl.float32)
    if SPLIT == 2:
        acc = tl.dot(lo, c, acc=acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _query_planes(q_ptrs, mask, DP: tl.constexpr, PERK: tl.constexpr):
    """The rotated, scaled query (rotate_rows_kernel) as the key byte planes' channel blocks: q_ptrs points at plane
    0 (any 2-D orientation: query rows or, transposed, columns), plane j sits DP channels further. Returns the
    PERK planes (planes 2-3 repeat plane 0 when PERK == 2) normalised by max |q| so |q * sK| <= |sK| stays in
    fp16, and that norm (it goes back in with rK)."""
    p0 = tl.load(q_ptrs, mask=mask, other=0.0)
    p1 = tl.load(q_ptrs + DP, mask=mask, other=0.0)
    qmax = tl.maximum(tl.max(tl.max(tl.abs(p0), axis=1), axis=0), tl.max(tl.max(tl.abs(p1), axis=1), axis=0))
    if PERK == 4:
        p2 = tl.load(q_ptrs + 2 * DP, mask=mask, other=0.0)
        p3 = tl.load(q_ptrs + 3 * DP, mask=mask, other=0.0)
        qmax = tl.maximum(qmax, tl.maximum(tl.max(tl.max(tl.abs(p2), axis=1), axis=0),
                                           tl.max(tl.max(tl.abs(p3), axis=1), axis=0)))
    else:
        p2 = p0
        p3 = p0
    qnorm = tl.where(qmax > 0.0, qmax, 1.0)
    qinv = 1.0 / qnorm
    return p0 * qinv, p1 * qinv, p2 * qinv, p3 * qinv, qnorm


@triton.jit
def _key_plane(qj, sk_ptr, zk_ptr, DP: tl.constexpr, KSPLIT: tl.constexpr):
    # fold sK into the (normalised) query plane; the zK term is a per-row constant of the tile
    i = tl.arange(0, DP)
    sk = tl.load(sk_ptr + i).to(tl.float32)
    zk = tl.load(zk_ptr + i).to(tl.float32)
    hi, lo = _split16(qj * sk[None, :], KSPLIT)
    return hi, lo, tl.sum(qj * zk[None, :], axis=1)


@triton.jit
def _sink_lo(sink_lens_ptr, b, SINK: tl.constexpr):
    """Positions of request b below this are read 16-bit from the tail buffer's sink rows (by the tail kernel), so
    the record kernels skip them: sink_lens[b] clamped to the SINK rows the buffer has (0 without a sink)."""
    if SINK > 0:
        return tl.minimum(tl.load(sink_lens_ptr + b), SINK)
    return 0


@triton.jit
def _sub_scores(pk_ptr, rk_ptr, J: tl.constexpr, a0, l0, a1, l1, a2, l2, a3, l3, qz, qnorm, tok0, L,
                BM: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, G: tl.constexpr, KB: tl.constexpr,
                UNPACK: tl.constexpr, KSPLIT: tl.constexpr, SINK: tl.constexpr = 0, sink_lo=0):
    """exp2-domain scores [BM, BT] of tokens J*BT .. (J+1)*BT - 1 of a tile (masked by the visible length, and
    below sink_lo: those positions are read 16-bit from the tail buffer's sink rows)."""
    PERK: tl.constexpr = 8 // KB
    dp = tl.arange(0, DP)
    bt = tl.arange(0, BT)
    pk = tl.load(pk_ptr + dp[:, None] * G + (J * BT + bt)[None, :])  # [DP, BT] bytes, tokens contiguous
    s = tl.zeros([BM, BT], dtype=tl.float32)
    s = _dot16(a0, l0, _plane(pk, 0, KB, UNPACK), s, KSPLIT)
    s = _dot16(a1, l1, _plane(pk, KB, KB, UNPACK), s, KSPLIT)
    if PERK == 4:
        s = _dot16(a2, l2, _plane(pk, 2 * KB, KB, UNPACK), s, KSPLIT)
        s = _dot16(a3, l3, _plane(pk, 3 * KB, KB, UNPACK), s, KSPLIT)
    rk = tl.load(rk_ptr + J * BT + bt).to(tl.float32) * qnorm
    s = (s + qz[:, None]) * rk[None, :]
    pos = tok0 + J * BT + bt
    ok = pos[None, :] < L[:, None]
    if SINK > 0:
        ok = ok & (pos >= sink_lo)[None, :]
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _sub_values(p, pv, sv_ptr, zv_ptr, acc, pz, J: tl.constexpr, BT: tl.constexpr, VB: tl.constexpr,
                UNPACK: tl.constexpr, VSPLIT: tl.constexpr):
    bt = tl.arange(0, BT)
    sv = tl.load(sv_ptr + J * BT + bt).to(tl.float32)
    zv = tl.load(zv_ptr + J * BT + bt).to(tl.float32)
    hi, lo = _split16(p * sv[None, :], VSPLIT)
    acc = _dot16(hi, lo, _plane(pv, J * VB, VB, UNPACK), acc, VSPLIT)
    return acc, pz + tl.sum(p * zv[None, :], axis=1)


@triton.jit
def _records_end(S, DEFER: tl.constexpr, defer_ptr):
    """The context length whose full tiles are in the records: S, or, with DEFER and the step's flag defer_ptr[0]
    set (a decode step that leaves the tile it completes in the 16-bit tail, flushed later), S - 1, so a tile that
    fills this step is read from the tail. The flag is device data: one captured graph serves both."""
    if DEFER:
        return tl.maximum(S - tl.load(defer_ptr), 0)
    return S


@triton.jit
def _split_tiles(S, L, G: tl.constexpr, split, num_splits):
    """Record tiles [t_begin, t_stop) of one context split: the L visible tokens' tiles dealt out in equal runs,
    only the S // G full ones read from records (the rest is the tail). Every record kernel partitions alike, so
    their partials merge in finish_kernel."""
    n_tiles = (L + G - 1) // G
    per_split = (n_tiles + num_splits - 1) // num_splits
    t_begin = split * per_split
    return t_begin, tl.minimum(tl.minimum(t_begin + per_split, n_tiles), S // G)


@triton.jit
def _partial_stats(m_i, l_i):
    """1 / l and the log2-sum-exp of a split's partial (rows that saw nothing: 1 and -inf)."""
    has = l_i > 0.0
    return 1.0 / tl.where(has, l_i, 1.0), tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))


@triton.jit
def pdl_sync(PDL: tl.constexpr):
    """Programmatic dependent launch (DecodeConfig.pdl; sm_90+): a kernel launched with launch_pdl=True may start
    while the previous kernel in the stream still runs; here it waits until that kernel has finished and its writes
    are visible, then lets the next kernel's programs start (they wait likewise before touching memory). What comes
    before this call may only compute (the Hadamard), not read or write global memory."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@serving_jit(ints=["R"])
def rotate_rows_kernel(x_ptr, y_ptr, R, scale, stride_xn, stride_xh, HQ: tl.constexpr, D: tl.constexpr,
                       BR: tl.constexpr, MMA_BF16: tl.constexpr, PDL: tl.constexpr = 0):
    """y[r] = (x[n, h] * scale) @ Hn for the R = N*HQ rows r = n*HQ + h; y fp32 [R, D] contiguous. PDL: launched
    as a programmatic dependent launch (pdl_sync): the Hadamard is built before waiting for the previous kernel."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    di = tl.arange(0, D)
    ok = r < R
    off = (r // HQ).to(tl.int64) * stride_xn + (r % HQ) * stride_xh
    h = hadamard_pm1(D, MMA_BF16)
    pdl_sync(PDL)
    x = tl.load(x_ptr + off[:, None] + di[None, :], mask=ok[:, None], other=0.0).to(tl.float32) * scale
    y = x_times_h(x, h, D, MMA_BF16)
    tl.store(y_ptr + r.to(tl.int64)[:, None] * D + di[None, :], y, mask=ok[:, None])


@serving_jit(ints=["R", "num_splits"])
def finish_kernel(po_r_ptr, po_t_ptr, plse_ptr, out_ptr, R, num_splits, stride_on, stride_oh, HQ: tl.constexpr,
                  D: tl.constexpr, BR: tl.constexpr, MMA_BF16: tl.constexpr, PDL: tl.constexpr = 0):
    """Merge the record-split partials (rotated basis) and the tail partial (unrotated) of R rows with
    log2-sum-exp weights, rotating back once: out = (sum_s w_s o_s) @ Hn + w_t o_t; all-empty rows give zeros.
    PDL: as rotate_rows_kernel's (the Hadamard built while the records kernel finishes)."""
    h = hadamard_pm1(D, MMA_BF16)
    pdl_sync(PDL)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    di = tl.arange(0, D)
    ok = r < R
    r64 = r.to(tl.int64)
    lbase = r64 * (num_splits + 1)
    m = tl.full([BR], float("-inf"), dtype=tl.float32)
    for sp in range(0, num_splits + 1):
        m = tl.maximum(m, tl.load(plse_ptr + lbase + sp, mask=ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc_r = tl.zeros([BR, D], dtype=tl.float32)
    den = tl.zeros([BR], dtype=tl.float32)
    for sp in range(0, num_splits):
        w = tl.exp2(tl.load(plse_ptr + lbase + sp, mask=ok, other=float("-inf")) - m_safe)
        acc_r += w[:, None] * tl.load(po_r_ptr + (r64 * num_splits + sp)[:, None] * D + di[None, :],
                                      mask=ok[:, None], other=0.0)
        den += w
    w = tl.exp2(tl.load(plse_ptr + lbase + num_splits, mask=ok, other=float("-inf")) - m_safe)
    den += w
    o = x_times_h(acc_r, h, D, MMA_BF16)
    o += w[:, None] * tl.load(po_t_ptr + r64[:, None] * D + di[None, :], mask=ok[:, None], other=0.0)
    o = o / tl.where(den > 0.0, den, 1.0)[:, None]
    o_off = (r // HQ).to(tl.int64) * stride_on + (r % HQ) * stride_oh
    tl.store(out_ptr + o_off[:, None] + di[None, :], o.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@serving_jit(ints=["num_splits", "stride_btb"])
def kvarn_attention_kernel(
    qr_ptr, cache_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, sink_lens_ptr, defer_ptr,
    po_r_ptr, plse_ptr,  # (the tail is tail_attention_kernel's)
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain (already in qr)
    num_splits,  # context splits per (request, KV head): a run-time value (no recompile per split count)
    stride_btb, stride_cb, stride_ch, HQ,
    GROUP: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr,
    G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    IS_PREFILL: tl.constexpr, MMA_BF16: tl.constexpr,
    UNPACK: tl.constexpr, KSPLIT: tl.constexpr, VSPLIT: tl.constexpr, STAGES: tl.constexpr,
    SINK: tl.constexpr = 0, DEFER: tl.constexpr = 0,
):
    b = tl.program_id(0)
    qblk = tl.program_id(1)
    kvh = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    S = tl.load(seq_lens_ptr + b)
    sink_lo = _sink_lo(sink_lens_ptr, b, SINK)
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

    PERK: tl.constexpr = 8 // KB
    DP: tl.constexpr = D // PERK  # channels per key byte plane
    PERV: tl.constexpr = 8 // VB
    BT: tl.constexpr = G // PERV  # tokens per value byte plane = token sub-block

    di = tl.arange(0, D)
    dp = tl.arange(0, DP)
    head = kvh * GROUP + hq
    row = (q0 + tok).to(tl.int64) * HQ + head  # flattened (query token, head) row
    # rotated, scaled query, loaded directly as the key byte planes' column blocks [BM, DP], normalised
    qr0, qr1, qr2, qr3, qnorm = _query_planes(qr_ptr + row[:, None] * D + dp[None, :], row_ok[:, None], DP, PERK)

    t_begin, t_stop = _split_tiles(_records_end(S, DEFER, defer_ptr), Lmax, G, split, num_splits)

    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc_r = tl.zeros([BM, D], dtype=tl.float32)  # rotated basis (records)

    bt = tl.arange(0, BT)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for t in tl.range(t_begin, t_stop, num_stages=STAGES):
        blk = tl.load(bt_row + t).to(tl.int64)
        rec = blk * stride_cb + kvh * stride_ch
        rec16 = rec // 2
        # ---- keys: fold sK into the query planes (per tile), zK into a per-row constant
        sk_ptr = cache16_ptr + rec16 + OFF_SK // 2
        zk_ptr = cache16_ptr + rec16 + OFF_ZK // 2
        a0, l0, qz = _key_plane(qr0, sk_ptr, zk_ptr, DP, KSPLIT)
        a1, l1, z1 = _key_plane(qr1, sk_ptr + DP, zk_ptr + DP, DP, KSPLIT)
        qz += z1
        if PERK == 4:
            a2, l2, z2 = _key_plane(qr2, sk_ptr + 2 * DP, zk_ptr + 2 * DP, DP, KSPLIT)
            a3, l3, z3 = _key_plane(qr3, sk_ptr + 3 * DP, zk_ptr + 3 * DP, DP, KSPLIT)
            qz += z2 + z3
        else:
            a2 = a0
            l2 = l0
            a3 = a0
            l3 = l0
        pk_ptr = cache_ptr + rec + OFF_PK
        rk_ptr = cache16_ptr + rec16 + OFF_RK // 2
        tok0 = t * G
        s0 = _sub_scores(pk_ptr, rk_ptr, 0, a0, l0, a1, l1, a2, l2, a3, l3, qz, qnorm, tok0, L,
                         BM, DP, BT, G, KB, UNPACK, KSPLIT, SINK, sink_lo)
        s1 = _sub_scores(pk_ptr, rk_ptr, 1, a0, l0, a1, l1, a2, l2, a3, l3, qz, qnorm, tok0, L,
                         BM, DP, BT, G, KB, UNPACK, KSPLIT, SINK, sink_lo)
        m_t = tl.maximum(tl.max(s0, axis=1), tl.max(s1, axis=1))
        if PERV == 4:
            s2 = _sub_scores(pk_ptr, rk_ptr, 2, a0, l0, a1, l1, a2, l2, a3, l3, qz, qnorm, tok0, L,
                             BM, DP, BT, G, KB, UNPACK, KSPLIT, SINK, sink_lo)
            s3 = _sub_scores(pk_ptr, rk_ptr, 3, a0, l0, a1, l1, a2, l2, a3, l3, qz, qnorm, tok0, L,
                             BM, DP, BT, G, KB, UNPACK, KSPLIT, SINK, sink_lo)
            m_t = tl.maximum(m_t, tl.maximum(tl.max(s2, axis=1), tl.max(s3, axis=1)))
        # ---- online softmax, one rescale per tile (exp2 domain); fully masked rows stay at -inf without NaN
        m_new = tl.maximum(m_i, m_t)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p0 = tl.exp2(s0 - m_safe[:, None])
        p1 = tl.exp2(s1 - m_safe[:, None])
        psum = tl.sum(p0, axis=1) + tl.sum(p1, axis=1)
        # ---- values: plane j of the tile's PV bytes is token sub-block j
        pv = tl.load(cache_ptr + rec + OFF_PV + bt[:, None] * D + di[None, :])  # [BT, D] bytes
        sv_ptr = cache16_ptr + rec16 + OFF_SV // 2
        zv_ptr = cache16_ptr + rec16 + OFF_ZV // 2
        o = tl.zeros([BM, D], dtype=tl.float32)
        pz = tl.zeros([BM], dtype=tl.float32)
        o, pz = _sub_values(p0, pv, sv_ptr, zv_ptr, o, pz, 0, BT, VB, UNPACK, VSPLIT)
        o, pz = _sub_values(p1, pv, sv_ptr, zv_ptr, o, pz, 1, BT, VB, UNPACK, VSPLIT)
        if PERV == 4:
            p2 = tl.exp2(s2 - m_safe[:, None])
            p3 = tl.exp2(s3 - m_safe[:, None])
            psum += tl.sum(p2, axis=1) + tl.sum(p3, axis=1)
            o, pz = _sub_values(p2, pv, sv_ptr, zv_ptr, o, pz, 2, BT, VB, UNPACK, VSPLIT)
            o, pz = _sub_values(p3, pv, sv_ptr, zv_ptr, o, pz, 3, BT, VB, UNPACK, VSPLIT)
        l_i = l_i * alpha + psum
        m_i = m_new
        cv = tl.load(cache16_ptr + rec16 + OFF_CV // 2 + di).to(tl.float32)
        acc_r = acc_r * alpha[:, None] + (o + pz[:, None]) * cv[None, :]

    # partials (finish_kernel merges the splits + the tail partial and rotates back once): o / l in the rotated
    # basis and log2-sum-exp at [row, split] of [R, num_splits + 1]; empty rows/splits carry lse = -inf and zeros
    inv_l, lse = _partial_stats(m_i, l_i)
    tl.store(po_r_ptr + (row * num_splits + split)[:, None] * D + di[None, :], acc_r * inv_l[:, None],
             mask=row_ok[:, None])
    tl.store(plse_ptr + row * (num_splits + 1) + split, lse, mask=row_ok)


@triton.jit
def _tail_run(qa, qb, tk_base, tv_base, stride_tkg, stride_tvg, n, pos0, L, m_i, l_i, acc_t, qk_scale,
              D: tl.constexpr, TT: tl.constexpr, MMA_BF16: tl.constexpr, TAIL16: tl.constexpr,
              Q_AS_TAIL: tl.constexpr, STAGES: tl.constexpr):
    """Online softmax of the rows over n consecutive 16-bit buffer rows holding positions pos0, pos0 + 1, ...
    (visible where pos < L). qa / qb: the 16-bit query hi / lo parts (tensor-core path), or the
    fp32 scaled query twice. STAGES: the loop's pipeline depth (inside the records kernel 1: its num_stages = 5
    would give these [TT, D] tiles 5 buffers, 136 KB of shared memory, one program per SM)."""
    di = tl.arange(0, D)
    ti = tl.arange(0, TT)
    for c0 in tl.range(0, n, TT, num_stages=STAGES):
        tmask = (c0 + ti) < n
        if MMA_BF16 and TAIL16:
            tk = tl.load(tk_base + (c0 + ti)[:, None] * stride_tkg + di[None, :], mask=tmask[:, None],
                         other=0.0)  # [TT, D], tail dtype
            s = tl.dot(qa, tl.trans(tk), out_dtype=tl.float32)
            if not Q_AS_TAIL:
                s = tl.dot(qb, tl.trans(tk), s, out_dtype=tl.float32)
            s = s * qk_scale
        else:
            tk32 = tl.load(tk_base + (c0 + ti)[None, :] * stride_tkg + di[:, None], mask=tmask[None, :],
                           other=0.0).to(tl.float32)  # [D, TT]
            s = tl.dot(qa, tk32, input_precision="ieee")
        pos = pos0 + c0 + ti
        s = tl.where((pos[None, :] < L[:, None]) & tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        tv = tl.load(tv_base + (c0 + ti)[:, None] * stride_tvg + di[None, :], mask=tmask[:, None],
                     other=0.0)  # [TT, D]
        acc_t = acc_t * alpha[:, None]
        if MMA_BF16 and TAIL16:
            vdt = tv_base.dtype.element_ty
            p_hi = p.to(vdt)
            p_lo = (p - p_hi.to(tl.float32)).to(vdt)
            acc_t = tl.dot(p_hi, tv, acc_t, out_dtype=tl.float32)
            acc_t = tl.dot(p_lo, tv, acc_t, out_dtype=tl.float32)
        else:
            acc_t += tl.dot(p, tv.to(tl.float32), input_precision="ieee")
    return m_i, l_i, acc_t


@serving_jit(ints=["num_splits"])
def tail_attention_kernel(
    q_ptr, seq_lens_ptr, qsl_ptr, tail_k_ptr, tail_v_ptr, tail_slots_ptr, sink_lens_ptr, defer_ptr, po_t_ptr,
    plse_ptr,
    qk_scale, num_splits,
    stride_qn, stride_qh, stride_tks, stride_tkh, stride_tkg, stride_tvs, stride_tvh, stride_tvg, HQ,
    GROUP: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    IS_PREFILL: tl.constexpr, TT: tl.constexpr, MMA_BF16: tl.constexpr, TAIL16: tl.constexpr,
    Q_AS_TAIL: tl.constexpr, SINK: tl.constexpr = 0, DEFER: tl.constexpr = 0, TS: tl.constexpr = 16,
):
    """Attention of the same rows over the 16-bit tail buffer (unrotated, TT tokens at a time): the unfinished
    tile's rows and, once the first tile is in the records, the sink rows [G, G + sink_lens[b]) (positions
    0 .. sink_lens[b] - 1, which the record kernels then skip; sink_lens[b] <= SINK, 0 where the rows do not hold
    this request's tokens). The partial o / l goes to po_t [R, D], its log2-sum-exp to plse[row, num_splits] (the
    extra 'split').

    Compiled GPU path with a 16-bit tail (MMA_BF16 and TAIL16): tensor-core dots with fp32 accumulation. Scores are
    dot(q, k) on the 16-bit operands (exact products; q in the tail's dtype, or split hi + lo in it when q has
    another dtype, Q_AS_TAIL false), scaled by qk_scale afterwards; p @ v is dot(p_hi, v) + dot(p_lo, v) with
    p = p_hi + p_lo in the value dtype (~1e-6 relative). Otherwise (interpreter, fp32 tail) fp32 ieee dots."""
    _tail_partial(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, seq_lens_ptr, qsl_ptr, tail_k_ptr,
                  tail_v_ptr, tail_slots_ptr, sink_lens_ptr, defer_ptr, po_t_ptr, plse_ptr, qk_scale, num_splits,
                  stride_qn, stride_qh, stride_tks, stride_tkh, stride_tkg, stride_tvs, stride_tvh, stride_tvg, HQ,
                  GROUP, GP, BQ, BM, G, D, IS_PREFILL, TT, MMA_BF16, TAIL16, Q_AS_TAIL, SINK, DEFER, 3, TS)


@triton.jit
def _tail_partial(b, qblk, kvh, q_ptr, seq_lens_ptr, qsl_ptr, tail_k_ptr, tail_v_ptr, tail_slots_ptr, sink_lens_ptr,
                  defer_ptr, po_t_ptr, plse_ptr, qk_scale, num_splits,
                  stride_qn, stride_qh, stride_tks, stride_tkh, stride_tkg, stride_tvs, stride_tvh, stride_tvg, HQ,
                  GROUP: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr, G: tl.constexpr,
                  D: tl.constexpr, IS_PREFILL: tl.constexpr, TT: tl.constexpr, MMA_BF16: tl.constexpr,
                  TAIL16: tl.constexpr, Q_AS_TAIL: tl.constexpr, SINK: tl.constexpr, DEFER: tl.constexpr,
                  STAGES: tl.constexpr, TS: tl.constexpr):
    # tail_attention_kernel's program (b, qblk, kvh); also run by the decode records kernel's extra programs
    # (kvarn_attention_pair_pipe_kernel with TAIL = 1). TS: rows per step over the sink's (<= SINK) rows
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
    row_ok = (hq < GROUP) & (m_idx < BQ * GP) & (tok < qlen)
    L = tl.where(row_ok, tl.maximum(S - qlen + tok + 1, 0), 0)
    di = tl.arange(0, D)
    head = kvh * GROUP + hq
    row = (q0 + tok).to(tl.int64) * HQ + head
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc_t = tl.zeros([BM, D], dtype=tl.float32)
    n_full = _records_end(S, DEFER, defer_ptr) // G
    n_tail = S - n_full * G  # up to G rows with DEFER (the tile completed this step, not flushed yet)
    n_sink = tl.where(n_full > 0, _sink_lo(sink_lens_ptr, b, SINK), 0)  # the sink rows once tile 0 is quantized
    if (qblk * BQ < qlen) & ((n_tail > 0) | (n_sink > 0)):
        q_off = (q0 + tok).to(tl.int64) * stride_qn + head * stride_qh
        q_raw = tl.load(q_ptr + q_off[:, None] + di[None, :], mask=row_ok[:, None], other=0.0)
        slot = tl.load(tail_slots_ptr + b).to(tl.int64)
        tk_base = tail_k_ptr + slot * stride_tks + kvh * stride_tkh
        tv_base = tail_v_ptr + slot * stride_tvs + kvh * stride_tvh
        if MMA_BF16 and TAIL16:
            kdt = tail_k_ptr.dtype.element_ty
            if Q_AS_TAIL:
                qa = q_raw.to(kdt)
                qb = qa
            else:
                q32 = q_raw.to(tl.float32)
                qa = q32.to(kdt)
                qb = (q32 - qa.to(tl.float32)).to(kdt)
        else:
            qa = q_raw.to(tl.float32) * qk_scale
            qb = qa
        if SINK > 0:
            m_i, l_i, acc_t = _tail_run(qa, qb, tk_base + G * stride_tkg, tv_base + G * stride_tvg, stride_tkg,
                                        stride_tvg, n_sink, 0, L, m_i, l_i, acc_t, qk_scale, D, TS, MMA_BF16,
                                        TAIL16, Q_AS_TAIL, STAGES)
        m_i, l_i, acc_t = _tail_run(qa, qb, tk_base, tv_base, stride_tkg, stride_tvg, n_tail, n_full * G, L,
                                    m_i, l_i, acc_t, qk_scale, D, TT, MMA_BF16, TAIL16, Q_AS_TAIL, STAGES)
    has = l_i > 0.0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(po_t_ptr + row[:, None] * D + di[None, :], acc_t / tl.where(has, l_i, 1.0)[:, None],
             mask=row_ok[:, None])
    tl.store(plse_ptr + row * (num_splits + 1) + num_splits, lse, mask=row_ok)


@triton.jit
def unpack_selftest_kernel(src_ptr, out_ptr, N: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """Inline-PTX unpack of N bytes (one plane), for the once-per-device self-check."""
    i = tl.arange(0, N)
    x = tl.load(src_ptr + i)
    tl.store(out_ptr + i, _asm_plane(x, SHIFT, BITS))
