"""Which path the vLLM backend's ops take when the Triton kernels do not import: without Triton a CPU step runs the
torch reference; CUDA tensors get an error naming the kernel module instead of a silent slowdown of every step; a
kernel module broken for any other reason raises as it is, never falls back."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvarn.formats import get_format
from kvarn.method.paged import store_tiles_torch
from kvarn.vllm_plugin import dense_prefill, ops

FMT = get_format("kvarn_k4v2_g64")


def _tiles(T=2, H=2, D=64):
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(T, H, FMT.group, D, generator=gen).half()
    v = torch.randn(T, H, FMT.group, D, generator=gen).half()
    return k, v, torch.zeros(T + 1, H, FMT.record_bytes(D), dtype=torch.uint8), torch.tensor([2, 0], dtype=torch.int32)


@pytest.fixture
def no_triton(monkeypatch):
    """The kernel modules fail to import as they do where Triton is not installed."""
    for m in ("store", "decode", "dequant"):
        monkeypatch.setitem(sys.modules, f"kvarn.kernels.{m}", None)  # import -> ModuleNotFoundError


@pytest.fixture
def broken_build(monkeypatch):
    """The kernel modules raise something other than ImportError on import (a broken Triton build)."""

    class Broken:
        @staticmethod
        def find_spec(name, *_):
            if name.startswith("kvarn.kernels."):
                raise AttributeError(f"module 'triton.language' has no attribute 'x' (importing {name})")
            return None

    for m in ("store", "decode", "dequant"):
        monkeypatch.delitem(sys.modules, f"kvarn.kernels.{m}", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])


def test_cpu_without_triton_runs_the_torch_reference(no_triton):
    k, v, cache, ids = _tiles()
    ops.store_tiles(k, v, cache, ids, FMT, use_kernels=True)
    ref = torch.zeros_like(cache)
    store_tiles_torch(k, v, ref, ids, FMT)
    assert torch.equal(cache, ref) and cache.any()
    assert not ops.decode_kernels_available()


def test_cuda_tensors_without_kernels_are_an_error(no_triton):
    gpu = SimpleNamespace(is_cuda=True)
    with pytest.raises(RuntimeError, match=r"CUDA tensors need the Triton kernels.*kvarn\.kernels\.store"):
        ops.store_tiles(gpu, gpu, gpu, None, FMT)
    plan = SimpleNamespace(num_reqs=1)
    with pytest.raises(RuntimeError, match=r"kvarn\.kernels\.store"):
        ops.decode_step(plan, gpu, None, None, None, None, None, None, None, None, None, FMT, 1.0)
    with pytest.raises(RuntimeError, match=r"CUDA cache needs the Triton kernels.*kvarn\.kernels\.dequant"):
        dense_prefill.materialize_dense(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                        np.zeros(1, dtype=np.int64), gpu, None, None, None, FMT, torch.float16)


def test_a_broken_kernel_build_raises_instead_of_falling_back(broken_build):
    k, v, cache, ids = _tiles()
    with pytest.raises(AttributeError, match="triton.language"):
        ops.store_tiles(k, v, cache, ids, FMT, use_kernels=True)
    with pytest.raises(AttributeError, match="triton.language"):
        dense_prefill.materialize_dense(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                        np.zeros(1, dtype=np.int64), cache, None, None, None, FMT, torch.float16,
                                        use_kernels=True)
