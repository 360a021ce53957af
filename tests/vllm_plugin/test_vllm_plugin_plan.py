"""The vectorized step-plan builder (`step_plan.plan_step`) against the per-row loop it replaced
(`tests/plan_reference.py`): every field equal, dtypes and None-ness included, on randomized batches."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvarn.vllm_plugin import step_plan
from tests.plan_reference import build_plan_reference


def assert_same_plan(new: step_plan.StepPlan, ref: step_plan.StepPlan):
    for f in dataclasses.fields(step_plan.StepPlan):
        a, b = getattr(new, f.name), getattr(ref, f.name)
        if b is None or a is None:
            assert a is None and b is None, f.name
        elif isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.device == b.device, f.name
            assert torch.equal(a, b), f.name
        elif isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype, f.name
            assert np.array_equal(a, b), f.name
        else:
            assert type(a) is type(b) and a == b, f.name
    assert new.pure_prefill == ref.pure_prefill


def random_row(rng, g):
    """(ctx, q) of one batch row of a random kind."""
    kind = rng.integers(0, 9)
    if kind == 0:  # decode, anywhere
        return int(rng.integers(1, 40 * g)), 1
    if kind == 1:  # decode completing a tile (empty tail afterwards)
        return int(rng.integers(1, 40)) * g - 1, 1
    if kind == 2:  # decode starting a new tile
        return int(rng.integers(1, 40)) * g, 1
    if kind == 3:  # first prefill chunk, maybe a whole number of tiles
        return 0, int(rng.choice([rng.integers(1, 5 * g), g * rng.integers(1, 5)]))
    if kind == 4:  # continuation chunk starting mid-tile, spanning several tiles
        return int(rng.integers(1, 10 * g)), int(rng.integers(g, 5 * g))
    if kind == 5:  # prefix hit / continuation starting on a tile boundary
        return g * int(rng.integers(1, 20)), int(rng.integers(2, 4 * g))
    if kind == 6:  # chunk that stays inside one tile (no tile completes)
        c = g * int(rng.integers(0, 20)) + int(rng.integers(1, g // 2))
        return c, int(rng.integers(2, g // 2))
    if kind == 7:  # chunk ending exactly on a tile boundary (empty tail)
        c = int(rng.integers(1, 10 * g))
        return c, (-c) % g or g
    return -1, 0  # padded row


def random_batch(rng, g, R, scratch=300, torch_qsl=False):
    ctx, qlen = [], []
    for _ in range(R):
        c, q = random_row(rng, g)
        ctx.append(max(c, 0)); qlen.append(q)
    ctx, qlen = np.array(ctx, dtype=np.int64), np.array(qlen, dtype=np.int64)
    seq = np.where(qlen > 0, ctx + qlen, 0)
    extra = int(rng.integers(0, 3))  # host arrays may be longer than num_reqs
    qsl = np.zeros(R + 1 + extra, dtype=np.int32)
    qsl[1:R + 1] = np.cumsum(qlen)
    qsl[R + 1:] = qsl[R]
    seq_cpu = np.concatenate([seq, np.zeros(extra, dtype=np.int64)]).astype(np.int32)
    slots = rng.permutation(scratch)[:R].astype(np.int32)
    slots[qlen == 0] = scratch
    width = max(1, int(-(-seq.max() // g)) if R else 1) + int(rng.integers(0, 3))
    bt = torch.from_numpy(rng.integers(-1, 10_000, size=(R, width)).astype(np.int32))
    qsl_in = torch.from_numpy(qsl) if torch_qsl else qsl
    return qsl_in, seq_cpu, R, slots, bt


@pytest.mark.parametrize("g", [16, 64, 128])
def test_vectorized_plan_equals_reference_loop(g):
    rng = np.random.default_rng(g)
    for trial in range(150):
        R = int(rng.choice([0, 1, 2, 3, rng.integers(4, 40), rng.integers(40, 260)]))
        args = random_batch(rng, g, R, torch_qsl=bool(trial % 2))
        assert_same_plan(step_plan.plan_step(*args, g, "cpu"), build_plan_reference(*args, g, "cpu"))


@pytest.mark.parametrize("case", ["all_decode", "all_first_chunks", "all_padded", "decode_no_tiles", "single_token"])
def test_vectorized_plan_equals_reference_loop_edge_batches(case):
    g = 64
    if case == "all_decode":  # every row completes a tile (no tail tokens, every tile half from the tail)
        ctx = np.arange(1, 65) * g - 1; q = np.ones(64, dtype=np.int64)
    elif case == "all_first_chunks":  # pure prefill: plain slices downstream, no tail gathers
        ctx = np.zeros(5, dtype=np.int64); q = np.array([g, 3 * g, 1, g + 7, 2 * g - 1])
    elif case == "all_padded":
        ctx = np.zeros(4, dtype=np.int64); q = np.zeros(4, dtype=np.int64)
    elif case == "decode_no_tiles":  # decodes only into tails: no tile completes
        ctx = np.arange(1, 33) * g + 5; q = np.ones(32, dtype=np.int64)
    else:
        ctx = np.array([0]); q = np.array([1])
    R = len(q)
    seq = np.where(q > 0, ctx + q, 0).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    slots = np.arange(R, dtype=np.int32)
    bt = torch.arange(R * 80, dtype=torch.int32).view(R, 80)
    assert_same_plan(step_plan.plan_step(qsl, seq, R, slots, bt, g, "cpu"),
                     build_plan_reference(qsl, seq, R, slots, bt, g, "cpu"))
