"""kvarn.eval.stats and kvarn.eval.extract: intervals, paired tests, pass@k, lm-eval-compatible answer extraction."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvarn.eval import extract as X
from kvarn.eval import stats as S


def test_wilson_known_values():
    lo, hi = S.wilson(0, 3)
    assert lo == 0.0 and hi == pytest.approx(0.5615, abs=1e-3)
    lo, hi = S.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    lo, hi = S.wilson(10, 10)
    assert hi == 1.0 and 0.69 < lo < 0.73
    assert all(math.isnan(v) for v in S.wilson(0, 0))


def test_mcnemar_exact():
    assert S.mcnemar_exact(0, 0) == 1.0
    # 0 vs 6 discordant: 2 * 0.5^6
    assert S.mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert S.mcnemar_exact(6, 0) == S.mcnemar_exact(0, 6)
    assert S.mcnemar_exact(5, 5) == 1.0
    assert S.mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 1024)


def test_pass_at_k():
    assert S.pass_at_k(4, 0, 4) == 0.0
    assert S.pass_at_k(4, 1, 4) == 1.0
    assert S.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert S.pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    with pytest.raises(ValueError):
        S.pass_at_k(2, 1, 3)


def test_bootstrap_covers_mean_and_is_deterministic():
    rng = np.random.default_rng(1)
    x = rng.normal(5, 1, 200)
    lo, hi = S.bootstrap_mean(x, seed=3)
    assert lo < x.mean() < hi and hi - lo < 0.5
    assert (lo, hi) == S.bootstrap_mean(x, seed=3)
    assert S.bootstrap_mean([2.0, 2.0]) == (2.0, 2.0)


def test_summarize_accuracy_k1_and_k4():
    a = S.summarize_accuracy({"a": [1.0], "b": [0.0], "c": [1.0], "d": [1.0]})
    assert (a.n, a.k, a.method) == (4, 1, "wilson") and a.accuracy == 0.75
    assert (a.ci_low, a.ci_high) == S.wilson(3, 4)
    b = S.summarize_accuracy({"a": [1, 0, 0, 0], "b": [0, 0, 0, 0], "c": [1, 1, 1, 1]})
    assert b.k == 4 and b.method == "bootstrap"
    assert b.accuracy == pytest.approx((0.25 + 0 + 1) / 3)
    assert b.pass_at_k == pytest.approx(2 / 3)
    assert b.ci_low <= b.accuracy <= b.ci_high


def test_paired_accuracy_discordant_and_interval():
    base = {str(i): [1.0] for i in range(20)}
    cand = {str(i): [1.0 if i >= 6 else 0.0] for i in range(20)}  # 6 regressions, no gains
    d = S.paired_accuracy(cand, base)
    assert d.n_paired == 20 and d.delta == pytest.approx(-0.3)
    assert d.only_candidate == 0 and d.only_baseline == 6
    assert d.mcnemar_p == pytest.approx(2 / 64)
    assert d.ci_high < 0  # significant drop: interval excludes 0
    same = S.paired_accuracy(base, base)
    assert same.delta == 0 and same.ci_low == 0 and same.ci_high == 0 and same.mcnemar_p == 1.0
    # only shared problems are paired
    assert S.paired_accuracy({"x": [1.0]}, base).n_paired == 0


def test_paired_ppl():
    nll_b, tok = np.array([100.0, 110.0, 90.0, 105.0]), np.array([50, 50, 50, 50])
    nll_a = nll_b + 5
    d, lo, hi = S.paired_bootstrap_ppl(nll_a, tok, nll_b, tok)
    assert d == pytest.approx(S.ppl_of(nll_a, tok) - S.ppl_of(nll_b, tok)) and 0 < lo <= d <= hi
    assert S.ppl_of([math.log(10) * 4], [4]) == pytest.approx(10.0)


# ---- extraction ------------------------------------------------------------------------------------------------------
def test_gsm8k_strict_and_flexible():
    assert X.gsm8k_target("so 9*2 = 18\n#### 18") == "18"
    assert X.gsm8k_strict("... #### 1,200.") == "1,200."
    assert X.gsm8k_match(X.gsm8k_strict("... #### 1,200."), "1200")
    assert X.gsm8k_strict("The answer is 18") == X.INVALID
    assert X.gsm8k_flexible("She has 3 apples, then 16 - 3 = $13.") == "$13."
    assert X.gsm8k_match("$13.", "13")
    assert X.gsm8k_flexible("no digits") == X.INVALID
    assert X.gsm8k_flexible("x is 7") == "7"
    assert not X.gsm8k_match(X.INVALID, "7")


def test_math_extraction_and_equivalence():
    r = "We get $x = 3$ and so the answer is $\\boxed{\\frac{1}{2}}$."
    assert X.last_boxed(r) == "\\frac{1}{2}"
    assert X.math_candidate(r) == "\\frac{1}{2}"
    assert X.math_equal("\\dfrac12", "\\frac{1}{2}") and X.math_equal("0.5", "\\frac{1}{2}")
    assert X.math_equal("1/2", "\\frac{1}{2}")
    assert X.math_equal("\\boxed{70}"[7:-1], "70")
    assert X.math_candidate("The answer is $204$.") == "204"
    assert X.math_candidate("so \\boxed{033}", boxed=True) == "033" and not X.math_equal("033", "33")
    assert X.math_equal("x = 5", "5") and X.math_equal("10^\\circ", "10")
    assert not X.math_equal("6", "5")
    assert X.last_boxed("no box") is None and X.last_boxed("\\boxed{unclosed") is None
    assert X.math_candidate("a $1$ b $\\boxed{2}$", boxed=False) == "1$ b $\\boxed{2}"  # math500: $...$ only
    assert X.strip_thinking("<think>maybe 3</think> it is 4") == " it is 4"


def test_first_number_exact_digits():
    assert X.first_number(" 1234567.", 7) == "1234567"
    assert X.first_number("12345678", 7) == X.INVALID  # longer numbers do not match
    assert X.first_number("none", 7) == X.INVALID
