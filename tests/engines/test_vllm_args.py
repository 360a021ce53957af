"""vLLM engine arguments per KV format: one rule set (format_args) under bench's cells and eval's jobs."""
import pytest

from kvarn.engines.vllm_args import format_args, llm_kwargs, serve_argv


def test_vllm_kwargs_and_serve_flags(bench_cfg):
    kw = llm_kwargs(bench_cfg("fp8"), "/m")
    assert kw["dtype"] == "bfloat16" and kw["load_format"] == "dummy" and kw["max_model_len"] == 4096
    assert kw["disable_log_stats"] is False and kw["kv_cache_dtype"] == "fp8"
    kv = llm_kwargs(bench_cfg("kvarn_k4v2_g128", engine_args='{"enforce_eager": true}'), "/m")
    assert kv["block_size"] == 128 and kv["enforce_eager"] is True and "dtype" not in kv
    argv = serve_argv(kv, "127.0.0.1", 8001)
    assert argv[:2] == ["serve", "/m"] and "--enforce-eager" in argv and "--disable-log-stats" not in argv
    assert argv[argv.index("--block-size") + 1] == "128" and argv[argv.index("--host") + 1] == "127.0.0.1"


def test_format_args_rules():
    assert format_args("fp8") == {"kv_cache_dtype": "fp8", "dtype": "bfloat16"}  # FA3: no fp8 KV with fp16 output
    assert format_args("fp8", "auto")["dtype"] == "bfloat16"
    assert format_args("fp8", "float16")["dtype"] == "float16"  # the user's choice stands (bench's check refuses it)
    assert format_args("kvarn_k4v2_g128") == {"kv_cache_dtype": "kvarn_k4v2_g128", "block_size": 128}
    assert format_args("auto") == {"kv_cache_dtype": "auto"}
    assert format_args("auto", "bfloat16")["dtype"] == "bfloat16"


@pytest.mark.parametrize("kv, model_dtype", [("fp8", None), ("fp8", "bfloat16"), ("kvarn_k4v2_g128", None),
                                             ("kvarn_k4v2_g64", "float16"), ("auto", None),
                                             ("turboquant_4bit_nc", None)])
def test_bench_and_eval_build_the_same_format_arguments(bench_cfg, kv, model_dtype):
    """The per-format part of a bench cell's LLM(...) and of an eval job's is the same: both call format_args."""
    from kvarn.eval.engines import VLLMConfig, VLLMEngine
    from kvarn.formats import get_format

    fmt = get_format(kv)
    bench = llm_kwargs(bench_cfg(kv, model_dtype=model_dtype), "/m")
    evaluated = VLLMEngine(VLLMConfig(model="/m", dtype=model_dtype or "auto"), None)._llm_args(fmt, None, None)
    for k, v in format_args(kv, model_dtype).items():
        assert bench[k] == v and evaluated[k] == v, k
    assert evaluated["dtype"] == bench.get("dtype", "auto")  # "auto": vLLM's default, as bench leaves it unset
    if fmt.family == "fp8" and not model_dtype:
        assert bench["dtype"] == evaluated["dtype"] == "bfloat16"
    if fmt.family == "kvarn":
        assert bench["block_size"] == evaluated["block_size"] == fmt.block_size == int(kv.rsplit("_g", 1)[1])
