"""`kvarn eval ppl --engine vllm` when vLLM's prompt log-probs come back NaN (vLLM mocked by a fake `vllm` package on
the worker's PYTHONPATH): that format's row is failed, naming the format, the window and the token, the CLI exits
1, and a failed fp16 baseline shows no difference to itself."""
from __future__ import annotations

import json
import math
import os
import textwrap

import pytest

from kvarn.engines import gpus
from kvarn.eval import runner as R
from kvarn.eval.engines import VLLMConfig, VLLMEngine
from tests.eval.helpers import FakeTok
from tests.helpers import cli

FAKE = textwrap.dedent('''
    import os

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class _O:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class LLM:
        def __init__(self, **kw):
            self.kv = kw["kv_cache_dtype"]

        def generate(self, prompts, sp, use_tqdm=False):
            bad = self.kv in os.environ.get("FAKE_VLLM_NAN", "").split(",")
            outs = []
            for p in prompts:
                ids = p["prompt_token_ids"]
                lps = [None] + [{t: _O(logprob=float("nan") if bad and i == 5 else -1.0)} for i, t in
                                enumerate(ids[1:], 1)]
                outs.append(_O(prompt_logprobs=lps, outputs=[]))
            return outs
''')


@pytest.fixture
def nan_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "fakevllm" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fakevllm"), root,
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(gpus, "wait_for_free_memory", lambda *a, **k: "")  # the fake engine holds no GPU
    return lambda formats: monkeypatch.setenv("FAKE_VLLM_NAN", formats)


def _rows(tmp_path, kv_dtypes="kvarn_k4v2_g128"):
    o = R.EvalOptions(task="ppl", engine="hf", context="64", limit=2, kv_dtypes=kv_dtypes, out=str(tmp_path / "res"))
    eng = VLLMEngine(VLLMConfig(model="/models/m", timeout_s=60, log_dir=str(tmp_path / "logs")), FakeTok())
    return {r["kv_dtype"]: r for r in R.run_eval(o, engine_obj=eng)}


def test_nan_log_probs_fail_that_format_naming_format_window_and_token(tmp_path, nan_vllm):
    nan_vllm("kvarn_k4v2_g128")
    by = _rows(tmp_path)
    assert by["auto"]["status"] == "ok" and by["auto"]["ppl"] == pytest.approx(math.e)
    q = by["kvarn_k4v2_g128"]
    assert q["status"] == "failed"
    assert "vLLM returned non-finite log-probs for kv dtype kvarn_k4v2_g128 at window 0, token 5 (nan)" in q["error"]
    assert "--dtype" in q["error"]
    assert q.get("ppl") is None or math.isnan(q["ppl"])


def test_a_failed_baseline_has_no_zero_difference(tmp_path, nan_vllm):
    nan_vllm("auto")
    by = _rows(tmp_path)
    b = by["auto"]
    assert b["status"] == "failed" and "for kv dtype auto at window 0" in b["error"]
    for c in ("delta_vs_fp16", "delta_ci_low", "delta_ci_high"):
        assert math.isnan(b[c]), (c, b[c])
    assert by["kvarn_k4v2_g128"]["status"] == "ok"


def test_cli_exits_1_and_the_table_shows_no_difference_for_the_failed_baseline(tmp_path, nan_vllm, monkeypatch):
    nan_vllm("auto")
    monkeypatch.setattr(gpus, "vllm_available", lambda: True)
    model = tmp_path / "m"
    model.mkdir()
    text = tmp_path / "t.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 40)
    monkeypatch.setattr("kvarn.eval.engines.load_tokenizer", lambda src: FakeTok())
    args = ["eval", "ppl", "--engine", "vllm", "--model", str(model), "--data", str(text), "--context", "64",
            "--limit", "2", "--kv-dtype", "kvarn_k4v2_g128", "--out", str(tmp_path / "res")]
    code, out, err = cli(*args, "--json")
    assert code == 1, out + err
    rows = {r["kv_dtype"]: r for r in (json.loads(x) for x in out.splitlines() if x.startswith("{"))}
    assert rows["auto"]["status"] == "failed" and "vLLM returned non-finite log-probs" in rows["auto"]["error"]
    code, out, err = cli(*args, "--out", str(tmp_path / "res2"))
    assert code == 1, out + err
    line = next(x for x in out.splitlines() if "auto" in x and "failed" in x)
    assert "+0.0" not in line and "- [-, -]" in line
