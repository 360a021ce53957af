"""Decode attention over a KVarN paged cache plus its 16-bit tail: one query token per request, split-K over the
context, the GQA group's query heads sharing every unpacked tile.

Public API (the vLLM backend calls exactly this):

    decode_attention(q, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, fmt, scale,
                     num_splits=None, out=None, *, sink_lens=None, win_lens=None, defer=False) -> out
        q           [B, Hq, D] fp16/bf16
        cache       uint8 [num_blocks, Hk, record_bytes(D)]
        block_table int32 [B, max_blocks]: record row of each full tile of request b
        seq_lens    int32 [B]: tokens visible to the query; seq_len // g full tiles come from records, the last
                    seq_len % g tokens from tail_k / tail_v [S, Hk, g + sink + 2W, D] at row tail_slots[b] (int32
                    [B]), position pos % g; positions below sink (0 <= sink < g) from rows g + pos instead (the
                    attention sink, 16-bit for good), and with a sink the last W = fmt.window_tokens positions of
                    the tile before the newest position's from its window half (rows g + sink + (tile % 2) W ..).
                    seq_len 0 rows (CUDA-graph padding) produce zeros.
        scale       softmax scale (python float)
        num_splits  context splits per (request, KV head), merged with log-sum-exp; None: from the shapes and the
                    SM count (host values only, never device data)
        out         optional [B, Hq, D] output (q's dtype, or fp32 for tests); allocated when None
        sink_lens   optional int32 [B]: sink rows row b may read (<= sink; 0 where they hold another request's
                    tokens); None: all of them, from a tensor made per call (a CUDA graph captured that way keeps
                    "all": pass a persistent buffer, as the backend does)
        win_lens    optional int32 [B]: > 0 where row b's window half holds its tile (step_plan.update_window_lens);
                    None: everywhere, as sink_lens
        defer       True: a tile that fills at this step (seq_len % g == 0) is still in the tail (its record is
                    written later, by store.flush_layers): (seq_len - 1) // g tiles from records, the rest (up to g
                    rows) from the tail. False (default): seq_len // g from records. An int32 [1] tensor: the same,
                    decided by its value on the device at run time (what a captured decode graph needs).

    prepare_decode(q, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, fmt, scale, num_splits=None,
                   *, out, sink_lens=None, win_lens=None, defer=False) -> launch(q, cache, tail_k, tail_v, out)
        the same checked once, its split count and workspaces made once: the launch serves every layer of a step
        (tensors of the shapes, strides and dtypes given here; the rows' block table and lengths stay)

Two launches with grids fixed by the shapes, no host sync, so a decode step can be captured in a CUDA graph:

    1. records_kernel          grid (B, Hk * (num_splits + 1)): program (b, kvh, split) attends over its run of
                               record tiles, its query heads read and scaled by scale * log2(e) in fp32 (the records
                               hold K as is and V rotated by Hn); the last Hk programs of each request attend over the
                               16-bit tail (kvarn.kernels.tail.tail_partial), so the tail needs no launch of its own
    2. tail.merge_kernel       the partials weighted by their log-sum-exp, the record part (values' basis) rotated
                               back

The math of one record tile (docs/format.md: K = ((codes * sK + zK) * rK), V = (codes * sV + zV) * cV): the scales
fold out of the dot products, which then run on the raw codes,

    scores[t, n] = rK[t] * ( sum_d codes_K[d, t] * (q[n, d] * sK[d])  +  sum_d q[n, d] * zK[d] )
    o[d, n]      = cV[d] * ( sum_t codes_V[t, d] * (p[t, n] * sV[t])  +  sum_t p[t, n] * zV[t] )

with tokens t (keys) and channels d (values) as the MMA M dimension, the group's query heads n as N (padded to
8: mma.sync m16n8 tiles). The codes are bit planes of the packed bytes (docs/format.md: key byte plane j holds
channels j*DP.., value byte plane j tokens j*BT..), read as int16 so that each element carries two M rows (even and
odd tokens / channels): every tile becomes two M/2 dots per plane. The fp32 operand (q * sK, p * sV) goes in as
fp16; for keys also its fp16 residual (hi + lo, ~22 bits: scores need it), for values fp16 alone.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..errors import KvarnError
from ..formats import KVFormat
from .device import LOG2E, partial_stats, pdl_sync, records_end, sink_start, split16, split_tiles, window_start
from .records import as_format, check_cache, check_tail, defer_flag, f16_view, layout
from .runtime import cdiv, compiled, next_pow2, no_launch, pdl_supported, programs_per_sm, serving_jit, sm_count
from .tail import merge_kernel, tail_partial

# Launch shape of the records kernel. 2 warps (each owns 32 of the 64 token / channel pair rows) replicate less of
# the softmax and scale work than 4; 5 pipeline stages because Triton gives the block index (an indirect load) a
# stage of its own: below 5 the next tile's async copies are waited for in full at the top of each iteration, from
# 5 on they stay in flight while the current tile computes (tests/kernels/test_kernels_pipelining.py checks the waits).
RECORD_WARPS = 2
RECORD_STAGES = 5
MMA_N = 8  # the group's query heads as N, padded: mma.sync m16n8 tiles
# warps of the merge (which builds the +-1 Hadamard in registers and rotates 16 rows back);
# at large batches there is about one program per SM, so its instruction chain is the launch's time
ROT_WARPS = 8


# ------------------------------------------------------------------------------------------------ device helpers


@triton.jit
def _pair_codes(x, SHIFT: tl.constexpr, BITS: tl.constexpr, COMPILED: tl.constexpr):
    """x: int16 = two bytes of one packed column (low byte: row 2i, high byte: row 2i + 1). The codes of one bit
    plane of both rows as exact fp16: (even, odd). The code keeps its bit position SHIFT inside a half whose fp16
    exponent is set to E = 2^(10 - SHIFT), so the half reads E + code, and E is subtracted. On the GPU that is
    inline PTX on 2 pairs per register: one lop3 and one sub.f16x2 per 2 codes, and one shift by 8 (shared by all
    planes) for the odd rows."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if COMPILED:
        M2: tl.constexpr = (MASK << SHIFT) * 0x10001
        E2: tl.constexpr = ((25 - SHIFT) << 10) * 0x10001  # fp16 2^(10 - SHIFT) in both halves
        return tl.inline_asm_elementwise(
            f"{{ .reg .b32 t0, t1, k; shr.b32 t1, $2, 8; lop3.b32 t0, $2, {M2}, {E2}, 0xEA; "
            f"lop3.b32 t1, t1, {M2}, {E2}, 0xEA; mov.b32 k, {E2}; sub.f16x2 $0, t0, k; sub.f16x2 $1, t1, k; }}",
            "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:  # the same values in plain Triton: code | 0x6400 is 1024 + code as fp16
        e = ((x >> SHIFT) & MASK) | 0x6400
        o = ((x >> (SHIFT + 8)) & MASK) | 0x6400
        return e.to(tl.float16, bitcast=True) - 1024.0, o.to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _fp16_pairs(x):
    """int32 = an fp16 pair (low half: element 2i, high half: 2i + 1) -> the two values as fp32 (even, odd)."""
    e = x.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    o = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return e, o


@triton.jit
def _halves(x, M: tl.constexpr, N: tl.constexpr):
    """Rows 0 .. M-1 and M .. 2M-1 of x [2M, N] (a reshape + split: register tensors cannot be sliced)."""
    return tl.split(tl.permute(tl.reshape(x, [2, M, N]), (1, 2, 0)))


@triton.jit
def _query_planes(q_ptrs, mask, scale, DP: tl.constexpr, PERK: tl.constexpr):
    """The query times `scale` (fp32) as the key byte planes' channel blocks [DP, BN] (plane j sits DP channels
    further), normalised by max |q| so that |q * sK| <= |sK| stays in the fp16 range; returns the planes (planes 2-3
    repeat plane 0 when there are 2) and that norm, which goes back in with rK."""
    p0 = tl.load(q_ptrs, mask=mask, other=0.0).to(tl.float32) * scale
    p1 = tl.load(q_ptrs + DP, mask=mask, other=0.0).to(tl.float32) * scale
    qmax = tl.maximum(tl.max(tl.max(tl.abs(p0), axis=1), axis=0), tl.max(tl.max(tl.abs(p1), axis=1), axis=0))
    if PERK == 4:
        p2 = tl.load(q_ptrs + 2 * DP, mask=mask, other=0.0).to(tl.float32) * scale
        p3 = tl.load(q_ptrs + 3 * DP, mask=mask, other=0.0).to(tl.float32) * scale
        qmax = tl.maximum(qmax, tl.maximum(tl.max(tl.max(tl.abs(p2), axis=1), axis=0),
                                           tl.max(tl.max(tl.abs(p3), axis=1), axis=0)))
    else:
        p2 = p0
        p3 = p0
    qnorm = tl.where(qmax > 0.0, qmax, 1.0)
    qinv = 1.0 / qnorm
    return p0 * qinv, p1 * qinv, p2 * qinv, p3 * qinv, qnorm


@triton.jit
def _key_scales(rec16, DP: tl.constexpr, PERK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr):
    """sK and zK of every key plane (fp16 [DP] each; planes 2-3 repeat plane 0 for 4-bit keys). One load of the
    2D adjacent halves: wide enough per thread for the pipeliner to make it an async copy like the code tiles."""
    tl.static_assert(OFF_ZK == OFF_SK + 2 * PERK * DP, "zK follows sK in the record (docs/format.md)")
    skz = tl.load(rec16 + OFF_SK // 2 + tl.arange(0, 2 * PERK * DP))
    if PERK == 2:
        sk, zk = tl.split(tl.permute(tl.reshape(skz, [2, 2, DP]), (2, 1, 0)))  # [DP, plane] each
        sk0, sk1 = tl.split(sk)
        zk0, zk1 = tl.split(zk)
        sk2, sk3, zk2, zk3 = sk0, sk0, zk0, zk0
    else:
        tl.static_assert(PERK == 4, "codes are 2 or 4 bits")
        sk, zk = tl.split(tl.permute(tl.reshape(skz, [2, 2, 2, DP]), (3, 2, 1, 0)))  # [DP, plane % 2, plane // 2]
        ska, skb = tl.split(sk)
        zka, zkb = tl.split(zk)
        sk0, sk1 = tl.split(ska)
        sk2, sk3 = tl.split(skb)
        zk0, zk1 = tl.split(zka)
        zk2, zk3 = tl.split(zkb)
    return sk0, sk1, sk2, sk3, zk0, zk1, zk2, zk3


@triton.jit
def _key_operand(qT, sk, KSPLIT: tl.constexpr):
    """(q_j * sK_j)^T [DP, BN], the B operand of plane j's key dots, as fp16 (hi, lo). KSPLIT 3: the query heads sit
    twice in the N columns (_split_attention), so hi goes in the first BN/2 columns and lo in the rest of one
    operand, and one MMA per plane carries both (_fold_halves adds the halves)."""
    x = qT * sk.to(tl.float32)[:, None]
    if KSPLIT == 3:
        hi, lo = split16(x, 2)
        col = tl.arange(0, x.shape[1])
        both = tl.where((col < x.shape[1] // 2)[None, :], hi, lo)
        return both, both
    return split16(x, KSPLIT)


@triton.jit
def _code_dot(codes, hi, lo, acc, SPLIT: tl.constexpr):
    """acc + codes @ (hi [+ lo]): the codes are the A operand (M = tokens or channels), the fp32 factor the B."""
    acc = tl.dot(codes, hi, acc=acc, out_dtype=tl.float32)
    if SPLIT == 2:
        acc = tl.dot(codes, lo, acc=acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _key_dots(pk, J: tl.constexpr, qT, sk, s_e, s_o, KB: tl.constexpr, KSPLIT: tl.constexpr,
              COMPILED: tl.constexpr):
    """Scores^T of the even / odd tokens += Kcodes_J^T [G/2, DP] @ (q_J * sK_J)^T [DP, BN]."""
    hi, lo = _key_operand(qT, sk, KSPLIT)
    c_e, c_o = _pair_codes(pk, J * KB, KB, COMPILED)
    return _code_dot(c_e, hi, lo, s_e, KSPLIT), _code_dot(c_o, hi, lo, s_o, KSPLIT)


@triton.jit
def _fold_halves(x, COMPILED: tl.constexpr):
    """x [M, 8] (the key accumulator of KSPLIT 3) -> x + x with its column halves swapped: every column then holds
    hi + lo of its query head. On the GPU one shfl.bfly per register: in the mma.sync m16n8 accumulator layout lane
    l holds columns 2 (l % 4) and 2 (l % 4) + 1, so lane l ^ 2 holds the same rows at column + 4 (the GPU tests
    check the sum against the reference). In the interpreter the same sum by reshapes."""
    if COMPILED:
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
def _value_plane(pv, ps_j, J: tl.constexpr, o_e, o_o, VB: tl.constexpr, COMPILED: tl.constexpr):
    """o^T of the even / odd channels += Vcodes_J^T [D/2, BT] @ (p * sV)_J [BT, BN] (fp16 alone: enough for values)."""
    hi = ps_j.to(tl.float16)
    c_e, c_o = _pair_codes(pv, J * VB, VB, COMPILED)
    return _code_dot(c_e, hi, hi, o_e, 1), _code_dot(c_o, hi, hi, o_o, 1)


@triton.jit
def _value_dots(pv, ps, D2: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, VB: tl.constexpr,
                COMPILED: tl.constexpr):
    """o^T of the even / odd channels [D/2, BN] of one tile: value plane J (tokens J*BT ..) against its BT rows of
    p * sV [G, BN]."""
    PERV: tl.constexpr = 8 // VB
    o_e = tl.zeros([D2, BN], dtype=tl.float32)
    o_o = tl.zeros([D2, BN], dtype=tl.float32)
    if PERV == 2:
        ps0, ps1 = _halves(ps, BT, BN)
        o_e, o_o = _value_plane(pv, ps0, 0, o_e, o_o, VB, COMPILED)
        o_e, o_o = _value_plane(pv, ps1, 1, o_e, o_o, VB, COMPILED)
    else:
        tl.static_assert(PERV == 4, "codes are 2 or 4 bits")
        h0, h1 = _halves(ps, 2 * BT, BN)
        ps0, ps1 = _halves(h0, BT, BN)
        ps2, ps3 = _halves(h1, BT, BN)
        o_e, o_o = _value_plane(pv, ps0, 0, o_e, o_o, VB, COMPILED)
        o_e, o_o = _value_plane(pv, ps1, 1, o_e, o_o, VB, COMPILED)
        o_e, o_o = _value_plane(pv, ps2, 2, o_e, o_o, VB, COMPILED)
        o_e, o_o = _value_plane(pv, ps3, 3, o_e, o_o, VB, COMPILED)
    return o_e, o_o


# ------------------------------------------------------------------------------------------------ kernels


@serving_jit(ints=["num_splits", "stride_btb"])
def records_kernel(
    q_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, sink_lens_ptr, win_lens_ptr, defer_ptr, po_r_ptr, plse_ptr,
    num_splits, stride_btb, stride_cb16, stride_ch16, HQ, qk_scale, stride_qn, stride_qh,
    # the tail programs' arguments (tail.tail_partial)
    tail_k_ptr, tail_v_ptr, tail_slots_ptr, po_t_ptr,
    stride_tks, stride_tkh, stride_tkg, stride_tvs, stride_tvh, stride_tvg,
    GROUP: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    KSPLIT: tl.constexpr, STAGES: tl.constexpr, SINK: tl.constexpr, DEFER: tl.constexpr,
    TBM: tl.constexpr, TT: tl.constexpr, TS: tl.constexpr, TENSOR_CORES: tl.constexpr, Q_AS_TAIL: tl.constexpr,
    COMPILED: tl.constexpr, PDL: tl.constexpr, WIN: tl.constexpr = 0, TW: tl.constexpr = 16,
):
    """Program (b, p): p < Hk * num_splits attends over split p % num_splits of KV head p // num_splits's record
    tiles; the Hk programs after them attend over the tail of KV head p - Hk * num_splits. Last in the grid, the
    tail programs fill the slots the record programs' last wave leaves free. Offsets and strides of the cache are
    in fp16 (2-byte) units."""
    pdl_sync(PDL)  # the query is read below
    b = tl.program_id(0)
    p = tl.program_id(1)
    n_records = (HQ // GROUP) * num_splits
    if p >= n_records:
        tail_partial(b, p - n_records, q_ptr, seq_lens_ptr, tail_k_ptr, tail_v_ptr, tail_slots_ptr, sink_lens_ptr,
                     win_lens_ptr, defer_ptr, po_t_ptr, plse_ptr, qk_scale, num_splits, stride_qn, stride_qh, stride_tks,
                     stride_tkh, stride_tkg, stride_tvs, stride_tvh, stride_tvg, HQ, GROUP, TBM, G, D, TT, TS,
                     TENSOR_CORES, Q_AS_TAIL, SINK, DEFER, WIN, TW)
    else:
        _split_attention(q_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, sink_lens_ptr, win_lens_ptr, defer_ptr, po_r_ptr,
                         plse_ptr, b, p // num_splits, p % num_splits, num_splits, stride_btb, stride_cb16,
                         stride_ch16, HQ, qk_scale, stride_qn, stride_qh, GROUP, BN, G, D, KB, VB,
                         OFF_PK, OFF_SK, OFF_ZK, OFF_RK, OFF_PV, OFF_SV, OFF_ZV, OFF_CV, KSPLIT, STAGES, SINK, DEFER,
                         COMPILED, WIN)


@triton.jit
def _split_attention(
    q_ptr, cache16_ptr, bt_ptr, seq_lens_ptr, sink_lens_ptr, win_lens_ptr, defer_ptr, po_r_ptr, plse_ptr,
    b, kvh, split, num_splits, stride_btb, stride_cb16, stride_ch16, HQ, qk_scale, stride_qn, stride_qh,
    GROUP: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    KSPLIT: tl.constexpr, STAGES: tl.constexpr, SINK: tl.constexpr, DEFER: tl.constexpr, COMPILED: tl.constexpr,
    WIN: tl.constexpr = 0,
):
    """Request b's GROUP query heads of KV head kvh over the record tiles of one context split: online softmax over
    the tiles, then the partial o / l and its log2-sum-exp for the merge. Positions the tail programs read 16-bit
    (the sink's, the window's) are skipped."""
    PERK: tl.constexpr = 8 // KB  # key byte planes: plane j holds channels j*DP .. of every token
    DP: tl.constexpr = D // PERK
    PERV: tl.constexpr = 8 // VB  # value byte planes: plane j holds tokens j*BT .. of every channel
    BT: tl.constexpr = G // PERV
    G2: tl.constexpr = G // 2  # token pairs (2u, 2u + 1)
    D2: tl.constexpr = D // 2  # channel pairs (2v, 2v + 1)
    tl.static_assert(KSPLIT != 3 or (BN == 8 and 2 * GROUP <= BN), "KSPLIT 3 needs the group in half of N = 8")

    # ---- the program's query columns: the group's heads, padded to BN (KSPLIT 3: the heads twice, see
    # _key_operand); row / col_ok are the stored columns
    n = tl.arange(0, BN)
    col_ok = n < GROUP
    row = (b * HQ + kvh * GROUP + n).to(tl.int64)
    if KSPLIT == 3:
        qn = n % (BN // 2)
    else:
        qn = n
    q_head = q_ptr + b.to(tl.int64) * stride_qn + (kvh * GROUP + qn) * stride_qh
    dp = tl.arange(0, DP)
    # the scores come out in the exp2 domain: the softmax scale and log2(e) go into the query (qk_scale)
    q0, q1, q2, q3, qnorm = _query_planes(q_head[None, :] + dp[:, None], (qn < GROUP)[None, :], qk_scale, DP, PERK)
    u = tl.arange(0, G2)
    v = tl.arange(0, D2)
    bt = tl.arange(0, BT)

    # ---- this split's record tiles
    S = tl.load(seq_lens_ptr + b)
    sink_lo = sink_start(sink_lens_ptr, b, SINK)
    win_lo = window_start(S, win_lens_ptr, b, G, WIN)
    t_begin, t_stop = split_tiles(records_end(S, DEFER, defer_ptr), S, G, split, num_splits)

    m_i = tl.full([BN], float("-inf"), dtype=tl.float32)
    l_part = tl.zeros([G2, BN], dtype=tl.float32)  # the softmax denominator per token-pair row, summed at the end
    acc_e = tl.zeros([D2, BN], dtype=tl.float32)  # o^T of the even / odd channels, rotated basis
    acc_o = tl.zeros([D2, BN], dtype=tl.float32)

    c32 = cache16_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for t in tl.range(t_begin, t_stop, num_stages=STAGES):
        # ---- every load of the tile, issued together (each one an async copy under the pipeliner); the
        # per-token / per-channel fp16 runs as int32 pairs, already split into even and odd rows
        blk = tl.load(bt_row + t).to(tl.int64)
        rec16 = cache16_ptr + blk * stride_cb16 + kvh * stride_ch16
        rec32 = c32 + blk * (stride_cb16 // 2) + kvh * (stride_ch16 // 2)
        pk = tl.load(rec16 + OFF_PK // 2 + dp[None, :] * G2 + u[:, None])  # key bytes as [G/2, DP] int16
        pv = tl.load(rec16 + OFF_PV // 2 + bt[None, :] * D2 + v[:, None])  # value bytes as [D/2, BT] int16
        sk0, sk1, sk2, sk3, zk0, zk1, zk2, zk3 = _key_scales(rec16, DP, PERK, OFF_SK, OFF_ZK)
        rk_e, rk_o = _fp16_pairs(tl.load(rec32 + OFF_RK // 4 + u))
        sv_e, sv_o = _fp16_pairs(tl.load(rec32 + OFF_SV // 4 + u))
        zv_e, zv_o = _fp16_pairs(tl.load(rec32 + OFF_ZV // 4 + u))
        cv_e, cv_o = _fp16_pairs(tl.load(rec32 + OFF_CV // 4 + v))

        # ---- scores^T [G/2, BN] of the even / odd tokens (exp2 domain: the scale and log2(e) are in the planes)
        pk = pk.to(tl.int16, bitcast=True)
        zq = q0 * zk0.to(tl.float32)[:, None] + q1 * zk1.to(tl.float32)[:, None]
        if PERK == 4:
            zq += q2 * zk2.to(tl.float32)[:, None] + q3 * zk3.to(tl.float32)[:, None]
        qz = tl.sum(zq, axis=0)  # q . zK: a per-column constant of the tile
        s_e = tl.zeros([G2, BN], dtype=tl.float32)
        s_o = tl.zeros([G2, BN], dtype=tl.float32)
        s_e, s_o = _key_dots(pk, 0, q0, sk0, s_e, s_o, KB, KSPLIT, COMPILED)
        s_e, s_o = _key_dots(pk, 1, q1, sk1, s_e, s_o, KB, KSPLIT, COMPILED)
        if PERK == 4:
            s_e, s_o = _key_dots(pk, 2, q2, sk2, s_e, s_o, KB, KSPLIT, COMPILED)
            s_e, s_o = _key_dots(pk, 3, q3, sk3, s_e, s_o, KB, KSPLIT, COMPILED)
        if KSPLIT == 3:
            s_e = _fold_halves(s_e, COMPILED)
            s_o = _fold_halves(s_o, COMPILED)
        s_e = (s_e + qz[None, :]) * (rk_e * qnorm)[:, None]
        s_o = (s_o + qz[None, :]) * (rk_o * qnorm)[:, None]
        if SINK > 0:  # positions below sink_lo and in [win_lo, win_lo + WIN) are the tail programs' (16-bit rows)
            pos_e = t * G + 2 * u
            keep_e = pos_e >= sink_lo
            keep_o = pos_e + 1 >= sink_lo
            if WIN > 0:
                keep_e = keep_e & ((pos_e < win_lo) | (pos_e >= win_lo + WIN))
                keep_o = keep_o & ((pos_e + 1 < win_lo) | (pos_e + 1 >= win_lo + WIN))
            s_e = tl.where(keep_e[:, None], s_e, float("-inf"))
            s_o = tl.where(keep_o[:, None], s_o, float("-inf"))

        # ---- online softmax per query column, one rescale per tile
        m_new = tl.maximum(m_i, tl.max(tl.maximum(s_e, s_o), axis=0))
        alpha = tl.exp2(m_i - m_new)
        p_e = tl.exp2(s_e - m_new[None, :])
        p_o = tl.exp2(s_o - m_new[None, :])
        l_part = l_part * alpha[None, :] + (p_e + p_o)
        m_i = m_new

        # ---- values: o^T [D/2, BN] of the even / odd channels (pz before ps: the order that compiles best)
        pz = tl.sum(p_e * zv_e[:, None] + p_o * zv_o[:, None], axis=0)  # p . zV: a per-column constant
        ps_e = p_e * sv_e[:, None]
        ps_o = p_o * sv_o[:, None]
        ps = tl.reshape(tl.permute(tl.join(ps_e, ps_o), (0, 2, 1)), [G, BN])  # tokens back in order
        o_e, o_o = _value_dots(pv.to(tl.int16, bitcast=True), ps, D2, BT, BN, VB, COMPILED)
        acc_e = acc_e * alpha[None, :] + (o_e + pz[None, :]) * cv_e[:, None]
        acc_o = acc_o * alpha[None, :] + (o_o + pz[None, :]) * cv_o[:, None]

    # ---- the partial: o / l of every stored column, even / odd channels interleaved back, and its statistics
    inv_l, lse = partial_stats(m_i, tl.sum(l_part, axis=0))
    dst = po_r_ptr + (row * num_splits + split)[None, :] * D + 2 * v[:, None]
    tl.store(dst, acc_e * inv_l[None, :], mask=col_ok[None, :])
    tl.store(dst + 1, acc_o * inv_l[None, :], mask=col_ok[None, :])
    tl.store(plse_ptr + row * (num_splits + 1) + split, lse, mask=col_ok)


# ------------------------------------------------------------------------------------------------ host


def group_geometry(hq: int, hk: int) -> tuple[int, int]:
    """(GQA group, the group padded to a power of two)."""
    if hq % hk:
        raise KvarnError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    group = hq // hk
    return group, next_pow2(group)


def key_split(group: int) -> int:
    """The records kernel's KSPLIT: 3 (q * sK's hi and lo in the two column halves of one N = 8 key operand: half
    the key MMAs) where the group fits in half the columns, else 2 (hi and lo in two MMAs)."""
    return 3 if 2 * group <= MMA_N else 2


# programs per SM of the compiled records kernel per (record layout, padded group), noted at its first launch;
# until then (and off CUDA) the split count assumes 4
_PROGRAMS_PER_SM: dict[tuple, int] = {}


def default_num_splits(batch: int, kv_heads: int, max_blocks: int, device: torch.device, per_sm: int = 4) -> int:
    """Splits per (request, KV head) from wave quantization: of the split counts 1 .. 64 (>= 4 tiles per split), the
    smallest whose programs fill their last wave of resident slots (per_sm x SMs) to >= 95% of the best fill (a
    last wave half empty costs as much as a full one; more splits than needed add merge work). Host-only."""
    sms = sm_count(device.index or 0) if device.type == "cuda" else 4
    return _wave_fill_splits(max(1, batch * kv_heads), max(1, per_sm) * sms, int(max(1, min(64, max_blocks // 4))))


@functools.lru_cache(maxsize=4096)  # host work of every eager decode launch (a mixed step: once per layer)
def _wave_fill_splits(programs: int, slots: int, cap: int) -> int:
    fill = {s: (programs * s / slots) / math.ceil(programs * s / slots) for s in range(1, cap + 1)}
    best = max(fill.values())
    return next(s for s, f in fill.items() if f >= 0.95 * best)


def prepare_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   tail_k: torch.Tensor, tail_v: torch.Tensor, tail_slots: torch.Tensor, fmt: KVFormat | str,
                   scale: float, num_splits: int | None = None, *, out: torch.Tensor,
                   sink_lens: torch.Tensor | None = None, win_lens: torch.Tensor | None = None, defer=False):
    """decode_attention checked and prepared: returns launch(q, cache, tail_k, tail_v, out), the attention of these
    rows (block table, lengths, slots as given here) for tensors of the shapes, strides and dtypes given here (every
    layer of a step: the checks, the split count and the workspaces once; its launches run in stream order, so
    one workspace serves them all)."""
    if q.dim() != 3:
        raise KvarnError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    fmt = as_format(fmt)
    lay = layout(fmt, D)
    check_cache(cache, lay)
    Hk = cache.shape[1]
    group, gp = group_geometry(Hq, Hk)
    sink = check_tail(tail_k, tail_v, Hk, lay.g, D, fmt.window_tokens)
    win = fmt.window_tokens if sink else 0  # tails without sink rows have no window rows either
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise KvarnError(f"block_table must be [B={B}, max_blocks], got {tuple(block_table.shape)}")
    if out.shape != q.shape:
        raise KvarnError(f"out must be [B, Hq, D] = {tuple(q.shape)}, got {tuple(out.shape)}")
    if B == 0:
        return no_launch
    copy_q = q.stride(-1) != 1  # the kernel reads a query row as one vector
    if copy_q:
        q = q.contiguous()
    dev = q.device
    splits = int(max(1, num_splits)) if num_splits is not None else default_num_splits(
        B, Hk, block_table.shape[1], dev, _PROGRAMS_PER_SM.get((lay, gp), 4))
    if sink_lens is None:  # every row's sink rows hold its own first tokens
        sink_lens = torch.full((B,), sink, dtype=torch.int32, device=dev) if sink else seq_lens
    if win_lens is None:  # every row's window rows hold its own tile's (as sink_lens above)
        win_lens = torch.full((B,), win, dtype=torch.int32, device=dev) if win else seq_lens
    flag = defer_flag(defer, dev, "query")
    if flag is True:  # deferred on every call: a per-call flag (the backend passes its persistent one)
        flag = torch.ones(1, dtype=torch.int32, device=dev)
    defer_ptr, DEFER = (seq_lens, 0) if flag is None else (flag, 1)  # without deferral the pointer is never read

    comp = compiled()
    pdl = {"PDL": 1, "launch_pdl": True} if pdl_supported(dev) else {"PDL": 0}
    R = B * Hq
    qk = float(scale) * LOG2E
    po_r = torch.empty(R * splits * D, dtype=torch.float32, device=dev)
    po_t = torch.empty(R * D, dtype=torch.float32, device=dev)
    plse = torch.empty(R * (splits + 1), dtype=torch.float32, device=dev)
    # the tail on tensor cores where compiled and the buffers are 16-bit; TT rows per step, TS over the sink's rows
    tensor_cores = bool(comp) and all(t.dtype in (torch.float16, torch.bfloat16) for t in (tail_k, tail_v))
    tt = (64 if D <= 128 else 32) if tensor_cores else 16
    rows_grid = (cdiv(R, 16),)
    records_grid = (B, Hk * (splits + 1))
    records_kw = dict(
        GROUP=group, BN=max(MMA_N, gp), G=lay.g, D=D, KB=lay.kb, VB=lay.vb, **lay.offsets(),
        KSPLIT=key_split(group), STAGES=RECORD_STAGES, SINK=sink, DEFER=DEFER,
        TBM=max(16, gp), TT=tt, TS=min(tt, max(16, next_pow2(max(1, sink)))),
        TENSOR_CORES=tensor_cores, Q_AS_TAIL=q.dtype == tail_k.dtype, COMPILED=comp,
        WIN=win, TW=min(tt, max(16, next_pow2(max(1, win)))),
        num_warps=RECORD_WARPS, num_stages=RECORD_STAGES, **pdl)
    merge_kw = dict(HQ=Hq, D=D, BR=16, COMPILED=comp, num_warps=ROT_WARPS, **pdl)
    sq, so = q.stride(), out.stride()
    tks, tvs = tail_k.stride()[:3], tail_v.stride()[:3]
    cs, bts = (cache.stride(0) // 2, cache.stride(1) // 2), block_table.stride(0)
    noted = (lay, gp) in _PROGRAMS_PER_SM or dev.type != "cuda"

    def launch(q, cache, tail_k, tail_v, out):
        nonlocal noted
        if copy_q:
            q = q.contiguous()
        records = records_kernel[records_grid](
            q, f16_view(cache), block_table, seq_lens, sink_lens, win_lens, defer_ptr, po_r, plse,
            splits, bts, *cs, Hq, qk, sq[0], sq[1], tail_k, tail_v, tail_slots, po_t, *tks, *tvs, **records_kw)
        merge_kernel[rows_grid](po_r, po_t, plse, out, R, splits, so[0], so[1], **merge_kw)
        if not noted:
            per_sm = programs_per_sm(records, dev)
            if per_sm:
                _PROGRAMS_PER_SM[(lay, gp)] = per_sm
            noted = True

    return launch


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     tail_k: torch.Tensor, tail_v: torch.Tensor, tail_slots: torch.Tensor, fmt: KVFormat | str,
                     scale: float, num_splits: int | None = None, out: torch.Tensor | None = None, *,
                     sink_lens: torch.Tensor | None = None, win_lens: torch.Tensor | None = None,
                     defer=False) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(q)
    prepare_decode(q, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, fmt, scale, num_splits, out=out,
                   sink_lens=sink_lens, win_lens=win_lens, defer=defer)(q, cache, tail_k, tail_v, out)
    return out
