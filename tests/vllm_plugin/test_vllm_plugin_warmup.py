"""The engine-start warm-up (kvarn.vllm_plugin.warmup) must run every kind of step a serving run sends through the
backend, so that no kernel compiles mid-run (the GPU half: tests/kernels/test_kernels_gpu.py's no-compile test)."""
from __future__ import annotations

import os

import pytest
import torch

from kvarn.formats import get_format
from kvarn.kernels import runtime
from kvarn.vllm_plugin import warmup


def test_synthetic_steps_cover_every_step_kind():
    fmt = get_format("kvarn_k4v2_g128")
    p1, p2, p3 = warmup.synthetic_steps(2, 4, 64, torch.float32, fmt, "cpu")
    # fresh prompts completing a tile each: the tile store and raw attention
    assert p1.num_tiles == 2 and list(p1.raw_rows) == [0, 1] and p1.tail_tok is not None
    # a mixed step: one decode row (eager decode attention) and one continuation chunk (the prefill path)
    assert not p2.decode_only and list(p2.dec_rows) == [0] and list(p2.cont_rows) == [1] and p2.num_tiles == 0
    # a decode-only step (store_decode + decode attention, run eagerly)
    assert p3.decode_only and list(p3.seq_lens) == [fmt.group + 5, fmt.group + 8]


def test_warm_up_is_a_no_op_off_cuda():
    assert warmup.warm_up(2, 4, 64, torch.float32, get_format("kvarn_k4v2_g128"), "cpu") == 0.0


_NO_COMPILE_AFTER_WARM_UP = r"""
import json, sys
import numpy as np
import torch
from triton import knobs
from kvarn.formats import get_format
from kvarn.vllm_plugin import ops, step_plan
from kvarn.vllm_plugin.warmup import _torch_varlen, warm_up

compiles, phase = [], ["warm-up"]
knobs.compilation.listener = lambda *, src=None, **_: compiles.append((phase[0], getattr(src, "name", "?")))
fmt, dev, dt = get_format(sys.argv[1]), torch.device("cuda"), torch.bfloat16
defer = sys.argv[2] == "defer"  # the backend's deferred flush: every decode-only step carries a device flag
H, Hq, D, g = 8, 32, 128, fmt.group
warm_up(H, Hq, D, dt, fmt, dev, defer=defer)
phase[0] = "serving"
# serving-like steps of other sizes: 17 prompts (17 tiles in one store), then 16 decode rows + 1 continuation chunk,
# then an eager decode-only step of 17 rows (row, tile and split counts of 1, 16 and 17 all differ from warm-up's)
R, nb = 17, 5
cache = torch.zeros(R * nb + 1, H, fmt.record_bytes(D), dtype=torch.uint8, device=dev)
tk = torch.zeros(R + 1, H, fmt.tail_rows, D, dtype=dt, device=dev)
tv = torch.zeros_like(tk)
bt = (1 + torch.arange(R * nb, dtype=torch.int32, device=dev)).view(R, nb)
slots = np.arange(R, dtype=np.int32)
tags = torch.full((R + 1,), -1, dtype=torch.int32, device=dev)
sl_buf = torch.zeros(R + 1, dtype=torch.int32, device=dev)
wtags = torch.full((R + 1, 2), -1, dtype=torch.int32, device=dev)
wl_buf = torch.zeros(R + 1, dtype=torch.int32, device=dev)
fa = _torch_varlen(D ** -0.5)  # the warm-up's own FlashAttention stand-in (torch)
lens = np.zeros(R, dtype=np.int64)
for qlen in (np.full(R, g + 9), np.array([1] * (R - 1) + [300])):
    qsl = np.concatenate([[0], np.cumsum(qlen)]); seq = lens + qlen
    plan = step_plan.plan_step(qsl, seq, R, slots, bt, g, dev, sink=fmt.sink_tokens, window=fmt.window_tokens)
    step_plan.update_sink_lens(plan, tags, bt, sl_buf)
    step_plan.update_window_lens(plan, wtags, bt, wl_buf)
    n = int(qsl[-1]); q = torch.randn(n, Hq, D, device=dev, dtype=dt)
    k, v = torch.randn(n, H, D, device=dev, dtype=dt), torch.randn(n, H, D, device=dev, dtype=dt)
    ops.store(plan, k, v, cache, tk, tv, fmt)
    ops.attention(plan, q, k, v, torch.empty_like(q), cache, bt, torch.from_numpy(seq.astype(np.int32)).to(dev),
                  tk, tv, fmt, D ** -0.5, raw_varlen=fa)
    lens = seq
seq = lens + 1; sd = torch.from_numpy(seq.astype(np.int32)).to(dev); td = torch.from_numpy(slots).to(dev)
plan = step_plan.plan_step(np.arange(R + 1), seq, R, slots, bt, g, dev, decode_minimal=True, tail_slots_dev=td,
                           sink=fmt.sink_tokens, window=fmt.window_tokens)
step_plan.update_lens(plan, tags, wtags, bt, sl_buf, wl_buf, seq_lens_dev=sd)  # the builder's one launch
if defer:
    plan.defer = torch.zeros(1, dtype=torch.int32, device=dev)
q = torch.randn(R, Hq, D, device=dev, dtype=dt)
ops.decode_step(plan, q, q[:, :H], q[:, :H], torch.empty_like(q), cache, bt, sd, td, tk, tv, fmt, D ** -0.5)
torch.cuda.synchronize()
print(json.dumps(compiles))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("defer", ["no-defer", "defer"])
def test_no_kernel_compiles_mid_run_after_warm_up(tmp_path, defer):
    """A fresh process with an empty Triton cache: warm_up compiles; the serving-like steps after it (other row,
    tile and split counts, a mixed batch, an eager decode-only batch: with the deferred flush, as the backend runs
    it, with a deferral flag) compile nothing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    r = subprocess.run([sys.executable, "-c", _NO_COMPILE_AFTER_WARM_UP, "kvarn_k4v2_g128", defer], capture_output=True,
                       text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    compiles = json.loads(r.stdout.strip().splitlines()[-1])
    assert any(p == "warm-up" for p, _ in compiles), compiles  # the cache was cold: the listener saw the compiles
    assert [c for p, c in compiles if p == "serving"] == []


@pytest.mark.parametrize("noted", ["own-cache", None])
def test_warm_up_compiles_into_the_cache_in_force_at_registration(monkeypatch, tmp_path, noted):
    """vLLM moves TRITON_CACHE_DIR to a folder per engine configuration when it compiles the model; the warm-up's
    compiles go where Triton cached when the plugin registered (unset: Triton's default), and vLLM's setting is back
    afterwards."""
    monkeypatch.setattr(runtime, "_CACHE_DIR", {"noted": False, "dir": None})
    if noted is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / noted))
    runtime.note_compile_cache()
    vllm_dir = str(tmp_path / "torch_compile_cache" / "0123abcd" / "triton_cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", vllm_dir)  # what vLLM sets when it compiles the model
    runtime.note_compile_cache()  # noted once: a second call changes nothing
    seen = []
    note = lambda *a, **k: seen.append(os.environ.get("TRITON_CACHE_DIR"))  # noqa: E731
    monkeypatch.setattr(warmup, "synthetic_steps", note)
    monkeypatch.setattr("kvarn.kernels.store.compile_flush_layers", note)  # the deferred flush's kernel
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(warmup, "_DONE", set())
    assert warmup.warm_up(2, 4, 64, torch.float32, get_format("kvarn_k4v2_g128"), "cuda", defer=True) >= 0.0
    assert seen == [None if noted is None else str(tmp_path / noted)] * 2
    assert os.environ["TRITON_CACHE_DIR"] == vllm_dir


def test_a_failed_warm_up_gives_vllm_its_triton_cache_back(monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "_CACHE_DIR", {"noted": True, "dir": str(tmp_path / "own")})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "vllm"))

    def fail(*a, **k):
        raise RuntimeError("out of shared memory")

    monkeypatch.setattr(warmup, "synthetic_steps", fail)
    monkeypatch.setattr(warmup, "_DONE", set())
    assert warmup.warm_up(2, 4, 64, torch.float32, get_format("kvarn_k4v2_g128"), "cuda") == 0.0
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "vllm")


def test_compile_cache_is_left_alone_without_the_plugin(monkeypatch):
    monkeypatch.setattr(runtime, "_CACHE_DIR", {"noted": False, "dir": None})
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere")
    with runtime.kernel_compile_cache():
        assert os.environ["TRITON_CACHE_DIR"] == "/somewhere"
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere"
