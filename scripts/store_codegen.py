"""What the tile store kernels compile to for sm_90, without a GPU: per variant, registers and spills (ptxas -v,
Triton's bundled ptxas), 16-byte vector loads, cvt.rni conversions and the adds of the 1.5 * 2^23 rounding in the
PTX. The Triton on PYTHONPATH decides the version (the device runs the one vLLM pins).

    python scripts/store_codegen.py [--head-dim 128] [--kv-dtype kvarn_k4v2_g128] [--modes tiles,step,decode,flush]
                                    [--json]

Variants: `tiles` (store_tiles, [T, H, g, D] input), `step` (store_step_tiles: a prefill / mixed step's tiles from
the new K/V and the tail), each as its keys launch and its values launch; `decode` (store_decode's flush,
deferred-flag variant) and `flush` (flush_layers), both halves in one launch.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvarn.formats import get_format, kvarn_formats
from kvarn.kernels import store as S
from kvarn.kernels.records import layout

MODES = ("tiles", "step", "decode", "flush")
PARTS = {"tiles": ("keys", "values"), "step": ("keys", "values"), "decode": ("both",), "flush": ("both",)}


def _compile(kernel, const: dict, types: dict, aligned, warps: int):
    names = kernel.arg_names
    sig = {n: "constexpr" if n in const else types.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in names}
    return triton.compile(ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in const.items()},
                                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def _ptxas(ptx: str) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                           text=True, timeout=300)
    finally:
        os.unlink(f.name)
    txt = r.stdout + r.stderr
    if r.returncode != 0:
        raise SystemExit(f"ptxas ({ptxas}) failed on this Triton's PTX: {txt.strip().splitlines()[-1:]}; "
                         "--no-ptxas reports the PTX facts alone")
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, txt)) else None  # noqa: E731
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame")}


def codegen(mode: str, part: str = "both", head_dim: int = 128, fmt_name: str = "kvarn_k4v2_g128",
            ptxas: bool = True) -> dict:
    """The compiled facts of one store variant at this head dim (bf16 tensors, 8 KV heads); part: keys, values
    (tiles, step) or both (decode, flush), with the launch's warp count."""
    lay = layout(get_format(fmt_name), head_dim)
    const = S._tile_constexprs(lay, 8, head_dim, 3)
    part_v = {"both": S.BOTH, "keys": S.KEYS, "values": S.VALUES}[part].value
    warps = S._warps(lay, head_dim, part_v)
    if mode == "flush":
        kernel = S._flush_layers_kernel
        const["TAIL_DT"] = 1
        types = {n: "*i64" for n in ("ktab_ptr", "vtab_ptr", "ctab_ptr")}
        aligned = [*types, *(n for n in kernel.arg_names if n.startswith("stride_"))]
    else:
        kernel = S._store_tiles_kernel
        const.update(SOURCE={"tiles": S.TILES, "step": S.STEP, "decode": S.DECODE}[mode].value,
                     DEFER=int(mode == "decode"), PART=part_v)
        types = {"k_ptr": "*bf16", "v_ptr": "*bf16", "tk_ptr": "*bf16", "tv_ptr": "*bf16", "cache_ptr": "*u8",
                 "cache16_ptr": "*fp16", "first_ptr": "*i64"}
        # as a launch specialises them: tensors 16-byte aligned, strides multiples of 16
        aligned = [n for n in kernel.arg_names
                   if (n in types and n != "first_ptr") or (n.startswith("stride_") and n != "stride_bt")]
    ptx = _compile(kernel, const, types, aligned, warps).asm["ptx"]
    out = {"mode": mode, "part": part, "warps": warps, "head_dim": head_dim, "triton": triton.__version__,
           "vector_loads": len(re.findall(r"ld\.global(?:\.[a-z0-9]+)*\.v[248]\.", ptx)),
           "loads": len(re.findall(r"ld\.global", ptx)), "rni": len(re.findall(r"cvt\.rni\.f32\.f32", ptx)),
           # 0f4B400000 = 1.5 * 2^23: the round-to-nearest-even adds (added, then subtracted as 0fCB400000)
           "magic_adds": len(re.findall(r"add(?:\.rn)?\.f32\s[^;]*0f[4C]B400000", ptx))}
    return {**out, **(_ptxas(ptx) if ptxas else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    ap.add_argument("--kv-dtype", default="kvarn_k4v2_g128", help="a KVarN preset (its tile size and bit widths)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-ptxas", action="store_true", help="PTX facts only (no register / spill counts)")
    ap.add_argument("--json", action="store_true", help="one JSON object per variant")
    a = ap.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes {','.join(bad)}: accepted are {', '.join(MODES)}")
    presets = [f.name for f in kvarn_formats()]
    if a.kv_dtype not in presets:
        ap.error(f"--kv-dtype {a.kv_dtype}: accepted are {', '.join(presets)}")
    rows = [codegen(m, p, a.head_dim, a.kv_dtype, ptxas=not a.no_ptxas) for m in modes for p in PARTS[m]]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    cols = ("mode", "part", "warps", "head_dim", "registers", "spill_stores", "spill_loads", "stack", "vector_loads",
            "loads", "rni", "magic_adds")
    print(f"triton {rows[0]['triton']}, sm_90\n" + " ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" ".join(f"{str(r.get(c, '-')):>12}" for c in cols))


if __name__ == "__main__":
    main()
