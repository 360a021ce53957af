"""Provenance of a run (`kvarn env`): versions, git sha, CUDA, driver, GPUs. Every result row carries it."""
from __future__ import annotations

import functools
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


def gpus() -> list[dict]:
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
    from .vllm_plugin.common import backend_env

    return backend_env()
