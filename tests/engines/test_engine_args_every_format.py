"""The vLLM arguments of every registered KV format as bench's cells, eval's jobs and lm-eval's model_args pass them,
written out in full: the engine's settings, what the format needs (kv_cache_dtype; block_size = a KVarN tile; a
bfloat16 model for FP8), the user's pass-through last. Bench's order is also its `vllm serve` flag order and
lm-eval's is what the results store keeps, so both are compared as ordered items."""
import json

import pytest

from kvarn.engines.vllm_args import llm_kwargs
from kvarn.eval.engines import VLLMConfig, VLLMEngine
from kvarn.eval.harness import model_args
from kvarn.formats import REGISTRY, get_format

FORMATS = sorted(REGISTRY)


def _format_part(fmt, dtype=None) -> dict:
    out = {"kv_cache_dtype": fmt.name}
    if fmt.block_size:
        out["block_size"] = fmt.block_size
    if dtype or fmt.family == "fp8":
        out["dtype"] = dtype or "bfloat16"
    return out


@pytest.mark.parametrize("name", FORMATS)
def test_bench_cell_arguments(bench_cfg, name):
    fmt = get_format(name)
    got = llm_kwargs(bench_cfg(name), "/m")
    want = {"model": "/m", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "seed": 0, "max_model_len": 4096,
            "disable_log_stats": False, "load_format": "dummy", "skip_tokenizer_init": True, **_format_part(fmt)}
    assert list(got.items()) == list(want.items())
    got = llm_kwargs(bench_cfg(name, tp=2, max_num_seqs=8, dummy_weights=False, model_dtype="float16",
                               engine_args='{"block_size": 32, "enforce_eager": true}'), "/m")
    want = {"model": "/m", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.9, "seed": 0, "max_model_len": 4096,
            "disable_log_stats": False, "max_num_seqs": 8, **_format_part(fmt, "float16")}
    want.update(block_size=32, enforce_eager=True)  # the user's engine arguments win
    assert list(got.items()) == list(want.items())


@pytest.mark.parametrize("name", FORMATS)
def test_eval_job_arguments(name):
    fmt = get_format(name)
    part = _format_part(fmt)
    base = {"model": "/m", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.85, "enforce_eager": True, "seed": 0,
            **part, "dtype": part.get("dtype", "auto")}
    eng = VLLMEngine(VLLMConfig(model="/m"), None)
    assert eng._llm_args(fmt, None, None) == base
    # a generation job's prefill budget caps the batch; a scoring job runs one sequence at a time
    assert eng._llm_args(fmt, 512, None) == {**base, "enable_chunked_prefill": True, "max_num_batched_tokens": 512,
                                             "max_num_seqs": 256}
    assert eng._llm_args(fmt, 64, 1) == {**base, "enable_chunked_prefill": True, "max_num_batched_tokens": 64,
                                         "max_num_seqs": 1}
    eng = VLLMEngine(VLLMConfig(model="/m", tp=2, dtype="float16", max_model_len=2048, seed=3,
                                extra={"max_num_seqs": 4, "enforce_eager": False}), None)
    assert eng._llm_args(fmt, None, 16) == {**base, "tensor_parallel_size": 2, "seed": 3, "max_model_len": 2048,
                                            "dtype": "float16", "max_num_seqs": 4, "enforce_eager": False}


@pytest.mark.parametrize("name", FORMATS)
def test_lm_eval_model_arguments(name):
    fmt = get_format(name)
    got = model_args("/m", fmt, 2, 5)
    want = {"pretrained": "/m", "kv_cache_dtype": fmt.name, "tensor_parallel_size": 2, "seed": 5,
            "gpu_memory_utilization": 0.85, **_format_part(fmt)}
    assert json.dumps(got) == json.dumps(want)
    got = model_args("/m", fmt, 1, 0, {"dtype": "float16", "max_model_len": 4096})
    assert got["dtype"] == "float16" and got["max_model_len"] == 4096 and got["kv_cache_dtype"] == fmt.name
