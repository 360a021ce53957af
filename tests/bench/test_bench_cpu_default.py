"""The main job on a CPU box: the default plan is the fast set at a tile-dominated context, and its rows and table
say that throughput is CPU-measured and carry the accuracy axis (chunked perplexity through each format)."""
import pytest

from kvarn.bench.plan import DEFAULT_KV_DTYPES, HF_KV_DTYPES, BenchOptions, build_plan
from kvarn.results import ResultsStore
from kvarn_cli.app import main
from tests.helpers import TINY_LLAMA


@pytest.fixture
def cpu_box(tiny_llama, monkeypatch):
    monkeypatch.setattr("kvarn.bench.plan.DEFAULT_MODEL", str(tiny_llama))  # the embedded default, pointed at the tiny model
    from kvarn.engines import gpus

    monkeypatch.setattr(gpus, "vllm_available", lambda: False)
    monkeypatch.setattr("kvarn.bench.plan._cuda", lambda: False)
    return tiny_llama


def test_default_plan_is_the_fast_set_at_full_tiles(cpu_box, tmp_path):
    plan = build_plan(BenchOptions(out=str(tmp_path / "res")))
    assert plan.engine.name == "hf"
    assert [c.kv_dtype for c in plan.configs] == list(HF_KV_DTYPES) == ["auto", "fp8", "kvarn_k4v2_g128"]
    assert not any(k.startswith("turboquant") for k in HF_KV_DTYPES)
    c = plan.configs[0]
    # most of each request's context sits in full 128-token tiles, not in the 16-bit tail
    assert c.prompt_len >= 4 * 128 and (c.prompt_len + c.output_len) % 128 < 64
    notes = " ".join(plan.notes)
    assert "says nothing about vLLM's speed on a GPU" in notes
    assert "turboquant_4bit_nc, turboquant_k3v4_nc take minutes per cell" in notes
    # named, the slow formats run
    plan = build_plan(BenchOptions(out=str(tmp_path / "res"), kv_dtype="auto,turboquant_k3v4_nc"))
    assert [c.kv_dtype for c in plan.configs] == ["auto", "turboquant_k3v4_nc"]
    assert "take minutes per cell" not in " ".join(plan.notes)


def test_vllm_default_set_keeps_turboquant():
    assert {"turboquant_4bit_nc", "turboquant_k3v4_nc"} <= set(DEFAULT_KV_DTYPES)


class _Tok:
    """Stands in for a tokenizer: byte values modulo the tiny model's vocabulary."""

    def __call__(self, text, return_tensors="pt"):
        import torch

        ids = torch.tensor([[b % TINY_LLAMA["vocab_size"] for b in text.encode()[:4096]]])
        return type("Enc", (), {"input_ids": ids})()


def test_rows_and_table_carry_the_cpu_label_and_the_accuracy_column(cpu_box, tmp_path, monkeypatch, capsys):
    """Real weights (a seeded tiny model with a tokenizer) get chunked perplexity per format and its change vs the
    one fp16 reference."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvarn.bench.engines import hf_engine

    def load(cfg, device):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model_path)).eval(), 0.0, _Tok()

    monkeypatch.setattr(hf_engine, "load_hf_model", load)
    monkeypatch.setattr("kvarn.bench.plan.weights_source", lambda engine, shape: str(cpu_box))
    res = tmp_path / "res"
    assert main(["bench", "--out", str(res), "--real-weights", "--output-len", "8", "--prompt-len", "512"]) == 0
    text = capsys.readouterr().out
    df = ResultsStore(res).read("bench").set_index("kv_dtype")
    assert list(df.index) == ["auto", "fp8", "kvarn_k4v2_g128"] and set(df.status) == {"ok"}
    assert set(df.hf_device) == {"cpu"}
    assert df.loc["auto", "ppl_delta_pct"] == 0.0 and df.loc["auto", "ppl"] == df.loc["auto", "ppl_fp16"]
    assert df.ppl.notna().all() and df.loc["kvarn_k4v2_g128", "ppl_delta_pct"] != 0.0
    # 4 stored tiles (57 B per token and head) beside 8 tail + 16 sink + 64 window tokens 16-bit (256 B):
    # 520 x 256 / (512 x 57 + 88 x 256) = 2.57
    assert 2.5 < df.loc["kvarn_k4v2_g128", "kv_ratio_vs_fp16"] < 2.65
    assert "measured on the CPU" in text and "not representative of a GPU" in text
    assert "Δ ppl" in text and "CPU tok/s" in text and "…" not in text  # fits an 80-column terminal
    assert "Triton" not in text


def test_a_cpu_stall_blames_no_kernel_compile():
    from kvarn.bench.view import stall_notes

    row = {"status": "ok", "engine": "hf", "kv_dtype": "fp8", "repeat": 0, "itl_ms_max": 5_000.0,
           "itl_ms_p50": 40.0, "preemptions": 0.0}
    (note,) = stall_notes([row])
    assert "compiles nothing" in note and "Triton" not in note and "kernel compil" not in note
