"""kvarn.finite.all_finite: the per-module flag of the non-finite watch catches a NaN or an infinity anywhere."""
import pytest
import torch

from kvarn.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_element_anywhere_is_caught(dtype, bad):
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(3, 50, 64, generator=gen).to(dtype)
    assert bool(all_finite(t))
    for pos in (0, 4_321, t.numel() - 1):
        u = t.clone()
        u.view(-1)[pos] = bad
        assert not bool(all_finite(u)), (dtype, bad, pos)


def test_extremes_that_are_finite_pass_and_empty_is_finite():
    t = torch.tensor([65504.0, -65504.0, 0.0, 6e-8], dtype=torch.float16)  # float16's max and a subnormal
    assert bool(all_finite(t)) and bool(all_finite(torch.empty(0, 4)))
    assert all_finite(t).dtype == torch.bool and all_finite(t).dim() == 0
