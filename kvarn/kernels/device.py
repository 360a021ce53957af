"""Triton device functions shared by the kernels: the Hadamard rotation, the fp16 hi / lo split of an fp32 MMA
operand, and the bookkeeping every attention program over the records does alike (which tiles a split reads, the
attention sink, the partial's statistics, programmatic dependent launch).

Every function takes COMPILED (kvarn.kernels.runtime.compiled(): 1 on a GPU, 0 in the Triton interpreter) where
its GPU form uses what the interpreter lacks; the other form computes the same values.

H (entries +-1, Sylvester order: H[i, j] = (-1)^popcount(i & j)) is generated in registers, never loaded, and is
exact in bf16; Hn = H / sqrt(D) is applied as (x @ H) * (1/sqrt(D)). On a GPU the fp32 operand is split into three
bf16 parts (hi + mid + lo ~ 24 mantissa bits) so three bf16 tensor-core MMAs give fp32-accurate products with a
bf16 H in shared memory (128 KiB at D=256, where an fp32 Hn would not fit). Under the interpreter (no bf16
matmul) one exact fp32 dot is used.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice


@triton.jit
def hadamard_pm1(D: tl.constexpr, COMPILED: tl.constexpr):
    return hadamard_pm1_block(D, D, 0, 0, COMPILED)


@triton.jit
def hadamard_pm1_block(R: tl.constexpr, C: tl.constexpr, r0, c0, COMPILED: tl.constexpr):
    """H[r0:r0+R, c0:c0+C] of the +-1 Hadamard of any order up to 512 (offsets may be runtime values)."""
    i = (tl.arange(0, R) + r0)[:, None]
    c = (tl.arange(0, C) + c0)[None, :]
    v = i & c
    if COMPILED:
        # the bf16 bits directly: 0x3F80 (+1) with the sign bit set where popcount(i & c) is odd (popc + two
        # integer ops per entry instead of a 4-step xor fold, an int -> float conversion and an fp32 -> bf16 one)
        bits = ((libdevice.popc(v) << 15) & 0x8000) | 0x3F80
        h = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:  # interpreter: no libdevice
        v = v ^ (v >> 8)
        v = v ^ (v >> 4)
        v = v ^ (v >> 2)
        v = v ^ (v >> 1)
        h = 1.0 - 2.0 * (v & 1).to(tl.float32)
    return h


@triton.jit
def inv_sqrt_d(D: tl.constexpr):
    # 1/sqrt(D) for the supported head dims, as a compile-time constant (no math on constexprs in device code)
    if D == 64:
        return 0.125
    elif D == 256:
        return 0.0625
    else:
        tl.static_assert(D == 128, "head dim must be 64, 128 or 256")
        return 0.08838834764831845


@triton.jit
def _split3(x):
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def x_times_h(x, h, D: tl.constexpr, COMPILED: tl.constexpr):
    """(x @ H) / sqrt(D) for fp32 x [M, D]."""
    acc = tl.zeros([x.shape[0], h.shape[1]], dtype=tl.float32)
    return rot_scale(x_times_h_acc(x, h, acc, COMPILED), D)


@triton.jit
def x_times_h_acc(x, h, acc, COMPILED: tl.constexpr):
    """acc + x @ h (unscaled) for fp32 x [M, K], +-1 h [K, N]: x_times_h is this from zero, then rot_scale; a
    blocked x @ H sums K-blocks of it. The fp32 x is split into three bf16 parts (hi + mid + lo) on the GPU, so
    the products with the exact +-1 h are exact; only the fp32 summation order differs between blockings."""
    if COMPILED:
        hi, mid, lo = _split3(x)
        acc = tl.dot(hi, h, acc=acc, out_dtype=tl.float32)
        acc = tl.dot(mid, h, acc=acc, out_dtype=tl.float32)
        acc = tl.dot(lo, h, acc=acc, out_dtype=tl.float32)
    else:
        acc = tl.dot(x, h, acc=acc, input_precision="ieee")
    return acc


@triton.jit
def rot_scale(acc, D: tl.constexpr):
    """acc * (1/sqrt(D)): turns an accumulated +-1 product into the Hn rotation."""
    return acc * inv_sqrt_d(D)



LOG2E = 1.4426950408889634  # scores live in the exp2 domain: softmax scale * log2(e) is folded into the query


@triton.jit
def split16(a, SPLIT: tl.constexpr):
    """fp32 `a` as fp16 hi (+ lo = the rounding residual, when SPLIT == 2): two fp16 MMA operands whose sum carries
    ~22 mantissa bits. SPLIT == 1: hi alone (lo = hi, unused)."""
    hi = a.to(tl.float16)
    if SPLIT == 2:
        lo = (a - hi.to(tl.float32)).to(tl.float16)
    else:
        lo = hi
    return hi, lo


@triton.jit
def sink_start(sink_lens_ptr, b, SINK: tl.constexpr):
    """Positions of request b below this are read 16-bit from the tail buffer's sink rows, so the record programs
    skip them: sink_lens[b] clamped to the SINK rows the buffer has (0 without a sink)."""
    if SINK > 0:
        return tl.minimum(tl.load(sink_lens_ptr + b), SINK)
    return 0


@triton.jit
def window_start(S, win_lens_ptr, b, G: tl.constexpr, WIN: tl.constexpr):
    """First of the WIN positions of request b read 16-bit from its tail buffer's window rows: the last WIN of the
    tile before the newest position's tile, where that tile exists and the slot's window half holds it
    (win_lens[b] > 0: step_plan.update_window_lens). Else -WIN: the window [-WIN, 0) holds no position."""
    if WIN > 0:
        wt = (S - 1) // G - 1
        ok = (S > G) & (tl.load(win_lens_ptr + b) > 0)
        return tl.where(ok, wt * G + G - WIN, -WIN)
    return -WIN


@triton.jit
def records_end(S, DEFER: tl.constexpr, defer_ptr):
    """The context length whose full tiles are in the records: S, or, with DEFER and the step's flag defer_ptr[0]
    set (a decode step that leaves the tile it completes in the 16-bit tail, flushed later), S - 1, so a tile that
    fills this step is read from the tail. The flag is device data: one captured graph serves both."""
    if DEFER:
        return tl.maximum(S - tl.load(defer_ptr), 0)
    return S


@triton.jit
def split_tiles(S, L, G: tl.constexpr, split, num_splits):
    """Record tiles [t_begin, t_stop) of one context split: the L visible tokens' tiles dealt out in equal runs,
    only the S // G full ones read from records (the rest is the tail)."""
    n_tiles = (L + G - 1) // G
    per_split = (n_tiles + num_splits - 1) // num_splits
    t_begin = split * per_split
    return t_begin, tl.minimum(tl.minimum(t_begin + per_split, n_tiles), S // G)


@triton.jit
def partial_stats(m_i, l_i):
    """1 / l and the log2-sum-exp of a split's partial (rows that saw nothing: 1 and -inf)."""
    has = l_i > 0.0
    return 1.0 / tl.where(has, l_i, 1.0), tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))


@triton.jit
def pdl_sync(PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90+): a kernel launched with launch_pdl=True may start while the previous
    kernel in the stream still runs; here it waits until that kernel has finished and its writes are visible, then
    lets the next kernel's programs start. What comes before this call may only compute (the Hadamard), not read
    or write global memory."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
