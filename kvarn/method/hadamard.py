"""Orthonormal Sylvester-Hadamard matrix Hn = H_d / sqrt(d) (symmetric, Hn @ Hn = I)."""
from __future__ import annotations

import functools
import math

import torch

from ..errors import KvarnError


@functools.lru_cache(maxsize=None)
def _sylvester(d: int) -> torch.Tensor:
    # Built in float64 on CPU once per size; callers get a cast copy on their device.
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


_CACHE: dict[tuple, torch.Tensor] = {}


def hadamard(d: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Hn of size d x d (d a power of two), cached per (d, device, dtype). Do not modify the result in place."""
    if d < 1 or d & (d - 1):
        raise KvarnError(f"Hadamard size must be a power of two, got {d}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = (d, str(dev), dtype)
    h = _CACHE.get(key)
    if h is None:
        h = _sylvester(d).to(device=dev, dtype=dtype)
        _CACHE[key] = h
    return h
