"""scripts/device/store_halves.py (the store's keys and values timed apart, and against an earlier store module)
runs every variant and compares records; on the CPU through the interpreter, so only that it runs and what it
reports."""
import json
import os
import subprocess
import sys
from pathlib import Path


def test_store_halves_script_runs_every_variant_and_compares_bytes():
    root = Path(__file__).resolve().parents[2]
    args = ["--device", "cpu", "--tiles", "1", "--kv-heads", "1", "--head-dims", "64", "--reps", "1", "--calls", "1",
            "--against", "kvarn.kernels.store"]
    got = subprocess.run([sys.executable, str(root / "scripts" / "device" / "store_halves.py"), *args],
                         capture_output=True, text=True, check=True, cwd=root,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    (row,) = json.loads(got.stdout.strip().splitlines()[-1])
    for label in ("both w8", "keys w4", "keys w8", "values w8", "values w16", "store_tiles", "against"):
        assert row[label] > 0, (label, row)
    # the same module against itself: the same records (the interpreter ignores the warp count)
    assert row["bytes_differ_keys"] == 0 and row["bytes_differ_values"] == 0
