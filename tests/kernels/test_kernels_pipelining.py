"""Does the decode kernel's tile loop overlap a program's loads with its own compute? Offline sm_90 compile (no GPU)
of the records kernel at the pipeline depth it launches with (kvarn.kernels.decode): the wait at the top of the tile
loop must leave the next tile's async copies in flight during the compute (the pipeliner gives the block-table index,
an indirect load, a stage of its own, so a shallow pipeline waits for every copy, `async_wait {num = 0}`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvarn.formats import get_format
from kvarn.kernels.decode import MMA_N, RECORD_WARPS, key_split, records_kernel as k
from kvarn.kernels.records import layout

stages = int(sys.argv[1])
lay = layout(get_format("kvarn_k4v2_g128"), 128)
sig = {"q_ptr": "*bf16", "cache16_ptr": "*fp16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "sink_lens_ptr": "*i32",
       "win_lens_ptr": "*i32", "defer_ptr": "*i32", "po_r_ptr": "*fp32", "plse_ptr": "*fp32", "num_splits": "i32",
       "stride_btb": "i32", "stride_cb16": "i32", "stride_ch16": "i32", "HQ": "i32", "qk_scale": "fp32",
       "tail_k_ptr": "*bf16", "tail_v_ptr": "*bf16", "tail_slots_ptr": "*i32", "po_t_ptr": "*fp32",
       **{n: "i32" for n in ("stride_qn", "stride_qh", "stride_tks", "stride_tkh", "stride_tkg", "stride_tvs",
                             "stride_tvh", "stride_tvg")}}
# as kvarn.kernels.decode.prepare_decode passes them (GQA group 4, D = 128, a 16-token sink, a 32-token window)
const = dict(GROUP=4, BN=MMA_N, G=lay.g, D=128, KB=lay.kb, VB=lay.vb, **lay.offsets(), KSPLIT=key_split(4),
             STAGES=stages, SINK=16, DEFER=0, TBM=16, TT=64, TS=16, TENSOR_CORES=1, Q_AS_TAIL=1, COMPILED=1, PDL=1,
             WIN=32, TW=32)
sig.update({n: "constexpr" for n in const})
names = k.arg_names
aligned = ("q_ptr", "cache16_ptr", "bt_ptr", "seq_lens_ptr", "sink_lens_ptr", "win_lens_ptr", "defer_ptr", "po_r_ptr",
           "plse_ptr",
           "stride_cb16", "stride_ch16")
c = triton.compile(ASTSource(k, sig, constexprs={(names.index(n),): v for n, v in const.items()},
                             attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned}),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=RECORD_WARPS, num_stages=stages))
# the tile loop's body: of the kernel's loops the one with the async copies (the tail programs' loop, not
# pipelined, comes first)
bodies = [b.split("scf.yield", 1)[0] for b in c.asm["ttgir"].split("scf.for")[1:]]
loop = max(bodies, key=lambda b: len(re.findall(r"async_copy_global_to_local|= tt\.load ", b)))
print(json.dumps({"waits": [int(n) for n in re.findall(r"async_wait[^{]*\{num = (\d+) : i32\}", loop)],
                  "copies": len(re.findall(r"async_copy_global_to_local", loop)), "shared": c.metadata.shared,
                  "loads": len(re.findall(r"= tt\.load ", loop))}))
"""


def _loop(stages: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(stages)], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[2], timeout=300)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1:]
        if any(e in r.stderr for e in ("CompilationError", "AttributeError", "TypeError", "NameError", "KeyError",
                                       "ValueError")):
            pytest.fail(f"offline sm_90 compile at {stages} stages failed: {last}")
        pytest.skip(f"no offline sm_90 compile here: {last}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_next_tile_stays_in_flight_during_the_compute():
    pytest.importorskip("triton.backends.nvidia")
    from kvarn.kernels.decode import RECORD_STAGES

    got = _loop(RECORD_STAGES)
    assert got["copies"] > 0 and got["waits"], got
    # the wait at the top of the loop leaves one tile's copies outstanding
    assert max(got["waits"]) > 0, got


def test_no_synchronous_load_in_the_tile_loop():
    """Every load of a tile is an async copy: the key scales and zero points are read in one 2D-half load (8 bytes
    per thread on 2 warps; DP-wide fp16 vectors would be 2 bytes, below cp.async's 4, and stay synchronous loads
    that every tile waits for), the per-token runs as int32 pairs."""
    pytest.importorskip("triton.backends.nvidia")
    from kvarn.kernels.decode import RECORD_STAGES

    got = _loop(RECORD_STAGES)
    assert got["loads"] == 0 and got["copies"] > 0 and max(got["waits"]) > 0, got
