"""kvarn gate on results directories that hold reruns: the newest row of each (configuration, repeat) counts, and
rows of different configurations are never pooled into one cell's median."""
import pytest

from kvarn.gate import markdown, run_gate
from kvarn.report.fixtures import bench_config, bench_row
from kvarn.results import ResultsStore, config_hash
from tests.helpers import run_cli
from tests.gate_helpers import BASE_TPS, M, hf_run, write_bench

KV = "kvarn_k4v2_g128"
SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _rerun(root, kv, tps, *, repeats=(0, 1, 2), run_id="forced", **over):
    """Rows a later `kvarn bench --force` (or a resumed call) of one format adds: same config hash and repeats."""
    rows = []
    for r in repeats:
        row = bench_row(M, kv, 1, repeat=r, output_tok_s=tps, kv_tokens=3_600_000, burst=16384, run_id=run_id,
                        kv_ratio_vs_fp16=4.5, output_tok_s_ratio_vs_fp16=tps / BASE_TPS["auto"],
                        ratio_scope="same-run", fp16_run_id=run_id)
        row.update(over)
        rows.append(row)
    ResultsStore(root).append(rows)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return write_bench(tmp_path_factory.mktemp("base"), BASE_TPS, run_id="base")


def test_self_gate_passes_after_a_failed_cell_was_retried(tmp_path):
    one = tmp_path / "one"
    ResultsStore(one).append([bench_row(SMOL, k, 1, repeat=0, status="timeout", error="no result after 2 s",
                                        burst=192, prompt_len=64, output_len=128, requests=2, engine="hf",
                                        run_id="first") for k in ("auto", "fp8", KV)])
    hf_run(one, repeats=1, run_id="resumed", model=SMOL)  # the resumed call reruns the timed-out cells
    r = run_cli("gate", str(one), "--baseline", str(one), "--min-repeats", "1", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    v = run_gate(one, one, min_repeats=1)
    assert v["invalid_runs"] == [] and v["summary"]["failed"] == 0
    assert any("3 bench rows superseded" in n for n in v["notes"])


def test_a_failure_retried_in_a_three_repeat_run_counts_once(tmp_path, baseline):
    new = write_bench(tmp_path / "new", BASE_TPS, bad={(KV, 1): {"status": "failed", "error": "engine died"}})
    _rerun(new, KV, BASE_TPS[KV], repeats=(1,), run_id="resumed")  # the resumed call reruns the failed repeat
    v = run_gate(new, baseline)
    assert v["exit_code"] == 0, markdown(v)
    tps = next(c for c in v["checks"] if c["metric"] == "output_tok_s" and c["cell"]["kv_dtype"] == KV)
    assert tps["repeats"] == 3 and tps["runs"] == 3


def test_forced_rerun_supersedes_the_older_run(tmp_path, baseline):
    same = write_bench(tmp_path / "same", BASE_TPS, run_id="base")
    write_bench(same, BASE_TPS, run_id="forced")  # `cp -r base same; kvarn bench --out same --force`
    v = run_gate(same, baseline)
    assert v["exit_code"] == 0, markdown(v)
    assert {c["repeats"] for c in v["checks"] if c["kind"] == "perf"} == {3}
    # the forced rerun's numbers are the ones judged: a slower rerun fails although the older run passes
    slow = write_bench(tmp_path / "slow", BASE_TPS, run_id="base")
    write_bench(slow, {**BASE_TPS, KV: BASE_TPS[KV] * 0.9}, run_id="forced")
    v = run_gate(slow, baseline)
    fails = {(c["cell"]["kv_dtype"], c["metric"]): c for c in v["checks"] if c["status"] == "fail"}
    assert v["exit_code"] == 1 and set(fails) == {(KV, "output_tok_s"), (KV, "output_tok_s_ratio_vs_fp16")}
    assert fails[(KV, "output_tok_s")]["new"] == pytest.approx(BASE_TPS[KV] * 0.9, rel=1e-3)


def test_forced_rerun_that_fails_is_not_hidden_by_the_older_ok_row(tmp_path, baseline):
    new = write_bench(tmp_path / "new", BASE_TPS, run_id="base")
    _rerun(new, KV, BASE_TPS[KV], repeats=(1,), status="oom", error="CUDA out of memory", completed=0)
    v = run_gate(new, baseline)
    assert v["exit_code"] == 1 and len(v["invalid_runs"]) == 1
    assert v["invalid_runs"][0]["run_id"] == "forced" and "kvarn bench --force" in v["invalid_runs"][0]["reason"]


def test_forced_rerun_of_one_format_names_the_way_to_pair_its_ratios(tmp_path, baseline):
    new = write_bench(tmp_path / "new", BASE_TPS, run_id="base")
    _rerun(new, KV, BASE_TPS[KV], kv_ratio_vs_fp16=float("nan"), output_tok_s_ratio_vs_fp16=float("nan"),
           ratio_scope="unpaired", fp16_run_id=None)
    v = run_gate(new, baseline)
    assert v["exit_code"] == 2 and len(v["problems"]) == 1, markdown(v)
    msg = v["problems"][0]["message"]
    assert "unpaired" in msg and f"kvarn bench --force --kv-dtype auto,{KV}" in msg and "would run over" not in msg


def _dtype_rows(dtype, tps, run_id):
    rows = []
    for kv, kv_tokens in (("auto", 800_000), (KV, 3_600_000)):
        h = config_hash({**bench_config(M, kv, 1, burst=16384), "model_dtype": dtype})
        for r in range(3):
            rows.append(bench_row(M, kv, 1, repeat=r, output_tok_s=tps[kv], kv_tokens=kv_tokens, burst=16384,
                                  run_id=run_id, model_dtype=dtype, config_hash=h))
    return rows


def test_rows_of_different_config_hashes_are_not_pooled(tmp_path):
    both = tmp_path / "both"
    ResultsStore(both).append(_dtype_rows("float32", {"auto": 1000.0, KV: 1500.0}, "f32"))
    ResultsStore(both).append(_dtype_rows("float16", {"auto": 2600.0, KV: 4500.0}, "f16"))
    r = run_cli("gate", str(both), "--baseline", str(both), "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    v = run_gate(both, both)
    tps = {c["label"]: c["new"] for c in v["checks"] if c["metric"] == "output_tok_s"}
    assert len(tps) == 4, tps
    assert tps[f"{M} · TP=1 · {KV} · throughput · burst 16384 · model_dtype float16"] == pytest.approx(4500.0)
    assert tps[f"{M} · TP=1 · {KV} · throughput · burst 16384 · model_dtype float32"] == pytest.approx(1500.0)
    # a float16-only run against that baseline is compared with its float16 cells, not with a pooled median
    f16 = tmp_path / "f16"
    ResultsStore(f16).append(_dtype_rows("float16", {"auto": 2600.0, KV: 4500.0 * 0.9}, "new"))
    v = run_gate(f16, both)
    fails = {(c["label"], c["metric"]) for c in v["checks"] if c["status"] == "fail"}
    assert (f"{M} · TP=1 · {KV} · throughput · burst 16384 · model_dtype float16", "output_tok_s") in fails
    chk = next(c for c in v["checks"] if c["metric"] == "output_tok_s" and "float16" in c["label"]
               and c["cell"]["kv_dtype"] == KV)
    assert chk["baseline"] == pytest.approx(4500.0) and chk["change_pct"] == pytest.approx(-10.0)
    missing = [c["label"] for c in v["checks"] if c["kind"] == "coverage"]
    assert sorted(missing) == [f"{M} · TP=1 · auto · throughput · burst 16384 · model_dtype float32",
                               f"{M} · TP=1 · {KV} · throughput · burst 16384 · model_dtype float32"]
