"""The decode kernel's split heuristic (wave quantization over the kernel's resident programs) and the occupancy it
reads from a compiled kernel: host-only arithmetic, checked against the H200 split sweeps it was fitted to."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvarn.kernels.decode as decode
from kvarn.formats import get_format
from kvarn.kernels.common import layout

H200_SMS = 132


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(decode, "_sm_count", lambda index: H200_SMS)
    props = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                            max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("batch,kv_heads,max_blocks,per_sm,want", [
    (8, 8, 128, 4, 8),    # 64 programs: 8 splits fill one wave (0.97); the old ceil gave 9 (1.09 waves), 16% slower
    (64, 8, 128, 4, 2),   # the shape: 2 (1 fills as well; not taken, see the docstring)
    (96, 8, 128, 4, 2),   # 1 split = 1.45 waves (measured 14% slower), 2 = 2.9
    (128, 8, 32, 4, 2),   # the Qwen3-32B step
    (64, 3, 64, 6, 4),    # SmolLM2 shape, 6 programs per SM: 4 splits (0.97 of a wave), the sweep's best
    (64, 3, 64, 4, 8),    # the same before the occupancy is known
    (16, 8, 8, 4, 2),     # 8 tiles: at most 2 splits (>= 4 tiles each)
    (2, 1, 4, 4, 1),      # one split's worth of tiles
])
def test_splits_fill_the_last_wave(h200, batch, kv_heads, max_blocks, per_sm, want):
    assert decode.default_num_splits(batch, kv_heads, max_blocks, h200, per_sm) == want


@pytest.mark.parametrize("batch,kv_heads,max_blocks,want", [
    (64, 8, 128, 1),      # the shape: one split fills as well as two (H200: 0.988-0.992x their time)
    (128, 8, 32, 1),      # the Qwen3-32B step (0.906-0.970x)
    (96, 8, 128, 2),      # 1 split = 1.45 waves (1.11x two splits' time)
    (32, 8, 128, 2),      # 256 programs: half a wave at 1
    (8, 8, 128, 8),
])
def test_default_config_may_take_one_split(h200, batch, kv_heads, max_blocks, want):
    """The 2-warp pipe kernels (the default) take one split where it fills the resident slots as well; older
    configs keep at least two (14-25% slower at one for the 4-warp 3-stage kernel)."""
    lay = layout(get_format("kvarn_k4v2_g128"), 128)
    got = decode.heuristic_splits(decode.DEFAULT_CONFIG, batch, kv_heads, max_blocks, lay, 4, h200)
    assert got == want
    old = decode.DecodeConfig(2, 2, 1, 4, 3, maxnreg=128, layout=2, bn=8, pipe=1)
    assert decode.heuristic_splits(old, batch, kv_heads, max_blocks, lay, 4, h200) == max(want, 2)


@pytest.mark.parametrize("regs,warps,shared,want", [
    (254, 2, 28808, 4),   # the default (2-warp pipe kernel, D=128): registers allow 8 warps
    (168, 2, 16648, 6),   # the same at D=64: 12 warps
    (128, 4, 31752, 4),   # 4 warps, 128-register cap
    (64, 4, 120000, 1),   # shared memory bound
    (32, 1, 0, 32),       # the per-SM block limit
])
def test_programs_per_sm_from_the_compiled_kernel(h200, regs, warps, shared, want):
    kernel = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(num_warps=warps, shared=shared))
    assert decode.programs_per_sm(kernel, h200) == want


def test_programs_per_sm_without_a_register_count():
    assert decode.programs_per_sm(None, torch.device("cpu")) is None  # the interpreter returns no compiled kernel
    assert decode.programs_per_sm(SimpleNamespace(n_regs=None, metadata=None), torch.device("cpu")) is None


def test_occupancy_is_keyed_by_config_and_geometry():
    lay = layout(get_format("kvarn_k4v2_g128"), 128)
    a = decode._per_sm_key(decode.DEFAULT_CONFIG, lay, 4)
    assert a != decode._per_sm_key(decode.DEFAULT_CONFIG, layout(get_format("kvarn_k4v2_g128"), 64), 4)
    assert a != decode._per_sm_key(decode.DecodeConfig(2, 2, 1, 4, 5, maxnreg=128, layout=2, bn=8, pipe=1), lay, 4)
    assert a != decode._per_sm_key(decode.DEFAULT_CONFIG, lay, 8)
