"""Statistics for accuracy and perplexity claims: intervals, paired comparisons against fp16, pass@k.

Everything is plain Python + numpy, deterministic for a given seed. Conventions (shared with `kvarn gate`):
accuracy and its change vs fp16 are fractions (0.031 = 3.1 pp); perplexity change is absolute (ppl - ppl_fp16).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054
BOOT = 10_000


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion (good at p near 0 or 1 and for small n, unlike the Wald interval)."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return (lo, hi)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def bootstrap_mean(values, iters: int = BOOT, seed: int = 0, alpha: float = 0.05) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (resampling items)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return (math.nan, math.nan)
    if x.size == 1 or np.all(x == x[0]):
        return (float(x[0]), float(x[0]))
    idx = _rng(seed).integers(0, x.size, size=(iters, x.size))
    means = x[idx].mean(axis=1)
    return (float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2)))


def ppl_of(nll_sum, tokens) -> float:
    nll, n = float(np.sum(nll_sum)), float(np.sum(tokens))
    return math.exp(nll / n) if n > 0 else math.nan


def bootstrap_ppl(nll_sums, token_counts, iters: int = BOOT, seed: int = 0, alpha: float = 0.05) -> tuple[float, float]:
    """Interval of exp(sum nll / sum tokens), resampling windows (the unit that is independent enough)."""
    a, b = np.asarray(nll_sums, float), np.asarray(token_counts, float)
    if a.size < 2:
        p = ppl_of(a, b)
        return (p, p)
    idx = _rng(seed).integers(0, a.size, size=(iters, a.size))
    vals = np.exp(a[idx].sum(1) / b[idx].sum(1))
    return (float(np.quantile(vals, alpha / 2)), float(np.quantile(vals, 1 - alpha / 2)))


def paired_bootstrap_diff(x, y, iters: int = BOOT, seed: int = 0, alpha: float = 0.05) -> tuple[float, float, float]:
    """Mean of x - y over paired items and its percentile bootstrap interval (items resampled jointly)."""
    d = np.asarray(x, float) - np.asarray(y, float)
    if d.size == 0:
        return (math.nan, math.nan, math.nan)
    lo, hi = bootstrap_mean(d, iters, seed, alpha)
    return (float(d.mean()), lo, hi)


def paired_bootstrap_ppl(nll_a, tok_a, nll_b, tok_b, iters: int = BOOT, seed: int = 0,
                         alpha: float = 0.05) -> tuple[float, float, float]:
    """ppl(a) - ppl(b) over the same windows, interval by resampling windows jointly."""
    na, ta, nb, tb = (np.asarray(v, float) for v in (nll_a, tok_a, nll_b, tok_b))
    point = ppl_of(na, ta) - ppl_of(nb, tb)
    if na.size < 2:
        return (point, point, point)
    idx = _rng(seed).integers(0, na.size, size=(iters, na.size))
    vals = np.exp(na[idx].sum(1) / ta[idx].sum(1)) - np.exp(nb[idx].sum(1) / tb[idx].sum(1))
    return (point, float(np.quantile(vals, alpha / 2)), float(np.quantile(vals, 1 - alpha / 2)))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (b: only A right, c: only B right)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(0, k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class AccuracySummary:
    n: int  # problems
    k: int  # samples per problem
    accuracy: float  # avg@k (= pass@1 estimate); plain accuracy when k == 1
    ci_low: float
    ci_high: float
    pass_at_k: float
    method: str  # "wilson" | "bootstrap"


def summarize_accuracy(per_problem: dict[str, list[float]], seed: int = 0) -> AccuracySummary:
    """per_problem: problem id -> list of 0/1 scores (one per sample)."""
    if not per_problem:
        return AccuracySummary(0, 0, math.nan, math.nan, math.nan, math.nan, "none")
    ks = {len(v) for v in per_problem.values()}
    k = min(ks)
    rates = [float(np.mean(v)) for v in per_problem.values()]
    acc = float(np.mean(rates))
    pk = float(np.mean([1.0 if max(v) > 0 else 0.0 for v in per_problem.values()]))
    if ks == {1}:
        succ = int(round(sum(rates)))
        lo, hi = wilson(succ, len(rates))
        return AccuracySummary(len(rates), 1, acc, lo, hi, pk, "wilson")
    lo, hi = bootstrap_mean(rates, seed=seed)
    return AccuracySummary(len(rates), k, acc, lo, hi, pk, "bootstrap")


@dataclass
class PairedDiff:
    n_paired: int
    delta: float
    ci_low: float
    ci_high: float
    mcnemar_p: float  # NaN unless one sample per problem
    only_candidate: int  # discordant: candidate right, baseline wrong (k == 1)
    only_baseline: int


def paired_accuracy(cand: dict[str, list[float]], base: dict[str, list[float]], seed: int = 0) -> PairedDiff:
    """Candidate minus baseline on the problems both answered (per-problem mean over samples), paired bootstrap
    interval, and the exact McNemar test when there is one sample per problem."""
    ids = sorted(set(cand) & set(base))
    if not ids:
        return PairedDiff(0, math.nan, math.nan, math.nan, math.nan, 0, 0)
    a = [float(np.mean(cand[i])) for i in ids]
    b = [float(np.mean(base[i])) for i in ids]
    d, lo, hi = paired_bootstrap_diff(a, b, seed=seed)
    p, oc, ob = math.nan, 0, 0
    if all(len(cand[i]) == 1 and len(base[i]) == 1 for i in ids):
        oc = sum(1 for x, y in zip(a, b) if x > 0.5 and y < 0.5)
        ob = sum(1 for x, y in zip(a, b) if x < 0.5 and y > 0.5)
        p = mcnemar_exact(oc, ob)
    return PairedDiff(len(ids), d, lo, hi, p, oc, ob)
