"""The one way bench, eval, lm-eval and profile start a worker that may hold a GPU.

The worker gets the engines' environment (child_env), first waits for the GPU memory the engine before may still be
handing back (a "[kvarn] starting anyway" line in its log when it does not come free), runs in a session of its own
with its output in a log file, and a timeout or an interrupt ends its whole process group (process.kill_group); an
engine core it leaves behind is ended too. How it ended comes back as a Launched, whose status reads the log
through vllm_log.classify_error.
"""
from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import gpus, process
from .vllm_log import classify_error, last_error_line, latest_attempt

STARTING_ANYWAY = "[kvarn] starting anyway: "


def child_env(force: dict | None = None, defaults: dict | None = None) -> dict:
    """This process's environment for a worker: output unbuffered (lines reach the log and the parent as printed),
    vLLM's FlashInfer sampler off unless the user chose; `force` overrides, `defaults` only where unset."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in {"VLLM_USE_FLASHINFER_SAMPLER": "0", **(defaults or {})}.items():
        env.setdefault(k, v)
    env.update(force or {})
    return env


def engine_ranks(engine_args: dict) -> int:
    """GPUs an engine of these vLLM arguments takes: tensor x pipeline parallel size."""
    return (int(engine_args.get("tensor_parallel_size", 1) or 1)
            * int(engine_args.get("pipeline_parallel_size", 1) or 1))


def wait_for_gpus(engine_args: dict | None) -> str:
    """Wait until the GPUs of an engine with these vLLM arguments have its memory fraction free; the log line to
    write when they do not in time ("" when they do, or when the arguments name no fraction)."""
    if not engine_args or engine_args.get("gpu_memory_utilization") is None:
        return ""
    busy = gpus.wait_for_free_memory(float(engine_args["gpu_memory_utilization"]), engine_ranks(engine_args))
    return f"{STARTING_ANYWAY}{busy}\n" if busy else ""


@dataclass
class Launched:
    """How a worker ended: returncode None when it timed out; killed_pids what its group's end signalled; done when
    a streamed worker printed its `until` line (every result is out, whatever its exit)."""
    returncode: int | None
    timed_out: bool
    elapsed_s: float
    killed_pids: list[int]
    log_path: Path
    done: bool = False

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    @property
    def status(self) -> str:
        """"ok", "timeout", or the failure's kind ("oom" or "failed")."""
        if self.timed_out:
            return "timeout"
        return "ok" if self.returncode == 0 else self.failure()[0]

    def failure(self) -> tuple[str, str]:
        """What the log's latest attempt (a rerun appends to the log) says went wrong: ("oom" or "failed", the line
        that says why)."""
        text = self.log_text()
        return classify_error("\n".join(latest_attempt(text))), last_error_line(text)


DRAIN_S = 5.0  # after the worker exits, how long its pipe may stay open (a line still in flight) before reading stops


class _StdoutReader:
    """A worker's stdout line by line, read by a thread of its own so that reading ends when the worker has ended even
    if a descendant that escaped its session and group still holds the pipe open (an EOF would never come): at once
    after a timeout, else DRAIN_S after the worker exited."""

    def __init__(self, proc: subprocess.Popen, fired: threading.Event):
        self.proc, self.fired, self.queue = proc, fired, queue.Queue()
        self.thread = threading.Thread(target=self._pump, daemon=True, name=f"kvarn-stdout-{proc.pid}")
        self.thread.start()

    def _pump(self) -> None:
        try:
            for line in self.proc.stdout:
                self.queue.put(line)
        except (OSError, ValueError):  # the pipe was closed under the reader
            pass
        self.queue.put(None)

    def __iter__(self) -> Iterator[str]:
        exited_at = None
        while True:
            try:
                line = self.queue.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is None:
                    continue
                exited_at = exited_at or time.monotonic()
                if self.fired.is_set() or time.monotonic() - exited_at > DRAIN_S:
                    return
                continue
            if line is None:
                return
            yield line

    def close(self) -> None:
        """Close the pipe, unless the reader thread is still blocked on it (a closed file under a reading thread
        is undefined; the daemon thread ends with the holder or with kvarn)."""
        self.thread.join(timeout=1.0)
        if not self.thread.is_alive():
            self.proc.stdout.close()


class Launcher:
    """Runs one worker at a time; `stop()` ends it from elsewhere (bench's interrupt handler)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.result: Launched | None = None

    def run(self, cmd: list[str], log_path: str | os.PathLike, timeout_s: float, env: dict | None = None,
            engine_args: dict | None = None, cwd: str | None = None) -> Launched:
        """Run `cmd` to its end with stdout and stderr appended to `log_path` (after a `$ command` header).
        engine_args: the vLLM arguments of the engine it starts, for the free-memory wait."""
        for _ in self._go(cmd, Path(log_path), timeout_s, env, engine_args, cwd, None):
            pass
        return self.result

    def stream(self, cmd: list[str], log_path: str | os.PathLike, timeout_s: float, env: dict | None = None,
               engine_args: dict | None = None, until: str | None = None) -> Iterator[str]:
        """Run `cmd` and yield its stdout line by line, stderr going to `log_path`; stop reading at a line that
        starts with `until` (the worker is leaving: an engine core it left alive would hold the pipe open).
        self.result says how it ended once the iteration is over."""
        return self._go(cmd, Path(log_path), timeout_s, env, engine_args, None, until or "")

    def _go(self, cmd, log_path: Path, timeout_s: float, env, engine_args, cwd, until) -> Iterator[str]:
        pipe = until is not None
        self.result = None
        busy = wait_for_gpus(engine_args)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(log_path, "ab", buffering=0) as log:
            log.write(busy.encode())
            log.write(f"$ {' '.join(cmd)}\n".encode())
            proc = self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if pipe else log, stderr=log,
                                                stdin=subprocess.DEVNULL, env=env, cwd=cwd, text=True,
                                                start_new_session=True)
            killed: list[int] = []
            fired = threading.Event()

            def time_out():
                if proc.poll() is None:  # a worker that ended on its own in time is no timeout
                    fired.set()
                    killed.extend(process.kill_group(proc))

            timer = threading.Timer(timeout_s, time_out)
            timer.daemon = True
            timer.start()
            done = False
            reader = None
            try:
                if pipe:
                    reader = _StdoutReader(proc, fired)
                    for line in reader:
                        if until and line.startswith(until):
                            done = True
                            break
                        yield line
                try:
                    proc.wait(timeout=45 if done else None)  # a leaving worker: longer than its own wait
                except subprocess.TimeoutExpired:
                    pass
            except KeyboardInterrupt:  # Ctrl-C / SIGTERM of kvarn: free the GPU before leaving
                process.kill_group(proc)
                log.write(b"\n[kvarn] interrupted: process group killed\n")
                raise
            finally:
                timer.cancel()
                timer.join()  # a kill under way completes before the next engine starts
                if proc.poll() is None:  # the reader left early (an error, a closed iterator): end the group
                    killed.extend(process.kill_group(proc))
                proc.wait()
                # workers can leave children behind (a crashed engine core): they keep GPU memory
                if process.session_members(proc.pid):
                    killed.extend(process.kill_group(proc, grace_s=2.0))
                if reader is not None:
                    reader.close()
                self.proc = None
            if fired.is_set():
                log.write(f"\n[kvarn] timeout after {timeout_s:.0f} s: killed process group {proc.pid} "
                          f"(pids {sorted(set(killed))})\n".encode())
            self.result = Launched(None if fired.is_set() else proc.returncode, fired.is_set(),
                                   time.monotonic() - t0, sorted(set(killed)), log_path, done)

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            process.kill_group(p)
