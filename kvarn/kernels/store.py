"""Quantize-on-write: full 128/64-token tiles -> KVarN records in the paged cache (docs/format.md).

Public API (the vLLM backend codes against these; signatures are stable):

    store_tiles(k, v, cache, block_ids, fmt, iters=None) -> None   (iters None: fmt.balance_iters, 3)
        k, v       [T, H, g, D] fp16/bf16/fp32: T complete tiles per KV head, token rows, NOT rotated
        cache      uint8 [num_blocks, H, record_bytes(D)] (records contiguous)
        block_ids  int32 [T]: the block (record row) each tile goes to; entries < 0 are skipped (padding)
        One program per (tile, head, keys|values): sanitize (NaN -> 0, clamp to the fp16 range), rotate values by Hn,
        balance (Sinkhorn-like, `iters` iterations, best iterate kept), round (keys min-max, values with the range
        search and gain), fold, pack; fp32 math throughout.
        Writes the bytes kvarn.method.reference.quantize_tiles would (codes may differ by one where a value sits
        on a rounding boundary, because of fp32 reduction order / exp ulps; a value row whose two best range
        factors score within that noise of the tie margin may take the other one, a different but equally good
        rounding of that row).

    store_step_tiles(k, v, tail_k, tail_v, cache, block_ids, first, old, slots, fmt, iters=None) -> None
        The tiles a prefill / mixed step completes, read in place: tile t's position j is new token first[t] + j of
        k, v [N, H, D], or, for j < old[t] (written in earlier steps), tail row slots[t] at position j. No gather of
        the tiles before the launch.

    store_decode(k, v, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, fmt, iters=None) -> None
        The whole KV write of a one-token-per-row (decode) step: k, v [B, H, D]; row b's token goes to the tail at
        position (seq_lens[b] - 1) % g of row tail_slots[b]; a tile it completes is quantized from the tail into
        cache[block_table[b, seq_lens[b] // g - 1]]. seq_lens[b] == 0 marks a padded row (skipped). A tail buffer
        [S, H, g + sink + 2W, D] also keeps positions below sink in rows g + pos (the attention sink, 16-bit for good)
        and a tile's last W = fmt.window_tokens positions in rows g + sink + (tile % 2) W + pos - (g - W).

    flush_layers(tails_k, tails_v, caches, slots, block_ids, fmt, iters=None) -> None
        The tiles of several layers in one launch: for every layer l and pending tile i, tail rows [0, g) of slot
        slots[i] in tails_k[l] / tails_v[l] ([S, H, g + sink, D], one per layer, same shape) go to
        caches[l][block_ids[i]] (block_ids[i] < 0: skipped). Layers are reached through a table of their buffers'
        addresses, so one tile x L layers is L x H x 2 programs at once instead of L launches in a row (a single
        flush is latency-bound whatever the number of programs up to one per SM).

All launch a fixed grid from shapes only and never sync with the host, so they can be captured in CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KvarnError
from ..formats import KVFormat
from ..method import reference as ref
from .device import hadamard_pm1_block, rot_scale, x_times_h, x_times_h_acc
from .records import as_format, check_cache, check_tail, defer_flag, f16_view, layout
from .runtime import compiled, no_launch, serving_jit

# the value rows' range search, as the reference defines it
VALUE_CLIP_STEPS = tl.constexpr(ref.CLIP_STEPS)
CLIP_STEP = tl.constexpr(ref.CLIP_STEP)
TIE_TOL = tl.constexpr(ref.TIE_TOL)
GAIN_MIN = tl.constexpr(ref.GAIN_MIN)
GAIN_MAX = tl.constexpr(ref.GAIN_MAX)

@triton.jit
def _round_clamped(x, QMAX: tl.constexpr):
    # torch's x.round().clamp(0, QMAX) (ties to even), clamped first (the same for integer bounds): adding and
    # removing 1.5 * 2^23 leaves the integer nearest x, ties to even, for |x| < 2^22. Two adds on the FMA pipe
    # rather than cvt.rni, whose variable latency stalls the clamp after it; the range search rounds every value
    # tile eleven times, so this is most of its arithmetic. Exact in the interpreter too (numpy fp32 adds); a NaN
    # gives 0 (the clamp's max returns the number).
    MAGIC: tl.constexpr = 12582912.0
    x = tl.minimum(tl.maximum(x, 0.0), QMAX)
    return (x + MAGIC) - MAGIC


@triton.jit
def _to_f16_range(x):
    x = tl.where(x != x, 0.0, x)
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def _var(t, AXIS: tl.constexpr, N: tl.constexpr):
    # population variance along AXIS, two-pass (mean, then squared deviations), unclamped
    mean = tl.sum(t, axis=AXIS) / N
    if AXIS == 0:
        dev = t - mean[None, :]
    else:
        dev = t - mean[:, None]
    return tl.sum(dev * dev, axis=AXIS) / N


@triton.jit
def _keep_best(imb, best, er, best_er, ec, best_ec):
    # the balance factors of the least imbalanced iterate so far; strict: ties keep the earlier one,
    # as the reference
    better = imb < best
    return tl.where(better, imb, best), tl.where(better, er, best_er), tl.where(better, ec, best_ec)


@triton.jit
def _value_range(t, w, QMAX: tl.constexpr, STEPS: tl.constexpr):
    """Per row of the balanced tile t [R, C] (w [C]: squared column factors): the range [a * min, a * max],
    a = 1, 0.95, ... (STEPS factors), whose rounding is best correlated with the row, and the gain that makes the
    rounding's projection on the row exact (kvarn.method.reference._value_range says why)."""
    mn = tl.min(t, axis=1)
    mx = tl.max(t, axis=1)
    best = tl.full(mn.shape, -1.0, dtype=tl.float32)
    lo_b = mn
    hi_b = mx
    ip_b = tl.zeros(mn.shape, dtype=tl.float32)
    # a loop, not unrolled: unrolled, the STEPS passes over the tile spill registers and the flush is ~1.6x slower
    for i in range(STEPS):
        a = 1.0 - CLIP_STEP * i
        lo = mn * a
        hi = mx * a
        sc = (hi - lo) / QMAX
        safe = sc > 1e-12
        inv = tl.where(safe, 1.0 / tl.where(safe, sc, 1.0), 0.0)
        q = _round_clamped((t - lo[:, None]) * inv[:, None], QMAX)
        xh = q * sc[:, None] + lo[:, None]
        xw = xh * w[None, :]
        ip = tl.sum(xw * t, axis=1)
        nh = tl.sum(xw * xh, axis=1)
        ok = (ip > 0) & (nh > 0)
        score = tl.where(ok, ip * ip / tl.where(ok, nh, 1.0), 0.0)
        better = score > best * (1.0 + TIE_TOL)  # near-ties keep the wider range, as the reference
        best = tl.where(better, score, best)
        lo_b = tl.where(better, lo, lo_b)
        hi_b = tl.where(better, hi, hi_b)
        ip_b = tl.where(better, ip, ip_b)
    nt = tl.sum(t * w[None, :] * t, axis=1)  # the reference's order, (w t) t
    gain = tl.where(ip_b > 0, nt / tl.where(ip_b > 0, ip_b, 1.0), 1.0)
    return lo_b, hi_b, tl.minimum(tl.maximum(gain, GAIN_MIN), GAIN_MAX)


@triton.jit
def _codes(x, ec, er, mn, mx, gain, BITS: tl.constexpr, SEARCH: tl.constexpr):
    """Round x [R, C] per row after balancing by the factors ec (columns) and er (rows) into the row ranges
    [mn, mx] of the balanced tile (min-max, or the values' range search); returns codes, and the folded fp16 vectors
    s, z (rows, times the gain where SEARCH) and c (columns). Multiplies by reciprocals where the reference divides
    element-wise (codes may move by one on a rounding boundary, which the contract allows)."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    row = 1.0 / er
    s = _to_f16_range((mx - mn) / QMAX * row)
    z = _to_f16_range(mn * row)
    c = _to_f16_range(1.0 / ec)
    c_safe = tl.where(tl.abs(c) > 1e-12, c, 1.0)
    s_ok = tl.abs(s) > 1e-12
    s_inv = tl.where(s_ok, 1.0 / tl.where(s_ok, s, 1.0), 0.0)  # 0: a constant row gets code 0
    q = (x * (1.0 / c_safe)[None, :] - z[:, None]) * s_inv[:, None]
    q = _round_clamped(q, QMAX)
    if SEARCH > 0:  # the levels scaled, the codes kept
        s = _to_f16_range(s * gain)
        z = _to_f16_range(z * gain)
    return q.to(tl.int32), s, z, c


@triton.jit
def _add2(a, b, c, d):
    return a + c, b + d


@triton.jit
def _maxmin(a0, a1, b0, b1):
    return tl.maximum(a0, b0), tl.minimum(a1, b1)


@triton.jit
def _sum_and_squares(d, COMPILED: tl.constexpr):
    # column sums of d and d * d: one cross-warp reduction of the pair when compiled (the interpreter runs a
    # tuple reduction element by element, ~20x slower: two plain sums there, the same values)
    if COMPILED:
        return tl.reduce((d, d * d), 0, _add2)
    return tl.sum(d, axis=0), tl.sum(d * d, axis=0)


@triton.jit
def _max_min(x, COMPILED: tl.constexpr):
    # max and min of a vector: one 2-operand reduction when compiled (as _sum_and_squares)
    if COMPILED:
        return tl.reduce((x, x), 0, _maxmin)
    return tl.max(x, axis=0), tl.min(x, axis=0)


@triton.jit
def _balance(x, R: tl.constexpr, C: tl.constexpr, ITERS: tl.constexpr, COMPILED: tl.constexpr):
    """x [R, C] fp32 -> the balance factors ec [C], er [R] of the reference's Sinkhorn-like balancing
    (kvarn.method.reference, docs/format.md): ITERS iterations, the least imbalanced iterate kept; x * ec * er is
    the balanced tile that is rounded per row (x ~= (q * s + z) * c, s and z per row, c = 1 / ec per column).

    The reference keeps log-scales lc, lr and updates lc = clip(lc + log(clamp(std)), -0.3, 10); here the balance is
    kept as the factors ec = exp(-lc), er = exp(-lr) (the same iterates in exact arithmetic), so each update is
    ec = clamp(ec * rsqrt(clamp(var, 1e-6, 1e6)), e^-10, e^0.3): one MUFU instead of a log and an exp per column.
    The balancing chain's cross-warp reductions are this kernel's latency, so they are cut to 2 per iteration:
    * the column variance of x * ec * er is ec^2 times that of w = x * er, measured in ONE reduction of the pair
      (sum d, sum d^2), d = w - pm, var = E[d^2] - E[d]^2: pm (a pilot per column) is the exact column mean of w
      from the previous measurement, so d is near zero-mean and the subtraction loses nothing worth the name (a
      column that stays constant gives d == 0 exactly, var 0 as in the two-pass form);
    * the row variance stays two-pass: in the tensor-core (dot output) layout each warp owns whole rows, so it is
      in-thread sums plus 2 quad shuffles, no shared memory and no barrier; after the row update it is not measured
      again (only rows were rescaled: the pre-update variance times (er_new / er)^2);
    * the imbalance compares variances (max/min of sqrt is sqrt of max/min), max and min in one reduction."""
    E_MIN: tl.constexpr = 4.5399929762484854e-05  # exp(-10): lc <= 10
    E_MAX: tl.constexpr = 1.3498588075760032  # exp(0.3): lc >= -0.3
    ec = tl.full([C], 1.0, dtype=tl.float32)
    er = tl.full([R], 1.0, dtype=tl.float32)
    best_ec = ec
    best_er = er
    best = float("inf")
    pm = tl.sum(x, axis=0) / R  # exact two-pass start (also the first pilot)
    d0 = x - pm[None, :]
    vc = tl.minimum(tl.maximum(tl.sum(d0 * d0, axis=0) / R, 1e-6), 1e6)
    for _ in range(ITERS):
        ec = tl.minimum(tl.maximum(ec * tl.rsqrt(vc), E_MIN), E_MAX)
        u = x * ec[None, :]
        vr = tl.minimum(tl.maximum(_var(u * er[:, None], 1, C), 1e-6), 1e6)
        er_new = tl.minimum(tl.maximum(er * tl.rsqrt(vr), E_MIN), E_MAX)
        f = er_new / er
        vr = tl.minimum(tl.maximum(vr * f * f, 1e-6), 1e6)
        er = er_new
        d = x * er[:, None] - pm[None, :]
        sd, sq = _sum_and_squares(d, COMPILED)
        md = sd / R
        pm = pm + md
        vc = tl.minimum(tl.maximum(ec * ec * tl.maximum(sq / R - md * md, 0.0), 1e-6), 1e6)
        cmax, cmin = _max_min(vc, COMPILED)  # column vectors are whole in every warp: warp-local
        rmax, rmin = _max_min(vr, COMPILED)  # rows span the warps: one exchange for both
        imb = tl.sqrt(cmax / cmin) + tl.sqrt(rmax / rmin)
        best, best_er, best_ec = _keep_best(imb, best, er, best_er, ec, best_ec)
    return best_ec, best_er


@triton.jit
def _pack_store(q, dst_ptr, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr):
    # planar pack along rows: byte[i, c] = sum_j q[i + j*R/PER, c] << (j*BITS)
    PER: tl.constexpr = 8 // BITS
    q3 = tl.reshape(q, [PER, R // PER, C])
    shifts = (tl.arange(0, PER) * BITS)[:, None, None]
    packed = tl.sum(q3 << shifts, axis=0)
    ri = tl.arange(0, R // PER)
    ci = tl.arange(0, C)
    tl.store(dst_ptr + ri[:, None] * C + ci[None, :], packed.to(tl.uint8))


@triton.jit
def _sanitize(x):
    x = tl.where(x != x, 0.0, x)
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0)


@triton.jit
def _load_tokens(tok, tail, old, ci, TOKEN_AXIS: tl.constexpr, MIXED: tl.constexpr):
    """fp32 tokens x channels ci of one head (tokens along TOKEN_AXIS): token j at tok[j] (pointers [G]), or with
    MIXED at tail[j] where j < old. Two masked loads rather than one load through a select of the pointers: each
    keeps the alignment Triton proves for its buffer, so both stay 16-byte vector loads."""
    if TOKEN_AXIS == 1:
        ptr = tok[None, :] + ci[:, None]
    else:
        ptr = tok[:, None] + ci[None, :]
    if MIXED:
        gi = tl.arange(0, tok.shape[0])
        in_tail = (gi[None, :] if TOKEN_AXIS == 1 else gi[:, None]) < old
        tptr = tail[None, :] + ci[:, None] if TOKEN_AXIS == 1 else tail[:, None] + ci[None, :]
        x = tl.where(in_tail, tl.load(tptr, mask=in_tail, other=0.0), tl.load(ptr, mask=~in_tail, other=0.0))
    else:
        x = tl.load(ptr)
    return _sanitize(x.to(tl.float32))


@triton.jit
def _values_rotated(tok, tail, old, D: tl.constexpr, RB: tl.constexpr, COMPILED: tl.constexpr, MIXED: tl.constexpr):
    """Y = V @ Hn [g, D] of one head's value tile (tokens as _load_tokens finds them); RB > 0: accumulated over
    RB-channel blocks of V, Y += V[:, blk] @ H[blk, :] (D = 256: the whole-tile dots would overflow an sm_90's shared
    memory). Deterministic: a second call gives the same bits."""
    if RB == 0:
        vt = _load_tokens(tok, tail, old, tl.arange(0, D), 0, MIXED)
        y = x_times_h(vt, hadamard_pm1_block(D, D, 0, 0, COMPILED), D, COMPILED)
    else:
        acc = tl.zeros([tok.shape[0], D], dtype=tl.float32)
        for kb in range(0, D, RB):
            vt = _load_tokens(tok, tail, old, kb + tl.arange(0, RB), 0, MIXED)
            acc = x_times_h_acc(vt, hadamard_pm1_block(RB, D, kb, 0, COMPILED), acc, COMPILED)
        y = rot_scale(acc, D)
    return y


@triton.jit
def _pack_vectors(q, dst, s, z, c, dst16, OFF_S: tl.constexpr, OFF_Z: tl.constexpr, OFF_C: tl.constexpr,
                  R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr):
    # one matrix's codes packed at dst, its row scale, row zero and column scale (fp16) at dst16 + OFF_* / 2
    _pack_store(q, dst, R, C, BITS)
    tl.store(dst16 + OFF_S // 2 + tl.arange(0, R), s.to(tl.float16))
    tl.store(dst16 + OFF_Z // 2 + tl.arange(0, R), z.to(tl.float16))
    tl.store(dst16 + OFF_C // 2 + tl.arange(0, C), c.to(tl.float16))


# which half of a tile a store program quantizes
BOTH = tl.constexpr(0)  # program_id(1) says: one launch of both halves (a decode step's store, the layers' flush)
KEYS = tl.constexpr(1)
VALUES = tl.constexpr(2)


@triton.jit
def _store_keys(tok, tail, old, dst, dst16, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr,
                ITERS: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
                COMPILED: tl.constexpr, MIXED: tl.constexpr):
    # K^T [D, g], rows = channels, in the original basis: per-channel rounding already gives every channel its own
    # range, and a rotation would spread the RoPE'd key biases over all of them. Min-max rounding per row.
    di = tl.arange(0, D)
    x = _load_tokens(tok, tail, old, di, 1, MIXED)
    ec, er = _balance(x, D, G, ITERS, COMPILED)
    t = x * ec[None, :] * er[:, None]
    mn = tl.min(t, axis=1)
    mx = tl.max(t, axis=1)
    x = _load_tokens(tok, tail, old, di, 1, MIXED)  # again (see _store_one)
    q, s, z, c = _codes(x, ec, er, mn, mx, 1.0, KB, 0)
    _pack_vectors(q, dst, s, z, c, dst16, OFF_SK, OFF_ZK, OFF_RK, D, G, KB)


@triton.jit
def _store_values(tok, tail, old, dst, dst16, G: tl.constexpr, D: tl.constexpr, VB: tl.constexpr,
                  ITERS: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
                  COMPILED: tl.constexpr, RB: tl.constexpr, MIXED: tl.constexpr):
    # Y = V @ Hn [g, D], rows = tokens; the range search and gain per row
    y = _values_rotated(tok, tail, old, D, RB, COMPILED, MIXED)
    ec, er = _balance(y, G, D, ITERS, COMPILED)
    col = 1.0 / ec
    mn, mx, gain = _value_range(y * ec[None, :] * er[:, None], col * col, (1 << VB) - 1, VALUE_CLIP_STEPS)
    y = _values_rotated(tok, tail, old, D, RB, COMPILED, MIXED)  # again (see _store_one)
    q, s, z, c = _codes(y, ec, er, mn, mx, gain, VB, VALUE_CLIP_STEPS)
    _pack_vectors(q, dst, s, z, c, dst16, OFF_SV, OFF_ZV, OFF_CV, G, D, VB)


@triton.jit
def _store_one(ktok, vtok, ktail, vtail, old, cache_ptr, cache16_ptr, blk, head, stride_cb, stride_ch,
               G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
               OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
               OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
               COMPILED: tl.constexpr, RB: tl.constexpr, MIXED: tl.constexpr, PART: tl.constexpr):
    """One (tile, head): its keys or its values (PART: KEYS, VALUES, or BOTH: keys when program_id(1) == 0, else
    values), into record row `blk`. ktok / vtok [G]: where token j's D channels of this head start in K / V; with
    MIXED, positions j < old are at ktail / vtail[j] instead (the tail rows of a tile begun in earlier steps).
    Sanitize (NaN -> 0, clamp to the fp16 range), rotate the values by Hn, balance and round, pack, store the
    vectors.

    Each half balances and ranges its tile, then rounds a second load of it (the values a second rotation), which
    gives the same bits: the compiler may keep the first tile or load it again, whichever needs fewer registers
    (Triton 3.6 keeps it at D <= 128 and rotates twice at D = 256, where the rotation is blocked). The halves are
    functions of their own: under BOTH the branch is taken at run time, and Triton would merge the locals of the
    two branches, whose shapes differ unless D == g."""
    base = blk.to(tl.int64) * stride_cb + head * stride_ch  # byte offset of the record
    if PART == KEYS or (PART == BOTH and tl.program_id(1) == 0):
        _store_keys(ktok, ktail, old, cache_ptr + base + OFF_PK, cache16_ptr + base // 2, G, D, KB, ITERS, OFF_SK,
                    OFF_ZK, OFF_RK, COMPILED, MIXED)
    else:
        _store_values(vtok, vtail, old, cache_ptr + base + OFF_PV, cache16_ptr + base // 2, G, D, VB, ITERS, OFF_SV,
                      OFF_ZV, OFF_CV, COMPILED, RB, MIXED)


# where _store_tiles_kernel finds a tile's tokens
TILES = tl.constexpr(0)  # k / v [T, H, g, D]: tile t is k[t]
STEP = tl.constexpr(1)  # the step's new tokens [N, H, D] and the tail: positions < old[t] from tail row slot[t]
DECODE = tl.constexpr(2)  # the tail alone: row src_rows[b] when batch row b's new token completes its tile


@serving_jit(ints=["n_rows", "stride_bt"],
             index_ptrs=["block_ids_ptr", "first_ptr", "old_ptr", "src_rows_ptr", "seq_lens_ptr", "bt_ptr",
                         "defer_ptr"])
def _store_tiles_kernel(
    k_ptr, v_ptr, tk_ptr, tv_ptr, cache_ptr, cache16_ptr, block_ids_ptr, first_ptr, old_ptr, src_rows_ptr,
    seq_lens_ptr, bt_ptr, defer_ptr,
    stride_kt, stride_kh, stride_kg, stride_vt, stride_vh, stride_vg,
    stride_ts, stride_th, stride_tg, stride_us, stride_uh, stride_ug,
    stride_cb, stride_ch, stride_bt, n_rows,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    COMPILED: tl.constexpr, SOURCE: tl.constexpr, RB: tl.constexpr, DEFER: tl.constexpr = 0,
    PART: tl.constexpr = 0,
):
    """Grid (tiles * H, 2) with PART == BOTH: program (tile, head, keys | values), axis 1 putting the keys' and the
    values' balancing chains (the kernel's latency) on different SMs; (tiles * H, 1) with PART == KEYS or VALUES,
    one launch per half, each at its own warp count. Token j of tile t is read from k at
    first * stride_kt + j * stride_kg (+ head * stride_kh), where SOURCE says what `first` is:
    TILES: t (k is [T, H, g, D]); STEP: first_ptr[t], a token index of the step's new tokens (k is [N, H, D],
    stride_kt == stride_kg), except positions j < old_ptr[t], which the request wrote in earlier steps: those are
    tail row src_rows[t] (tk, position j); DECODE: tile = batch row b of a one-token-per-row step, complete iff
    seq_lens[b] is a positive multiple of G, its tokens tail row src_rows[b] (k is the tail), its block from the
    block table: everything derived on the device, so the launch is the same every step (CUDA-graph safe). DEFER:
    the step's flag defer_ptr[0] set means the completed tiles stay in the tail (flush_layers writes them later);
    device data, so one captured graph serves steps with and without it.
    RB > 0: the values' rotation accumulates over RB-channel blocks (D = 256: the whole-tile dots would overflow an
    sm_90's shared memory)."""
    pid = tl.program_id(0)
    tile = pid // H
    head = pid % H
    if SOURCE == DECODE:
        s = tl.load(seq_lens_ptr + tile)
        full = (s > 0) & (s % G == 0)
        if DEFER:
            full = full & (tl.load(defer_ptr) == 0)
        blk = tl.load(bt_ptr + tile.to(tl.int64) * stride_bt + tl.maximum(s // G - 1, 0), mask=full, other=-1)
        first = tl.load(src_rows_ptr + tile, mask=full, other=0).to(tl.int64)
    elif SOURCE == STEP:
        blk = tl.load(block_ids_ptr + tile)
        first = tl.load(first_ptr + tile).to(tl.int64)
    else:
        blk = tl.load(block_ids_ptr + tile)
        first = tile.to(tl.int64)
    if blk >= 0:
        gi = tl.arange(0, G)
        # int64 before the multiply: first * stride can pass 2^31 in a large step or cache
        ktok = k_ptr + first * stride_kt + head * stride_kh + gi.to(tl.int64) * stride_kg
        vtok = v_ptr + first * stride_vt + head * stride_vh + gi.to(tl.int64) * stride_vg
        if SOURCE == STEP:
            # positions before old: tail row `slot` (where first is negative, those lanes of ktok are never read)
            old = tl.load(old_ptr + tile)
            slot = tl.load(src_rows_ptr + tile).to(tl.int64)
            ktail = tk_ptr + slot * stride_ts + head * stride_th + gi * stride_tg
            vtail = tv_ptr + slot * stride_us + head * stride_uh + gi * stride_ug
        else:
            old = 0
            ktail = ktok
            vtail = vtok
        _store_one(ktok, vtok, ktail, vtail, old, cache_ptr, cache16_ptr, blk, head, stride_cb, stride_ch, G, D, KB,
                   VB, ITERS, OFF_PK, OFF_SK, OFF_ZK, OFF_RK, OFF_PV, OFF_SV, OFF_ZV, OFF_CV, COMPILED, RB,
                   SOURCE == STEP, PART)


@serving_jit(ints=["n_tiles"], index_ptrs=["slots_ptr", "blk_ptr"])
def _flush_layers_kernel(
    ktab_ptr, vtab_ptr, ctab_ptr, slots_ptr, blk_ptr, n_tiles,
    stride_kt, stride_kh, stride_kg, stride_vt, stride_vh, stride_vg, stride_cb, stride_ch,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
    OFF_PK: tl.constexpr, OFF_SK: tl.constexpr, OFF_ZK: tl.constexpr, OFF_RK: tl.constexpr,
    OFF_PV: tl.constexpr, OFF_SV: tl.constexpr, OFF_ZV: tl.constexpr, OFF_CV: tl.constexpr,
    COMPILED: tl.constexpr, RB: tl.constexpr, TAIL_DT: tl.constexpr,
):
    # grid (L * n_tiles * H, 2): program (layer, tile, head) quantizes keys (axis 1 == 0) or values of one pending
    # tile of one layer; the layer's tail and cache addresses come from the tables (int64, one entry per layer).
    pid = tl.program_id(0)
    head = pid % H
    rest = pid // H
    tile = rest % n_tiles
    layer = rest // n_tiles
    blk = tl.load(blk_ptr + tile)
    if blk >= 0:
        src = tl.load(slots_ptr + tile).to(tl.int64)
        ka = tl.load(ktab_ptr + layer)
        va = tl.load(vtab_ptr + layer)
        ca = tl.load(ctab_ptr + layer)
        if TAIL_DT == 1:
            kp = ka.to(tl.pointer_type(tl.bfloat16))
            vp = va.to(tl.pointer_type(tl.bfloat16))
        elif TAIL_DT == 2:
            kp = ka.to(tl.pointer_type(tl.float32))
            vp = va.to(tl.pointer_type(tl.float32))
        else:
            kp = ka.to(tl.pointer_type(tl.float16))
            vp = va.to(tl.pointer_type(tl.float16))
        gi = tl.arange(0, G)
        # one pointer vector per program, K's or V's (the loads are scalar either way: the tables' addresses carry
        # no alignment): fewer spills than holding both through the quantizer
        if tl.program_id(1) == 0:
            tok = kp + src * stride_kt + head * stride_kh + gi * stride_kg
        else:
            tok = vp + src * stride_vt + head * stride_vh + gi * stride_vg
        _store_one(tok, tok, tok, tok, 0, ca.to(tl.pointer_type(tl.uint8)), ca.to(tl.pointer_type(tl.float16)),
                   blk, head, stride_cb, stride_ch, G, D, KB, VB, ITERS, OFF_PK, OFF_SK, OFF_ZK, OFF_RK, OFF_PV,
                   OFF_SV, OFF_ZV, OFF_CV, COMPILED, RB, False, BOTH)


class LayerTable:
    """The device tables of several layers' buffer addresses for flush_layers, built once per set of buffers (the
    backend's caches and tails live for the engine's life; a new set of tensors builds a new table)."""

    def __init__(self, tails_k, tails_v, caches):
        if not (len(tails_k) == len(tails_v) == len(caches)) or not caches:
            raise KvarnError(f"flush_layers needs one tail pair and one cache per layer, got {len(tails_k)}, "
                             f"{len(tails_v)}, {len(caches)}")
        first = (tails_k[0], tails_v[0], caches[0])
        for t in zip(tails_k, tails_v, caches):
            for a, b in zip(t, first):
                if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype or a.device != b.device:
                    raise KvarnError("flush_layers: every layer's tails and cache must have the same shape, strides, "
                                     f"dtype and device; got {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} "
                                     f"{b.dtype}")
        _check_tail_dtypes(tails_k[0], tails_v[0], "flush_layers")
        dev = caches[0].device
        self.k, self.v, self.c = (torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)
                                  for ts in (tails_k, tails_v, caches))
        self.tail, self.cache, self.layers = tails_k[0], caches[0], len(caches)
        self._keep = (list(tails_k), list(tails_v), list(caches))  # the addresses stay valid while the table lives


_TABLES: dict = {}
_TAIL_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # flush_layers' TAIL_DT


def _check_tail_dtypes(tail_k: torch.Tensor, tail_v: torch.Tensor, what: str) -> None:
    """The tails the kernels read: K and V alike, fp16, bf16 or fp32."""
    if tail_k.dtype not in _TAIL_DTYPES or tail_v.dtype != tail_k.dtype:
        raise KvarnError(f"{what}: tails must be fp16, bf16 or fp32 alike, got {tail_k.dtype} and {tail_v.dtype}")


def layer_table(tails_k, tails_v, caches) -> LayerTable:
    """The table of this set of buffers, built once (a set per KV-cache group; the oldest of more than 8 goes)."""
    key = tuple(t.data_ptr() for t in (*tails_k, *tails_v, *caches))
    tab = _TABLES.get(key)
    if tab is None:
        if len(_TABLES) >= 8:
            _TABLES.pop(next(iter(_TABLES)))
        tab = _TABLES[key] = LayerTable(tails_k, tails_v, caches)
    return tab


def flush_layers(tails_k, tails_v, caches, slots: torch.Tensor, block_ids: torch.Tensor, fmt: KVFormat | str,
                 iters: int | None = None) -> None:
    """Quantize tail rows [0, g) of slots[i] of every layer's tail into that layer's cache[block_ids[i]], all layers
    and tiles in one launch (see the module docstring). slots / block_ids int32 [n] on the caches' device."""
    _flush_table(layer_table(tails_k, tails_v, caches), slots, block_ids, fmt, iters)


def _flush_table(tab: LayerTable, slots, block_ids, fmt, iters=None) -> None:
    fmt = as_format(fmt)
    iters = fmt.balance_iters if iters is None else iters
    tk, cache = tab.tail, tab.cache
    if tk.dim() != 4:
        raise KvarnError(f"tail buffers must be [S, H, g + sink, D], got {tuple(tk.shape)}")
    H, D = tk.shape[1], tk.shape[3]
    lay = layout(fmt, D)
    check_cache(cache, lay)
    check_tail(tk, tk, H, lay.g, D, fmt.window_tokens)
    if cache.shape[1] != H:
        raise KvarnError(f"cache has {cache.shape[1]} kv heads, the tails {H}")
    n = block_ids.shape[0]
    if slots.shape != (n,) or slots.dtype != torch.int32 or block_ids.dtype != torch.int32:
        raise KvarnError(f"slots and block_ids must be int32 [n], got {slots.dtype} {tuple(slots.shape)} and "
                         f"{block_ids.dtype} {tuple(block_ids.shape)}")
    if n == 0:
        return
    if tk.stride(-1) != 1:
        raise KvarnError("tail buffers must be contiguous along the head dim")
    _flush_layers_kernel[(tab.layers * n * H, 2)](
        tab.k, tab.v, tab.c, slots, block_ids, n,
        tk.stride(0), tk.stride(1), tk.stride(2), tk.stride(0), tk.stride(1), tk.stride(2),
        cache.stride(0), cache.stride(1),
        **_tile_constexprs(lay, H, D, iters), TAIL_DT=_TAIL_DTYPES[tk.dtype], num_warps=_warps(lay, D, BOTH.value),
    )


def compile_flush_layers(num_kv_heads: int, head_dim: int, tail_rows: int, dtype: torch.dtype, fmt: KVFormat | str,
                         device) -> None:
    """Compile flush_layers for buffers of these shapes now, by one launch on scratch tensors of the same shapes and
    strides (what the launch specialises on). The backend calls it at engine start with the deferred flush on: else
    the compile (seconds) would happen at the first deferred flush of a serving run, stalling every request."""
    fmt = as_format(fmt)
    tk = torch.zeros(1, num_kv_heads, tail_rows, head_dim, dtype=dtype, device=device)
    tv = torch.zeros_like(tk)
    cache = torch.zeros(1, num_kv_heads, fmt.record_bytes(head_dim), dtype=torch.uint8, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    _flush_table(LayerTable([tk], [tv], [cache]), zero, zero, fmt)  # not through _TABLES: the real sets stay cached


# Channel block of the values' blocked rotation per head dim (0 = whole-tile rotation). D=256 needs it on sm_90 (the
# whole-tile form asks for 448 KiB of shared memory); tests may override it to run the blocked path at small D.
ROTATION_BLOCK = {64: 0, 128: 0, 256: 64}


def _prepare_store(k, v, cache, lay, n_tiles, H, iters, source, *, block_ids=None, first=None, old=None,
                   tails=None, src_rows=None, seq_lens=None, block_table=None, defer_flag=None, parts=None):
    """_store_tiles_kernel over n_tiles tiles (its docstring says what each SOURCE reads), prepared: returns
    launch(k, v, tail_k, tail_v, cache), the launches for tensors of the shapes, strides and dtypes given here
    (another layer's in one step; the index tensors stay). k, v: the tiles [T, H, g, D] (TILES), the step's new
    tokens [N, H, D] (STEP) or the tails (DECODE); tails: (tail_k, tail_v) in STEP mode, else (k, v); the index
    tensors of the mode (the others get a placeholder pointer: never read). parts: the launches, (PART, warps) each
    in turn; None: _launch_parts."""
    decode = source == DECODE.value
    some = seq_lens if decode else block_ids
    tk, tv = tails if tails is not None else (k, v)
    ks, vs = k.stride(), v.stride()
    if source == STEP.value:  # token rows: a tile's positions are consecutive tokens
        sk, sv = (ks[0], ks[1], ks[0]), (vs[0], vs[1], vs[0])
    else:
        sk, sv = ks[:3], vs[:3]
    # every argument after the buffers, built once: a prefill step stores every layer, and its host time is what
    # the GPU waits for
    rest = (some if block_ids is None else block_ids, some if first is None else first, some if old is None else old,
            some if src_rows is None else src_rows, some if seq_lens is None else seq_lens,
            some if block_table is None else block_table, some if defer_flag is None else defer_flag,
            *sk, *sv, *tk.stride()[:3], *tv.stride()[:3], *cache.stride()[:2],
            block_table.stride(0) if decode else 0, n_tiles)
    const = _tile_constexprs(lay, H, k.shape[-1], iters)
    launches = [((n_tiles * H, 2 if part == BOTH.value else 1),
                 dict(const, SOURCE=source, DEFER=int(defer_flag is not None), PART=part, num_warps=warps))
                for part, warps in (_launch_parts(source, lay, k.shape[-1]) if parts is None else parts)]

    def launch(k, v, tk, tv, cache):
        for grid, kw in launches:
            _store_tiles_kernel[grid](k, v, tk, tv, cache, f16_view(cache), *rest, **kw)

    return launch


def _launch_store(k, v, cache, lay, n_tiles, H, iters, source, **kw):
    """_prepare_store's launches, once."""
    tk, tv = kw.get("tails") or (k, v)
    _prepare_store(k, v, cache, lay, n_tiles, H, iters, source, **kw)(k, v, tk, tv, cache)


def _launch_parts(source: int, lay, D: int) -> tuple[tuple[int, int], ...]:
    """The launches of a store, (PART, warps) each: bulk stores (TILES, STEP) launch the keys and the values apart,
    each at its warp count; a decode step's store, captured in its CUDA graph and mostly programs that find no full
    tile, is one launch of both."""
    halves = (BOTH.value,) if source == DECODE.value else (KEYS.value, VALUES.value)
    return tuple((part, _warps(lay, D, part)) for part in halves)


def _warps(lay, D: int, part: int) -> int:
    """Warps of one store program. It holds a whole [128, 128] fp32 tile (255 registers a thread at 8 warps: one
    program per SM), so more warps hide the balancing chain's latency, fewer cut its cross-warp reductions. "Wide":
    a tile of more than 16384 values (D = 256 at g = 128). Values alone: 8, wide too (16 measured 2.5x slower there).
    Keys alone (min-max rounding, no range search: the reductions weigh more): 4, and 8 when wide (4 measured 4x
    slower: 256 values a thread spill). Both halves in one launch (a decode step's store, the flush: mostly one tile
    at a time, latency-bound): 8, 16 when wide (not re-measured since the halves were split)."""
    wide = D * lay.g > 16384
    if part == VALUES.value:
        return 8
    if part == KEYS.value:
        return 8 if wide else 4
    return 16 if wide else 8


def _tile_constexprs(lay, H: int, D: int, iters) -> dict:
    """What every launch of _store_one's tile quantizer passes alike (store_tiles, store_step_tiles, store_decode,
    flush_layers)."""
    return dict(H=H, G=lay.g, D=D, KB=lay.kb, VB=lay.vb, ITERS=int(iters), **lay.offsets(),
                COMPILED=compiled(), RB=ROTATION_BLOCK[D])


def store_tiles(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                fmt: KVFormat | str, iters: int | None = None) -> None:
    """Quantize T complete tiles per head into `cache[block_ids[t], h]` (see the module docstring)."""
    fmt = as_format(fmt)
    iters = fmt.balance_iters if iters is None else iters
    if k.dim() != 4 or k.shape != v.shape:
        raise KvarnError(f"k and v must both be [T, H, g, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    T, H, g, D = k.shape
    lay = layout(fmt, D)
    if g != lay.g:
        raise KvarnError(f"{fmt.name} stores tiles of {lay.g} tokens, got {g}")
    check_cache(cache, lay)
    if cache.shape[1] != H:
        raise KvarnError(f"cache has {cache.shape[1]} kv heads, k has {H}")
    if block_ids.shape != (T,) or block_ids.dtype not in (torch.int32, torch.int64):
        raise KvarnError(f"block_ids must be int32 [T={T}], got {block_ids.dtype} {tuple(block_ids.shape)}")
    if T == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _launch_store(k, v, cache, lay, T, H, iters, TILES.value, block_ids=block_ids)


def _token_args(k, v, cache, tail_k, tail_v, fmt, iters, rows: str):
    """The checks of a store from token rows k, v [rows, H, D] with tails: (format, iters, record layout, H, sink)."""
    fmt = as_format(fmt)
    iters = fmt.balance_iters if iters is None else iters
    if k.dim() != 3 or k.shape != v.shape:
        raise KvarnError(f"k and v must both be [{rows}, H, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    H, D = k.shape[1], k.shape[2]
    lay = layout(fmt, D)
    check_cache(cache, lay)
    if cache.shape[1] != H:
        raise KvarnError(f"cache has {cache.shape[1]} kv heads, k has {H}")
    return fmt, iters, lay, H, check_tail(tail_k, tail_v, H, lay.g, D, fmt.window_tokens)


def prepare_step_tiles(k: torch.Tensor, v: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor,
                       cache: torch.Tensor, block_ids: torch.Tensor, first: torch.Tensor, old: torch.Tensor,
                       slots: torch.Tensor, fmt: KVFormat | str, iters: int | None = None):
    """store_step_tiles checked and prepared: returns launch(k, v, tail_k, tail_v, cache), the store of these tiles
    from and into tensors of the shapes, strides and dtypes given here (every layer of a step: the checks and the
    arguments are built once)."""
    fmt, iters, lay, H, _ = _token_args(k, v, cache, tail_k, tail_v, fmt, iters, "N")
    _check_tail_dtypes(tail_k, tail_v, "store_step_tiles")
    T = block_ids.shape[0]
    for name, t, dt in (("block_ids", block_ids, torch.int32), ("first", first, torch.int64),
                        ("old", old, torch.int32), ("slots", slots, torch.int32)):
        if t.shape != (T,) or t.dtype != dt or t.device != cache.device:
            raise KvarnError(f"{name} must be {dt} [T={T}] on {cache.device}, got {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}")
    if T == 0:
        return no_launch
    # one element type per load: the tail's (the backend's new K/V already have it)
    convert = any(x.dtype != tail_k.dtype or x.stride(-1) != 1 for x in (k, v))
    if convert:  # the launch converts each layer's; the arguments need only the shapes and strides of the copies
        k, v = (torch.empty(x.shape, dtype=tail_k.dtype, device="meta") for x in (k, v))
    launch = _prepare_store(k, v, cache, lay, T, H, iters, STEP.value, block_ids=block_ids, first=first, old=old,
                            tails=(tail_k, tail_v), src_rows=slots)
    if not convert:
        return launch

    def converted(k, v, tk, tv, cache):
        launch(k.to(tk.dtype).contiguous(), v.to(tk.dtype).contiguous(), tk, tv, cache)

    return converted


def store_step_tiles(k: torch.Tensor, v: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor,
                     cache: torch.Tensor, block_ids: torch.Tensor, first: torch.Tensor, old: torch.Tensor,
                     slots: torch.Tensor, fmt: KVFormat | str, iters: int | None = None) -> None:
    """The tiles a step completes, read where they are (no gather): tile t's position j is the step's new token
    first[t] + j (k, v [N, H, D]), except positions j < old[t], written in earlier steps, which are tail row slots[t]
    at position j (tail_k / tail_v [S, H, g (+ sink + 2W), D]). Records go to cache[block_ids[t]] (< 0: skipped).
    block_ids, old, slots int32 [T]; first int64 [T] (entries where old[t] == g are not read)."""
    prepare_step_tiles(k, v, tail_k, tail_v, cache, block_ids, first, old, slots, fmt, iters)(k, v, tail_k, tail_v,
                                                                                               cache)


@triton.jit
def _decode_tail_kernel(k_ptr, v_ptr, tk_ptr, tv_ptr, slot_ptr, seq_lens_ptr,
                        stride_kn, stride_kh, stride_vn, stride_vh,
                        stride_ts, stride_th, stride_tg, stride_us, stride_uh, stride_ug,
                        H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SINK: tl.constexpr = 0,
                        WIN: tl.constexpr = 0):
    # row b's one new token sits at position seq_lens[b] - 1 of its sequence; rows with seq_len 0 are padding.
    # SINK > 0: a token below SINK also goes to the sink row G + position (16-bit for good); WIN > 0: a token in its
    # tile's last WIN positions also goes to the window half of its tile's parity
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    s = tl.load(seq_lens_ptr + b)
    if s > 0:
        pos = (s - 1) % G
        slot = tl.load(slot_ptr + b).to(tl.int64)
        di = tl.arange(0, D)
        kv = tl.load(k_ptr + b.to(tl.int64) * stride_kn + h * stride_kh + di).to(tk_ptr.dtype.element_ty)
        vv = tl.load(v_ptr + b.to(tl.int64) * stride_vn + h * stride_vh + di).to(tv_ptr.dtype.element_ty)
        tkb = tk_ptr + slot * stride_ts + h * stride_th
        tvb = tv_ptr + slot * stride_us + h * stride_uh
        tl.store(tkb + pos * stride_tg + di, kv)
        tl.store(tvb + pos * stride_ug + di, vv)
        if SINK > 0:
            if s - 1 < SINK:
                tl.store(tkb + (G + s - 1) * stride_tg + di, kv)
                tl.store(tvb + (G + s - 1) * stride_ug + di, vv)
        if WIN > 0:
            if pos >= G - WIN:
                w = G + SINK + (((s - 1) // G) % 2) * WIN + pos - (G - WIN)
                tl.store(tkb + w * stride_tg + di, kv)
                tl.store(tvb + w * stride_ug + di, vv)


def store_decode(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor, tail_slots: torch.Tensor,
                 fmt: KVFormat | str, iters: int | None = None, *, defer=False) -> None:
    """The KV write of a step where batch row b has exactly one new token k[b], v[b] ([B, H, D]) at position
    seq_lens[b] - 1 (seq_lens int32 [B]; 0 = padded row, skipped): the token goes to tail row tail_slots[b], and
    when it completes its tile (seq_len % g == 0) the tile is quantized from the tail into
    cache[block_table[b, seq_len // g - 1]]. Two launches of fixed grids, no host data: CUDA-graph capturable.
    defer: True: the tail write only; a completed tile stays in the tail (decode_attention(defer=True) reads it
    there) until flush_layers quantizes it. An int32 [1] tensor: the same when its value is 1 at run time, the
    immediate flush when 0 (a captured graph serves both)."""
    fmt, iters, lay, H, sink = _token_args(k, v, cache, tail_k, tail_v, fmt, iters, "B")
    B, D = k.shape[0], k.shape[2]
    if seq_lens.shape[0] < B or tail_slots.shape[0] < B or block_table.dim() != 2 or block_table.shape[0] < B:
        raise KvarnError(f"seq_lens, tail_slots and block_table need {B} rows, got {tuple(seq_lens.shape)}, "
                         f"{tuple(tail_slots.shape)}, {tuple(block_table.shape)}")
    if B == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _decode_tail_kernel[(B * H,)](
        k, v, tail_k, tail_v, tail_slots, seq_lens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        tail_k.stride(0), tail_k.stride(1), tail_k.stride(2), tail_v.stride(0), tail_v.stride(1), tail_v.stride(2),
        H=H, G=lay.g, D=D, SINK=sink, WIN=fmt.window_tokens if sink else 0, num_warps=1,
    )
    flag = defer_flag(defer, cache.device, "cache")
    if flag is True:  # always deferred: no flush launch at all
        return
    _launch_store(tail_k, tail_v, cache, lay, B, H, iters, DECODE.value, src_rows=tail_slots, seq_lens=seq_lens,
                  block_table=block_table, defer_flag=flag)


__all__ = ["store_tiles", "store_step_tiles", "prepare_step_tiles", "store_decode", "flush_layers"]
