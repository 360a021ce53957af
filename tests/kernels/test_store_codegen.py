"""What the tile store compiles to on sm_90 (offline compile, no GPU, scripts/store_codegen.py): the prefill / mixed
step's variant (tokens from the step's new K/V and from the tail) loads its tile with 16-byte vector loads from both
buffers, and the value range search rounds with cvt.rni (one instruction instead of a floor-based round-half-even).
A pointer select between the two buffers would cost the alignment proof, and every load would go out element by
element."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_step_store_loads_vectors_and_rounds_in_one_instruction():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "scripts" / "store_codegen.py"), "--modes", "step", "--no-ptxas",
                        "--json"], capture_output=True, text=True, env={**env, "PYTHONPATH": str(root)}, cwd=root,
                       timeout=600)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1:]
        if any(e in r.stderr for e in ("CompilationError", "AttributeError", "TypeError", "NameError", "KeyError")):
            pytest.fail(f"offline sm_90 compile of the step store failed: {last}")
        pytest.skip(f"no offline sm_90 compile here: {last}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # [128 tokens x 128 channels] bf16 per program over 256 threads: 64 values a thread, eight 16-byte loads from
    # each buffer (keys and values programs are two branches of one kernel: 32 vector loads in all)
    assert got["vector_loads"] >= 32, got
    assert got["rni"] > 0, got
