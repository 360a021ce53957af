"""The two pieces of a decode call around the record tiles: the attention over the 16-bit tail buffer (run by
extra programs of the records launch, kvarn.kernels.decode) and the merge of every partial into the output.

Split-K bookkeeping shared by both: each program writes a partial output o / l and its log2-sum-exp; the record
splits write po_r [R * num_splits, D] in the rotated basis, the tail writes po_t [R, D] in the original basis, and
plse [R, num_splits + 1] holds the statistics (the tail's in the last column). The merge weighs them and rotates the
record part back once: out = (sum_s w_s o_s) @ Hn + w_t o_t.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .device import hadamard_pm1, pdl_sync, records_end, sink_start, window_start, x_times_h
from .runtime import serving_jit


@triton.jit
def _tail_run(qa, qb, tk_base, tv_base, stride_tkg, stride_tvg, n, pos0, L, m_i, l_i, acc, qk_scale,
              D: tl.constexpr, TT: tl.constexpr, TENSOR_CORES: tl.constexpr, Q_AS_TAIL: tl.constexpr):
    """Online softmax of the rows over n consecutive buffer rows holding positions pos0, pos0 + 1, ... (visible
    where pos < L). TENSOR_CORES (compiled, 16-bit tail): 16-bit dots with fp32 accumulation, the scores from q in
    the tail's dtype (or its hi + lo in it, Q_AS_TAIL false: exact products), p @ v as p_hi @ v + p_lo @ v
    (~1e-6 relative). Otherwise fp32 ieee dots with the scale already in qa."""
    di = tl.arange(0, D)
    ti = tl.arange(0, TT)
    # not pipelined: the records kernel's num_stages would give these [TT, D] tiles as many shared-memory buffers
    for c0 in tl.range(0, n, TT, num_stages=1):
        tmask = (c0 + ti) < n
        if TENSOR_CORES:
            tk = tl.load(tk_base + (c0 + ti)[:, None] * stride_tkg + di[None, :], mask=tmask[:, None], other=0.0)
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
        tv = tl.load(tv_base + (c0 + ti)[:, None] * stride_tvg + di[None, :], mask=tmask[:, None], other=0.0)
        acc = acc * alpha[:, None]
        if TENSOR_CORES:
            vdt = tv_base.dtype.element_ty
            p_hi = p.to(vdt)
            p_lo = (p - p_hi.to(tl.float32)).to(vdt)
            acc = tl.dot(p_hi, tv, acc, out_dtype=tl.float32)
            acc = tl.dot(p_lo, tv, acc, out_dtype=tl.float32)
        else:
            acc += tl.dot(p, tv.to(tl.float32), input_precision="ieee")
    return m_i, l_i, acc


@triton.jit
def tail_partial(b, kvh, q_ptr, seq_lens_ptr, tail_k_ptr, tail_v_ptr, tail_slots_ptr, sink_lens_ptr, win_lens_ptr,
                 defer_ptr,
                 po_t_ptr, plse_ptr, qk_scale, num_splits,
                 stride_qn, stride_qh, stride_tks, stride_tkh, stride_tkg, stride_tvs, stride_tvh, stride_tvg, HQ,
                 GROUP: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, D: tl.constexpr, TT: tl.constexpr,
                 TS: tl.constexpr, TENSOR_CORES: tl.constexpr, Q_AS_TAIL: tl.constexpr, SINK: tl.constexpr,
                 DEFER: tl.constexpr, WIN: tl.constexpr = 0, TW: tl.constexpr = 16):
    """Decode attention of request b's GROUP query heads of KV head kvh (BM >= 16 rows, padded) over its 16-bit
    rows: the unfinished tile (tail rows [0, S - n_full * G)) and, once the first tile is in the records, the sink
    rows [G, G + sink_lens[b]) holding positions 0 .. sink_lens[b] - 1 and the window rows of the tile before the
    newest position's (kvarn.kernels.device.window_start), which the record programs then skip.
    Writes po_t and the last plse column. TS / TW: rows per step over the sink's (<= SINK) / the window's rows."""
    S = tl.load(seq_lens_ptr + b)
    m = tl.arange(0, BM)
    row_ok = m < GROUP
    L = tl.where(row_ok, S, 0)  # a decode query sees every position; padding rows (seq_len 0) see nothing
    di = tl.arange(0, D)
    head = kvh * GROUP + m
    row = b.to(tl.int64) * HQ + head
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    n_full = records_end(S, DEFER, defer_ptr) // G
    n_tail = S - n_full * G  # up to G rows with DEFER (the tile completed this step, not flushed yet)
    n_sink = tl.where(n_full > 0, sink_start(sink_lens_ptr, b, SINK), 0)
    win_lo = window_start(S, win_lens_ptr, b, G, WIN)
    n_win = tl.where(win_lo >= 0, WIN, 0)
    if (n_tail > 0) | (n_sink > 0) | (n_win > 0):
        q_raw = tl.load(q_ptr + b.to(tl.int64) * stride_qn + head[:, None] * stride_qh + di[None, :],
                        mask=row_ok[:, None], other=0.0)
        slot = tl.load(tail_slots_ptr + b).to(tl.int64)
        tk_base = tail_k_ptr + slot * stride_tks + kvh * stride_tkh
        tv_base = tail_v_ptr + slot * stride_tvs + kvh * stride_tvh
        if TENSOR_CORES:
            kdt = tail_k_ptr.dtype.element_ty
            q32 = q_raw.to(tl.float32)
            qa = q32.to(kdt)
            qb = (q32 - qa.to(tl.float32)).to(kdt)
        else:
            qa = q_raw.to(tl.float32) * qk_scale
            qb = qa
        if SINK > 0:
            m_i, l_i, acc = _tail_run(qa, qb, tk_base + G * stride_tkg, tv_base + G * stride_tvg, stride_tkg,
                                      stride_tvg, n_sink, 0, L, m_i, l_i, acc, qk_scale, D, TS, TENSOR_CORES,
                                      Q_AS_TAIL)
        if WIN > 0:  # the window half of the tile's parity: rows G + SINK + (tile % 2) * WIN ..
            w_row = G + SINK + ((tl.maximum(win_lo, 0) // G) % 2) * WIN
            m_i, l_i, acc = _tail_run(qa, qb, tk_base + w_row * stride_tkg, tv_base + w_row * stride_tvg,
                                      stride_tkg, stride_tvg, n_win, win_lo, L, m_i, l_i, acc, qk_scale, D, TW,
                                      TENSOR_CORES, Q_AS_TAIL)
        m_i, l_i, acc = _tail_run(qa, qb, tk_base, tv_base, stride_tkg, stride_tvg, n_tail, n_full * G, L,
                                  m_i, l_i, acc, qk_scale, D, TT, TENSOR_CORES, Q_AS_TAIL)
    has = l_i > 0.0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(po_t_ptr + row[:, None] * D + di[None, :], acc / tl.where(has, l_i, 1.0)[:, None], mask=row_ok[:, None])
    tl.store(plse_ptr + row * (num_splits + 1) + num_splits, lse, mask=row_ok)


@serving_jit(ints=["R", "num_splits"])
def merge_kernel(po_r_ptr, po_t_ptr, plse_ptr, out_ptr, R, num_splits, stride_on, stride_oh, HQ: tl.constexpr,
                 D: tl.constexpr, BR: tl.constexpr, COMPILED: tl.constexpr, PDL: tl.constexpr = 0):
    """out for BR of the R = B * HQ rows: the record splits' partials weighted by their log2-sum-exp and rotated
    back, plus the tail's; rows that saw nothing give zeros. PDL: the Hadamard is built while the records kernel
    finishes."""
    h = hadamard_pm1(D, COMPILED)
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
    o = x_times_h(acc_r, h, D, COMPILED)
    o += w[:, None] * tl.load(po_t_ptr + r64[:, None] * D + di[None, :], mask=ok[:, None], other=0.0)
    o = o / tl.where(den > 0.0, den, 1.0)[:, None]
    o_off = (r // HQ).to(tl.int64) * stride_on + (r % HQ) * stride_oh
    tl.store(out_ptr + o_off[:, None] + di[None, :], o.to(out_ptr.dtype.element_ty), mask=ok[:, None])
