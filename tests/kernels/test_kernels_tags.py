"""kvarn.kernels.tags (a decode-only step's sink and window bookkeeping in one launch) against the torch form
(step_plan.update_sink_lens / update_window_lens), in the Triton interpreter on CPU and compiled on a GPU: the same
tags and lengths after every step of random decode sequences, with stale tags naming the blocks a step writes,
claims below the sink, window writes, rows with no token, and more rows and slots than one vector step holds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvarn.errors import KvarnError
from kvarn.kernels.tags import decode_tags
from kvarn.vllm_plugin import step_plan

G, SINK, W = 128, 16, 32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _seq_lens(rng, n):
    """Lengths where the bookkeeping turns: within the sink, at and around tile ends, in a tile's window."""
    tile = rng.integers(0, 6, n) * G
    near = rng.choice([1, 2, SINK - 1, SINK, SINK + 1, G - W, G - W + 1, G - 1, G, G + 1], n)
    return np.maximum(tile + near, 1)


def _step(rng, S, R, n_new, pool, device):
    """One decode-only step: rows [0, n_new) with a token (distinct slots), the rest none (some on the scratch
    slot); block ids drawn from a small pool, so tags and rows name the same blocks often."""
    slots = rng.permutation(S - 1)[:R].astype(np.int32)
    slots[n_new:][rng.random(R - n_new) < 0.5] = S - 1
    seq = _seq_lens(rng, R)
    seq[n_new:][rng.random(R - n_new) < 0.3] = 0
    width = int(seq.max()) // G + 2
    bt = torch.from_numpy(rng.integers(0, pool, (R, width)).astype(np.int32)).to(device)
    qsl = np.concatenate([np.arange(n_new + 1), np.full(R - n_new, n_new)])
    return qsl, seq, slots, bt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("S,R,window", [(7, 5, W), (200, 150, W), (40, 33, 0)])
def test_decode_tags_match_the_torch_bookkeeping(S, R, window, device):
    rng = np.random.default_rng(S + R + window)
    pool = 3 * S
    st = torch.from_numpy(rng.integers(-1, pool, S).astype(np.int32)).to(device)
    wt = torch.from_numpy(rng.integers(-1, pool, (S, 2)).astype(np.int32)).to(device)
    tags = {"torch": (st, wt), "kernel": (st.clone(), wt.clone())}
    seen = []
    for step in range(6):
        n_new = R if step % 2 else int(rng.integers(1, R + 1))
        qsl, seq, slots, bt = _step(rng, S, R, n_new, pool, device)
        # some rows' slots already name their first block and the tile before their newest (an earlier step's
        # claims), which this step's clearing may or may not undo
        plant = (rng.random(R) < 0.5) & (np.arange(R) < n_new)  # distinct slots
        wt_tile = np.maximum((seq - 1) // G - 1, 0)
        for st, wt in tags.values():
            rows = torch.from_numpy(np.nonzero(plant)[0]).to(device)
            st[slots[plant].tolist()] = bt[rows, 0]
            tiles = torch.from_numpy(wt_tile[plant]).to(device)
            wt[slots[plant].tolist(), (wt_tile[plant] % 2).tolist()] = bt[rows, tiles]
        lens = {}
        for path, (st, wt) in tags.items():
            slots_dev = torch.from_numpy(slots).to(device)
            plan = step_plan.plan_step(qsl, seq, R, slots, bt, G, device, decode_minimal=True,
                                       tail_slots_dev=slots_dev, sink=SINK, window=window)
            assert plan.decode_only
            sl = torch.full((R + 3,), 99, dtype=torch.int32, device=device)
            wl = torch.full((R + 3,), 99, dtype=torch.int32, device=device)
            seq_dev = torch.from_numpy(seq.astype(np.int32)).to(device) if path == "kernel" else None
            step_plan.update_lens(plan, st, wt, bt, sl, wl, seq_lens_dev=seq_dev)
            lens[path] = (plan.sink_lens.tolist(), None if plan.win_lens is None else plan.win_lens.tolist(),
                          sl[R:].tolist(), wl[R:].tolist())
        assert lens["kernel"] == lens["torch"], f"step {step}"
        assert torch.equal(tags["kernel"][0], tags["torch"][0]), f"step {step}: sink tags"
        assert torch.equal(tags["kernel"][1], tags["torch"][1]), f"step {step}: window tags"
        assert lens["torch"][2] == [99] * 3  # rows past the step's untouched
        seen += [(sink, win) for sink, win in zip(lens["torch"][0], lens["torch"][1] or [None] * R)]
    # the cases the comparison is about occurred: each length both granted and refused
    assert {SINK, 0} <= {a for a, _ in seen} and (window == 0 or {W, 0} <= {b for _, b in seen})


def test_decode_tags_refuse_what_they_cannot_index():
    i32 = lambda *s: torch.zeros(*s, dtype=torch.int32)  # noqa: E731
    with pytest.raises(KvarnError, match="sink_tags must be contiguous int32"):
        decode_tags(i32(4), i32(4, 2), i32(4), 4, 4, torch.zeros(5, dtype=torch.int64), i32(4), i32(5, 2), i32(4),
                    G, SINK, W)
    with pytest.raises(KvarnError, match=r"rows with a new token \(5\) must be within the step's rows \(4\)"):
        decode_tags(i32(4), i32(4, 2), i32(4), 4, 5, i32(5), i32(4), i32(5, 2), i32(4), G, SINK, W)
    with pytest.raises(KvarnError, match="block_table must have >= 4 rows"):
        decode_tags(i32(4), i32(3, 2), i32(4), 4, 4, i32(5), i32(4), i32(5, 2), i32(4), G, SINK, W)
    with pytest.raises(KvarnError, match=r"win_lens must be \[>= 4\], got \(3,\)"):
        decode_tags(i32(4), i32(4, 2), i32(4), 4, 4, i32(5), i32(4), i32(5, 2), i32(3), G, SINK, W)
    with pytest.raises(KvarnError, match=r"sink_tags \[S\] and win_tags \[S, 2\] must agree"):
        decode_tags(i32(4), i32(4, 2), i32(4), 4, 4, i32(5), i32(4), i32(6, 2), i32(4), G, SINK, W)
