"""Does the decode kernel's tile loop overlap a program's loads with its own compute? Offline sm_90 compile (no GPU):
in Triton 3.6 the pipeliner gives the block-table index (an indirect load) a stage of its own, so at num_stages 2-4
the tile's async copies for t + 1 are issued at the end of iteration t and waited for in full (`async_wait {num =
0}`) at the top of t + 1; from 5 stages on the wait leaves the next tile's copies in flight during the compute. The
default config runs 5 stages for that double buffer (kvarn.kernels.decode.DEFAULT_CONFIG, 0.84x the 3-stage time on
the H200); this test keeps the reason true across Triton versions."""
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvarn.formats import get_format
from kvarn.kernels.attention_tokrows import kvarn_attention_pair_pipe_kernel as k
from kvarn.kernels.common import layout
from kvarn.kernels.decode import DecodeConfig

cfg = DecodeConfig.from_name(sys.argv[1])
lay = layout(get_format("kvarn_k4v2_g128"), 128)
sig = {"qr_ptr": "*fp32", "cache16_ptr": "*fp16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "sink_lens_ptr": "*i32",
       "defer_ptr": "*i32", "po_r_ptr": "*fp32", "plse_ptr": "*fp32", "num_splits": "i32", "stride_btb": "i32",
       "stride_cb16": "i32", "stride_ch16": "i32", "HQ": "i32", "q_ptr": "*bf16", "tail_k_ptr": "*bf16",
       "tail_v_ptr": "*bf16", "tail_slots_ptr": "*i32", "po_t_ptr": "*fp32", "qk_scale": "fp32",
       **{n: "i32" for n in ("stride_qn", "stride_qh", "stride_tks", "stride_tkh", "stride_tkg", "stride_tvs",
                             "stride_tvh", "stride_tvg")}}
const = dict(GROUP=4, BN=cfg.bn, G=lay.g, D=128, KB=lay.kb, VB=lay.vb, OFF_PK=lay.pk, OFF_SK=lay.sk,
             OFF_ZK=lay.zk, OFF_RK=lay.rk, OFF_PV=lay.pv, OFF_SV=lay.sv, OFF_ZV=lay.zv, OFF_CV=lay.cv,
             UNPACK=cfg.unpack, KSPLIT=cfg.ksplit, VSPLIT=cfg.vsplit, STAGES=cfg.num_stages, SINK=16, DEFER=0,
             SKV=max(cfg.pipe - 1, 0), TAIL=cfg.tail, GP=4, TBM=16, TT=64, MMA_BF16=1, TAIL16=1, Q_AS_TAIL=1,
             TS=16, PDL=cfg.pdl, VOFF=cfg.voff)
# (as kvarn.kernels.decode._launch_tok passes them; offsets in bytes)
sig.update({n: "constexpr" for n in const})
names = k.arg_names
aligned = ("qr_ptr", "cache16_ptr", "bt_ptr", "seq_lens_ptr", "sink_lens_ptr", "defer_ptr", "po_r_ptr", "plse_ptr",
           "stride_cb16", "stride_ch16")
opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
if cfg.maxnreg:
    opts["maxnreg"] = cfg.maxnreg
c = triton.compile(ASTSource(k, sig, constexprs={(names.index(n),): v for n, v in const.items()},
                             attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned}),
                   target=GPUTarget("cuda", 90, 32), options=opts)
# the tile loop's body: of the kernel's loops the one with the async copies (with TAIL = 1 the tail programs' loop,
# not pipelined, comes first)
bodies = [b.split("scf.yield", 1)[0] for b in c.asm["ttgir"].split("scf.for")[1:]]
loop = max(bodies, key=lambda b: len(re.findall(r"async_copy_global_to_local|= tt\.load ", b)))
print(json.dumps({"waits": [int(n) for n in re.findall(r"async_wait[^{]*\{num = (\d+) : i32\}", loop)],
                  "copies": len(re.findall(r"async_copy_global_to_local", loop)), "shared": c.metadata.shared,
                  "loads": len(re.findall(r"= tt\.load ", loop))}))
"""


def _loop(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, name], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[1], timeout=300)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1:]
        if any(e in r.stderr for e in ("CompilationError", "AttributeError", "TypeError", "NameError", "KeyError")):
            pytest.fail(f"offline sm_90 compile of {name} failed: {last}")
        pytest.skip(f"no offline sm_90 compile here: {last}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_five_stages_keep_the_next_tile_in_flight_during_the_compute():
    pytest.importorskip("triton.backends.nvidia")
    from kvarn.kernels.decode import DEFAULT_CONFIG, SWEEP_CONFIGS

    assert DEFAULT_CONFIG.pipe and DEFAULT_CONFIG.num_stages >= 5 and DEFAULT_CONFIG in SWEEP_CONFIGS
    got = _loop(DEFAULT_CONFIG.name)
    assert got["copies"] > 0 and got["waits"], got
    # the wait at the top of the loop leaves copies outstanding (one tile's worth), and the second buffer costs
    # shared memory: one more tile's records per program (compared without the tail programs, whose dots' shared
    # memory would otherwise set the 3-stage kernel's size)
    assert max(got["waits"]) > 0, got
    core = replace(DEFAULT_CONFIG, tail=0)
    base = _loop(replace(core, num_stages=3).name)  # the same kernel at Triton's usual depth
    assert _loop(core.name)["shared"] > base["shared"] + 8 * 1024, (base, got)
    if re.match(r"3\.[69]\.", __import__("triton").__version__):  # seen with 3.6 (the device's) and 3.9 (CI's)
        assert max(base["waits"]) == 0, base  # 3 stages wait for everything: see the docstring


def test_pipe2_leaves_no_synchronous_load_in_the_tile_loop():
    """pipe = 1 reads the key scales / zero points as DP-wide fp16 vectors: on 2 warps that is 2 bytes per thread,
    below cp.async's 4, so they stay synchronous loads inside the loop, waited for every tile. pipe = 2 reads them
    in one 2D-half load (8 bytes per thread), an async copy with the tiles."""
    pytest.importorskip("triton.backends.nvidia")
    from kvarn.kernels.decode import DEFAULT_CONFIG

    p2 = replace(DEFAULT_CONFIG, pipe=2, tail=0, pdl=0)
    got = _loop(p2.name)
    assert got["loads"] == 0 and got["copies"] > 0 and max(got["waits"]) > 0, (p2.name, got)
    if re.match(r"3\.[69]\.", __import__("triton").__version__) and DEFAULT_CONFIG.num_warps == 2:
        assert _loop(replace(p2, pipe=1).name)["loads"] > 0  # the reason pipe = 2 exists (triton 3.6 and 3.9)
