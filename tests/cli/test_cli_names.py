"""The CLI speaks the ecosystem's names (vLLM's, lm-eval's) and is consistent with itself: one unit for timeouts,
one `--tp`, `--version`, flags that take no value, impossible combinations caught with values that then work."""
import pytest

from kvarn.report.fixtures import write_demo_results
from tests.helpers import cli


@pytest.fixture
def cpu_box(tiny_llama, monkeypatch):
    from kvarn.engines import gpus

    monkeypatch.setattr(gpus, "vllm_available", lambda: False)
    return tiny_llama


def test_version():
    code, out, _ = cli("--version")
    assert code == 0 and out.strip() == "kvarn 0.1.0"


def test_flags_show_no_value_type_and_take_no_value(tmp_path):
    code, out, _ = cli("results", "--help")
    assert code == 0 and "--json" in out and "<bool>" not in out and "<str>" in out  # options keep their type
    code, _, err = cli("results", "--json", "true")
    assert code == 2 and "--json is a flag and takes no value: 'true' was read as the directory" in err
    assert len(err.strip().splitlines()) == 1


def test_bench_takes_vllm_bench_names(cpu_box, tmp_path):
    code, out, err = cli("bench", "--dry-run", "--model", str(cpu_box), "--out", str(tmp_path / "r"),
                         "--kv-cache-dtype", "auto,fp8",
                         "--input-len", "256", "--output-len", "32", "--num-prompts", "3",
                         "--tensor-parallel-size", "1")
    assert code == 0, err
    assert "3x(256+32)" in out and "fp8" in out and "kvarn_k4v2_g128" not in out


@pytest.mark.parametrize("tp, says", [
    ("4", "--tp 4 does not divide the 2 attention heads"),  # the tiny model's 2 heads
    ("2", "--tp 2: the hf engine runs on one device"),
])
def test_bench_tp_beyond_the_machine_offers_only_what_runs(cpu_box, tmp_path, tp, says):
    code, _, err = cli("bench", "--dry-run", "--model", str(cpu_box), "--out", str(tmp_path / "r"), "--tp", tp)
    assert code == 2 and says in err and "accepted: 1" in err and "accepted: 1, 2" not in err
    ok = cli("bench", "--dry-run", "--model", str(cpu_box), "--out", str(tmp_path / "r"), "--tp", "1")
    assert ok[0] == 0  # the value offered works


def test_tp_is_one_option_everywhere():
    for cmd in ("bench", "eval", "capacity"):
        code, out, _ = cli(cmd, "--help")
        assert code == 0 and "--tensor-parallel-size" in out and "--kv-cache-dtype" in out, cmd
    code, _, err = cli("eval", "ppl", "--tp", "1,2")
    assert code == 2 and "runs one tensor-parallel size" in err
    code, _, err = cli("capacity", "--tp", "x")
    assert code == 2 and "--tp 'x' is not an integer >= 1" in err
    code, out, _ = cli("capacity", "--model", "qwen3-8b", "--tensor-parallel-size", "2", "--kv-dtype", "auto")
    assert code == 0 and "TP=2" in out


def test_eval_takes_lm_eval_names_and_seconds():
    code, out, _ = cli("eval", "--help")
    assert code == 0 and "--num-fewshot" in out and "--limit" in out and "--tasks" in out
    assert "--timeout-min" not in out and "Seconds" in out
    code, _, err = cli("eval", "--tasks", "gsm8k,niah")
    assert code == 2 and "runs one task per call" in err
    code, _, err = cli("eval", "ppl", "--timeout-min", "1")
    assert code == 2 and "No such option: --timeout-min" in err
    code, _, err = cli("eval", "ppl", "--timeout", "0")
    assert code == 2 and "--timeout must be > 0 seconds" in err
    code, _, err = cli("eval", "ppl", "--tasks", "niah")
    assert code == 2 and "two tasks given" in err


def test_b_means_burst_only(tmp_path):
    code, _, err = cli("gate", str(tmp_path), "-b", str(tmp_path))
    assert code == 2 and "No such option" in err and "-b" in err
    code, out, _ = cli("report", "--help")
    assert code == 0 and "-b" in out and "16k" in out


def test_report_takes_bursts_as_bench_does(tmp_path):
    write_demo_results(tmp_path / "res", models=(("qwen3-8b", 1),), bursts=(4096, 16384), repeats=1)
    code, out, err = cli("report", str(tmp_path / "res"), "--out", str(tmp_path / "rep"), "--burst", "16k")
    assert code == 0, err
    code, _, err = cli("report", str(tmp_path / "res"), "--out", str(tmp_path / "rep"), "-b", "8k")
    assert code == 2 and "--burst 8192 is not in the results; measured: 4096, 16384" in err
    code, _, err = cli("report", str(tmp_path / "res"), "--out", str(tmp_path / "rep"), "--burst", "lots")
    assert code == 2 and "--burst 'lots' is not a token count" in err


def test_suite_resumes_by_default_and_force_redoes(tmp_path):
    code, out, err = cli("suite", "run", "suites/nightly.yaml", "--dry-run", "--out", str(tmp_path / "o"))
    assert code == 0, err
    cmds = [c for c in out.splitlines() if c.startswith("kvarn ")]
    assert cmds and not any("--force" in c or "--no-resume" in c for c in cmds)
    assert all("--resume" in c for c in cmds if c.startswith("kvarn eval"))
    code, out, _ = cli("suite", "run", "suites/nightly.yaml", "--dry-run", "--force", "--out", str(tmp_path / "o"))
    cmds = [c for c in out.splitlines() if c.startswith("kvarn ")]
    assert code == 0 and all("--force" in c for c in cmds if c.startswith("kvarn bench"))
    assert all("--no-resume" in c for c in cmds if c.startswith("kvarn eval"))
    code, out, _ = cli("suite", "run", "--help")
    assert "the default" in out and "--force" in out
