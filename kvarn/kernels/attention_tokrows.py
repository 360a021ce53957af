"""Decode attention with tokens (keys) and channels (values) as the MMA M dimension (DecodeConfig.layout 1 / 2).

kvarn_attention_tok_kernel (decode only, DecodeConfig.layout = 1) is kvarn_attention_kernel's computation
transposed: tokens (keys) and channels (values) are the MMA M dimension, the unpacked codes the A operand, the
group's query heads the N dimension (padded to 16): on sm_90 that is wgmma with A in registers (M = 128) instead of
16-row mma.sync tiles.
kvarn_attention_pair_kernel (layout = 2) is that kernel with the code bytes read as int16 pairs of M rows, so the
conversion of the byte tiles to the MMA operand layout moves 16-bit elements (ldmatrix) instead of single bytes.
kvarn_attention_pair_pipe_kernel (layout = 2, pipe = 1) is the pair kernel with every load of a tile pipelineable.

Same math and partials as kvarn_attention_kernel (attention.py), whose helpers these share.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention import (_partial_stats, _plane, _query_planes, _records_end, _sink_lo, _split16, _split_tiles,
                        _tail_partial, pdl_sync)
from .common import serving_jit


# ------------------------------------------------------------------------------------------------ token-row layout


@triton.jit
def _halves(x, M: tl.constexpr, N: tl.constexpr):
    """Rows 0 .. M-1 and M .. 2M-1 of x [2M, N] (a reshape + split: no slicing of register tensors in Triton)."""
    return tl.split(tl.permute(tl.reshape(x, [2, M, N]), (1, 2, 0)))


@triton.jit
def _key_plane_t(qT, sk_ptr, zk_ptr, DP: tl.constexpr, KSPLIT: tl.constexpr):
    # (q_j * sK_j)^T [DP, BN] as the (small) B operand, hi/lo; the zK term is a per-column constant of the tile
    c = tl.arange(0, DP)
    sk = tl.load(sk_ptr + c).to(tl.float32)
    zk = tl.load(zk_ptr + c).to(tl.float32)
    hi, lo = _split16(qT * sk[:, None], KSPLIT)
    return hi, lo, tl.sum(qT * zk[:, None], axis=0)


@triton.jit
def _dot16_t(a, hi, lo, acc, SPLIT: tl.constexpr):
    # the codes are the A operand (M = tokens or channels); the fp32 factor is split hi + lo in the B operand
    acc = tl.dot(a, hi, acc=acc, out_dtype=tl.float32)
    if SPLIT == 2:
        acc = tl.dot(a, lo, acc=acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _value_plane_t(pvT, ps, acc, J: tl.constexpr, VB: tl.constexpr, UNPACK: tl.constexpr, VSPLIT: tl.constexpr):
    # o^T [D, BN] += Vcodes_J^T [D, BT] x (p * sV)_J^T [BT, BN]: M = D channels, K = the BT tokens of plane J
    hi, lo = _split16(ps, VSPLIT)
    return _dot16_t(_plane(pvT, J * VB, VB, UNPACK), hi, lo, acc, VSPLIT)


@serving_jit(ints=["num_splits", "stride_btb"])
def kvarn_attention_tok_kernel(
    qr_ptr, cache_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, sink_lens_ptr, defer_ptr,
    po_r_ptr, plse_ptr,
    num_splits, stride_btb, stride_cb, stride_ch, HQ,
    GROUP: tl.constexpr, BN: tl.constexpr,
    G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    UNPACK: tl.constexpr, KSPLIT: tl.constexpr, VSPLIT: tl.constexpr, STAGES: tl.constexpr,
    SINK: tl.constexpr = 0, DEFER: tl.constexpr = 0,
):
    """Decode-only attention over the records with the tiles transposed: tokens (keys) and channels (values) are
    the MMA M dimension and the unpacked codes its A operand; the BN >= 16 columns are the query heads of the GQA
    group (padded). Same grid (B, 1, Hk * num_splits), tile partition and partial outputs (po_r, plse) as
    kvarn_attention_kernel, so tail_attention_kernel and finish_kernel are shared. Per tile:

        scores^T [G, BN] = rK * ( sum_j Kcodes_j^T [G, DP] x (q_j * sK_j)^T [DP, BN]  +  q.zK )
        o^T      [D, BN] = cV * ( sum_j Vcodes_j^T [D, BT] x (p * sV)_j^T [BT, BN]   +  p.zV )

    (j: key byte planes of DP channels, value byte planes of BT tokens; the p rows of plane j are cut out of the
    [G, BN] tile by reshape + split). Softmax statistics are per column. Decode sees every token of a full tile,
    so the record tiles need no mask but the sink's (positions below SINK, read 16-bit by the tail kernel)."""
    b = tl.program_id(0)
    kvh = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    S = tl.load(seq_lens_ptr + b)
    sink_lo = _sink_lo(sink_lens_ptr, b, SINK)

    PERK: tl.constexpr = 8 // KB
    DP: tl.constexpr = D // PERK  # channels per key byte plane
    PERV: tl.constexpr = 8 // VB
    BT: tl.constexpr = G // PERV  # tokens per value byte plane

    n = tl.arange(0, BN)
    col_ok = n < GROUP
    row = (b * HQ + kvh * GROUP + n).to(tl.int64)  # flattened (token, head) rows of the group
    di = tl.arange(0, D)
    dp = tl.arange(0, DP)
    ti = tl.arange(0, G)
    bt = tl.arange(0, BT)
    # transposed query planes [DP, BN], normalised by max |q|
    q0, q1, q2, q3, qnorm = _query_planes(qr_ptr + row[None, :] * D + dp[:, None], col_ok[None, :], DP, PERK)

    # as kvarn_attention_kernel (decode: L = S)
    t_begin, t_stop = _split_tiles(_records_end(S, DEFER, defer_ptr), S, G, split, num_splits)

    m_i = tl.full([BN], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BN], dtype=tl.float32)
    acc = tl.zeros([D, BN], dtype=tl.float32)  # o^T, rotated basis

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for t in tl.range(t_begin, t_stop, num_stages=STAGES):
        blk = tl.load(bt_row + t).to(tl.int64)
        rec = blk * stride_cb + kvh * stride_ch
        rec16 = rec // 2
        # ---- keys: M = the G tokens of the tile; pk bytes [DP, G] (tokens contiguous) loaded as [G, DP]
        sk_ptr = cache16_ptr + rec16 + OFF_SK // 2
        zk_ptr = cache16_ptr + rec16 + OFF_ZK // 2
        pkT = tl.load(cache_ptr + rec + OFF_PK + dp[None, :] * G + ti[:, None])
        s = tl.zeros([G, BN], dtype=tl.float32)
        b_hi, b_lo, qz = _key_plane_t(q0, sk_ptr, zk_ptr, DP, KSPLIT)
        s = _dot16_t(_plane(pkT, 0, KB, UNPACK), b_hi, b_lo, s, KSPLIT)
        b_hi, b_lo, z1 = _key_plane_t(q1, sk_ptr + DP, zk_ptr + DP, DP, KSPLIT)
        s = _dot16_t(_plane(pkT, KB, KB, UNPACK), b_hi, b_lo, s, KSPLIT)
        qz += z1
        if PERK == 4:
            b_hi, b_lo, z2 = _key_plane_t(q2, sk_ptr + 2 * DP, zk_ptr + 2 * DP, DP, KSPLIT)
            s = _dot16_t(_plane(pkT, 2 * KB, KB, UNPACK), b_hi, b_lo, s, KSPLIT)
            b_hi, b_lo, z3 = _key_plane_t(q3, sk_ptr + 3 * DP, zk_ptr + 3 * DP, DP, KSPLIT)
            s = _dot16_t(_plane(pkT, 3 * KB, KB, UNPACK), b_hi, b_lo, s, KSPLIT)
            qz += z2 + z3
        rk = tl.load(cache16_ptr + rec16 + OFF_RK // 2 + ti).to(tl.float32) * qnorm
        s = (s + qz[None, :]) * rk[:, None]  # exp2-domain scores^T [G, BN]
        if SINK > 0:  # positions below sink_lo are read 16-bit from the tail buffer's sink rows (_sink_lo)
            s = tl.where((t * G + ti >= sink_lo)[:, None], s, float("-inf"))
        # ---- online softmax per column (query head), one rescale per tile
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
        # ---- values: M = the D channels; plane j of the pv bytes [BT, D] (loaded as [D, BT]) is tokens j*BT ..
        sv = tl.load(cache16_ptr + rec16 + OFF_SV // 2 + ti).to(tl.float32)
        zv = tl.load(cache16_ptr + rec16 + OFF_ZV // 2 + ti).to(tl.float32)
        pz = tl.sum(p * zv[:, None], axis=0)
        ps = p * sv[:, None]
        pvT = tl.load(cache_ptr + rec + OFF_PV + bt[None, :] * D + di[:, None])
        o = tl.zeros([D, BN], dtype=tl.float32)
        if PERV == 2:
            ps0, ps1 = _halves(ps, BT, BN)
            o = _value_plane_t(pvT, ps0, o, 0, VB, UNPACK, VSPLIT)
            o = _value_plane_t(pvT, ps1, o, 1, VB, UNPACK, VSPLIT)
        else:
            tl.static_assert(PERV == 4, "codes are 2 or 4 bits")
            h0, h1 = _halves(ps, 2 * BT, BN)
            ps0, ps1 = _halves(h0, BT, BN)
            ps2, ps3 = _halves(h1, BT, BN)
            o = _value_plane_t(pvT, ps0, o, 0, VB, UNPACK, VSPLIT)
            o = _value_plane_t(pvT, ps1, o, 1, VB, UNPACK, VSPLIT)
            o = _value_plane_t(pvT, ps2, o, 2, VB, UNPACK, VSPLIT)
            o = _value_plane_t(pvT, ps3, o, 3, VB, UNPACK, VSPLIT)
        cv = tl.load(cache16_ptr + rec16 + OFF_CV // 2 + di).to(tl.float32)
        acc = acc * alpha[None, :] + (o + pz[None, :]) * cv[:, None]

    # partials exactly as kvarn_attention_kernel writes them (po_r rows [R * num_splits, D], plse [R, splits + 1])
    inv_l, lse = _partial_stats(m_i, l_i)
    tl.store(po_r_ptr + (row * num_splits + split)[None, :] * D + di[:, None], acc * inv_l[None, :],
             mask=col_ok[None, :])
    tl.store(plse_ptr + row * (num_splits + 1) + split, lse, mask=col_ok)


# ------------------------------------------------------------------------------- token-row layout, 16-bit pairs


@triton.jit
def _pair_plane(x, SHIFT: tl.constexpr, BITS: tl.constexpr, UNPACK: tl.constexpr):
    """x: int16 = two bytes of one packed column (low byte: row 2i, high byte: row 2i + 1). The codes of one bit
    plane of the two rows as exact fp16: (even, odd). On the GPU 2 pairs per register (bytes 0 / 2 the even rows,
    1 / 3 the odd ones): the code stays at bit SHIFT of its half and the half gets the fp16 exponent of
    E = 2^(10 - SHIFT), so it reads E + code (SHIFT + BITS <= 10); one lop3 + one sub.f16x2 per 2 codes, and one
    shr (by 8, shared by all planes) for the odd rows."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if UNPACK == 2:
        M2: tl.constexpr = (MASK << SHIFT) * 0x10001
        E2: tl.constexpr = ((25 - SHIFT) << 10) * 0x10001  # fp16 2^(10 - SHIFT) in both halves
        return tl.inline_asm_elementwise(
            f"{{ .reg .b32 t0, t1, k; shr.b32 t1, $2, 8; lop3.b32 t0, $2, {M2}, {E2}, 0xEA; "
            f"lop3.b32 t1, t1, {M2}, {E2}, 0xEA; mov.b32 k, {E2}; sub.f16x2 $0, t0, k; sub.f16x2 $1, t1, k; }}",
            "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        e = ((x >> SHIFT) & MASK) | 0x6400
        o = ((x >> (SHIFT + 8)) & MASK) | 0x6400
        return e.to(tl.float16, bitcast=True) - 1024.0, o.to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _pair_plane_off(x, J: tl.constexpr, BITS: tl.constexpr, UNPACK: tl.constexpr):
    """_pair_plane's (even, odd) codes of value plane J with an offset left in: E + code as exact fp16, E =
    _plane_offset(J, BITS). Each half's code is moved into a window of bits 6.. (E = 16) or 8.. (E = 4) of the
    mantissa by one shift of the register (shl for the even rows' byte, shr for the odd rows'), and one lop3 masks it
    and sets the exponent: the shifted copies serve two planes each (2-bit codes), so per 2 codes it is one lop3 and
    half a shift instead of a lop3 and a sub.f16x2. E's share, E * sum(p * sV) per query column, is taken out with
    the zero-point term (kvarn_attention_pair_pipe_kernel, VOFF). E <= 16 should keep the tensor cores' fp32 sums
    exact enough: the codes and p * sV are >= 0, so nothing cancels (the dropped "offset codes" of an earlier
    session, offsets up to 1024 on keys and values, lost the codes' bits: rel. err 2.2e-2; up to 256: 2.1e-3)."""
    PAIR: tl.constexpr = J * BITS // 4  # 2-bit codes: planes 0-1 / 2-3 share a shift; 4-bit: one plane each
    KE: tl.constexpr = 6 - 4 * PAIR  # even rows: bits BITS*J -> the window
    KO: tl.constexpr = 2 + 4 * PAIR  # odd rows: bits 8 + BITS*J -> the window
    W: tl.constexpr = 6 + BITS * J - 4 * PAIR  # the window's low bit (6 or 8)
    MASK: tl.constexpr = ((1 << BITS) - 1) << W
    EXP: tl.constexpr = (25 - W) << 10  # fp16 2^(10 - W): the code then counts in units of 1
    if UNPACK == 2:
        M2: tl.constexpr = MASK * 0x10001
        E2: tl.constexpr = EXP * 0x10001
        return tl.inline_asm_elementwise(
            f"{{ .reg .b32 t0, t1; shl.b32 t0, $2, {KE}; shr.b32 t1, $2, {KO}; "
            f"lop3.b32 $0, t0, {M2}, {E2}, 0xEA; lop3.b32 $1, t1, {M2}, {E2}, 0xEA; }}",
            "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        e = (((x >> (BITS * J)) & ((1 << BITS) - 1)) << W) | EXP
        o = (((x >> (8 + BITS * J)) & ((1 << BITS) - 1)) << W) | EXP
        return e.to(tl.float16, bitcast=True), o.to(tl.float16, bitcast=True)


@triton.jit
def _plane_offset(J, BITS: tl.constexpr):
    # _pair_plane_off's E of value plane J (J may be a tensor of planes): 16, or 4 for the odd planes of 2-bit codes
    if BITS == 2:
        return tl.where(J % 2 == 0, 16.0, 4.0)
    else:
        return tl.full(J.shape, 16.0, tl.float32)


@triton.jit
def _pair_key_dot(pk, J: tl.constexpr, b_hi, b_lo, s_e, s_o, KB: tl.constexpr, UNPACK: tl.constexpr,
                  KSPLIT: tl.constexpr):
    # scores^T of the even / odd tokens += Kcodes_J^T [G/2, DP] x (q_J * sK_J)^T [DP, BN]
    c_e, c_o = _pair_plane(pk, J * KB, KB, UNPACK)
    return _dot16_t(c_e, b_hi, b_lo, s_e, KSPLIT), _dot16_t(c_o, b_hi, b_lo, s_o, KSPLIT)


@triton.jit
def _pair_sink_mask(s_e, s_o, pos_e, sink_lo):
    """Pair-kernel scores of the even / odd tokens (positions pos_e, pos_e + 1) with the sink's positions (below
    sink_lo, read 16-bit by the tail kernel) taken out."""
    return (tl.where((pos_e >= sink_lo)[:, None], s_e, float("-inf")),
            tl.where((pos_e + 1 >= sink_lo)[:, None], s_o, float("-inf")))


@triton.jit
def _pair_program(qr_ptr, seq_lens_ptr, num_splits, HQ, GROUP: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                  D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, FOLD: tl.constexpr = 0):
    """Shared prologue of the pair kernels: this program's request, KV head and split, its query columns (padded to
    BN), the index vectors of the pair tiles and the normalised query planes. FOLD (KSPLIT = 3): the query planes'
    columns BN/2.. repeat columns 0.. (the lo half of the key operand); row and col_ok stay the stored columns."""
    b = tl.program_id(0)
    kvh = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    S = tl.load(seq_lens_ptr + b)
    PERK: tl.constexpr = 8 // KB
    DP: tl.constexpr = D // PERK
    n = tl.arange(0, BN)
    col_ok = n < GROUP
    row = (b * HQ + kvh * GROUP + n).to(tl.int64)
    dp = tl.arange(0, DP)
    u = tl.arange(0, G // 2)  # token pairs (2u, 2u + 1)
    v = tl.arange(0, D // 2)  # channel pairs (2v, 2v + 1)
    bt = tl.arange(0, G // (8 // VB))
    if FOLD:
        qn = n % (BN // 2)
        q_ok = qn < GROUP
        q_row = (b * HQ + kvh * GROUP + qn).to(tl.int64)
    else:
        q_ok = col_ok
        q_row = row
    q0, q1, q2, q3, qnorm = _query_planes(qr_ptr + q_row[None, :] * D + dp[:, None], q_ok[None, :], DP, PERK)
    return b, kvh, split, S, col_ok, row, dp, u, v, bt, q0, q1, q2, q3, qnorm


@serving_jit(ints=["num_splits", "stride_btb"])
def kvarn_attention_pair_kernel(
    qr_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, sink_lens_ptr, defer_ptr,
    po_r_ptr, plse_ptr,
    num_splits, stride_btb, stride_cb16, stride_ch16, HQ,
    GROUP: tl.constexpr, BN: tl.constexpr,
    G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    UNPACK: tl.constexpr, KSPLIT: tl.constexpr, VSPLIT: tl.constexpr, STAGES: tl.constexpr,
    SINK: tl.constexpr = 0, DEFER: tl.constexpr = 0,
):
    """kvarn_attention_tok_kernel with the packed bytes read as int16 pairs (DecodeConfig.layout = 2): the byte
    tiles are token-contiguous (keys) / channel-contiguous (values), but the MMA A operand wants pairs along its K
    dim, so the tok kernel's layout conversion of the byte tile (through shared memory) runs one byte at a time
    (LDS.U8 + byte permutes). As int16 elements it is a 16-bit conversion (ldmatrix-able), and each int16 holds
    two M rows: the even / odd tokens (keys) and channels (values) become two M = G/2 (D/2) dots each. Same math,
    same partials. Offsets and strides are in fp16 (2-byte) units."""
    PERK: tl.constexpr = 8 // KB
    DP: tl.constexpr = D // PERK
    PERV: tl.constexpr = 8 // VB
    BT: tl.constexpr = G // PERV
    G2: tl.constexpr = G // 2
    D2: tl.constexpr = D // 2
    b, kvh, split, S, col_ok, row, dp, u, v, bt, q0, q1, q2, q3, qnorm = _pair_program(
        qr_ptr, seq_lens_ptr, num_splits, HQ, GROUP, BN, G, D, KB, VB)
    sink_lo = _sink_lo(sink_lens_ptr, b, SINK)

    t_begin, t_stop = _split_tiles(_records_end(S, DEFER, defer_ptr), S, G, split, num_splits)

    m_i = tl.full([BN], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BN], dtype=tl.float32)
    acc_e = tl.zeros([D2, BN], dtype=tl.float32)  # o^T of the even / odd channels, rotated basis
    acc_o = tl.zeros([D2, BN], dtype=tl.float32)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for t in tl.range(t_begin, t_stop, num_stages=STAGES):
        blk = tl.load(bt_row + t).to(tl.int64)
        rec = cache16_ptr + blk * stride_cb16 + kvh * stride_ch16
        sk_ptr = rec + OFF_SK // 2
        zk_ptr = rec + OFF_ZK // 2
        # ---- keys: pk bytes [DP, G] as int16 [G/2, DP] (token pairs x channels)
        pk = tl.load(rec + OFF_PK // 2 + dp[None, :] * G2 + u[:, None]).to(tl.int16, bitcast=True)
        s_e = tl.zeros([G2, BN], dtype=tl.float32)
        s_o = tl.zeros([G2, BN], dtype=tl.float32)
        b_hi, b_lo, qz = _key_plane_t(q0, sk_ptr, zk_ptr, DP, KSPLIT)
        s_e, s_o = _pair_key_dot(pk, 0, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
        b_hi, b_lo, z1 = _key_plane_t(q1, sk_ptr + DP, zk_ptr + DP, DP, KSPLIT)
        s_e, s_o = _pair_key_dot(pk, 1, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
        qz += z1
        if PERK == 4:
            b_hi, b_lo, z2 = _key_plane_t(q2, sk_ptr + 2 * DP, zk_ptr + 2 * DP, DP, KSPLIT)
            s_e, s_o = _pair_key_dot(pk, 2, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
            b_hi, b_lo, z3 = _key_plane_t(q3, sk_ptr + 3 * DP, zk_ptr + 3 * DP, DP, KSPLIT)
            s_e, s_o = _pair_key_dot(pk, 3, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
            qz += z2 + z3
        rk = rec + OFF_RK // 2 + 2 * u
        s_e = (s_e + qz[None, :]) * (tl.load(rk).to(tl.float32) * qnorm)[:, None]
        s_o = (s_o + qz[None, :]) * (tl.load(rk + 1).to(tl.float32) * qnorm)[:, None]
        if SINK > 0:
            s_e, s_o = _pair_sink_mask(s_e, s_o, t * G + 2 * u, sink_lo)
        # ---- online softmax per column over both token halves
        m_new = tl.maximum(m_i, tl.max(tl.maximum(s_e, s_o), axis=0))
        alpha = tl.exp2(m_i - m_new)
        p_e = tl.exp2(s_e - m_new[None, :])
        p_o = tl.exp2(s_o - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p_e + p_o, axis=0)
        m_i = m_new
        sv = rec + OFF_SV // 2 + 2 * u
        zv = rec + OFF_ZV // 2 + 2 * u
        pz = tl.sum(p_e * tl.load(zv).to(tl.float32)[:, None] + p_o * tl.load(zv + 1).to(tl.float32)[:, None], axis=0)
        ps_e = p_e * tl.load(sv).to(tl.float32)[:, None]
        ps_o = p_o * tl.load(sv + 1).to(tl.float32)[:, None]
        ps = tl.reshape(tl.permute(tl.join(ps_e, ps_o), (0, 2, 1)), [G, BN])  # tokens in order
        # ---- values: pv bytes [BT, D] as int16 [D/2, BT] (channel pairs x tokens of a plane)
        pv = tl.load(rec + OFF_PV // 2 + bt[None, :] * D2 + v[:, None]).to(tl.int16, bitcast=True)
        o_e, o_o = _pair_value_planes(pv, ps, D2, BT, BN, VB, UNPACK, VSPLIT)
        cv = rec + OFF_CV // 2 + 2 * v
        acc_e = acc_e * alpha[None, :] + (o_e + pz[None, :]) * tl.load(cv).to(tl.float32)[:, None]
        acc_o = acc_o * alpha[None, :] + (o_o + pz[None, :]) * tl.load(cv + 1).to(tl.float32)[:, None]

    _store_pair_partials(po_r_ptr, plse_ptr, row, split, num_splits, v, col_ok, acc_e, acc_o, m_i, l_i, D)


@triton.jit
def _pair_values(pv, ps, o_e, o_o, J: tl.constexpr, VB: tl.constexpr, UNPACK: tl.constexpr, VSPLIT: tl.constexpr,
                 VOFF: tl.constexpr = 0):
    # o^T of the even / odd channels += Vcodes_J^T [D/2, BT] x (p * sV)_J^T [BT, BN] (VOFF: + E_J * sum of ps)
    hi, lo = _split16(ps, VSPLIT)
    if VOFF:
        c_e, c_o = _pair_plane_off(pv, J, VB, UNPACK)
    else:
        c_e, c_o = _pair_plane(pv, J * VB, VB, UNPACK)
    return _dot16_t(c_e, hi, lo, o_e, VSPLIT), _dot16_t(c_o, hi, lo, o_o, VSPLIT)


@triton.jit
def _pair_value_planes(pv, ps, D2: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, VB: tl.constexpr,
                       UNPACK: tl.constexpr, VSPLIT: tl.constexpr, VOFF: tl.constexpr = 0):
    # o^T of the even / odd channels of one tile: every value byte plane J against its BT rows of p * sV [G, BN]
    PERV: tl.constexpr = 8 // VB
    o_e = tl.zeros([D2, BN], dtype=tl.float32)
    o_o = tl.zeros([D2, BN], dtype=tl.float32)
    if PERV == 2:
        ps0, ps1 = _halves(ps, BT, BN)
        o_e, o_o = _pair_values(pv, ps0, o_e, o_o, 0, VB, UNPACK, VSPLIT, VOFF)
        o_e, o_o = _pair_values(pv, ps1, o_e, o_o, 1, VB, UNPACK, VSPLIT, VOFF)
    else:
        tl.static_assert(PERV == 4, "codes are 2 or 4 bits")
        h0, h1 = _halves(ps, 2 * BT, BN)
        ps0, ps1 = _halves(h0, BT, BN)
        ps2, ps3 = _halves(h1, BT, BN)
        o_e, o_o = _pair_values(pv, ps0, o_e, o_o, 0, VB, UNPACK, VSPLIT, VOFF)
        o_e, o_o = _pair_values(pv, ps1, o_e, o_o, 1, VB, UNPACK, VSPLIT, VOFF)
        o_e, o_o = _pair_values(pv, ps2, o_e, o_o, 2, VB, UNPACK, VSPLIT, VOFF)
        o_e, o_o = _pair_values(pv, ps3, o_e, o_o, 3, VB, UNPACK, VSPLIT, VOFF)
    return o_e, o_o


@triton.jit
def _store_pair_partials(po_r_ptr, plse_ptr, row, split, num_splits, v, col_ok, acc_e, acc_o, m_i, l_i,
                         D: tl.constexpr):
    # the pair kernels' even / odd channel halves interleaved back into kvarn_attention_kernel's partial rows
    inv_l, lse = _partial_stats(m_i, l_i)
    out = po_r_ptr + (row * num_splits + split)[None, :] * D + 2 * v[:, None]
    tl.store(out, acc_e * inv_l[None, :], mask=col_ok[None, :])
    tl.store(out + 1, acc_o * inv_l[None, :], mask=col_ok[None, :])
    tl.store(plse_ptr + row * (num_splits + 1) + split, lse, mask=col_ok)


@triton.jit
def _pair_scales(x):
    # int32 = fp16 pair (low half: element 2i, high half: 2i + 1) -> the two values as fp32
    e = x.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    o = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return e, o


@triton.jit
def _pair_tile_load(rec16, rec32, u, v, dp, bt, G2: tl.constexpr, D2: tl.constexpr, DP: tl.constexpr,
                    PERK: tl.constexpr, OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr,
                    OFF_RK: tl.constexpr, OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr,
                    OFF_CV: tl.constexpr, SKV: tl.constexpr = 0):
    """Every global load of one record tile, issued together. The per-token / per-channel scale runs are read as
    int32 pairs: one 4-byte load per (even, odd) M-row pair instead of two 2-byte loads, already in the even / odd
    split of the pair tiles (and 4 bytes wide, so the pipeliner can make them async copies)."""
    pk = tl.load(rec16 + OFF_PK // 2 + dp[None, :] * G2 + u[:, None])
    pv = tl.load(rec16 + OFF_PV // 2 + bt[None, :] * D2 + v[:, None])
    if SKV >= 1:
        # the key scales and zero points of every plane (sK then zK, D halves each, adjacent in the record) in one
        # load of 2D halves: >= 4 bytes per thread where the DP-wide loads below have 2, so the pipeliner makes it an
        # async copy like the tiles instead of a synchronous load inside the loop
        tl.static_assert(OFF_ZK == OFF_SK + 2 * PERK * DP, "zK follows sK in the record (docs/format.md)")
        skz = tl.load(rec16 + OFF_SK // 2 + tl.arange(0, 2 * PERK * DP))
        if PERK == 2:
            sk, zk = tl.split(tl.permute(tl.reshape(skz, [2, 2, DP]), (2, 1, 0)))  # [DP, plane] each
            sk0, sk1 = tl.split(sk)
            zk0, zk1 = tl.split(zk)
        else:
            tl.static_assert(PERK == 4, "codes are 2 or 4 bits")
            sk, zk = tl.split(tl.permute(tl.reshape(skz, [2, 2, 2, DP]), (3, 2, 1, 0)))  # [DP, plane % 2, plane // 2]
            ska, skb = tl.split(sk)
            zka, zkb = tl.split(zk)
            sk0, sk1 = tl.split(ska)
            sk2, sk3 = tl.split(skb)
            zk0, zk1 = tl.split(zka)
            zk2, zk3 = tl.split(zkb)
    else:
        sk0 = tl.load(rec16 + OFF_SK // 2 + dp)
        zk0 = tl.load(rec16 + OFF_ZK // 2 + dp)
        sk1 = tl.load(rec16 + OFF_SK // 2 + DP + dp)
        zk1 = tl.load(rec16 + OFF_ZK // 2 + DP + dp)
        if PERK == 4:
            sk2 = tl.load(rec16 + OFF_SK // 2 + 2 * DP + dp)
            zk2 = tl.load(rec16 + OFF_ZK // 2 + 2 * DP + dp)
            sk3 = tl.load(rec16 + OFF_SK // 2 + 3 * DP + dp)
            zk3 = tl.load(rec16 + OFF_ZK // 2 + 3 * DP + dp)
    if PERK == 2:  # 4-bit keys have planes 0 and 1 only; 2 and 3 are unused placeholders
        sk2 = sk0
        zk2 = zk0
        sk3 = sk0
        zk3 = zk0
    rk = tl.load(rec32 + OFF_RK // 4 + u)
    sv = tl.load(rec32 + OFF_SV // 4 + u)
    zv = tl.load(rec32 + OFF_ZV // 4 + u)
    cv = tl.load(rec32 + OFF_CV // 4 + v)
    return pk, pv, sk0, zk0, sk1, zk1, sk2, zk2, sk3, zk3, rk, sv, zv, cv


@triton.jit
def _key_operands(qT, sk, KSPLIT: tl.constexpr):
    """(q_j * sK_j)^T [DP, BN], hi / lo: the B operand of plane j's key dots, from the (prefetched) fp16 scales.
    KSPLIT = 3 (_pair_program's FOLD layout: columns BN/2.. repeat the query heads of 0..): one operand, the fp16
    hi in the first BN/2 columns and the lo residual in the rest, so one key MMA per plane carries both; the two
    column halves of the scores are added by _fold_halves."""
    x = qT * sk.to(tl.float32)[:, None]
    if KSPLIT == 3:
        hi, lo = _split16(x, 2)
        col = tl.arange(0, x.shape[1])
        both = tl.where((col < x.shape[1] // 2)[None, :], hi, lo)
        return both, both
    return _split16(x, KSPLIT)


@triton.jit
def _fold_halves(x, UNPACK: tl.constexpr):
    """x [M, 8] (the key dots' accumulator with KSPLIT = 3) -> x + x with its column halves swapped: every column
    then holds hi + lo of its query head. On the GPU (UNPACK = 2) one shfl.bfly per register: in the mma.sync
    m16n8 accumulator layout lane l holds columns 2 (l % 4) and 2 (l % 4) + 1, so lane l ^ 2 holds the same rows at
    column + 4 (the dot's result is used in that layout; the GPU tests check the sum against the reference).
    Elsewhere (the interpreter) the same sum by reshapes."""
    if UNPACK == 2:
        tl.static_assert(x.shape[1] == 8, "the lane fold needs N = 8 (one m16n8 tile per row block)")
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t; shfl.sync.bfly.b32 t, $1, 2, 0x1f, 0xffffffff; add.f32 $0, $1, t; }",
            "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        M: tl.constexpr = x.shape[0]
        H: tl.constexpr = x.shape[1] // 2
        a, b = tl.split(tl.permute(tl.reshape(x, [M, 2, H]), (0, 2, 1)))
        s = a + b
        return tl.reshape(tl.permute(tl.join(s, s), (0, 2, 1)), [M, 2 * H])


@triton.jit
def _key_plane_p(qT, sk, zk, KSPLIT: tl.constexpr):
    # _key_plane_t with the (prefetched) fp16 scale vectors as values
    hi, lo = _key_operands(qT, sk, KSPLIT)
    return hi, lo, tl.sum(qT * zk.to(tl.float32)[:, None], axis=0)


@serving_jit(ints=["num_splits", "stride_btb"])
def kvarn_attention_pair_pipe_kernel(
    qr_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, sink_lens_ptr, defer_ptr,
    po_r_ptr, plse_ptr,
    num_splits, stride_btb, stride_cb16, stride_ch16, HQ,
    # the 16-bit tail (tail_attention_kernel's arguments; read only by the TAIL programs)
    q_ptr, tail_k_ptr, tail_v_ptr, tail_slots_ptr, po_t_ptr, qk_scale,
    stride_qn, stride_qh, stride_tks, stride_tkh, stride_tkg, stride_tvs, stride_tvh, stride_tvg,
    GROUP: tl.constexpr, BN: tl.constexpr,
    G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    UNPACK: tl.constexpr, KSPLIT: tl.constexpr, VSPLIT: tl.constexpr, STAGES: tl.constexpr,
    SINK: tl.constexpr = 0, DEFER: tl.constexpr = 0, SKV: tl.constexpr = 0,
    TAIL: tl.constexpr = 0, GP: tl.constexpr = 4, TBM: tl.constexpr = 16, TT: tl.constexpr = 64,
    MMA_BF16: tl.constexpr = 1, TAIL16: tl.constexpr = 1, Q_AS_TAIL: tl.constexpr = 1, TS: tl.constexpr = 16,
    PDL: tl.constexpr = 0, VOFF: tl.constexpr = 0,
):
    """kvarn_attention_pair_kernel restructured for the pipeliner (DecodeConfig.pipe = 1; use with num_stages >= 2).

    In the pair kernel's loop the tile's loads go out in five dependent waves (codes, sK/zK, rK, sV/zV + values,
    cV), each consumed right after it is issued, and its per-token scale runs are 2-byte loads, which the
    pipeliner does not turn into async copies. Here all loads of a tile are issued together at the top of the
    iteration and the per-token / per-channel runs are read as int32 (even, odd) pairs, so with num_stages >= 2
    every load of the tile (not only the code tiles) becomes a cp.async into shared memory. The block index, an
    indirect load, takes a pipeline stage of its own, so with Triton 3.6 the copies only overlap the previous tile's
    compute from num_stages 5 on; at 2-4 they are waited for in full at the top of the next iteration (offline
    TTGIR, tests/test_kernels_pipelining.py). The softmax denominator is kept per token row and reduced across
    warps once after the loop (one cross-warp reduction fewer per tile). SKV = 1 (DecodeConfig.pipe = 2) reads the
    key scales and zero points in one load wide enough to become an async copy on 2 warps too, and sums q . zK of
    all planes in one reduction. Same math and partials as the pair kernel.

    TAIL = 1 (DecodeConfig.tail): the grid has Hk more programs along axis 2, after the Hk * num_splits record
    programs, and each runs tail_attention_kernel's program for its (request, KV head), which is then not launched.
    Last in the grid, they fill the resident slots the record programs' last wave leaves free instead of a launch
    of their own (H200, session 16: the tail kernel alone 10 us of the 341 us call at B=64 x 16K, latency-bound).
    VOFF = 1 (DecodeConfig.voff): the value codes reach the dots as E + code (_pair_plane_off)."""
    pdl_sync(PDL)  # (DecodeConfig.pdl) the query rotation's output, qr, is read below
    if TAIL and tl.program_id(2) >= (HQ // GROUP) * num_splits:
        _tail_partial(tl.program_id(0), 0, tl.program_id(2) - (HQ // GROUP) * num_splits, q_ptr, seq_lens_ptr,
                      seq_lens_ptr, tail_k_ptr, tail_v_ptr, tail_slots_ptr, sink_lens_ptr, defer_ptr, po_t_ptr,
                      plse_ptr, qk_scale, num_splits, stride_qn, stride_qh, stride_tks, stride_tkh, stride_tkg,
                      stride_tvs, stride_tvh, stride_tvg, HQ, GROUP, GP, 1, TBM, G, D, False, TT, MMA_BF16,
                      TAIL16, Q_AS_TAIL, SINK, DEFER, 1, TS)
    else:
        _pair_pipe_records(qr_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, sink_lens_ptr, defer_ptr, po_r_ptr, plse_ptr,
                           num_splits, stride_btb, stride_cb16, stride_ch16, HQ, GROUP, BN, G, D, KB, VB,
                           OFF_PK, OFF_SK, OFF_ZK, OFF_RK, OFF_PV, OFF_SV, OFF_ZV, OFF_CV,
                           UNPACK, KSPLIT, VSPLIT, STAGES, SINK, DEFER, SKV, VOFF)


@triton.jit
def _pair_pipe_records(
    qr_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, sink_lens_ptr, defer_ptr, po_r_ptr, plse_ptr,
    num_splits, stride_btb, stride_cb16, stride_ch16, HQ,
    GROUP: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    UNPACK: tl.constexpr, KSPLIT: tl.constexpr, VSPLIT: tl.constexpr, STAGES: tl.constexpr,
    SINK: tl.constexpr, DEFER: tl.constexpr, SKV: tl.constexpr, VOFF: tl.constexpr,
):
    # kvarn_attention_pair_pipe_kernel's record programs (program ids as in kvarn_attention_pair_kernel)
    PERK: tl.constexpr = 8 // KB
    DP: tl.constexpr = D // PERK
    PERV: tl.constexpr = 8 // VB
    BT: tl.constexpr = G // PERV
    G2: tl.constexpr = G // 2
    D2: tl.constexpr = D // 2
    tl.static_assert(KSPLIT != 3 or (BN == 8 and 2 * GROUP <= BN), "KSPLIT 3 needs the group in half of N = 8")
    b, kvh, split, S, col_ok, row, dp, u, v, bt, q0, q1, q2, q3, qnorm = _pair_program(
        qr_ptr, seq_lens_ptr, num_splits, HQ, GROUP, BN, G, D, KB, VB, KSPLIT == 3)
    sink_lo = _sink_lo(sink_lens_ptr, b, SINK)

    t_begin, t_stop = _split_tiles(_records_end(S, DEFER, defer_ptr), S, G, split, num_splits)

    m_i = tl.full([BN], float("-inf"), dtype=tl.float32)
    l_part = tl.zeros([G2, BN], dtype=tl.float32)  # per token-pair row; summed over rows after the loop
    acc_e = tl.zeros([D2, BN], dtype=tl.float32)
    acc_o = tl.zeros([D2, BN], dtype=tl.float32)

    c32 = cache16_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for t in tl.range(t_begin, t_stop, num_stages=STAGES):
        blk = tl.load(bt_row + t).to(tl.int64)
        pk, pv, sk0, zk0, sk1, zk1, sk2, zk2, sk3, zk3, rk, sv, zv, cv = _pair_tile_load(
            cache16_ptr + blk * stride_cb16 + kvh * stride_ch16, c32 + blk * (stride_cb16 // 2) + kvh * (stride_ch16 // 2),
            u, v, dp, bt, G2, D2, DP, PERK, OFF_PK, OFF_SK, OFF_ZK, OFF_RK, OFF_PV, OFF_SV, OFF_ZV, OFF_CV, SKV)
        # ---- keys (as kvarn_attention_pair_kernel)
        pki = pk.to(tl.int16, bitcast=True)
        s_e = tl.zeros([G2, BN], dtype=tl.float32)
        s_o = tl.zeros([G2, BN], dtype=tl.float32)
        if SKV >= 1:
            # q . zK of every plane in one cross-warp reduction (pipe = 1: one per plane)
            zq = q0 * zk0.to(tl.float32)[:, None] + q1 * zk1.to(tl.float32)[:, None]
            if PERK == 4:
                zq += q2 * zk2.to(tl.float32)[:, None] + q3 * zk3.to(tl.float32)[:, None]
            qz = tl.sum(zq, axis=0)
            b_hi, b_lo = _key_operands(q0, sk0, KSPLIT)
            s_e, s_o = _pair_key_dot(pki, 0, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
            b_hi, b_lo = _key_operands(q1, sk1, KSPLIT)
            s_e, s_o = _pair_key_dot(pki, 1, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
            if PERK == 4:
                b_hi, b_lo = _key_operands(q2, sk2, KSPLIT)
                s_e, s_o = _pair_key_dot(pki, 2, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
                b_hi, b_lo = _key_operands(q3, sk3, KSPLIT)
                s_e, s_o = _pair_key_dot(pki, 3, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
        else:  # each plane's reduction beside its dot (the measured schedule; hoisting them: +4 barriers per tile)
            b_hi, b_lo, qz = _key_plane_p(q0, sk0, zk0, KSPLIT)
            s_e, s_o = _pair_key_dot(pki, 0, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
            b_hi, b_lo, z1 = _key_plane_p(q1, sk1, zk1, KSPLIT)
            s_e, s_o = _pair_key_dot(pki, 1, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
            qz += z1
            if PERK == 4:
                b_hi, b_lo, z2 = _key_plane_p(q2, sk2, zk2, KSPLIT)
                s_e, s_o = _pair_key_dot(pki, 2, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
                b_hi, b_lo, z3 = _key_plane_p(q3, sk3, zk3, KSPLIT)
                s_e, s_o = _pair_key_dot(pki, 3, b_hi, b_lo, s_e, s_o, KB, UNPACK, KSPLIT)
                qz += z2 + z3
        if KSPLIT == 3:
            s_e = _fold_halves(s_e, UNPACK)
            s_o = _fold_halves(s_o, UNPACK)
        rk_e, rk_o = _pair_scales(rk)
        s_e = (s_e + qz[None, :]) * (rk_e * qnorm)[:, None]
        s_o = (s_o + qz[None, :]) * (rk_o * qnorm)[:, None]
        if SINK > 0:
            s_e, s_o = _pair_sink_mask(s_e, s_o, t * G + 2 * u, sink_lo)
        # ---- online softmax; the denominator stays per row (l_part)
        m_new = tl.maximum(m_i, tl.max(tl.maximum(s_e, s_o), axis=0))
        alpha = tl.exp2(m_i - m_new)
        p_e = tl.exp2(s_e - m_new[None, :])
        p_o = tl.exp2(s_o - m_new[None, :])
        l_part = l_part * alpha[None, :] + (p_e + p_o)
        m_i = m_new
        sv_e, sv_o = _pair_scales(sv)
        zv_e, zv_o = _pair_scales(zv)
        if VOFF:
            # the value dots read E_J + code (_pair_plane_off): take E_J * p * sV, with p * sV rounded to fp16 as
            # the dots read it, out of the zero-point term (tokens 2u, 2u + 1 are in plane 2u // BT)
            tl.static_assert(VSPLIT == 1, "offset value codes need the fp16-only p * sV operand")
            ps_e = p_e * sv_e[:, None]
            ps_o = p_o * sv_o[:, None]
            w = _plane_offset((2 * u) // BT, VB)
            pz = tl.sum(p_e * zv_e[:, None] + p_o * zv_o[:, None]
                        - w[:, None] * (ps_e.to(tl.float16).to(tl.float32) + ps_o.to(tl.float16).to(tl.float32)),
                        axis=0)
        else:  # the same products in the measured default's order (computing ps first changes its compiled schedule)
            pz = tl.sum(p_e * zv_e[:, None] + p_o * zv_o[:, None], axis=0)
            ps_e = p_e * sv_e[:, None]
            ps_o = p_o * sv_o[:, None]
        ps = tl.reshape(tl.permute(tl.join(ps_e, ps_o), (0, 2, 1)), [G, BN])
        # ---- values
        pvi = pv.to(tl.int16, bitcast=True)
        o_e, o_o = _pair_value_planes(pvi, ps, D2, BT, BN, VB, UNPACK, VSPLIT, VOFF)
        cv_e, cv_o = _pair_scales(cv)
        acc_e = acc_e * alpha[None, :] + (o_e + pz[None, :]) * cv_e[:, None]
        acc_o = acc_o * alpha[None, :] + (o_o + pz[None, :]) * cv_o[:, None]

    l_i = tl.sum(l_part, axis=0)
    _store_pair_partials(po_r_ptr, plse_ptr, row, split, num_splits, v, col_ok, acc_e, acc_o, m_i, l_i, D)


@triton.jit
def pair_selftest_kernel(src_ptr, even_ptr, odd_ptr, N: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr,
                         OFF: tl.constexpr = 0):
    """Inline-PTX unpack of N int16 pairs (kvarn_attention_pair_kernel's), for the same self-check. OFF = 1: the
    offset planes (_pair_plane_off, plane SHIFT // BITS), E + code."""
    i = tl.arange(0, N)
    if OFF:
        e, o = _pair_plane_off(tl.load(src_ptr + i), SHIFT // BITS, BITS, 2)
    else:
        e, o = _pair_plane(tl.load(src_ptr + i), SHIFT, BITS, 2)
    tl.store(even_ptr + i, e)
    tl.store(odd_ptr + i, o)
