"""`kvarn eval` on the transformers engine with a model that overflows in float16 (its config's dtype): a failed row
per format naming where it went non-finite and exit 1, never a NaN perplexity with exit 0; --dtype picks the
model dtype and is recorded in the rows."""
from __future__ import annotations

import json

import pytest

from kvarn.results import ResultsStore
from kvarn_cli.app import main

pytest.importorskip("transformers")


def _eval(capsys, model, text, out, *extra):
    code = main(["eval", "ppl", "--engine", "hf", "--model", str(model), "--data", str(text), "--context", "256",
                 "--limit", "2", "--kv-dtype", "auto,kvarn_k4v2_g128", "--out", str(out), "--json", *extra])
    cap = capsys.readouterr()
    return code, [json.loads(x) for x in cap.out.splitlines() if x.startswith("{")], cap.err


def test_overflow_is_a_failed_row_naming_format_window_and_layer(overflow_model, tmp_path, capsys):
    model, text = overflow_model
    code, rows, err = _eval(capsys, model, text, tmp_path / "r16")
    assert code == 1, err
    by = {r["kv_dtype"]: r for r in rows}
    assert set(by) == {"auto", "kvarn_k4v2_g128"} and {r["status"] for r in rows} == {"failed"}
    e = by["kvarn_k4v2_g128"]["error"]
    assert "non-finite logits for kv dtype kvarn_k4v2_g128, window 0, prefill tokens 0-127" in e
    assert "the first non-finite output is model.layers.1's" in e and "float16" in e
    assert all("ppl" not in r or r["ppl"] != r["ppl"] for r in rows)  # no NaN posing as a perplexity
    stored = ResultsStore(tmp_path / "r16").read("eval")
    assert set(stored["status"]) == {"failed"} and set(stored["model_dtype"]) == {"float16"}


def test_dtype_float32_runs_it_and_is_recorded(overflow_model, tmp_path, capsys):
    model, text = overflow_model
    code, rows, err = _eval(capsys, model, text, tmp_path / "r32", "--dtype", "float32")
    assert code == 0, err
    assert {r["status"] for r in rows} == {"ok"} and all(r["ppl"] > 0 for r in rows)
    assert {r["model_dtype"] for r in rows} == {"float32"}


def test_bad_dtype_one_line_exit_2(capsys):
    assert main(["eval", "ppl", "--engine", "hf", "--dtype", "fp16"]) == 2
    e = capsys.readouterr().err.strip().splitlines()
    assert e == ["error: unknown --dtype 'fp16'; accepted: auto, float16, bfloat16, float32 (auto: the model "
                 "config's dtype)"]


def test_generation_names_the_decode_step(overflow_model):
    """A decode step that goes non-finite (the prefill was fine) fails its format at that step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvarn.eval.engines import EngineError, GenParams, GenRequest, HFEngine
    from kvarn.formats import get_format

    model_dir, _ = overflow_model
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    calls = {"n": 0}

    def poison(mod, args, out):  # forward 1 is the prefill, 2 and 3 the first decode steps
        calls["n"] += 1
        return out * float("nan") if calls["n"] == 3 else out

    m.model.layers[2].self_attn.o_proj.register_forward_hook(poison)
    eng = HFEngine("tiny", model=m, tokenizer=tok)
    with pytest.raises(EngineError) as e:
        list(eng.generate(get_format("auto"), [GenRequest("p0", 0, list(range(3, 40)), 0)], GenParams(max_tokens=6)))
    msg = str(e.value)
    assert "for kv dtype auto, problem p0, decode step 2" in msg and "first non-finite output is model.layers.2's" in msg
    assert e.value.status == "failed"


def test_a_nan_perplexity_from_any_engine_is_a_failed_row(tmp_path):
    """An engine that hands back NaN log-likelihoods (vLLM's prompt log-probs of an overflowing model): the row is
    failed with the reason, never ok with ppl NaN."""
    from kvarn.eval import runner as R
    from kvarn.eval.engines import ScoreResult
    from tests.eval.helpers import FakeEngine

    class NanEngine(FakeEngine):
        def score(self, fmt, windows, chunk):
            for wid, toks in windows:
                yield ScoreResult(wid, float("nan"), len(toks) - 1)

    opts = R.EvalOptions(task="ppl", engine="hf", out=str(tmp_path / "res"), context="64", limit=2,
                         kv_dtypes="kvarn_k4v2_g128")
    rows = R.run_eval(opts, engine_obj=NanEngine())
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert "log-likelihood of window 0 is nan (non-finite) for kv dtype auto" in rows[0]["error"]
    assert "--dtype" in rows[0]["error"] and all(r.get("ppl") is None or r["ppl"] != r["ppl"] for r in rows)
