"""Starting a worker: its environment, the wait for the GPU memory of the engine before, a timeout that ends the
whole family (also a child in a session of its own that ignores SIGTERM), the failure read from the log, and
streamed output."""
import sys
import time

import pytest

from kvarn.engines import gpus, launch
from tests.helpers import STUBBORN_FAMILY, alive, kill_quietly, wait_gone


def test_a_timeout_ends_the_worker_and_a_child_that_escaped_its_group(tmp_path):
    pidfile = tmp_path / "pids"
    code = STUBBORN_FAMILY + f"\nstubborn_family({str(pidfile)!r})\n"
    t0 = time.monotonic()
    res = launch.Launcher().run([sys.executable, "-c", code], tmp_path / "w.log", timeout_s=3)
    pids = [int(x) for x in pidfile.read_text().split()]
    try:
        assert res.timed_out and res.returncode is None and res.status == "timeout"
        assert wait_gone(pids) == []
        assert set(pids) <= set(res.killed_pids)
        assert time.monotonic() - t0 < 30
        assert "[kvarn] timeout after 3 s: killed process group" in (tmp_path / "w.log").read_text()
    finally:
        kill_quietly(pids)


def test_it_waits_for_the_engines_gpus_and_says_when_it_starts_anyway(tmp_path, monkeypatch):
    asked = []

    def busy(fraction, count=1, **kw):
        asked.append((fraction, count))
        return "GPU 0: 3.0 of 80.0 GiB free after 60 s, 0.90 wanted"

    monkeypatch.setattr(gpus, "wait_for_free_memory", busy)
    log = tmp_path / "w.log"
    res = launch.Launcher().run([sys.executable, "-c", "print('hello')"], log, 30,
                                engine_args={"gpu_memory_utilization": 0.9, "tensor_parallel_size": 2,
                                             "pipeline_parallel_size": 2})
    assert asked == [(0.9, 4)]  # every rank's GPU
    lines = log.read_text().splitlines()
    assert lines[0] == "[kvarn] starting anyway: GPU 0: 3.0 of 80.0 GiB free after 60 s, 0.90 wanted"
    assert res.status == "ok" and "hello" in lines
    asked.clear()
    launch.Launcher().run([sys.executable, "-c", "pass"], log, 30)  # no engine arguments: nothing to wait for
    assert asked == []


def test_failure_kind_and_line_come_from_the_log(tmp_path):
    code = ("import sys; print('loading', flush=True); "
            "sys.exit('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB')")
    res = launch.Launcher().run([sys.executable, "-c", code], tmp_path / "w.log", 30)
    assert res.returncode == 1 and res.status == "oom"
    kind, line = res.failure()
    assert kind == "oom" and line.startswith("torch.OutOfMemoryError")
    res = launch.Launcher().run([sys.executable, "-c", "raise ValueError('bad arg')"], tmp_path / "w.log", 30)
    assert res.status == "failed" and res.failure()[1] == "ValueError: bad arg"  # this attempt's, not the last's


def test_stream_yields_stdout_until_the_done_line(tmp_path):
    code = ("import sys; print('a'); print('b'); print('bye', file=sys.stderr); print('@done'); print('after'); "
            "sys.stdout.flush(); sys.exit(3)")
    run = launch.Launcher()
    got = list(run.stream([sys.executable, "-c", code], tmp_path / "w.log", 30, until="@done"))
    assert got == ["a\n", "b\n"]
    assert run.result.done and run.result.returncode == 3
    assert "bye" in (tmp_path / "w.log").read_text()


def test_a_stream_left_early_ends_the_worker(tmp_path):
    pidfile = tmp_path / "pids"
    code = STUBBORN_FAMILY + f"\nprint('one', flush=True)\nstubborn_family({str(pidfile)!r})\n"
    stream = launch.Launcher().stream([sys.executable, "-c", code], tmp_path / "w.log", 60)
    assert next(stream) == "one\n"
    deadline = time.monotonic() + 20
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(x) for x in pidfile.read_text().split()]
    try:
        assert all(alive(p) for p in pids)
        stream.close()  # the reader stops (an exception in the consumer, Ctrl-C): the family goes with it
        assert wait_gone(pids) == []
    finally:
        kill_quietly(pids)


def test_child_env_keeps_the_users_choice(monkeypatch):
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    monkeypatch.setenv("PYTHONUNBUFFERED", "")
    env = launch.child_env(force={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, defaults={"KVARN_LOG_COMPILES": "1"})
    assert env["PYTHONUNBUFFERED"] == "1" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["KVARN_LOG_COMPILES"] == "1"
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    assert launch.child_env()["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


# the worker double-forks a sleeper into a session of its own: its parent exits at once, so it is no descendant of
# the worker, in none of its groups, and it holds the worker's stdout open (no EOF) for a minute
ORPHAN_HOLDS_STDOUT = """
import subprocess, sys, time
subprocess.run([sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep(60)'], start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid))",
                sys.argv[1]], check=True)
print("one", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.mark.parametrize("worker_s, timeout_s", [(0.2, 60), (60, 3)], ids=["exits", "times_out"])
def test_reading_ends_with_the_worker_while_an_orphan_holds_its_pipe(tmp_path, worker_s, timeout_s):
    pidfile = tmp_path / "orphan"
    run = launch.Launcher()
    t0 = time.monotonic()
    got = list(run.stream([sys.executable, "-c", ORPHAN_HOLDS_STDOUT, str(pidfile), str(worker_s)],
                          tmp_path / "w.log", timeout_s))
    orphan = int(pidfile.read_text())
    try:
        assert got == ["one\n"]
        assert run.result.timed_out == (timeout_s == 3)
        assert time.monotonic() - t0 < 30  # not the orphan's 60 s
    finally:
        kill_quietly([orphan])
