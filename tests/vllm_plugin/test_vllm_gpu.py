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

import pytest
import torch

from tests.helpers import ATOL_KERNEL_PATH, RTOL_KERNEL_PATH, kernel_path_vs_torch_path, one_engine_at_a_time

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


@need_cuda
@pytest.mark.parametrize("name", ["kvarn_k4v2_g128", "kvarn_k4v2_g64"])
def test_ops_kernels_match_torch_path(name):
    """The backend's steps with the Triton kernels on CUDA against the torch path on the CPU, both attending over
    the kernel side's records: every output within the fp16 arithmetic bound (tests/helpers.py), the records and
    tails as the torch store writes them."""
    for step, got, want in kernel_path_vs_torch_path(name, "cuda"):
        if step is None:
            kern, ref = got, want
            break
        torch.testing.assert_close(got, want, atol=ATOL_KERNEL_PATH, rtol=RTOL_KERNEL_PATH, msg=lambda m: f"{step}: {m}")
    a, b = kern["cache"].cpu(), ref["cache"]
    assert (a == b).float().mean() > 0.995  # codes may differ by one on rounding boundaries
    torch.testing.assert_close(kern["tk"].float().cpu(), ref["tk"].half().float())


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
    for attempt in (1, 2):
        with one_engine_at_a_time():
            p = subprocess.run([sys.executable, "-c", ENGINE, kv, "1" if eager else "0", SMOL], capture_output=True,
                               text=True, timeout=600, env={**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", **env})
        # vLLM refuses to start when the GPU's free memory grows while it profiles: another test process of the
        # suite (kernel tests run beside this one) freed memory then. Not this engine's fault: one more start.
        if not (p.returncode and "Error in memory profiling" in p.stderr and attempt == 1):
            break
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
