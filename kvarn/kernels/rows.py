"""16-bit row copies between a step's token-major K / V and the tail buffers, K and V in one launch.

    write_tail_rows(k, v, tail_k, tail_v, tok, slot, row) -> None
        tail[slot[i], :, row[i]] = k[tok[i]] (and v): the store's writes of the unfinished tiles', the sink's and the
        window's tokens (k, v [N, H, D]; tails [S, H, rows, D]).
    read_tail_rows(tail_k, tail_v, slot, row, k, v, dst, use=None) -> None
        k[dst[i]] = tail[slot[i], :, row[i]] (and v) where use[i] (None: every i): the dense prefill's reads of those
        rows into the materialized K / V.

prepare_write_tail_rows / prepare_read_tail_rows check and prepare the same copies once and return a launch that
takes only the K / V and tail tensors (another layer's, of the same shapes).

Each replaces a gather and a scatter per tensor (four launches and their index checks for K and V) by one launch:
a prefill step runs these once per layer, and its host time is what the GPU waits for. Exact copies (a dtype
conversion where source and destination differ); no host sync.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ..errors import KvarnError
from .runtime import cdiv, no_launch, serving_jit

ROWS_PER_PROGRAM = 16  # (row, head) pairs per program: [16, D] elements per tensor
UNITS = tl.constexpr(ROWS_PER_PROGRAM)


@serving_jit(ints=("n",), index_ptrs=("src_a_ptr", "src_b_ptr", "dst_a_ptr", "dst_b_ptr", "use_ptr"))
def _copy_rows_kernel(src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_a_ptr, src_b_ptr, dst_a_ptr, dst_b_ptr, use_ptr,
                      n, sk_a, sk_b, sk_h, sv_a, sv_b, sv_h, dk_a, dk_b, dk_h, dv_a, dv_b, dv_h,
                      H: tl.constexpr, D: tl.constexpr, SRC_B: tl.constexpr, DST_B: tl.constexpr,
                      USE: tl.constexpr):
    """Row i, head h: src[a_s[i] * stride_a + b_s[i] * stride_b + h * stride_h, :D] -> the same in dst (an index
    b only where SRC_B / DST_B: the tail's row within a slot). Axis 1 picks K or V, each with its own strides (a
    model's K may be a normed copy while V is still a view into the fused QKV output)."""
    u = tl.program_id(0) * UNITS + tl.arange(0, UNITS)  # (row, head) units
    i = u // H
    h = u % H
    live = i < n
    if USE:
        live = live & (tl.load(use_ptr + i, mask=live, other=0) != 0)
    a_s = tl.load(src_a_ptr + i, mask=live, other=0).to(tl.int64)
    a_d = tl.load(dst_a_ptr + i, mask=live, other=0).to(tl.int64)
    b_s = tl.load(src_b_ptr + i, mask=live, other=0).to(tl.int64) if SRC_B else a_s * 0
    b_d = tl.load(dst_b_ptr + i, mask=live, other=0).to(tl.int64) if DST_B else a_d * 0
    d = tl.arange(0, D)[None, :]
    m = live[:, None]
    if tl.program_id(1) == 0:
        src = (a_s * sk_a + b_s * sk_b + h * sk_h)[:, None]
        dst = (a_d * dk_a + b_d * dk_b + h * dk_h)[:, None]
        x = tl.load(src_k_ptr + src + d, mask=m)
        tl.store(dst_k_ptr + dst + d, x.to(dst_k_ptr.dtype.element_ty), mask=m)
    else:
        src = (a_s * sv_a + b_s * sv_b + h * sv_h)[:, None]
        dst = (a_d * dv_a + b_d * dv_b + h * dv_h)[:, None]
        x = tl.load(src_v_ptr + src + d, mask=m)
        tl.store(dst_v_ptr + dst + d, x.to(dst_v_ptr.dtype.element_ty), mask=m)


def _checked(what: str, k, v, tail_k, tail_v, **index) -> int:
    """The arguments of a row copy checked (token-major k, v [N, H, D]; tails [S, H, rows, D]; index tensors of one
    length n, int32 or int64, on k's device); returns n."""
    for a, b, name in ((k, v, "k / v"), (tail_k, tail_v, "tails")):
        if a.shape != b.shape or a.stride()[-1] != 1 or b.stride()[-1] != 1:
            raise KvarnError(f"{what} {name}: K and V must have one shape, contiguous along D; got {tuple(a.shape)} "
                             f"{a.stride()} and {tuple(b.shape)} {b.stride()}")
    if k.dim() != 3 or tail_k.dim() != 4 or k.shape[1:] != (tail_k.shape[1], tail_k.shape[3]):
        raise KvarnError(f"k [N, H, D] and tails [S, H, rows, D] must agree, got {tuple(k.shape)} and "
                         f"{tuple(tail_k.shape)}")
    n = next(iter(index.values())).shape[0]
    for name, t in index.items():
        if t.shape != (n,) or t.dtype not in (torch.int32, torch.int64) or t.device != k.device:
            raise KvarnError(f"{name} must be int32 / int64 [{n}] on {k.device}, got {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}")
    return n


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(index a, index b, head) strides: a token-major [N, H, D] (no index b) or a tail [S, H, rows, D]."""
    s = t.stride()
    return (s[0], 0, s[1]) if len(s) == 3 else (s[0], s[2], s[1])


def _prepare(src, dst, src_idx, dst_idx, n, use=None):
    """The launch of one row copy: launch(src_k, src_v, dst_k, dst_v) copies between those tensors, which must have
    the shapes, strides and dtypes of `src` and `dst` (another layer's buffers in one step: the indexes stay)."""
    (sk, sv), (dk, dv) = src, dst
    H, D = sk.shape[1], sk.shape[-1]  # k [N, H, D] and tails [S, H, rows, D] alike
    if D & (D - 1):
        raise KvarnError(f"row copies serve power-of-two head dims, got {D}")
    sa, sb = src_idx
    da, db = dst_idx
    # an absent index gets a placeholder pointer (never read)
    rest = (sa, sa if sb is None else sb, da, sa if db is None else db, sa if use is None else use, n,
            *_strides(sk), *_strides(sv), *_strides(dk), *_strides(dv))
    grid = (cdiv(n * H, ROWS_PER_PROGRAM), 2)
    const = dict(H=H, D=D, SRC_B=sb is not None, DST_B=db is not None, USE=use is not None, num_warps=4)

    def launch(sk, sv, dk, dv):
        _copy_rows_kernel[grid](sk, sv, dk, dv, *rest, **const)

    return launch


def prepare_write_tail_rows(k: torch.Tensor, v: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor,
                            tok: torch.Tensor, slot: torch.Tensor, row: torch.Tensor):
    """write_tail_rows checked and prepared: returns launch(k, v, tail_k, tail_v), which writes these rows between
    tensors of the shapes, strides and dtypes given here (every layer of a step: the checks run once)."""
    n = _checked("write_tail_rows", k, v, tail_k, tail_v, tok=tok, slot=slot, row=row)
    return no_launch if n == 0 else _prepare((k, v), (tail_k, tail_v), (tok, None), (slot, row), n)


def write_tail_rows(k: torch.Tensor, v: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor,
                    tok: torch.Tensor, slot: torch.Tensor, row: torch.Tensor) -> None:
    """tail_k[slot[i], :, row[i]] = k[tok[i]], and the same for v (see the module docstring)."""
    prepare_write_tail_rows(k, v, tail_k, tail_v, tok, slot, row)(k, v, tail_k, tail_v)


def prepare_read_tail_rows(tail_k: torch.Tensor, tail_v: torch.Tensor, slot: torch.Tensor, row: torch.Tensor,
                           k: torch.Tensor, v: torch.Tensor, dst: torch.Tensor, use: torch.Tensor | None = None):
    """read_tail_rows checked and prepared: returns launch(tail_k, tail_v, k, v) (as prepare_write_tail_rows)."""
    n = _checked("read_tail_rows", k, v, tail_k, tail_v, dst=dst, slot=slot, row=row)
    if use is not None:
        if use.numel() != n or use.dtype != torch.bool or use.device != k.device:
            raise KvarnError(f"use must be bool with {n} elements on {k.device}, got {use.dtype} "
                             f"{tuple(use.shape)} on {use.device}")
        use = use.reshape(-1)
    return no_launch if n == 0 else _prepare((tail_k, tail_v), (k, v), (slot, row), (dst, None), n, use)


def read_tail_rows(tail_k: torch.Tensor, tail_v: torch.Tensor, slot: torch.Tensor, row: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, dst: torch.Tensor, use: torch.Tensor | None = None) -> None:
    """k[dst[i]] = tail_k[slot[i], :, row[i]] where use[i] (bool [n], or any shape of n elements), and the same for
    v (see the module docstring)."""
    prepare_read_tail_rows(tail_k, tail_v, slot, row, k, v, dst, use)(tail_k, tail_v, k, v)


__all__ = ["write_tail_rows", "read_tail_rows", "prepare_write_tail_rows", "prepare_read_tail_rows"]
