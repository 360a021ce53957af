"""kvarn gate: validated medians, relative / absolute bounds, paired accuracy intervals, exit codes and outputs."""
import json

import pytest
import yaml

from kvarn.errors import KvarnError
from kvarn.gate import DEFAULT_POLICY, load_policy, markdown, run_gate, validate_policy
from kvarn.paths import suites_dir
from kvarn.report.fixtures import bench_row, eval_row
from kvarn.results import ResultsStore
from tests.gate_helpers import BASE_TPS, M, hf_run, write_bench
from tests.helpers import run_cli

def write_eval(root, deltas: dict, *, task="aime25", run_id="r"):
    """deltas: kv_dtype -> (delta, (ci_low, ci_high)) as fractions."""
    rows = [eval_row(M, "auto", task, accuracy=0.70, delta=0.0, delta_ci=(0.0, 0.0), run_id=run_id)]
    for kv, (d, ci) in deltas.items():
        rows.append(eval_row(M, kv, task, accuracy=0.70 + d, delta=d, delta_ci=ci, run_id=run_id))
    ResultsStore(root).append(rows)
    return root


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    write_bench(root, BASE_TPS, run_id="base")
    write_eval(root, {"kvarn_k4v2_g128": (-0.01, (-0.05, 0.03))}, run_id="base")
    return root


def test_default_policy_is_the_shipped_yaml():
    assert yaml.safe_load((suites_dir() / "gates.yaml").read_text()) == DEFAULT_POLICY
    assert load_policy(suites_dir() / "gates.yaml") == DEFAULT_POLICY


def test_pass(tmp_path, baseline):
    new = write_bench(tmp_path / "new", {k: v * 0.99 for k, v in BASE_TPS.items()})
    write_eval(new, {"kvarn_k4v2_g128": (-0.012, (-0.05, 0.026))})
    v = run_gate(new, baseline)
    assert v["verdict"] == "pass" and v["exit_code"] == 0, markdown(v)
    metrics = {(c["cell"]["kv_dtype"], c["metric"]) for c in v["checks"]}
    assert ("kvarn_k4v2_g128", "output_tok_s") in metrics and ("kvarn_k4v2_g128", "kv_ratio_vs_fp16") in metrics
    cap = next(c for c in v["checks"] if c["metric"] == "kv_ratio_vs_fp16" and c["cell"]["kv_dtype"] == "kvarn_k4v2_g128")
    assert cap["new"] == pytest.approx(4.5) and ">= 4.4" in cap["bound"]


def test_kvarn_throughput_drop_fails_but_fp8_has_a_looser_bound(tmp_path, baseline):
    # kvarn -6% (> 5% allowed for kvarn), fp8 -6% (< 7% allowed for others)
    new = write_bench(tmp_path / "new", {"auto": 2600.0, "fp8": 3100 * 0.94, "kvarn_k4v2_g128": 4500 * 0.94})
    v = run_gate(new, baseline)
    assert v["verdict"] == "regression" and v["exit_code"] == 1
    fails = [(c["cell"]["kv_dtype"], c["metric"]) for c in v["checks"] if c["status"] == "fail"]
    assert ("kvarn_k4v2_g128", "output_tok_s") in fails
    assert ("fp8", "output_tok_s") not in fails
    md = markdown(v)
    assert "❌ regression" in md and "dropped 6.0% vs baseline (allowed 5%)" in md


def test_capacity_absolute_floor(tmp_path, baseline):
    new = write_bench(tmp_path / "new", BASE_TPS,
                      kv_tokens={"auto": 800_000, "fp8": 1_600_000, "kvarn_k4v2_g128": 3_400_000})  # 4.25x
    v = run_gate(new, baseline)
    c = next(c for c in v["checks"] if c["metric"] == "kv_ratio_vs_fp16" and c["cell"]["kv_dtype"] == "kvarn_k4v2_g128")
    assert c["status"] == "fail" and "< min 4.4" in c["message"]


def test_hidden_regression_in_one_repeat(tmp_path, baseline):
    """Two fast repeats + one run with failed requests: the median alone would pass; validation catches it."""
    bad = {("kvarn_k4v2_g128", 1): {"completed": 40, "output_tok_s": 4600.0}}  # 40 of 64 requests, fast-looking
    new = write_bench(tmp_path / "new", BASE_TPS, bad=bad)
    v = run_gate(new, baseline)
    assert v["verdict"] == "regression" and v["exit_code"] == 1  # default policy: invalid_runs: regression
    assert len(v["invalid_runs"]) == 1 and "only 40 of 64 requests completed" in v["invalid_runs"][0]["reason"]
    validity = [c for c in v["checks"] if c["kind"] == "validity"]
    assert validity and validity[0]["status"] == "fail"
    # the throughput median itself (over the two valid runs) would have passed
    tps = next(c for c in v["checks"] if c["metric"] == "output_tok_s" and c["cell"]["kv_dtype"] == "kvarn_k4v2_g128")
    assert tps["status"] == "pass" and tps["repeats"] == 2
    # policy routes invalid runs to "unusable" instead: exit 2
    pol = validate_policy({"invalid_runs": "unusable"})
    v2 = run_gate(new, baseline, pol)
    assert v2["verdict"] == "unusable" and v2["exit_code"] == 2


def test_oom_repeat_is_invalid(tmp_path, baseline):
    bad = {("fp8", 2): {"status": "oom", "error": "CUDA out of memory", "completed": 0}}
    v = run_gate(write_bench(tmp_path / "new", BASE_TPS, bad=bad), baseline)
    assert v["exit_code"] == 1 and v["invalid_runs"][0]["status"] == "oom"


def test_even_repeats_and_missing_cells(tmp_path, baseline):
    v = run_gate(write_bench(tmp_path / "even", BASE_TPS, repeats=2), baseline)
    assert v["exit_code"] == 2 and any("odd number" in p["message"] for p in v["problems"])
    v = run_gate(write_bench(tmp_path / "missing", {"auto": 2600.0, "fp8": 3100.0}), baseline)
    cov = [c for c in v["checks"] if c["kind"] == "coverage"]
    assert v["exit_code"] == 1 and any("kvarn_k4v2_g128" in c["label"] for c in cov)


@pytest.mark.parametrize("ci,status", [((-0.045, -0.005), "pass"),   # interval includes the -2 pp allowed drop
                                       ((-0.06, -0.025), "fail")])    # interval entirely below -2 pp
def test_accuracy_uses_the_paired_interval(tmp_path, baseline, ci, status):
    new = write_bench(tmp_path / "new", BASE_TPS)
    write_eval(new, {"kvarn_k4v2_g128": (sum(ci) / 2, ci)})
    v = run_gate(new, baseline)
    c = next(c for c in v["checks"] if c["kind"] == "accuracy")
    assert c["status"] == status and c["interval"] == pytest.approx([ci[0] * 100, ci[1] * 100])
    assert v["exit_code"] == (0 if status == "pass" else 1)


def test_perplexity_rule(tmp_path):
    base = tmp_path / "b"
    ResultsStore(base).append([eval_row(M, "auto", "ppl", ppl=10.0, delta=0.0, delta_ci=(0, 0)),
                               eval_row(M, "fp8", "ppl", ppl=10.1, delta=0.1, delta_ci=(0.05, 0.15))])
    new = tmp_path / "n"
    ResultsStore(new).append([eval_row(M, "auto", "ppl", ppl=10.0, delta=0.0, delta_ci=(0, 0)),
                              eval_row(M, "fp8", "ppl", ppl=10.5, delta=0.5, delta_ci=(0.3, 0.7))])  # +3..7 %
    v = run_gate(new, base)
    c = next(c for c in v["checks"] if c["kind"] == "accuracy")
    assert c["status"] == "fail" and c["new"] == pytest.approx(5.0)
    assert run_gate(base, base)["exit_code"] == 0


def test_policy_validation():
    with pytest.raises(KvarnError, match="unknown key 'perff'"):
        validate_policy({"perff": []})
    with pytest.raises(KvarnError, match="sets no bound"):
        validate_policy({"perf": [{"metric": "output_tok_s"}]})
    with pytest.raises(KvarnError, match="invalid_runs must be one of"):
        validate_policy({"invalid_runs": "maybe"})


def test_cli_exit_codes_and_outputs(tmp_path, baseline):
    new = write_bench(tmp_path / "new", {k: v * 0.90 for k, v in BASE_TPS.items()})
    j, md = tmp_path / "v.json", tmp_path / "v.md"
    r = run_cli("gate", str(new), "--baseline", str(baseline), "--json-out", str(j), "--markdown-out", str(md))
    assert r.returncode == 1, r.stderr
    verdict = json.loads(j.read_text())
    assert verdict["verdict"] == "regression" and verdict["summary"]["failed"] >= 3
    assert md.read_text().startswith("## kvarn gate: ❌ regression") and "## kvarn gate" in r.stdout
    r = run_cli("gate", str(baseline), "--baseline", str(baseline), "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("gate", str(tmp_path / "nope"), "--baseline", str(baseline), "--json-out", str(j))
    assert r.returncode == 2 and "does not exist" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert json.loads(j.read_text())["verdict"] == "unusable"
    bad = tmp_path / "p.yaml"
    bad.write_text("repeats: {min: 3}\nwhatever: 1\n")
    r = run_cli("gate", str(baseline), "--baseline", str(baseline), "--policy", str(bad))
    assert r.returncode == 2 and "unknown key 'whatever'" in r.stderr


def test_eval_failure_after_an_ok_row_is_not_hidden(tmp_path, baseline):
    """Only a *later* ok row supersedes a failed eval; an older ok row must not hide a newer failure."""
    kv = "kvarn_k4v2_g128"
    new = write_bench(tmp_path / "new", BASE_TPS)
    ok = [eval_row(M, "auto", "aime25", accuracy=0.7, delta=0.0, delta_ci=(0.0, 0.0), created_at="2026-01-01T00:00:00+00:00"),
          eval_row(M, kv, "aime25", accuracy=0.7, delta=0.0, delta_ci=(-0.01, 0.01), created_at="2026-01-01T00:00:00+00:00")]
    ResultsStore(new).append(ok)
    ResultsStore(new).append([eval_row(M, kv, "aime25", status="failed", error="engine died",
                                       created_at="2026-01-02T00:00:00+00:00")])
    v = run_gate(new, baseline)
    assert v["exit_code"] == 1 and len(v["invalid_runs"]) == 1 and v["invalid_runs"][0]["status"] == "failed"
    # a failure followed by a successful retry is superseded
    retry = write_bench(tmp_path / "retry", BASE_TPS)
    ResultsStore(retry).append([eval_row(M, kv, "aime25", status="failed", error="engine died",
                                         created_at="2025-12-31T00:00:00+00:00")])
    ResultsStore(retry).append(ok)
    v = run_gate(retry, baseline)
    assert v["exit_code"] == 0 and v["invalid_runs"] == [], markdown(v)


def test_median_is_over_an_odd_number_of_runs(tmp_path, baseline):
    """An ignored invalid run leaves an even number of runs behind the median: the median is then no real run, so
    the input is unusable, and the message says how to fill the repeat in."""
    bad = {("kvarn_k4v2_g128", 1): {"status": "oom", "error": "CUDA out of memory", "completed": 0}}
    new = write_bench(tmp_path / "ignored", BASE_TPS, bad=bad)
    v = run_gate(new, baseline, validate_policy({"invalid_runs": "ignore"}))
    assert v["exit_code"] == 2 and any("2 valid runs" in p["message"] and "Rerun kvarn bench" in p["message"]
                                       for p in v["problems"]), markdown(v)
    # a repeat run again (--force into the same directory) counts once: its newest row
    new = write_bench(tmp_path / "dup", BASE_TPS)
    ResultsStore(new).append([bench_row(M, "kvarn_k4v2_g128", 1, repeat=0, output_tok_s=4000.0, kv_tokens=3_600_000,
                                        burst=16384, run_id="r2")])
    v = run_gate(new, baseline)
    tps = next(c for c in v["checks"] if c["metric"] == "output_tok_s" and c["cell"]["kv_dtype"] == "kvarn_k4v2_g128")
    assert v["problems"] == [] and tps["repeats"] == 3 and tps["runs"] == 3, markdown(v)


def test_cli_a_run_gated_against_itself_passes_on_any_engine(tmp_path, baseline):
    cpu = hf_run(tmp_path / "cpu")
    r = run_cli("gate", str(cpu), "--baseline", str(cpu), "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("gate", str(baseline), "--baseline", str(baseline), "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    # the vLLM floor does not reach another engine's cells, but still holds vLLM's own
    v = run_gate(cpu, cpu)
    cap = next(c for c in v["checks"]
               if c["metric"] == "kv_ratio_vs_fp16" and c["cell"]["kv_dtype"] == "kvarn_k4v2_g128")
    assert cap["status"] == "pass" and "4.4" not in cap["bound"]


def test_cli_single_repeat_run_says_how_to_gate_it(tmp_path):
    one = hf_run(tmp_path / "one", repeats=1)
    r = run_cli("gate", str(one), "--baseline", str(one))
    assert r.returncode == 2
    assert r.stdout.count("repeat(s); the policy needs an odd number >= 3") == 1  # one problem, not one per cell
    assert "and 2 more cells" in r.stdout and "--min-repeats 1" in r.stdout
    r = run_cli("gate", str(one), "--baseline", str(one), "--min-repeats", "1", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    pol = tmp_path / "p.yaml"
    pol.write_text("repeats: {min: 1}\n")
    assert run_cli("gate", str(one), "--baseline", str(one), "--policy", str(pol), "-q").returncode == 0
    r = run_cli("gate", str(one), "--baseline", str(one), "--min-repeats", "0")
    assert r.returncode == 2 and "--min-repeats must be >= 1, got 0" in r.stderr


def test_cli_baseline_with_no_cell_in_common_is_one_line(tmp_path, baseline):
    cpu = hf_run(tmp_path / "cpu")
    r = run_cli("gate", str(cpu), "--baseline", str(baseline))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no cell in common with" in lines[0] and "cell present" not in r.stdout
    assert "SmolLM2" in lines[0] and "Qwen3-8B" in lines[0]


def test_absolute_ratio_floor_needs_engine_and_model(tmp_path, baseline):
    pol = tmp_path / "p.yaml"
    pol.write_text("perf:\n  - {metric: kv_ratio_vs_fp16, kv_dtype: kvarn_k4v2_g128, min: 4.4}\n")
    r = run_cli("gate", str(baseline), "--baseline", str(baseline), "--policy", str(pol))
    assert r.returncode == 2 and "add engine and model selectors" in r.stderr
    pol.write_text("perf:\n  - {metric: kv_ratio_vs_fp16, kv_dtype: kvarn_k4v2_g128, engine: hf, model: '*SmolLM2*',"
                   " min: 1.5}\n")
    cpu = hf_run(tmp_path / "cpu")
    assert run_cli("gate", str(cpu), "--baseline", str(cpu), "--policy", str(pol), "-q").returncode == 0


def test_cross_run_ratios_are_labelled_in_the_gate(tmp_path):
    root = tmp_path / "x"
    rows = []
    for k, kv in (("auto", 800_000), ("kvarn_k4v2_g128", 3_600_000)):
        for r in range(3):
            row = bench_row(M, k, 1, repeat=r, output_tok_s=1000.0, kv_tokens=kv, burst=16384, run_id="new")
            if k != "auto":
                row.update(kv_ratio_vs_fp16=4.5, ratio_scope="cross-run", fp16_run_id="old", fp16_row_id="f")
            rows.append(row)
    ResultsStore(root).append(rows)
    v = run_gate(root, root)
    cap = next(c for c in v["checks"] if c["metric"] == "kv_ratio_vs_fp16" and c["cell"]["kv_dtype"] != "auto")
    assert cap.get("cross_run") and "cross-run ratio: FP16 of run old" in cap["message"]
    assert "cross-run ratio: FP16 of run old" in markdown(v)


def test_even_repeats_say_to_rerun_with_an_odd_number(tmp_path):
    two = hf_run(tmp_path / "two", repeats=2)
    v = run_gate(two, two)
    assert v["exit_code"] == 2 and len(v["problems"]) == 1
    msg = v["problems"][0]["message"]
    assert "2 repeat(s)" in msg and "Rerun with an odd number of repeats" in msg and "--min-repeats" not in msg
