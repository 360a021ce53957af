"""`kvarn eval --harness lm-eval` past its --timeout: lm-eval's worker and the engine core it started (here a fake
lm_eval whose child runs in a session of its own and ignores SIGTERM, as a vLLM engine core can) are both gone
when the row says timeout, so the next kv dtype's engine finds the GPU memory free; a crash is classified from
its log."""
from __future__ import annotations

import json
import os

from tests.helpers import STUBBORN_FAMILY, kill_quietly, run_cli, wait_gone


def _fake_lm_eval(tmp_path, body: str) -> dict:
    pkg = tmp_path / "fake" / "lm_eval"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STUBBORN_FAMILY + "\n" + body)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), root, os.environ.get("PYTHONPATH", "")])}


def _rows(stdout: str) -> list[dict]:
    return [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]


def test_timeout_ends_lm_eval_and_its_engine_core(tmp_path):
    pidfile = tmp_path / "pids"
    env = _fake_lm_eval(tmp_path, f"def simple_evaluate(**kw):\n    stubborn_family({str(pidfile)!r})\n")
    r = run_cli("eval", "--harness", "lm-eval", "--tasks", "gsm8k", "--kv-dtype", "auto", "--timeout", "3",
                "--out", str(tmp_path / "res"), "--json", env=env, timeout=120)
    pids = [int(x) for x in pidfile.read_text().split()] if pidfile.exists() else []
    try:
        assert len(pids) == 2, r.stderr
        rows = _rows(r.stdout)
        assert [x["status"] for x in rows] == ["timeout"] and "limit" in rows[0]["error"]
        assert wait_gone(pids) == []  # the worker and its escaped, SIGTERM-ignoring child
    finally:
        kill_quietly(pids)


def test_out_of_memory_is_an_oom_row_with_the_exception_line(tmp_path):
    """The out-of-memory line, not the shutdown chatter printed after it."""
    env = _fake_lm_eval(tmp_path, "import sys\n\ndef simple_evaluate(**kw):\n"
                                  "    print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB',"
                                  " file=sys.stderr)\n    for i in range(4):\n        print(f'shutting down engine {i}')\n"
                                  "    raise SystemExit(1)\n")
    r = run_cli("eval", "--harness", "lm-eval", "--tasks", "gsm8k", "--kv-dtype", "auto",
                "--out", str(tmp_path / "res"), "--json", env=env, timeout=120)
    rows = _rows(r.stdout)
    assert [x["status"] for x in rows] == ["oom"], r.stderr
    assert "exited 1: torch.OutOfMemoryError: CUDA out of memory" in rows[0]["error"]
