"""The one vLLM worker process: bench's cells and eval's jobs behind one entry point, dispatched on the spec's mode
(the modes themselves run end to end in tests/bench/engines/test_vllm_engine.py and tests/eval/test_eval_vllm.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvarn.engines import vllm_worker

ROOT = Path(__file__).resolve().parents[2]


def _worker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvarn.engines.vllm_worker", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_an_unknown_mode_is_a_clear_error(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"mode": "train"}))
    r = _worker(str(spec), str(tmp_path / "result.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unknown worker mode 'train'" in r.stderr and "offline, serve, generate, score" in r.stderr
    assert not (tmp_path / "result.json").exists()


@pytest.mark.parametrize("mode, paths", [("offline", 1), ("generate", 2)])
def test_a_mode_with_the_wrong_paths_is_refused(tmp_path, mode, paths):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"mode": mode}))
    assert vllm_worker.main([str(spec), str(tmp_path / "result.json")][:paths]) == 2


def test_every_mode_has_one_runner():
    assert set(vllm_worker.MODES) == {"offline", "serve", "generate", "score"}
    assert not set(vllm_worker.CELL_MODES) & set(vllm_worker.JOB_MODES)
    import importlib

    for target in vllm_worker.CELL_MODES.values():  # named by path: each must resolve
        mod, func = target.split(":")
        assert callable(getattr(importlib.import_module(mod), func))
