"""Pure functions of kvarn bench: token counts, lists, SLOs, engine args, burst split, vllm-bench metrics, ratios."""
import math

import pytest

from kvarn.bench.config import BenchConfig
from kvarn.bench.metrics import RequestRecord, max_concurrency_at, percentile, summarize
from kvarn.bench.parsing import parse_engine_args, parse_goodput, parse_int_list, parse_token_list, parse_tokens
from kvarn.bench.plan import split_burst
from kvarn.bench.ratios import fp16_reference, ratios
from kvarn.errors import KvarnError


@pytest.mark.parametrize("text,tokens", [("4k", 4096), ("16k", 16384), ("16K", 16384), ("32768", 32768),
                                         ("0.5k", 512), ("1m", 1048576)])
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("bad", ["16q", "", "k", "-4k", "0", "1.3k", "4 k b"])
def test_parse_tokens_rejects(bad):
    with pytest.raises(KvarnError, match="--burst"):
        parse_tokens(bad)


def test_lists_goodput_engine_args():
    assert parse_token_list("4k, 16k,4k") == [4096, 16384]
    assert parse_int_list("1,2,2", "--tp") == [1, 2]
    with pytest.raises(KvarnError):
        parse_int_list("1,x", "--tp")
    assert parse_goodput(["ttft:500 tpot:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in (["ttft=5"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(KvarnError, match="--goodput"):
            parse_goodput(bad)
    assert parse_engine_args(["enforce-eager=true", "max_num_batched_tokens=8192", "x=abc", "d={\"a\": 1}"]) == \
        {"enforce_eager": True, "max_num_batched_tokens": 8192, "x": "abc", "d": {"a": 1}}
    with pytest.raises(KvarnError, match="key=value"):
        parse_engine_args(["novalue"])


def test_split_burst():
    assert split_burst(16384, None, None) == (2048, 14336)  # prompt = 1/8: short prompt, long generation
    assert split_burst(16384, 14336, None) == (14336, 2048)
    assert split_burst(2048, None, 1024) == (1024, 1024)
    assert split_burst(288, 256, 32) == (256, 32)
    with pytest.raises(KvarnError, match="differs"):
        split_burst(300, 256, 32)
    with pytest.raises(KvarnError, match="no output"):
        split_burst(256, 256, None)


def test_metrics_match_vllm_bench_definitions():
    # two requests: 4 tokens with gaps 0.1,0.2,0.3 after a 1.0 s TTFT; one 1-token request; one failure
    a = RequestRecord(prompt_len=10, ttft=1.0, itl=[0.1, 0.2, 0.3], latency=1.6, output_tokens=4, success=True)
    b = RequestRecord(prompt_len=10, ttft=0.5, itl=[], latency=0.5, output_tokens=1, success=True)
    c = RequestRecord(prompt_len=10, error="boom")
    m = summarize([a, b, c], duration_s=2.0, goodput={"ttft": 800, "tpot": 250})
    assert m["completed"] == 2 and m["failed_requests"] == 1
    assert m["output_tok_s"] == pytest.approx(5 / 2.0) and m["total_tok_s"] == pytest.approx(25 / 2.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["tpot_ms_p50"] == pytest.approx(200.0)  # (1.6 - 1.0) / 3, only requests with > 1 token
    assert m["ttft_ms_p50"] == pytest.approx(750.0)  # numpy-style linear interpolation
    assert m["itl_ms_p99"] == pytest.approx(percentile([0.1, 0.2, 0.3], 99) * 1000)
    assert m["itl_ms_max"] == pytest.approx(300.0)
    assert m["e2el_ms_p90"] == pytest.approx((0.5 + 0.9 * 1.1) * 1000)
    # goodput: a fails ttft (1000 > 800); b passes (its TPOT counts as 0)
    assert m["goodput_req_s"] == pytest.approx(0.5)
    assert math.isclose(max_concurrency_at(1000, 16, 4096), 1000 / 256)
    assert math.isnan(max_concurrency_at(None, 16, 4096))


def _cfg(kv="auto", **kw):
    base = dict(model="m", kv_dtype=kv, tp=1, engine="vllm", mode="offline", burst=4096, prompt_len=512,
                output_len=3584, requests=8, gpu_memory_utilization=0.9, max_num_seqs=None, dummy_weights=True, seed=0)
    base.update(kw)
    return BenchConfig(**base)


def test_config_hash_is_stable_and_mode_aware():
    assert _cfg().hash == _cfg(model_path="/elsewhere").hash  # where it loads from is not its identity
    assert _cfg().hash != _cfg(kv="fp8").hash
    assert _cfg().hash == _cfg(request_rate=5.0).hash  # serve-only fields never split offline cells
    assert _cfg(mode="serve").hash != _cfg(mode="serve", request_rate=5.0).hash


def test_ratios_pick_the_fp16_row_of_the_same_group():
    fp16 = {"status": "ok", "kv_dtype": "auto", "model": "m", "tp": 1, "burst": 4096, "prompt_len": 512,
            "output_len": 3584, "requests": 8, "engine": "vllm", "mode": "offline", "run_id": "r", "repeat": 0,
            "kv_tokens": 1000.0, "output_tok_s": 100.0}
    other_tp = {**fp16, "tp": 2, "kv_tokens": 5.0}
    row = {**fp16, "kv_dtype": "fp8", "kv_tokens": 2000.0, "output_tok_s": 110.0}
    ref = fp16_reference(row, [other_tp, fp16])
    assert ref is fp16
    r = ratios(row, ref)
    assert r["kv_ratio_vs_fp16"] == pytest.approx(2.0) and r["output_tok_s_ratio_vs_fp16"] == pytest.approx(1.1)
    assert fp16_reference({**row, "burst": 1}, [fp16]) is None
    # KV capacity scales with the memory budget: an FP16 row at another gpu_memory_utilization (or max_num_seqs,
    # engine arguments, seed) is not this row's baseline; unset and default spellings match
    for k, v in (("gpu_memory_utilization", 0.5), ("max_num_seqs", 64), ("engine_args", '{"enforce_eager": true}'),
                 ("seed", 1)):
        assert fp16_reference({**row, k: v}, [{**fp16, k: {"seed": 0}.get(k, 0.9)}]) is None, k
    assert fp16_reference({**row, "engine_args": "{}", "max_num_seqs": None},
                          [{**fp16, "engine_args": None, "max_num_seqs": float("nan")}]) is not None


def test_ratios_find_an_fp16_row_read_back_as_floats():
    """Parquet gives numeric columns back as floats (4096.0) when any row lacks them, and that is still the same
    setting as this run's ints (4096)."""
    fp16 = {"status": "ok", "kv_dtype": "auto", "model": "m", "tp": 1, "burst": 4096.0, "prompt_len": 512.0,
            "output_len": 3584.0, "requests": 8.0, "engine": "vllm", "mode": "offline", "run_id": "r",
            "repeat": 0, "kv_tokens": 1000.0, "output_tok_s": 100.0, "row_id": "f16"}
    row = {**fp16, "kv_dtype": "fp8", "burst": 4096, "prompt_len": 512, "output_len": 3584, "requests": 8,
           "kv_tokens": 2000.0, "row_id": "x"}
    assert fp16_reference(row, [fp16]) is fp16
    assert fp16_reference({**row, "burst": 4097}, [fp16]) is None
    assert fp16_reference({**row, "tp": 2.0}, [fp16]) is None


def test_ratios_never_pair_across_runs_or_gpus_unless_asked():
    """A stored FP16 row of another run (or another GPU) is not this row's baseline: no silent fallback; a
    cross-run ratio is asked for by run id and says so; every ratio names the FP16 row, run and GPU it used."""
    fp16 = {"status": "ok", "kv_dtype": "auto", "model": "m", "tp": 1, "burst": 4096, "prompt_len": 512,
            "output_len": 3584, "requests": 8, "engine": "vllm", "mode": "offline", "run_id": "old", "repeat": 0,
            "kv_tokens": 1000.0, "output_tok_s": 100.0, "row_id": "f16old", "gpu_name": "H200"}
    row = {**fp16, "kv_dtype": "fp8", "run_id": "new", "row_id": "x", "kv_tokens": 2000.0}
    assert fp16_reference(row, [fp16]) is None
    r = ratios(row, None)
    assert math.isnan(r["kv_ratio_vs_fp16"]) and r["ratio_scope"] == "unpaired" and r["fp16_row_id"] == ""
    assert fp16_reference(row, [{**fp16, "run_id": "new", "gpu_name": "A100"}]) is None
    ref = fp16_reference(row, [fp16], baseline_run="old")
    r = ratios(row, ref)
    assert r["kv_ratio_vs_fp16"] == pytest.approx(2.0)
    assert (r["fp16_row_id"], r["fp16_run_id"], r["fp16_gpu"], r["ratio_scope"]) == ("f16old", "old", "H200",
                                                                                      "cross-run")
    same = {**fp16, "run_id": "new", "row_id": "f16new", "kv_tokens": 500.0}
    r = ratios(row, fp16_reference(row, [fp16, same]))
    assert r["kv_ratio_vs_fp16"] == pytest.approx(4.0) and r["ratio_scope"] == "same-run"
    assert r["fp16_row_id"] == "f16new"
    # another repeat only: the mean over that run's repeats, naming every row it averaged
    reps = [{**same, "repeat": 1, "row_id": "a", "kv_tokens": 400.0},
            {**same, "repeat": 2, "row_id": "b", "kv_tokens": 600.0}]
    r = ratios(row, fp16_reference(row, reps))
    assert r["kv_ratio_vs_fp16"] == pytest.approx(4.0) and r["fp16_row_id"] == "a,b"


def test_with_ratios_labels_each_row():
    import pandas as pd

    from kvarn.bench.ratios import with_ratios

    base = {"status": "ok", "model": "m", "tp": 1, "burst": 4096, "prompt_len": 512, "output_len": 3584,
            "requests": 8, "engine": "vllm", "mode": "offline", "repeat": 0, "output_tok_s": 100.0}
    df = pd.DataFrame([{**base, "kv_dtype": "auto", "run_id": "a", "row_id": "fa", "kv_tokens": 100.0},
                       {**base, "kv_dtype": "fp8", "run_id": "a", "row_id": "ca", "kv_tokens": 200.0},
                       {**base, "kv_dtype": "fp8", "run_id": "b", "row_id": "cb", "kv_tokens": 300.0}])
    out = with_ratios(df).set_index("row_id")
    assert out.loc["ca", "kv_ratio_vs_fp16"] == pytest.approx(2.0) and out.loc["ca", "fp16_row_id"] == "fa"
    assert out.loc["fa", "ratio_scope"] == "same-run"
    assert math.isnan(out.loc["cb", "kv_ratio_vs_fp16"]) and out.loc["cb", "ratio_scope"] == "unpaired"
    cross = with_ratios(df, baseline_run="a").set_index("row_id")
    assert cross.loc["cb", "kv_ratio_vs_fp16"] == pytest.approx(3.0)
    assert cross.loc["cb", "ratio_scope"] == "cross-run"
