"""Shared host-side helpers for the KVarN Triton kernels: record field offsets, format checks, the Hadamard
matrix on the kernel's device.

Everything here runs on the host from shapes and the format only (never reads device values), so the launches
that use it stay CUDA-graph capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..errors import KvarnError
from ..formats import KVFormat, get_format

FP16_MAX = 65504.0


def serving_jit(ints=(), index_ptrs=()):
    """triton.jit for a kernel that serving steps launch. `ints`: arguments that change from step to step (row,
    tile and split counts, the block table's width): Triton would otherwise compile one variant for 1, one for
    multiples of 16 and one for the rest, each at its first use, mid-run (H200, session 12: 4.8-6.3 s per variant of
    the store kernel, a stall of every running request; vLLM's JIT monitor warns about each). `index_ptrs`: index
    tensors that may be slices at any offset, not specialised on 16-byte alignment (scalar loads: nothing to
    vectorise). What the engine's warm-up compiles is then what every later step runs."""
    return triton.jit(do_not_specialize=list(ints), do_not_specialize_on_alignment=list(index_ptrs))


@dataclass(frozen=True)
class RecordLayout:
    """Byte offsets of the record fields (docs/format.md) for one (format, head dim)."""

    g: int
    d: int
    kb: int
    vb: int
    pk: int
    sk: int
    zk: int
    rk: int
    pv: int
    sv: int
    zv: int
    cv: int
    size: int


def layout(fmt: KVFormat | str, d: int) -> RecordLayout:
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if fmt.family != "kvarn":
        raise KvarnError(f"{fmt.name} is not a KVarN format; the kvarn kernels take kvarn_* formats only")
    if d not in (64, 128, 256):
        raise KvarnError(f"head dim {d} is not supported by the kvarn kernels; accepted: 64, 128, 256")
    g, kb, vb = fmt.group, int(fmt.key_bits), int(fmt.value_bits)
    off = 0
    offs = {}
    for name, n in (("pk", d * g * kb // 8), ("sk", 2 * d), ("zk", 2 * d), ("rk", 2 * g),
                    ("pv", g * d * vb // 8), ("sv", 2 * g), ("zv", 2 * g), ("cv", 2 * d)):
        offs[name] = off
        off += n
    size = fmt.record_bytes(d)
    assert off <= size and all(v % 2 == 0 for v in offs.values())
    return RecordLayout(g=g, d=d, kb=kb, vb=vb, size=size, **offs)


def as_format(fmt: KVFormat | str) -> KVFormat:
    return get_format(fmt) if isinstance(fmt, str) else fmt


_HN: dict[tuple, torch.Tensor] = {}


def hadamard_fp32(d: int, device) -> torch.Tensor:
    """Orthonormal Hn (fp32, contiguous) on `device`, cached. Call `prepare()` before CUDA-graph capture so the
    first (host-to-device) copy never happens inside a capture."""
    dev = torch.device(device)
    key = (d, str(dev))
    h = _HN.get(key)
    if h is None:
        from ..method.hadamard import hadamard

        h = hadamard(d, dev, torch.float32).contiguous()
        _HN[key] = h
    return h


def prepare(head_dim: int, device) -> None:
    """Warm the per-device state for one head dim; call once before graph capture: the Hadamard matrix, and on a
    GPU the once-per-device check of the inline-PTX code unpack (kvarn.kernels.decode.asm_unpack_ok; it syncs)."""
    hadamard_fp32(head_dim, device)
    dev = torch.device(device)
    if dev.type == "cuda":
        from .attention import mma_bf16
        from .decode import asm_unpack_ok

        if mma_bf16():
            asm_unpack_ok(dev)  # (DecodeConfig.voff's own check runs at a voff config's first eager call)


def check_cache(cache: torch.Tensor, lay: RecordLayout, name: str = "cache") -> None:
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[-1] != lay.size:
        raise KvarnError(f"{name} must be uint8 [num_blocks, kv_heads, {lay.size}], got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    if cache.stride(-1) != 1 or cache.stride(1) != lay.size:
        raise KvarnError(f"{name} must have contiguous records (strides [*, {lay.size}, 1]), got {cache.stride()}")
    if cache.storage_offset() % 2:
        raise KvarnError(f"{name} must start at an even byte offset (fp16 fields)")


def check_tail(tail_k: torch.Tensor, tail_v: torch.Tensor, hk: int, g: int, d: int) -> int:
    """The 16-bit tail buffers [S, Hk, g + sink, D] (K and V alike), contiguous along D: rows [0, g) hold a
    request's unfinished tile, rows [g, g + sink) its first `sink` tokens for good (0 <= sink < g; the backend
    allocates fmt.sink_tokens of them). Returns sink."""
    if (tail_k.dim() != 4 or tuple(tail_k.shape[1:2]) + tuple(tail_k.shape[3:]) != (hk, d)
            or not g <= tail_k.shape[2] < 2 * g or tail_v.shape != tail_k.shape):
        raise KvarnError(f"tail_k / tail_v must be [S, {hk}, {g} + sink, {d}] with 0 <= sink < {g}, got "
                         f"{tuple(tail_k.shape)} and {tuple(tail_v.shape)}")
    if tail_k.stride(-1) != 1 or tail_v.stride(-1) != 1:
        raise KvarnError("tail buffers must be contiguous along the head dim")
    return tail_k.shape[2] - g


def defer_flag(defer, device, what: str):
    """The kernels' `defer` argument checked: None (not deferred), True (always), or an int32 flag tensor on `device`
    whose value the kernels read at run time (what a captured decode graph needs)."""
    if defer is None or defer is False:
        return None
    if defer is True:
        return True
    if not torch.is_tensor(defer) or defer.dtype != torch.int32 or defer.numel() < 1 or defer.device != device:
        raise KvarnError(f"defer must be a bool or an int32 flag tensor on the {what}'s device")
    return defer


def f16_view(cache: torch.Tensor) -> torch.Tensor:
    """The same memory seen as fp16 words (records and every field offset are even), for the vector fields."""
    return cache.view(torch.float16)
