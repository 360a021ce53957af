"""GPU tests of the vLLM backend (pytest -m gpu). They skip cleanly where CUDA, vLLM or the model are absent.

* test_ops_*: the backend's store/attention with the Triton kernels on CUDA against the exact torch path on CPU
  (no engine; seconds).
* test_engine_*: a real vLLM 0.26 engine with kv_cache_dtype=kvarn_* on SmolLM2-135M (KVARN_SMOL, default
  /tmp/models/smollm2-135m-instruct), both model runners.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvarn.formats import get_format
from kvarn.vllm_plugin import ops

pytestmark = pytest.mark.gpu
CUDA = torch.cuda.is_available()
SMOL = os.environ.get("KVARN_SMOL", "/tmp/models/smollm2-135m-instruct")


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


need_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _step(device, dtype, fmt, D, sched, state):
    """One step of a two-request batch on `device`; `state` carries cache/tails/blocks between steps."""
    g = fmt.group
    qsl, seq, rows, qs, ks, vs = [0], [], [], [], [], []
    for rid, n in sched:
        r = state["reqs"][rid]
        qs.append(r["q"][r["done"]:r["done"] + n]); ks.append(r["k"][r["done"]:r["done"] + n])
        vs.append(r["v"][r["done"]:r["done"] + n])
        r["done"] += n
        seq.append(r["done"]); qsl.append(qsl[-1] + n); rows.append(r["slot"])
    bt = torch.stack([state["reqs"][rid]["blocks"] for rid, _ in sched]).to(device)
    q, k, v = (torch.cat(x).to(device, dtype) for x in (qs, ks, vs))
    plan = ops.build_plan(np.array(qsl), np.array(seq), len(seq), np.array(rows, dtype=np.int32), bt, g, device)
    ops.store(plan, k, v, state["cache"], state["tk"], state["tv"], fmt)
    out = torch.zeros_like(q)
    ops.attention(plan, q, k, v, out, state["cache"], bt, torch.tensor(seq, dtype=torch.int32, device=device),
                  state["tk"], state["tv"], fmt, D ** -0.5)
    return out.float().cpu()


@need_cuda
@pytest.mark.parametrize("name", ["kvarn_k4v2_g128", "kvarn_k4v2_g64"])
def test_ops_kernels_match_torch_path(name):
    fmt = get_format(name)
    D, HK, HQ, g = 64, 3, 9, fmt.group
    gen = torch.Generator().manual_seed(0)
    base = {rid: {"q": torch.randn(3 * g, HQ, D, generator=gen), "k": torch.randn(3 * g, HK, D, generator=gen),
                  "v": torch.randn(3 * g, HK, D, generator=gen)} for rid in ("a", "b")}
    states = {}
    for dev, dt in (("cuda", torch.float16), ("cpu", torch.float32)):
        reqs = {rid: dict(x, done=0, slot=i, blocks=torch.tensor([1 + 3 * i, 2 + 3 * i, 3 + 3 * i], dtype=torch.int32))
                for i, (rid, x) in enumerate(base.items())}
        for r in reqs.values():  # the cpu run sees the same fp16-rounded inputs
            for key in ("q", "k", "v"):
                r[key] = r[key].half().float()
        states[dev] = {"reqs": reqs, "cache": torch.zeros(8, HK, fmt.record_bytes(D), dtype=torch.uint8, device=dev),
                       "tk": torch.zeros(3, HK, g, D, dtype=dt, device=dev),
                       "tv": torch.zeros(3, HK, g, D, dtype=dt, device=dev), "dt": dt}
    steps = [[("a", g // 2)], [("a", g), ("b", g + 5)], [("a", 1), ("b", 7)], [("a", 1), ("b", 1)]]
    for sched in steps:
        o_gpu = _step("cuda", torch.float16, fmt, D, sched, states["cuda"])
        o_cpu = _step("cpu", torch.float32, fmt, D, sched, states["cpu"])
        torch.testing.assert_close(o_gpu, o_cpu, atol=3e-2, rtol=3e-2)
    a, b = states["cuda"]["cache"].cpu(), states["cpu"]["cache"]
    assert (a == b).float().mean() > 0.995  # codes may differ by one on rounding boundaries
    torch.testing.assert_close(states["cuda"]["tk"].float().cpu(), states["cpu"]["tk"].half().float())


ENGINE = r"""
import json, sys
from vllm import LLM, SamplingParams
kv, eager = sys.argv[1], sys.argv[2] == "1"
llm = LLM(model=sys.argv[3], dtype="float16", kv_cache_dtype=kv, block_size=128 if kv != "auto" else None,
          enforce_eager=eager, gpu_memory_utilization=0.3, max_model_len=2048, max_num_seqs=8,
          enable_chunked_prefill=True, max_num_batched_tokens=128)
cc = llm.llm_engine.vllm_config.cache_config
o = llm.generate(["Call me Ishmael. Some years ago, never mind how long precisely,"] * 2,
                 SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
print("RESULT", json.dumps({"blocks": cc.num_gpu_blocks, "block": cc.block_size,
                            "ids": [list(x.outputs[0].token_ids) for x in o]}))
"""


def _engine(kv: str, eager: bool, env: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", ENGINE, kv, "1" if eager else "0", SMOL], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", **env})
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(line[-1][7:])


@need_cuda
@pytest.mark.skipif(not _has_vllm(), reason="needs vLLM 0.26")
@pytest.mark.skipif(not os.path.isdir(SMOL), reason=f"needs the SmolLM2 folder at {SMOL}")
@pytest.mark.parametrize("runner", ["1", "0"], ids=["mrv2", "mrv1"])
def test_engine_kvarn_generates_and_counts_blocks(runner):
    env = {"VLLM_USE_V2_MODEL_RUNNER": runner}
    fp16 = _engine("auto", True, env)
    kv = _engine("kvarn_k4v2_g128", True, env)
    assert kv["block"] == 128
    # 3 KV heads x 30 layers: 108 B vs 512 B per token per head (minus the tail reservation)
    assert kv["blocks"] * 128 > 3.5 * fp16["blocks"] * fp16["block"]
    assert kv["ids"][0] == kv["ids"][1]  # deterministic across batch rows
    assert kv["ids"][0][:4] == fp16["ids"][0][:4]
