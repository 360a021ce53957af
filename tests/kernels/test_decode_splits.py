"""The decode kernel's split count (wave quantization over the records kernel's resident programs) and the
occupancy it reads from a compiled kernel: host-only arithmetic, at an H200's 132 SMs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvarn.kernels.decode as decode
from kvarn.kernels.runtime import programs_per_sm

SMS = 132


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(decode, "sm_count", lambda index: SMS)
    props = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                            max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("batch,kv_heads,max_blocks,per_sm,want", [
    (8, 8, 128, 4, 8),    # 64 programs: 8 splits fill one wave (0.97); 9 would start a second
    (64, 8, 128, 4, 1),   # 512 programs: one split fills the 528 slots as well as two
    (96, 8, 128, 4, 2),   # 1 split = 1.45 waves, 2 = 2.9
    (32, 8, 128, 4, 2),   # 256 programs: half a wave at 1
    (128, 8, 32, 4, 1),   # a Qwen3-32B decode step
    (64, 3, 64, 6, 4),    # SmolLM2's shape at 6 programs per SM: 4 splits (0.97 of a wave)
    (64, 3, 64, 4, 8),    # the same before the occupancy is known
    (16, 8, 8, 4, 2),     # 8 tiles: at most 2 splits (>= 4 tiles each)
    (2, 1, 4, 4, 1),      # one split's worth of tiles
])
def test_splits_fill_the_last_wave(gpu, batch, kv_heads, max_blocks, per_sm, want):
    assert decode.default_num_splits(batch, kv_heads, max_blocks, gpu, per_sm) == want


@pytest.mark.parametrize("regs,warps,shared,want", [
    (254, 2, 28808, 4),   # the records kernel at D=128: registers allow 8 warps
    (168, 2, 16648, 6),   # the same at D=64: 12 warps
    (128, 4, 31752, 4),   # 4 warps at 128 registers
    (64, 4, 120000, 1),   # shared memory bound
    (32, 1, 0, 32),       # the per-SM block limit
])
def test_programs_per_sm_from_the_compiled_kernel(gpu, regs, warps, shared, want):
    kernel = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(num_warps=warps, shared=shared))
    assert programs_per_sm(kernel, gpu) == want


def test_programs_per_sm_without_a_register_count():
    assert programs_per_sm(None, torch.device("cpu")) is None  # the interpreter returns no compiled kernel
    assert programs_per_sm(SimpleNamespace(n_regs=None, metadata=None), torch.device("cpu")) is None
