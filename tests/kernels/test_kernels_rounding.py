"""The tile store's rounding (kvarn.kernels.store._round_clamped) is torch's round-half-even then clamp, bit for bit:
the codes of every value and key tile go through it, and the store tests only bound how many codes may differ from
the reference (reduction order moves a few), so an off-by-one at a tie would hide there. Interpreter and GPU (where
ptxas could, but must not, fold the two adds)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kvarn.kernels.store import _round_clamped

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, _round_clamped(tl.load(x_ptr + i, mask=m), QMAX), mask=m)


def _inputs() -> torch.Tensor:
    ties = torch.arange(-5, 300, dtype=torch.float32) + 0.5  # every tie of the code ranges, and past them
    near = torch.cat([torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])  # one ulp either side
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 3.4e38, -3.4e38, 2.0 ** 22 + 0.5,
                            2.0 ** 23 + 0.5, 1e-45, -1e-45, 0.49999997, 0.50000006, -0.49999997])
    g = torch.Generator().manual_seed(7)
    return torch.cat([special, ties, near, torch.rand(4096, generator=g) * 400 - 50,
                      torch.randn(4096, generator=g) * 1e6])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_round_clamped_is_round_half_even_then_clamp(device, bits):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    qmax = (1 << bits) - 1
    x = _inputs().to(device)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), qmax, 1024)
    want = torch.round(x).clamp(0, qmax)
    assert torch.equal(y, want), x[y != want][:8].tolist()
    assert not torch.signbit(y).any()  # never -0.0: the codes are packed as integers


@pytest.mark.parametrize("device", DEVICES)
def test_round_clamped_maps_nan_to_zero(device):
    # the store sanitizes its inputs first; a NaN reaching the rounding still gives code 0, never garbage
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.tensor([float("nan")] * 4, device=device)
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, 4, 3, 4)
    assert torch.equal(y, torch.zeros_like(y))
