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
    args = ["--device", "cpu", "--tiles", "2", "--kv-heads", "1", "--head-dims", "64", "--reps", "1", "--calls", "1",
            "--against", str(root / "kvarn" / "kernels" / "store.py")]
    got = subprocess.run([sys.executable, str(root / "scripts" / "device" / "store_halves.py"), *args],
                         capture_output=True, text=True, cwd=root,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    assert got.returncode == 0, got.stderr[-2000:]
    (row,) = json.loads(got.stdout.strip().splitlines()[-1])
    for label in ("both w8", "keys w4", "keys w8", "values w8", "values w16", "store_tiles", "against"):
        assert row[label] > 0, (label, row)
    # the script's own keys and values launches (tiles in shuffled record rows) write what store_tiles writes: its
    # timings are of the shipped launches; and this store.py loaded from its file gives the same records
    assert row["halves_vs_store_tiles"] == 0
    assert row["bytes_differ_keys"] == 0 and row["bytes_differ_values"] == 0


def test_store_halves_profile_needs_cuda():
    root = Path(__file__).resolve().parents[2]
    got = subprocess.run([sys.executable, str(root / "scripts" / "device" / "store_halves.py"), "--device", "cpu",
                          "--profile"], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert got.returncode == 2 and "--profile needs a CUDA device, got --device cpu" in got.stderr
