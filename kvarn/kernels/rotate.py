"""In-kernel Hadamard rotation helpers (Triton device functions).

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
def hadamard_pm1(D: tl.constexpr, MMA_BF16: tl.constexpr):
    return hadamard_pm1_cols(D, D, 0, MMA_BF16)


@triton.jit
def hadamard_pm1_cols(D: tl.constexpr, DP: tl.constexpr, J: tl.constexpr, MMA_BF16: tl.constexpr):
    """Columns J*DP .. (J+1)*DP - 1 of the +-1 Hadamard, [D, DP] (for the planar key planes)."""
    return hadamard_pm1_block(D, DP, 0, J * DP, MMA_BF16)


@triton.jit
def hadamard_pm1_block(R: tl.constexpr, C: tl.constexpr, r0, c0, MMA_BF16: tl.constexpr):
    """H[r0:r0+R, c0:c0+C] of the +-1 Hadamard of any order up to 512 (offsets may be runtime values)."""
    i = (tl.arange(0, R) + r0)[:, None]
    c = (tl.arange(0, C) + c0)[None, :]
    v = i & c
    if MMA_BF16:
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
def _inv_sqrt(D: tl.constexpr):
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
def x_times_h(x, h, D: tl.constexpr, MMA_BF16: tl.constexpr):
    """(x @ H) / sqrt(D) for fp32 x [M, D]."""
    acc = tl.zeros([x.shape[0], h.shape[1]], dtype=tl.float32)
    return rot_scale(x_times_h_acc(x, h, acc, MMA_BF16), D)


@triton.jit
def h_times_x(h, x, D: tl.constexpr, MMA_BF16: tl.constexpr):
    """(H @ x) / sqrt(D) for fp32 x [D, N]."""
    acc = tl.zeros([h.shape[0], x.shape[1]], dtype=tl.float32)
    return rot_scale(h_times_x_acc(h, x, acc, MMA_BF16), D)


@triton.jit
def x_times_h_acc(x, h, acc, MMA_BF16: tl.constexpr):
    """acc + x @ h (unscaled) for fp32 x [M, K], +-1 h [K, N]: x_times_h is this from zero, then rot_scale; a
    blocked x @ H sums K-blocks of it. The fp32 x is split into three bf16 parts (hi + mid + lo) on the GPU, so
    the products with the exact +-1 h are exact; only the fp32 summation order differs between blockings."""
    if MMA_BF16:
        hi, mid, lo = _split3(x)
        acc = tl.dot(hi, h, acc=acc, out_dtype=tl.float32)
        acc = tl.dot(mid, h, acc=acc, out_dtype=tl.float32)
        acc = tl.dot(lo, h, acc=acc, out_dtype=tl.float32)
    else:
        acc = tl.dot(x, h, acc=acc, input_precision="ieee")
    return acc


@triton.jit
def h_times_x_acc(h, x, acc, MMA_BF16: tl.constexpr):
    """acc + h @ x (unscaled) for +-1 h [M, K], fp32 x [K, N] (see x_times_h_acc)."""
    if MMA_BF16:
        hi, mid, lo = _split3(x)
        acc = tl.dot(h, hi, acc=acc, out_dtype=tl.float32)
        acc = tl.dot(h, mid, acc=acc, out_dtype=tl.float32)
        acc = tl.dot(h, lo, acc=acc, out_dtype=tl.float32)
    else:
        acc = tl.dot(h, x, acc=acc, input_precision="ieee")
    return acc


@triton.jit
def rot_scale(acc, D: tl.constexpr):
    """acc * (1/sqrt(D)): turns an accumulated +-1 product into the Hn rotation."""
    return acc * _inv_sqrt(D)

