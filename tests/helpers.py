"""Small test helpers shared by test modules."""
from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `kvarn ARGS` in a subprocess (real exit codes, real stderr)."""
    e = dict(os.environ)
    e.setdefault("COLUMNS", "200")
    if env:
        e.update(env)
    return subprocess.run([sys.executable, "-m", "kvarn_cli.app", *args], capture_output=True, text=True,
                          env=e, timeout=timeout)
