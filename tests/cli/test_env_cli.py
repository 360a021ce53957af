"""`kvarn env` (the environment and the settings) and the CLI's own surface: the command list, one-line usage
errors."""
import json

import pytest

from tests.helpers import run_cli


def test_env_json():
    r = run_cli("env", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for key in ("kvarn_version", "git_sha", "python", "torch", "triton", "vllm", "cuda", "driver", "gpus", "gpu_count"):
        assert key in info


def test_env_lists_the_settings_and_a_bad_one_is_one_line():
    r = run_cli("env", env={"KVARN_SINK": "4"})
    assert r.returncode == 0 and "KVARN_SINK" in r.stdout and "KVARN_BALANCE_ITERS" in r.stdout, r.stderr
    r = run_cli("env", env={"KVARN_SINK": "many"})
    assert r.returncode == 2 and r.stderr.strip() == "error: KVARN_SINK='many': accepted values are an integer >= 0"
    assert "Traceback" not in r.stderr


def test_help_lists_all_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for c in ("capacity", "env", "bench", "eval", "report", "gate", "fidelity", "microbench", "suite"):
        assert c in r.stdout


@pytest.mark.parametrize("args,msg", [
    (["bench", "--bogus"], "No such option: --bogus"),
    (["results", "--out", "x"], "No such option: --out"),
    (["bench", "--requests", "many"], "Invalid value for '--requests'"),
])
def test_usage_errors_are_one_clean_message(args, msg):
    # Typer >= 0.25 raises its vendored click's exceptions (typer._click), not click's: both are usage errors here
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr and "Traceback" not in r.stderr
