"""kvarn.kernels.rows (the store's tail-row writes, the dense path's tail-row reads) against torch indexing, in the
Triton interpreter on CPU: bit-exact copies (NaN and outliers included), dtype conversion, K a contiguous copy
while V is still a strided view into a fused QKV buffer, the dense path's `use` mask, and one-line errors."""
from __future__ import annotations

import pytest
import torch

from kvarn.errors import KvarnError
from kvarn.kernels.rows import read_tail_rows, write_tail_rows

H, D = 3, 64
# the interpreter here; compiled on a GPU (pytest -m gpu)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _qkv(n, gen, dtype):
    """K a contiguous copy (as a model's K norm makes it), V a view into the fused QKV output."""
    qkv = torch.randn(n, 4 + 2 * H, D, generator=gen).to(dtype)
    qkv[1, 4, 7] = float("nan")  # copies carry NaN and outliers as they are
    qkv[2, 4 + H, 9] = 6e4 if dtype != torch.bfloat16 else 3e38
    return qkv[:, 4:4 + H].contiguous(), qkv[:, 4 + H:]


def _same(a, b):
    assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src,tail", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
                                      (torch.float16, torch.float32)])
def test_write_tail_rows_equals_indexing(src, tail, device):
    gen = torch.Generator().manual_seed(0)
    k, v = (x.to(device) for x in _qkv(40, gen, src))
    S, rows = 5, 64 + 16 + 2 * 8  # g + sink + 2 W, as the backend allocates them
    tk = torch.randn(S, H, rows, D, generator=gen).to(device, tail)
    tv = torch.randn(S, H, rows, D, generator=gen).to(device, tail)
    n = 29  # distinct (slot, row) destinations: each is written once per step
    dest = torch.randperm(S * rows, generator=gen)[:n]
    slot, row = (dest // rows).to(device), (dest % rows).to(device)
    tok = torch.randint(0, 40, (n,), generator=gen).to(device)
    want_k, want_v = tk.clone(), tv.clone()
    want_k[slot, :, row] = k[tok].to(tail)
    want_v[slot, :, row] = v[tok].to(tail)
    write_tail_rows(k, v, tk, tv, tok, slot.to(torch.int32), row)
    _same(tk, want_k)
    _same(tv, want_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_use", [False, True])
def test_read_tail_rows_equals_indexing(with_use, device):
    gen = torch.Generator().manual_seed(1)
    S, rows, N, n = 4, 96, 50, 21
    tk = torch.randn(S, H, rows, D, generator=gen).to(torch.bfloat16)
    tv = torch.randn(S, H, rows, D, generator=gen).to(torch.bfloat16)
    tk[2, 1, 5, 3] = float("nan")
    k = torch.randn(N, H, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(N, H, D, generator=gen).to(torch.bfloat16)
    slot = torch.randint(0, S, (n,), generator=gen)
    row = torch.randint(0, rows, (n,), generator=gen)
    slot[0], row[0] = 2, 5
    dst = torch.randperm(N, generator=gen)[:n]
    use = torch.rand(n, 1, 1, generator=gen) > 0.4 if with_use else None  # the shape PostStoreIndex.row_use has
    tk, tv, k, v, slot, row, dst = (x.to(device) for x in (tk, tv, k, v, slot, row, dst))
    use = None if use is None else use.to(device)
    want_k, want_v = k.clone(), v.clone()
    keep = use.view(-1) if with_use else torch.ones(n, dtype=torch.bool, device=device)
    want_k[dst[keep]] = tk[slot[keep], :, row[keep]]
    want_v[dst[keep]] = tv[slot[keep], :, row[keep]]
    read_tail_rows(tk, tv, slot, row, k, v, dst, use)
    _same(k, want_k)
    _same(v, want_v)


def test_row_copies_of_nothing_and_bad_arguments():
    tk = torch.zeros(2, H, 64, D)
    k = torch.zeros(4, H, D)
    none = torch.zeros(0, dtype=torch.int64)
    write_tail_rows(k, k, tk, tk, none, none, none)  # an empty step: no launch
    read_tail_rows(tk, tk, none, none, k, k, none)
    idx = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(KvarnError, match=r"^row must be int32 / int64 \[2\]"):
        write_tail_rows(k, k, tk, tk, idx, idx, idx[:1])
    with pytest.raises(KvarnError, match=r"^use must be bool with 2 elements"):
        read_tail_rows(tk, tk, idx, idx, k, k, idx, use=torch.ones(2, dtype=torch.int32))
    with pytest.raises(KvarnError, match=r"must agree"):
        write_tail_rows(torch.zeros(4, H, 32), torch.zeros(4, H, 32), tk, tk, idx, idx, idx)


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvarn.kernels.rows import _copy_rows_kernel as k
types = {"src_k_ptr": "*bf16", "src_v_ptr": "*bf16", "dst_k_ptr": "*bf16", "dst_v_ptr": "*bf16",
         "src_a_ptr": "*i64", "src_b_ptr": "*i64", "dst_a_ptr": "*i64", "dst_b_ptr": "*i64", "use_ptr": "*i1"}
const = dict(H=8, D=128, SRC_B=False, DST_B=True, USE=False)
sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in k.arg_names}
ptx = triton.compile(ASTSource(k, sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()}),
                     target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
print("ld.global" in ptx and "st.global" in ptx)
"""


def test_copy_kernel_compiles_for_sm90():
    """The interpreter runs what the compiler may reject (a global that is not a constexpr, say): the kernel is
    also compiled offline for sm_90 (no GPU), as a serving step's first launch would."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, cwd=root, timeout=300,
                       env={**env, "PYTHONPATH": str(root)})
    if r.returncode and not any(e in r.stderr for e in ("CompilationError", "NameError", "TypeError")):
        pytest.skip(f"no offline sm_90 compile here: {r.stderr.strip().splitlines()[-1:]}")
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-1500:]
