"""The GPUs this process may use and their memory, asked without creating a CUDA context here (nvidia-smi, or a
child process), so that a vLLM engine started afterwards finds every GPU untouched."""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def gpu_available() -> bool:
    """A CUDA device through torch (creates its context: for in-process engines)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover
        return False


def visible_gpus() -> list[dict]:
    """[{index, name, capability}] of the GPUs this process may use, without creating a CUDA context."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=15)
            gpus = []
            for line in out.stdout.strip().splitlines():
                parts = [s.strip() for s in line.split(",")]
                if len(parts) >= 3:
                    gpus.append({"index": parts[0], "name": parts[1], "capability": parts[2]})
            keep = _visible_ids()
            if keep is not None:
                gpus = [g for g in gpus if g["index"] in keep]
            return gpus
        except (OSError, subprocess.SubprocessError):
            pass
    from ..provenance import gpus as torch_gpus

    return [{"index": str(g["index"]), "name": g["name"], "capability": g["capability"]} for g in torch_gpus()]


def _visible_ids() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of ids (indices or UUIDs), None when unset (every GPU)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [v.strip() for v in vis.split(",") if v.strip()] if vis is not None else None


def gpu_total_bytes() -> int | None:
    """Memory of the first visible GPU, None where unknown. Asks nvidia-smi (no CUDA context in this process); a MIG
    instance (CUDA_VISIBLE_DEVICES=MIG-...) is not a GPU to nvidia-smi -i, so there a child process asks CUDA."""
    return _device_total_bytes((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0")


@functools.lru_cache(maxsize=8)
def _device_total_bytes(dev: str) -> int | None:  # once per device: engines side by side each ask
    if not dev.upper().startswith("MIG-"):
        got = _run_int(["nvidia-smi", "-i", dev, "--query-gpu=memory.total", "--format=csv,noheader,nounits"])
        return got * 2**20 if got is not None else None
    return _run_int([sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info(0)[1])"], timeout=60)


def _run_int(cmd: list[str], timeout: float = 20) -> int | None:
    """The first line of a command's output as an integer; None when it fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return int(float(out.stdout.strip().splitlines()[0])) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def wait_for_free_memory(fraction: float, count: int = 1, timeout_s: float = 60.0,
                         interval_s: float = 0.5) -> str:
    """Wait until the first `count` visible GPUs (those an engine of `count` ranks takes) each have `fraction` of their
    memory free, vLLM's start-up check; "" once they do, else a line saying what is still in use.

    The engine before may still be handing its memory back (a process frees it as it exits); started earlier, the
    next one fails with "Free memory on device ... is less than desired GPU memory utilization". "" at once where
    nvidia-smi cannot tell: none, or MIG, whose instances it does not report by CUDA's ids."""
    ids = _visible_ids()
    if not shutil.which("nvidia-smi") or any(i.upper().startswith("MIG-") for i in ids or []):
        return ""
    cmd = ["nvidia-smi", "--query-gpu=index,uuid,mig.mode.current,memory.free,memory.total",
           "--format=csv,noheader,nounits"]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
            rows = [[s.strip() for s in line.split(",")] for line in out.strip().splitlines()]
            rows = [r for r in rows if len(r) == 5]
            if any(r[2] == "Enabled" for r in rows):
                return ""
            if ids is not None:  # CUDA_VISIBLE_DEVICES order; an id is an index or a (prefix of a) UUID
                rows = [next((r for r in rows if i == r[0] or (i.startswith("GPU-") and r[1].startswith(i))), None)
                        for i in ids]
                if None in rows:
                    return ""
            short = [r for r in rows[:count] if float(r[3]) < fraction * float(r[4])]
        except (OSError, ValueError, subprocess.SubprocessError):
            return ""
        if not short:
            return ""
        if time.monotonic() >= deadline:
            return "; ".join(f"GPU {r[0]}: {float(r[3]) / 1024:.1f} of {float(r[4]) / 1024:.1f} GiB free after "
                             f"{timeout_s:.0f} s, {fraction:.2f} wanted" for r in short)
        time.sleep(interval_s)


class GpuMemSampler(threading.Thread):
    """Peak used memory (GiB) over the visible GPUs from nvidia-smi, without touching CUDA in this process."""

    def __init__(self, interval_s: float = 0.5):
        super().__init__(daemon=True)
        self.interval_s, self.peak, self._halt = interval_s, float("nan"), threading.Event()
        self.ok = shutil.which("nvidia-smi") is not None
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.ids = [x for x in vis.split(",") if x.strip()] if vis else None

    def run(self):
        while self.ok and not self._halt.is_set():
            try:
                cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
                for line in out.strip().splitlines():
                    idx, used = (s.strip() for s in line.split(","))
                    if self.ids is None or idx in self.ids:
                        gib = float(used) / 1024.0
                        self.peak = gib if self.peak != self.peak else max(self.peak, gib)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._halt.wait(self.interval_s)

    def stop(self) -> float:
        self._halt.set()
        self.join(timeout=15)
        return self.peak
