"""Provenance of a run (`kvarn env`): versions, git sha, CUDA, driver, GPUs. Every result row carries it."""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from . import __version__


def _pkg_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_sha() -> str | None:
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        sha = out.stdout.strip()
        if sha:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _driver() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _gpus_nvidia_smi() -> list[dict] | None:
    """GPUs from nvidia-smi (respecting CUDA_VISIBLE_DEVICES given as indices), or None if it cannot say. Preferred:
    asking torch initializes CUDA in this process, and `kvarn bench`'s orchestrator must leave the GPUs to the
    engine processes it starts (a context there is memory vLLM's start-up check counts as taken)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,compute_cap",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    rows = {}
    for line in out.stdout.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            try:
                rows[int(parts[0])] = {"name": parts[1], "memory_gib": round(float(parts[2]) / 1024, 2),
                                       "capability": parts[3]}
            except ValueError:
                return None
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        ids = [v.strip() for v in vis.split(",") if v.strip()]
        if not all(v.isdigit() for v in ids):
            return None  # UUIDs / MIG names: let torch resolve them
        order = [int(v) for v in ids if int(v) in rows]
    else:
        order = sorted(rows)
    return [{"index": i, **rows[k]} for i, k in enumerate(order)]


def gpus() -> list[dict]:
    smi = _gpus_nvidia_smi()
    if smi is not None:
        return smi
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / (1 << 30), 2),
                    "capability": f"{p.major}.{p.minor}"})
    return out


@functools.lru_cache(maxsize=1)
def provenance() -> dict:
    """Flat dict of provenance fields (stable keys; None where absent)."""
    torch_v = cuda_v = None
    try:
        import torch

        torch_v, cuda_v = torch.__version__, torch.version.cuda
    except ImportError:
        pass
    g = gpus()
    return {
        "kvarn_version": __version__,
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "torch": torch_v,
        "triton": _pkg_version("triton"),
        "vllm": _pkg_version("vllm"),
        "transformers": _pkg_version("transformers"),
        "cuda": cuda_v,
        "driver": _driver(),
        "gpu_count": len(g),
        "gpu_name": g[0]["name"] if g else None,
        "gpu_names": ",".join(d["name"] for d in g) if g else None,  # every visible GPU, in device order
        "gpu_memory_gib": g[0]["memory_gib"] if g else None,
        "gpus": g,
        "kvarn_env": _kvarn_env(),
    }


def _kvarn_env() -> str:
    from .settings import result_env

    return result_env()
