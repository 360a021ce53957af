"""kvarn suite: YAML validation (one-line errors), the expanded plan, dry-run, running steps through a fake runner."""
import json
import sys

import pytest
import yaml

from kvarn.errors import KvarnError
from kvarn.suite import load_suite, plan, preflight, run_suite, suite_names, validate_suite
from tests.helpers import run_cli

GOOD = {"name": "t", "models": ["qwen3-0.6b", {"name": "qwen3-8b", "tp": [1, 2]}],
        "formats": ["fp16", "fp8", "kvarn_k4v2_g128"],
        "bench": {"bursts": [4096, 16384], "repeats": 3}, "eval": {"tasks": ["ppl", {"name": "aime25", "samples": 8}]}}


def test_bundled_suites_validate():
    assert {"nightly", "paper"} <= set(suite_names()) and "gates" not in suite_names()
    n = load_suite("nightly")
    assert n.formats == ["auto", "fp8", "kvarn_k4v2_g128", "turboquant_k8v4"]
    assert n.bench["bursts"] == [16384] and [t["name"] for t in n.eval["tasks"]] == ["ppl", "niah"]
    p = load_suite("paper")
    assert p.models[0]["tp"] == [2] and p.models[0]["shape"] == "qwen3-32b"
    assert p.eval["tasks"][0] == {"name": "aime25", "args": [], "samples": 8}


def test_plan_is_the_cartesian_product():
    s = validate_suite(GOOD, "t.yaml")
    assert s.bench_cells() == 3 * 3 * 2 and s.eval_cells() == 3 * 3 * 2
    steps = plan(s, "out", resume=True)
    bench = [x for x in steps if x.kind == "bench"]
    evals = [x for x in steps if x.kind == "eval"]
    assert len(bench) == 3 * 2 and len(evals) == 3 * 2  # one subprocess per (model, TP, burst) / (model, TP, task)
    assert bench[0].argv[:3] == ["bench", "--model", "qwen3-0.6b"] and "--resume" not in bench[0].argv  # its default
    assert all("--resume" in e.argv for e in evals)
    assert bench[0].argv[bench[0].argv.index("--kv-dtype") + 1] == "auto,fp8,kvarn_k4v2_g128"
    assert sum(x.runs for x in bench) == s.bench_cells() * 3
    aime = [x for x in evals if "aime25" in x.argv]
    assert aime and aime[0].argv[aime[0].argv.index("--samples") + 1] == "8"
    assert all(x.argv[x.argv.index("--out") + 1] == "out" for x in steps)


def test_workloads_and_dummy_weights():
    # the performance suite: workloads name their models and formats, FP16 first in each, serve ones beside offline
    perf = load_suite("performance")
    steps = plan(perf, "out")
    assert len(steps) == 6 + 3 + 2 and all(x.kind == "bench" for x in steps)  # dummy weights: no eval steps
    first = steps[0].argv
    assert "--dummy-weights" in first and "--weights" not in first and "--pair-fp16" in first
    assert [first[first.index(k) + 1] for k in ("--burst", "--output-len", "--requests")] == ["16384", "2048", "96"]
    assert steps[1].argv[steps[1].argv.index("--output-len") + 1] == "15360" and "1024+15360" in steps[1].title
    big = [x for x in steps if x.argv[x.argv.index("--model") + 1] == "qwen3-32b"]
    assert [x.argv[x.argv.index("--requests") + 1] for x in big] == ["96", "32", "128"]
    assert [x.argv[-2:] for x in big] == [["--max-num-seqs", n] for n in ("96", "32", "128")]  # workload args last
    served = [x for x in steps if x.argv[x.argv.index("--mode") + 1] == "serve"]
    assert [(x.argv[x.argv.index("--model") + 1], x.argv[x.argv.index("--burst") + 1]) for x in served] == [
        ("qwen3-8b", "1280"), ("qwen3-8b", "8448"), ("qwen3-0.6b", "1280")]
    assert all(x.argv[x.argv.index("--kv-dtype") + 1].startswith("auto,") for x in steps)
    assert perf.bench_cells() == 5 * 5 + 2 + 3 + 2 + 2 + 3 + 2 and perf.eval_cells() == 0
    data = {**GOOD, "models": [{"name": "qwen3-8b", "weights": "dummy"}],
            "bench": {"workloads": [{"burst": 4096}, {"burst": 8192, "output_len": 4096, "requests": 8}]}}
    s = validate_suite(data, "w.yaml")
    assert s.bench["workloads"] == [{"burst": 4096, "output_len": 256, "requests": 64, "mode": "throughput"},
                                    {"burst": 8192, "output_len": 4096, "requests": 8, "mode": "throughput"}]
    assert s.eval_cells() == 0 and not [x for x in plan(s, "o") if x.kind == "eval"]
    wls = [{"burst": 4096, "models": ["qwen3-8b"], "args": ["--max-num-seqs", 8]}, {"burst": 2048}]
    only = validate_suite({**data, "models": ["qwen3-0.6b", {"name": "qwen3-8b", "weights": "dummy"}],
                           "bench": {"workloads": wls}}, "w.yaml")
    got = [(x.argv[x.argv.index("--model") + 1], x.argv[x.argv.index("--burst") + 1], x.argv[-2:])
           for x in plan(only, "o") if x.kind == "bench"]
    assert got == [("qwen3-0.6b", "2048", ["--out", "o"]), ("qwen3-8b", "4096", ["--max-num-seqs", "8"]),
                   ("qwen3-8b", "2048", ["--out", "o"])]
    assert only.bench_cells() == 3 * 3
    for bad, msg in (([{"output_len": 8}], r"workloads\[0\] needs a burst"),
                     ([{"burst": 4096, "models": ["qwen3-32b"]}], r"models: 'qwen3-32b' is not a model of this suite"),
                     ([{"burst": 4096, "models": []}], r"models must be a non-empty list"),
                     ([{"burst": 4096, "args": "--max-num-seqs 8"}], r"args must be a list of flags"),
                     ([{"burst": 4096, "reqs": 1}], r"workloads\[0\]: unknown key 'reqs'"),
                     ([{"burst": 4096, "mode": "offline"}], r"workloads\[0\]\.mode must be one of .*'offline'"),
                     ([{"burst": 4096, "output_len": 4096}], "leaves no prompt in burst 4096"), ([], "non-empty list"),
                     ([{"burst": 4096, "formats": ["fp8", "int3"]}], r"formats: 'int3' is not a format of this suite")):
        with pytest.raises(KvarnError, match=msg):
            validate_suite({**data, "bench": {"workloads": bad}}, "w.yaml")


def test_a_workload_can_run_in_serve_mode_beside_offline_ones():
    data = {**GOOD, "models": [{"name": "qwen3-0.6b", "weights": "dummy"}], "eval": None}
    wls = [{"burst": 1280, "output_len": 256, "requests": 32}, {"burst": 1280, "output_len": 256, "mode": "serve"}]
    s = validate_suite({**data, "bench": {"workloads": wls}}, "w.yaml")
    steps = [x for x in plan(s, "o") if x.kind == "bench"]
    assert [a.argv[a.argv.index("--mode") + 1] for a in steps] == ["throughput", "serve"]
    assert " serve " in steps[1].title and " serve" not in steps[0].title


def test_a_workload_runs_its_own_formats_paired_with_fp16_in_one_run():
    data = {**GOOD, "models": [{"name": "qwen3-8b", "weights": "dummy"}], "eval": None,
            "formats": ["auto", "fp8", "kvarn_k4v2_g128", "turboquant_4bit_nc"]}
    wls = [{"burst": 4096, "formats": ["kvarn_k4v2_g128", "auto"]}, {"burst": 2048}]
    s = validate_suite({**data, "bench": {"pair_fp16": True, "repeats": 1, "workloads": wls}}, "w.yaml")
    steps = [x.argv for x in plan(s, "o") if x.kind == "bench"]
    assert [a[a.index("--kv-dtype") + 1] for a in steps] == ["auto,kvarn_k4v2_g128",  # the suite's order: FP16 first
                                                             "auto,fp8,kvarn_k4v2_g128,turboquant_4bit_nc"]
    assert all("--pair-fp16" in a for a in steps) and s.bench_cells() == 2 + 4
    aliased = validate_suite({**data, "bench": {"pair_fp16": True, "workloads": [{"burst": 4096, "formats": ["FP16",
                                                                                                     "fp8_e4m3"]}]}},
                             "w.yaml")
    assert aliased.bench["workloads"][0]["formats"] == ["auto", "fp8"]  # aliases and casing, as the suite's list
    # a workload's formats leave the next workload's models check alone
    both = validate_suite({**data, "bench": {"workloads": [{"burst": 4096, "formats": ["auto", "fp8"]},
                                                           {"burst": 2048, "models": ["qwen3-8b"]}]}}, "w.yaml")
    assert both.bench["workloads"][1]["models"] == ["qwen3-8b"]
    with pytest.raises(KvarnError, match=r"workloads\[0\].formats pairs candidates with the FP16 cell.*got fp8"):
        validate_suite({**data, "bench": {"pair_fp16": True, "workloads": [{"burst": 4096, "formats": ["fp8"]}]}},
                       "w.yaml")


@pytest.mark.parametrize("patch,msg", [
    ({"bogus": 1}, "unknown key 'bogus'"),
    ({"formats": ["fp16", "int3"]}, "unknown kv dtype 'int3'"),
    ({"models": ["gpt-17"]}, "unknown model 'gpt-17'"),
    ({"models": [{"name": "qwen3-8b", "tp": [3]}]}, "--tp 3 does not divide"),
    ({"bench": {"bursts": [16384], "repeat": 3}}, "bench: unknown key 'repeat'"),
    ({"bench": {"bursts": [1_000_000]}}, "exceeds qwen3-8b's context"),
    ({"eval": {"tasks": ["mmlu-pro-max"]}}, "unknown task 'mmlu-pro-max'"),
    ({"bench": {"mode": "offline"}}, "bench.mode must be one of"),
])
def test_validation_errors(patch, msg):
    data = {**GOOD, "models": ["qwen3-8b"], **patch}
    with pytest.raises(KvarnError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
        validate_suite(data, "s.yaml")
    assert "\n" not in str(e.value) and str(e.value).startswith("s.yaml")


def test_cli_dry_run_and_bad_file(tmp_path):
    r = run_cli("suite", "run", "suites/nightly.yaml", "--dry-run", "--resume", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    cmds = [line for line in r.stdout.splitlines() if line.startswith("kvarn ")]
    assert len(cmds) == 3 and cmds[0].startswith("kvarn bench --model qwen3-0.6b")
    assert all(str(tmp_path / "o") in c for c in cmds)
    assert all("--resume" in c for c in cmds if c.startswith("kvarn eval"))
    assert not (tmp_path / "o").exists()  # a dry run writes nothing
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**GOOD, "formats": ["kvarn_k9v9"]}))
    r = run_cli("suite", "run", str(bad), "--dry-run")
    assert r.returncode == 2 and "unknown kv dtype 'kvarn_k9v9'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


FAKE = r'''
import json, sys
args = sys.argv[1:]
if "--help" in args:
    print("--model --weights --kv-dtype --tp --mode --burst --output-len --requests --repeats --out --resume "
          "--task --samples --limit --context")
    sys.exit(0)
with open(sys.argv[0] + ".calls", "a") as f:
    f.write(json.dumps(args) + "\n")
print("ran", args[0])
sys.exit(3 if args[0] == "eval" and "aime25" in args else 0)
'''


def test_run_records_steps_and_failures(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE)
    s = validate_suite({**GOOD, "models": ["qwen3-0.6b"]}, tmp_path / "s.yaml")
    steps = plan(s, tmp_path / "out")
    preflight(steps, [sys.executable, str(fake)])  # every flag is in the fake --help
    lines = []
    m = run_suite(s, steps, tmp_path / "out", runner=[sys.executable, str(fake)], echo=lines.append)
    calls = [json.loads(x) for x in (tmp_path / "fake.py.calls").read_text().splitlines()]
    assert [c[0] for c in calls] == [x.argv[0] for x in steps] and len(calls) == 4
    assert m["failed_steps"] == 1 and [x["exit_code"] for x in m["steps"]].count(3) == 1
    assert json.loads((tmp_path / "out" / "suite-manifest.json").read_text())["suite_sha256"]
    assert any("FAILED (exit 3)" in x for x in lines)
    assert (tmp_path / "out" / "suite-logs" / "01-bench.log").read_text().startswith("ran bench")
    # a CLI that lacks a flag the plan needs is one clear error before anything runs
    fake.write_text(FAKE.replace("--burst ", ""))
    with pytest.raises(KvarnError, match="does not accept --burst"):
        preflight(steps, [sys.executable, str(fake)])


@pytest.mark.parametrize("name", ["nightly", "paper", "readme"])
def test_shipped_suites_pass_preflight_against_the_real_cli(name):
    """Every flag a shipped suite passes exists in the real `kvarn bench/eval --help`."""
    from kvarn.suite import load_suite, plan, preflight

    preflight(plan(load_suite(name), "out", resume=True), [sys.executable, "-m", "kvarn_cli.app"])
