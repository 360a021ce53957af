"""Host-side facts about KVarN records that every kernel launch needs: the byte offset of each record field
(docs/format.md) and the argument checks of the cache and tail buffers.

Everything here runs on the host from shapes and the format only (never reads device values), so the launches
that use it stay CUDA-graph capturable.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import KvarnError
from ..formats import KVFormat, get_format

HEAD_DIMS = (64, 128, 256)


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

    def offsets(self) -> dict:
        """The kernels' OFF_* constexprs."""
        return dict(OFF_PK=self.pk, OFF_SK=self.sk, OFF_ZK=self.zk, OFF_RK=self.rk,
                    OFF_PV=self.pv, OFF_SV=self.sv, OFF_ZV=self.zv, OFF_CV=self.cv)


def as_format(fmt: KVFormat | str) -> KVFormat:
    return get_format(fmt) if isinstance(fmt, str) else fmt


def layout(fmt: KVFormat | str, d: int) -> RecordLayout:
    return _layout(as_format(fmt), d)


@functools.lru_cache(maxsize=None)  # every launch asks: a prefill step's host time is what its GPU waits for
def _layout(fmt: KVFormat, d: int) -> RecordLayout:
    if fmt.family != "kvarn":
        raise KvarnError(f"{fmt.name} is not a KVarN format; the kvarn kernels take kvarn_* formats only")
    if d not in HEAD_DIMS:
        raise KvarnError(f"head dim {d} is not supported by the kvarn kernels; accepted: 64, 128, 256")
    g, kb, vb = fmt.group, int(fmt.key_bits), int(fmt.value_bits)
    off = 0
    offs = {}
    for name, n in (("pk", d * g * kb // 8), ("sk", 2 * d), ("zk", 2 * d), ("rk", 2 * g),
                    ("pv", g * d * vb // 8), ("sv", 2 * g), ("zv", 2 * g), ("cv", 2 * d)):
        offs[name] = off
        off += n
    size = fmt.record_bytes(d)
    # every field starts on 4 bytes: the decode kernel reads the fp16 runs as int32 pairs
    assert off <= size and all(v % 4 == 0 for v in offs.values()) and size % 16 == 0
    return RecordLayout(g=g, d=d, kb=kb, vb=vb, size=size, **offs)


def check_cache(cache: torch.Tensor, lay: RecordLayout, name: str = "cache") -> None:
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[-1] != lay.size:
        raise KvarnError(f"{name} must be uint8 [num_blocks, kv_heads, {lay.size}], got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    st = cache.stride()
    if st[-1] != 1 or st[1] != lay.size or st[0] % 4:
        raise KvarnError(f"{name} must have contiguous records (strides [*, {lay.size}, 1]), got {cache.stride()}")
    if cache.data_ptr() % 4:
        raise KvarnError(f"{name} must start at a 4-byte aligned address (the kernels read fp16 pairs as int32)")


def check_tail(tail_k: torch.Tensor, tail_v: torch.Tensor, hk: int, g: int, d: int, window: int = 0) -> int:
    """The 16-bit tail buffers [S, Hk, g + sink + 2 * window, D] (K and V alike), contiguous along D: rows [0, g) hold
    a request's unfinished tile, rows [g, g + sink) its first `sink` tokens for good (0 < sink < g; the backend
    allocates fmt.sink_tokens of them), then the window halves (fmt.window_tokens rows each, tiles of even and odd
    index); [S, Hk, g, D]: neither (the window is kept only with a sink). Returns sink."""
    rows = tail_k.shape[2] if tail_k.dim() == 4 else -1
    w2 = 2 * window if rows > g else 0
    if (tail_k.dim() != 4 or tuple(tail_k.shape[1:2]) + tuple(tail_k.shape[3:]) != (hk, d)
            or not (rows == g or g + w2 + (1 if w2 else 0) <= rows < 2 * g + w2) or tail_v.shape != tail_k.shape):
        raise KvarnError(f"tail_k / tail_v must be [S, {hk}, {g}, {d}] or [S, {hk}, {g} + sink + {2 * window}, {d}] "
                         f"with 0 < sink < {g}, got {tuple(tail_k.shape)} and {tuple(tail_v.shape)}")
    if tail_k.stride(-1) != 1 or tail_v.stride(-1) != 1:
        raise KvarnError("tail buffers must be contiguous along the head dim")
    return rows - g - w2


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
