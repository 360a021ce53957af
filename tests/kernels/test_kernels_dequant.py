"""kvarn.kernels.dequantize_to_rows (the dense prefill path's decoder) vs the reference decoder, in the Triton
interpreter on CPU: every preset family, D 64 / 128, outlier channels, constant channels, scattered blocks."""
from __future__ import annotations

import pytest
import torch

from kvarn.formats import get_format
from kvarn.kernels.dequant import dequantize_to_rows
from kvarn.method.reference import dequantize_tiles, quantize_tiles


@pytest.mark.parametrize("name,D,dtype", [
    ("kvarn_k4v2_g128", 128, torch.float32),
    ("kvarn_k4v2_g128", 64, torch.bfloat16),
    ("kvarn_k4v4_g128", 64, torch.float16),
    ("kvarn_k2v2_g128", 64, torch.float32),
    ("kvarn_k4v2_g64", 64, torch.float32),
    ("kvarn_k4v2_g128", 256, torch.bfloat16),  # D=256: 32-token key programs, the 256 x 256 value rotation
])
def test_dequantize_to_rows_matches_reference(name, D, dtype):
    fmt = get_format(name)
    g, H, T = fmt.group, 2, 3
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(T, H, g, D, generator=gen) * 2
    k[..., 3] *= 30.0  # outlier channel
    k[1, 0, :, 5] = 2.5  # constant channel
    v = torch.randn(T, H, g, D, generator=gen)
    recs = quantize_tiles(k, v, fmt)
    cache = torch.zeros(7, H, fmt.record_bytes(D), dtype=torch.uint8)
    blocks = torch.tensor([5, 1, 3], dtype=torch.int32)
    cache[blocks.long()] = recs
    dst = torch.tensor([2 * g + 1, 0, g], dtype=torch.int64)  # out of order, a gap row at g .. 2g (tile 2 writes it)
    N = 3 * g + 1
    k_out = torch.full((N, H, D), float("nan"), dtype=dtype)
    v_out = torch.full((N, H, D), float("nan"), dtype=dtype)
    dequantize_to_rows(cache, blocks, dst, k_out, v_out, fmt)
    kr, vr = dequantize_tiles(recs, fmt, D)  # [T, H, g, D]
    for t in range(T):
        rows = slice(int(dst[t]), int(dst[t]) + g)
        for got, want in ((k_out[rows], kr[t]), (v_out[rows], vr[t])):
            want = want.transpose(0, 1).to(dtype).float()
            err = ((got.float() - want).norm() / want.norm()).item()
            assert err < (1e-5 if dtype == torch.float32 else 1e-2), (t, err)
    assert torch.isnan(k_out[2 * g]).all()  # the one row no tile covers stays untouched
