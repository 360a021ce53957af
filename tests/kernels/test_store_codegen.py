"""What the tile store compiles to on sm_90 (offline compile, no GPU, scripts/store_codegen.py): the prefill / mixed
step's launches (tokens from the step's new K/V and from the tail) load their tile with 16-byte vector loads from
both buffers, and round with two fp32 adds of 1.5 * 2^23 on the FMA pipe, never cvt.rni (whose variable latency
stalls the value range search). A pointer select between the two buffers would cost the alignment proof, and every
load would go out element by element; a compiler that folded (x + c) - c would turn the rounding into a no-op."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _codegen(*args: str) -> list[dict]:
    """scripts/store_codegen.py's JSON rows for these arguments (PTX facts only): a compile error fails the test, a
    machine without Triton's NVIDIA backend skips it."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "scripts" / "store_codegen.py"), *args, "--no-ptxas", "--json"],
                       capture_output=True, text=True, env={**env, "PYTHONPATH": str(root)}, cwd=root, timeout=600)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1:]
        if any(e in r.stderr for e in ("CompilationError", "AttributeError", "TypeError", "NameError", "KeyError",
                                       "error: ")):  # the last: the script's own argument errors
            pytest.fail(f"offline sm_90 compile of the store ({' '.join(args)}) failed: {last}")
        pytest.skip(f"no offline sm_90 compile here: {last}")
    return [json.loads(line) for line in r.stdout.strip().splitlines()]


def test_step_store_loads_vectors_and_rounds_with_adds():
    got = {row["part"]: row for row in _codegen("--modes", "step")}
    keys, values = got["keys"], got["values"]
    # [128 tokens x 128 channels] bf16 per program: values over 256 threads, 64 a thread, eight 16-byte loads from
    # each buffer; keys over 128 threads, 128 a thread, sixteen from each
    assert values["warps"] == 8 and values["vector_loads"] >= 16, values
    assert keys["warps"] == 4 and keys["vector_loads"] >= 32, keys
    # an add and a subtract per rounded element: values 64 a thread for the codes and 64 in the range search's loop
    # body, keys 128 for the codes
    for row in (keys, values):
        assert row["rni"] == 0 and row["magic_adds"] >= 256, row


@pytest.mark.parametrize("kv_dtype,head_dim", [("kvarn_k4v2_g128", 64), ("kvarn_k4v2_g128", 256),
                                               ("kvarn_k4v2_g64", 128)])
def test_one_launch_of_both_halves_compiles_where_head_dim_and_tile_differ(kv_dtype, head_dim):
    """A decode step's store and the layers' flush are one kernel whose program picks keys ([D, g] tiles) or values
    ([g, D]) at run time: both halves must compile into it where D != g. The interpreter runs only the branch taken,
    so only a compile shows this."""
    rows = _codegen("--modes", "decode,flush", "--head-dim", str(head_dim), "--kv-dtype", kv_dtype)
    assert [(r["mode"], r["part"], r["head_dim"]) for r in rows] == [("decode", "both", head_dim),
                                                                     ("flush", "both", head_dim)]
