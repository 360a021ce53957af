"""Ending an engine's processes: every descendant, also one in a session of its own and one whose parent died first;
nothing that is not a descendant."""
import subprocess
import sys
import time

from kvarn.engines import process

# a worker whose engine core runs in its own session and starts a TP worker of its own, then ignores SIGTERM
WORKER = """
import subprocess, sys, time
core = subprocess.Popen([sys.executable, "-c", '''
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(rank.pid, flush=True)
time.sleep(60)
'''], start_new_session=True, stdout=subprocess.PIPE, text=True)
print(core.pid, core.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def test_every_descendant_ends_wherever_its_session_and_nothing_else():
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        core, rank = (int(x) for x in worker.stdout.readline().split())
        assert process.session_members(core) == {core, rank}  # its own session, which its TP worker shares
        assert core not in process.session_members(process._session_of(worker.pid))
        t0 = time.monotonic()
        ended = process.end_descendants(worker.pid, grace_s=0.5, wait_s=10)
        assert {core, rank} <= ended and worker.pid not in ended
        assert not process._alive(core) and not process._alive(rank)  # the core ignored SIGTERM: SIGKILL ended it
        assert time.monotonic() - t0 < 5
        assert process._alive(worker.pid) and process._alive(bystander.pid)
    finally:
        for p in (worker, bystander):
            p.kill()
            p.wait()
