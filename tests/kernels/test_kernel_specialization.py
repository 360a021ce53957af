"""A serving run must not compile kernels mid-run. Triton compiles one variant of a kernel per specialisation of its
arguments (an int equal to 1, an int divisible by 16, a pointer aligned to 16 bytes), so every argument that changes
from step to step has to be left unspecialised (kvarn.kernels.runtime.serving_jit): then the variants the engine's
warm-up compiles are the ones every later step runs. A new variant compiles for seconds, a stall of every running
request. Checked here with Triton's own argument binder for an sm_90 target
(no GPU, no compile): the specialisation key of each serving kernel is the same for row / split counts of 1, 16 and
17 and index tensors at any offset, while a stride (specialised on purpose) still changes it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# kernel -> (module, the step-varying ints, the index pointers that may be slices)
SERVING_KERNELS = {
    "_store_tiles_kernel": ("store", {"n_rows", "stride_bt"},
                            {"block_ids_ptr", "first_ptr", "old_ptr", "src_rows_ptr", "seq_lens_ptr", "bt_ptr",
                             "defer_ptr"}),
    "_flush_layers_kernel": ("store", {"n_tiles"}, {"slots_ptr", "blk_ptr"}),
    "_dequant_kernel": ("dequant", set(), {"block_ids_ptr", "dst_ptr"}),
    "records_kernel": ("decode", {"num_splits", "stride_btb"}, set()),
    "merge_kernel": ("tail", {"R", "num_splits"}, set()),
    "_copy_rows_kernel": ("rows", {"n"}, {"src_a_ptr", "src_b_ptr", "dst_a_ptr", "dst_b_ptr", "use_ptr"}),
}

_PROBE = r"""
import importlib, json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

kernels = json.loads(sys.argv[1])
backend = make_backend(GPUTarget("cuda", 90, 32))
out = {}
for name, (module, ints, ptrs) in kernels.items():
    k = getattr(importlib.import_module(f"kvarn.kernels.{module}"), name)
    bind = create_function_from_signature(k.signature, k.params, backend)
    buf = torch.zeros(256, dtype=torch.int32)
    floats = {"scale", "qk_scale"}
    def key(vary_int=16, offset=0, stride=16):
        args, kw = [], {}
        for p in k.params:
            if p.is_constexpr:
                kw[p.name] = 1
            elif p.name.endswith("_ptr"):
                args.append(buf[offset:] if p.name in ptrs else buf)
            elif p.name in floats:
                args.append(1.0)
            else:
                args.append(vary_int if p.name in ints else stride)
        return str(bind(*args, **kw)[1])
    base = key()
    same = all(key(n, off) == base for n in (1, 16, 17) for off in (0, 1, 3))
    out[name] = {"same": same, "stride_matters": key(stride=17) != base,
                 "ints": sorted(p.name for p in k.params if p.do_not_specialize),
                 "ptrs": sorted(p.name for p in k.params if p.do_not_specialize_on_alignment)}
print(json.dumps(out))
"""


def test_serving_kernels_compile_one_variant_for_every_step():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real JIT binder, not the interpreter
    spec = {k: (m, sorted(i), sorted(p)) for k, (m, i, p) in SERVING_KERNELS.items()}
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(spec)], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[2], timeout=240)
    if r.returncode != 0:
        if any(e in r.stderr for e in ("AttributeError", "TypeError", "NameError", "KeyError")):
            pytest.fail(r.stderr.strip().splitlines()[-1])
        pytest.skip(f"no Triton CUDA backend here: {r.stderr.strip().splitlines()[-1:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (_, ints, ptrs) in SERVING_KERNELS.items():
        g = got[name]
        assert set(g["ints"]) == ints and set(g["ptrs"]) == ptrs, (name, g)
        assert g["same"], f"{name}: a step-varying argument still changes the compiled variant"
        assert g["stride_matters"], f"{name}: the probe no longer sees specialisation at all"
