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
from kvarn.vllm_plugin.common import kernel_lookup
from kvarn.vllm_plugin.step_plan import plan_step

FMT = get_format("kvarn_k4v2_g64")


def _step(D=64, H=2):
    """A fresh prompt of two tiles and three tokens more, planned as the backend plans it, with its K/V, cache and
    tails."""
    g = FMT.group
    gen = torch.Generator().manual_seed(3)
    n = 2 * g + 3
    plan = plan_step(np.array([0, n]), np.array([n]), 1, np.array([0], dtype=np.int32),
                     torch.tensor([[2, 0, 1]], dtype=torch.int32), g, "cpu", sink=FMT.sink_tokens,
                     window=FMT.window_tokens)
    k = torch.randn(n, H, D, generator=gen).half()
    v = torch.randn(n, H, D, generator=gen).half()
    tails = [torch.zeros(2, H, FMT.tail_rows, D, dtype=torch.float16) for _ in range(2)]
    return plan, k, v, torch.zeros(3, H, FMT.record_bytes(D), dtype=torch.uint8), tails


@pytest.fixture
def fresh_lookups():
    """The plugin looks its kernels up once per process: forget what it found before and after the test."""
    kernel_lookup.cache_clear()
    yield
    kernel_lookup.cache_clear()


@pytest.fixture
def no_triton(monkeypatch, fresh_lookups):
    """The kernel modules fail to import as they do where Triton is not installed."""
    for m in ("store", "decode", "dequant"):
        monkeypatch.setitem(sys.modules, f"kvarn.kernels.{m}", None)  # import -> ModuleNotFoundError


@pytest.fixture
def broken_build(monkeypatch, fresh_lookups):
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
    plan, k, v, cache, (tk, tv) = _step()
    ops.store(plan, k, v, cache, tk, tv, FMT, use_kernels=True)
    g = FMT.group
    ref = torch.zeros_like(cache)
    tiles = [x[:2 * g].view(2, g, *x.shape[1:]).transpose(1, 2) for x in (k, v)]
    store_tiles_torch(*tiles, ref, torch.tensor([2, 0], dtype=torch.int32), FMT)
    assert torch.equal(cache, ref) and cache[[0, 2]].any()
    assert not ops.decode_kernels_available()


def test_cuda_tensors_without_kernels_are_an_error(no_triton):
    gpu = SimpleNamespace(is_cuda=True)
    plan = SimpleNamespace(group=FMT.group, sink=FMT.sink_tokens, window=FMT.window_tokens, num_tiles=1)
    tail = SimpleNamespace(shape=(1, 1, FMT.tail_rows, 1))
    with pytest.raises(RuntimeError, match=r"CUDA tensors need the Triton kernels.*kvarn\.kernels\.store"):
        ops.store(plan, gpu, gpu, gpu, tail, tail, FMT)
    plan = SimpleNamespace(num_reqs=1)
    with pytest.raises(RuntimeError, match=r"kvarn\.kernels\.store"):
        ops.decode_step(plan, gpu, None, None, None, None, None, None, None, None, None, FMT, 1.0)
    with pytest.raises(RuntimeError, match=r"CUDA cache needs the Triton kernels.*kvarn\.kernels\.dequant"):
        dense_prefill.materialize_dense(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                        np.zeros(1, dtype=np.int64), gpu, None, None, None, FMT, torch.float16)


def test_a_broken_kernel_build_raises_instead_of_falling_back(broken_build):
    plan, k, v, cache, (tk, tv) = _step()
    with pytest.raises(AttributeError, match="triton.language"):
        ops.store(plan, k, v, cache, tk, tv, FMT, use_kernels=True)
    with pytest.raises(AttributeError, match="triton.language"):
        dense_prefill.materialize_dense(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                        np.zeros(1, dtype=np.int64), cache, None, None, None, FMT, torch.float16,
                                        use_kernels=True)
