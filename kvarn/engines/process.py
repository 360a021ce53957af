"""Ending a worker's processes: its whole process group on timeout or interrupt (kill_group, used by launch), every
descendant before the worker itself leaves (end_descendants).

vLLM spawns engine-core and TP worker processes; they stay in the worker's process group (session), so killing
the group frees the GPU; the worker itself ends its descendants before it leaves (`end_descendants`), wherever their
session. Anything that escaped (a new session) but still holds GPU memory is found through
`nvidia-smi --query-compute-apps` and ended only if it descends from our worker or shares its session: we never
touch processes we did not start.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def descendants(pid: int) -> set[int]:
    kids, out, todo = _children_map(), set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _session_of(pid: int) -> int | None:
    try:
        # after the command's ")": state, ppid, pgrp, session
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, ValueError, IndexError):
        return None


def session_members(sid: int) -> set[int]:
    """Live processes of session `sid` (our worker's children stay in it even after the worker exits)."""
    out = set()
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if d.name.isdigit() and _session_of(int(d.name)) == sid and _alive(int(d.name)):
            out.add(int(d.name))
    return out


def gpu_pids() -> list[int]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(x) for x in out.stdout.split() if x.strip().isdigit()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> list[int]:
    """SIGTERM then SIGKILL the process group of `proc` (and descendants that left it); return what was signalled."""
    pgid = proc.pid  # started with start_new_session=True: pgid == sid == pid
    family = descendants(proc.pid) | session_members(pgid) | {proc.pid}
    _term_then_kill(family, grace_s, 2.0, pgid)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    family |= kill_leftover_gpu_processes(family, pgid)
    return sorted(family)


def end_descendants(pid: int, grace_s: float = 3.0, wait_s: float = 30.0) -> set[int]:
    """End every descendant of `pid`, wherever its session: SIGTERM (vLLM's processes then remove their shared
    memory), SIGKILL for what is left after `grace_s`, and wait until all are gone. A process frees its GPU memory
    as it exits, so once this returns the memory of `pid`'s engine processes is free for the next engine."""
    family = descendants(pid)  # listed first: a grandchild stays in the set when its parent dies
    _term_then_kill(family, grace_s, wait_s)
    for p in family:  # reap those that are our children: a zombie of a live parent stays in the process table
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:
            pass
    return family


def _term_then_kill(family: set[int], grace_s: float, kill_wait_s: float, pgid: int | None = None) -> None:
    """SIGTERM `family` (and process group `pgid`), SIGKILL what is alive after `grace_s`, then wait up to
    `kill_wait_s` until none is alive (a zombie counts as gone)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        if pgid is not None:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p in family:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_alive(p) for p in family):
            time.sleep(0.05)
        if not any(_alive(p) for p in family):
            return


def kill_leftover_gpu_processes(ours: set[int], session: int, wait_s: float = 30.0) -> set[int]:
    """End GPU processes that are ours (in `ours` or in our session) and wait until they are gone."""
    targets = {p for p in gpu_pids() if p in ours or _session_of(p) == session}
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while targets and time.monotonic() < deadline and set(gpu_pids()) & targets:
        time.sleep(0.5)
    return targets
