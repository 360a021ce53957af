"""`kvarn eval --harness lm-eval`: lm-eval mocked at its boundary (a fake `lm_eval` package on PYTHONPATH whose
simple_evaluate records its arguments and returns lm-eval-shaped results)."""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.helpers import run_cli
from kvarn.eval.engines import parse_kv_args
from kvarn.eval.harness import model_args, primary_metric
from kvarn.formats import get_format
from kvarn.results import ResultsStore

FAKE = textwrap.dedent('''
    import json, os
    __version__ = "0.4.13-fake"

    def simple_evaluate(model, model_args, tasks, limit=None, log_samples=True, **kw):
        with open(os.environ["FAKE_LM_EVAL_LOG"], "a") as f:
            f.write(json.dumps({"model": model, "model_args": model_args, "tasks": tasks, "limit": limit,
                                "log_samples": log_samples, **{k: v for k, v in kw.items()}}) + "\\n")
        kv = model_args["kv_cache_dtype"]
        n = limit or 10
        # fp16 gets docs 0..n-1 right except doc 0; kvarn additionally misses docs 1 and 2
        bad = {0} if kv == "auto" else {0, 1, 2}
        results, samples = {}, {}
        for t in tasks:
            if t == "wikitext":  # a perplexity task: corpus-level values, per-doc (loglik, words) pairs
                ppl = 20.0 if kv == "auto" else 22.0
                results[t] = {"alias": t, "word_perplexity,none": ppl, "word_perplexity_stderr,none": "N/A",
                              "byte_perplexity,none": 1.5, "bits_per_byte,none": 0.6}
                samples[t] = [{"doc_id": i, "filter": "none", "word_perplexity": [-50.0, 20]} for i in range(n)]
                continue
            per = [0.0 if i in bad else 1.0 for i in range(n)]
            acc = sum(per) / n
            results[t] = {"alias": t, "exact_match,strict-match": acc, "exact_match_stderr,strict-match": 0.1,
                          "exact_match,flexible-extract": acc}
            samples[t] = [{"doc_id": i, "filter": f, "exact_match": v, "resps": [["x"]]}
                          for i, v in enumerate(per) for f in ("strict-match", "flexible-extract")]
        return {"results": results, "samples": samples, "n-samples": {t: {"original": 100, "effective": n}
                                                                      for t in tasks}}
''')


@pytest.fixture
def fake_lm_eval(tmp_path):
    pkg = tmp_path / "fake" / "lm_eval"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE)
    log = tmp_path / "calls.jsonl"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), root, os.environ.get("PYTHONPATH", "")]),
           "FAKE_LM_EVAL_LOG": str(log)}
    return env, log


def test_bridge_runs_each_format_and_stores_paired_metrics(tmp_path, fake_lm_eval):
    env, log = fake_lm_eval
    out = tmp_path / "res"
    r = run_cli("eval", "--harness", "lm-eval", "--tasks", "gsm8k,aime25", "--kv-dtype", "kvarn_k4v2_g128",
                "--weights", "/models/m", "--limit", "10", "--seed", "3", "--out", str(out), "--json",
                "--model-args", "max_model_len=4096,enforce_eager=true", env=env)
    assert r.returncode == 0, r.stderr
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert [c["model_args"]["kv_cache_dtype"] for c in calls] == ["auto", "kvarn_k4v2_g128"]
    c = calls[1]
    assert c["model"] == "vllm" and c["tasks"] == ["gsm8k", "aime25"] and c["limit"] == 10 and c["log_samples"]
    assert c["model_args"]["block_size"] == 128 and c["model_args"]["pretrained"] == "/models/m"
    assert c["model_args"]["max_model_len"] == 4096 and c["model_args"]["enforce_eager"] is True
    assert c["random_seed"] == 3
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    by = {(x["task"], x["kv_dtype"]): x for x in rows}
    q = by[("lm-eval:gsm8k", "kvarn_k4v2_g128")]
    assert q["accuracy"] == pytest.approx(0.7) and q["lm_eval_value"] == pytest.approx(0.7)
    assert q["lm_eval_metric"] == "exact_match,strict-match" and q["n"] == 10
    assert q["delta_vs_fp16"] == pytest.approx(-0.2) and q["delta_ci_high"] <= 0 < q["ci_high"]
    assert by[("lm-eval:gsm8k", "auto")]["delta_vs_fp16"] == 0.0
    store = ResultsStore(out)
    assert len(store.read("eval")) == 4
    s = store.read("sample")
    assert len(s) == 40 and set(s["task"]) == {"lm-eval:gsm8k", "lm-eval:aime25"}


def test_bridge_perplexity_task_is_a_ppl_row_and_unused_flags_are_refused(tmp_path, fake_lm_eval):
    env, _ = fake_lm_eval
    r = run_cli("eval", "--harness", "lm-eval", "--tasks", "wikitext", "--kv-dtype", "kvarn_k4v2_g128",
                "--weights", "/models/m", "--limit", "4", "--out", str(tmp_path / "res"), "--json", env=env)
    assert r.returncode == 0, r.stderr
    by = {x["kv_dtype"]: x for x in (json.loads(l) for l in r.stdout.splitlines() if l.startswith("{"))}
    q = by["kvarn_k4v2_g128"]
    assert q["metric"] == "ppl" and q["lm_eval_metric"] == "word_perplexity,none" and q["ppl"] == 22.0
    assert q["delta_vs_fp16"] == pytest.approx(2.0) and q["ppl_rise_pct"] == pytest.approx(10.0)
    assert "accuracy" not in q or q["accuracy"] is None
    # generation settings belong to lm-eval's task config: a flag the bridge would ignore is one clear line
    r = run_cli("eval", "--harness", "lm-eval", "--tasks", "gsm8k", "--samples", "4", "--max-tokens", "64", env=env)
    assert r.returncode == 2 and "not used with --harness lm-eval: --samples, --max-tokens" in r.stderr


def test_bridge_failure_is_a_failed_row(tmp_path, fake_lm_eval):
    env, _ = fake_lm_eval
    (tmp_path / "fake" / "lm_eval" / "__init__.py").write_text("def simple_evaluate(**kw):\n    raise SystemExit(3)\n")
    r = run_cli("eval", "--harness", "lm-eval", "--tasks", "gsm8k", "--out", str(tmp_path / "r"), "--json", env=env)
    assert r.returncode == 1
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert {x["status"] for x in rows} == {"failed"} and "exited 3" in rows[0]["error"]


def test_bridge_needs_tasks_and_lm_eval(tmp_path):
    r = run_cli("eval", "--harness", "lm-eval", "--out", str(tmp_path))
    assert r.returncode == 2 and ("--tasks" in r.stderr or "needs lm-eval" in r.stderr)


def test_helpers():
    assert parse_kv_args("a=1,b=0.5,c=true,d=x") == {"a": 1, "b": 0.5, "c": True, "d": "x"}
    assert primary_metric({"alias": "g", "exact_match,flexible-extract": 0.1, "exact_match,strict-match": 0.2,
                           "exact_match_stderr,strict-match": 0.01}) == "exact_match,strict-match"
    a = model_args("m", get_format("fp8"), 2, 0)
    assert a["dtype"] == "bfloat16" and a["tensor_parallel_size"] == 2 and "block_size" not in a
