"""Pooled paired comparisons over every input of a cell, with equivalence tests.

The method compares two models over k = 5 subsets of 200 inputs (a paired t-test with k − 1
degrees of freedom). Its subsets cover only part of the pool (5 × 200 draws from 1,000 inputs
reach about 670 of them) and four degrees of freedom give wide intervals, so a finding here is
read from every input of the cell, paired over inputs:

* **Mean of per-input values** (an indicator — correct, flipped, robust — or a number per
  input): ``Δ = mean_i (a_i − b_i)``. Binary outcomes are tested with the exact McNemar test
  (`stats.mcnemar_test`), other values with the paired t-test over inputs (``df = M − 1``;
  at the pool sizes used, M ≥ 100, the mean of the differences is close to normal).
* **Mean radius over correctly predicted inputs** (the method's R̄): ``Δ = R̄_a − R̄_b`` with
  ``R̄ = Σ_i R_i c_i / Σ_i c_i`` over each model's own correct inputs, a ratio of two sums, so
  no per-input difference exists. Tested with the input-level bootstrap: the same resampled
  inputs for both models, standard error ``se`` = the sd of the resampled Δ, and the Wald
  ``p = 2 Φ(−|Δ| / se)`` (a resampled p-value could not go below ``1/B``, which no run-wide
  correction over hundreds of tests can pass).

Every comparison gets the 95 % percentile interval of Δ over ``B`` paired input-level bootstrap
resamples (`bootstrap_weights`: one fixed set of resamples per pool size, so the intervals are
reproducible) and a **two one-sided test** (TOST, Schuirmann 1987) of equivalence within
``±margin``: H0 ``|Δ| ≥ margin`` is rejected when both ``Δ > −margin`` and ``Δ < margin`` are;
``p_TOST = max(p_lower, p_upper)`` from the same t (means) or normal (R̄) reference as the test
of difference. A small ``p_TOST`` supports "no difference larger than the margin"; a large
``p`` alone never does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import scipy.stats

from cbcert.robustness import stats

# Paired input-level bootstrap resamples per comparison, and their seed (fixed: reproducible).
RESAMPLES = 2000
SEED = 0
MCNEMAR = "exact McNemar (inputs)"
PAIRED_T = "paired t (inputs)"
BOOTSTRAP_WALD = "bootstrap Wald (inputs)"


@dataclass(frozen=True)
class PooledComparison:
    """One paired comparison of two models over a cell's inputs.

    ``value_a``/``value_b``: each model's statistic (mean, or R̄); ``delta = value_a − value_b``
    with its 95 % bootstrap interval ``[ci_low, ci_high]``; ``p``: two-sided p of ``Δ = 0``
    (None where the test has no answer: no input, or no variation in either model);
    ``tost_p``: the equivalence p within ``±margin`` (None without a margin or a p); ``test``
    names the test of difference; ``inputs`` counts the paired inputs.
    """

    value_a: float
    value_b: float
    delta: float
    ci_low: float
    ci_high: float
    p: float | None
    tost_p: float | None
    margin: float | None
    test: str
    inputs: int


@functools.lru_cache(maxsize=8)
def bootstrap_weights(inputs: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """``[B, M]`` float64 counts: row b holds how often each of the M inputs is drawn in the b-th
    bootstrap resample (M draws with replacement from ``numpy.random.default_rng(seed)``), so
    a resampled sum is ``W @ v``. Cached per (M, B, seed) and read-only: every comparison of
    one pool size shares its resamples."""
    if inputs < 1 or resamples < 1:
        raise ValueError(f"bootstrap_weights: inputs and resamples must be >= 1, got {inputs}, "
                         f"{resamples}")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, inputs, size=(resamples, inputs))  # [B, M]
    offsets = (np.arange(resamples)[:, None] * inputs + draws).ravel()
    weights = np.bincount(offsets, minlength=resamples * inputs).astype(np.float64)
    weights = weights.reshape(resamples, inputs)
    weights.setflags(write=False)
    return weights


def _interval(resampled: np.ndarray) -> tuple[float, float]:
    finite = resampled[np.isfinite(resampled)]
    if finite.size == 0:
        return math.nan, math.nan
    low, high = np.quantile(finite, [0.025, 0.975])
    return float(low), float(high)


def tost_t(mean: float, se: float, df: int, margin: float) -> float:
    """TOST p of equivalence within ``±margin`` for a mean with standard error ``se`` and a t
    reference with ``df`` degrees of freedom (``df = inf``: normal):
    ``max(1 − T((mean + margin)/se), T((mean − margin)/se))``. With ``se = 0`` the answer is
    exact: 0 inside the margin, 1 on or outside it."""
    if margin <= 0:
        return 1.0
    if se == 0:
        return 0.0 if abs(mean) < margin else 1.0
    dist = scipy.stats.norm if math.isinf(df) else scipy.stats.t(df)
    lower = float(dist.sf((mean + margin) / se))
    upper = float(dist.cdf((mean - margin) / se))
    return max(lower, upper)


def paired_means(a: np.ndarray, b: np.ndarray, *, margin: float | None,
                 resamples: int = RESAMPLES, seed: int = SEED) -> PooledComparison:
    """Pooled comparison of per-input values ``a``, ``b`` (``[M]``, same inputs in the same
    order): ``Δ = mean(a − b)``; exact McNemar if both hold only 0/1, else the paired t-test
    over inputs; 95 % paired bootstrap interval; TOST within ``±margin`` with the t reference
    (``se = sd(a − b)/√M``, ``df = M − 1``). All-equal pairs (every ``d_i = 0``) give
    ``p = 1``; a constant non-zero difference gives the exact sign-test p (McNemar) or None
    (t)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.shape[0] < 2:
        raise ValueError(f"paired_means: a and b must have the same shape [M] with M >= 2, "
                         f"got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("paired_means: a and b must be finite")
    d = a - b  # [M]
    m = d.shape[0]
    mean = float(d.mean())
    low, high = _interval(bootstrap_weights(m, resamples, seed) @ d / m)
    binary = np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all()
    sd = float(d.std(ddof=1))
    if binary:
        p, test = stats.mcnemar_test(a, b).pvalue, MCNEMAR
    elif np.ptp(d) == 0:
        p, test = (1.0 if mean == 0 else None), PAIRED_T
    else:
        p, test = float(scipy.stats.ttest_rel(a, b).pvalue), PAIRED_T
    tost = None if margin is None else tost_t(mean, sd / math.sqrt(m), m - 1, margin)
    return PooledComparison(float(a.mean()), float(b.mean()), mean, low, high, p, tost, margin,
                            test, m)


def _mean_of_correct(weights: np.ndarray, radius: np.ndarray, correct: np.ndarray):
    """``Σ_i w_i R_i c_i / Σ_i w_i c_i`` for each row of ``weights`` (NaN where no correct
    input was drawn)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (weights @ (radius * correct)) / (weights @ correct)


def paired_radius_of_correct(radius_a: np.ndarray, correct_a: np.ndarray,
                             radius_b: np.ndarray, correct_b: np.ndarray, *,
                             relative_margin: float | None, resamples: int = RESAMPLES,
                             seed: int = SEED) -> PooledComparison:
    """Pooled comparison of the mean certified radius over each model's correct inputs,
    ``R̄ = Σ_i R_i c_i / Σ_i c_i`` (the method's R), between models a and b on the same M
    inputs: ``Δ = R̄_a − R̄_b``, bootstrap Wald test and interval (module docstring), TOST
    within ``±relative_margin · R̄_a`` with the normal reference.

    Args:
      radius_a, radius_b: ``[M]`` certified radii (any value where not correct; NaN allowed
        there).
      correct_a, correct_b: ``[M]`` bool, the smoothed prediction equals the label.
    Returns:
      `PooledComparison`; ``p`` is None when either model has no correct input or neither
      radius varies over the resamples (e.g. every correct radius is 0 in both).
    """
    correct_a = np.asarray(correct_a, bool)
    correct_b = np.asarray(correct_b, bool)
    ra = np.where(correct_a, np.asarray(radius_a, np.float64), 0.0)
    rb = np.where(correct_b, np.asarray(radius_b, np.float64), 0.0)
    m = ra.shape[0]
    if not (ra.shape == rb.shape == correct_a.shape == correct_b.shape) or m < 2:
        raise ValueError("paired_radius_of_correct: radii and correct flags must share one "
                         f"shape [M] with M >= 2, got {ra.shape}, {rb.shape}")
    if not (np.isfinite(ra).all() and np.isfinite(rb).all()):
        raise ValueError("paired_radius_of_correct: radii of correct inputs must be finite")
    if not correct_a.any() or not correct_b.any():
        value_a = float(ra[correct_a].mean()) if correct_a.any() else math.nan
        value_b = float(rb[correct_b].mean()) if correct_b.any() else math.nan
        return PooledComparison(value_a, value_b, value_a - value_b, math.nan, math.nan, None,
                                None, None, BOOTSTRAP_WALD, m)
    value_a = float(ra[correct_a].mean())
    value_b = float(rb[correct_b].mean())
    delta = value_a - value_b
    weights = bootstrap_weights(m, resamples, seed)
    resampled = (_mean_of_correct(weights, ra, correct_a.astype(np.float64))
                 - _mean_of_correct(weights, rb, correct_b.astype(np.float64)))  # [B]
    low, high = _interval(resampled)
    finite = resampled[np.isfinite(resampled)]
    se = float(finite.std(ddof=1)) if finite.size > 1 else 0.0
    margin = None if relative_margin is None else relative_margin * value_a
    if se == 0:  # nothing varies (e.g. every correct radius 0 in both): no test at all
        return PooledComparison(value_a, value_b, delta, low, high, None, None, margin,
                                BOOTSTRAP_WALD, m)
    p = float(2 * scipy.stats.norm.sf(abs(delta) / se))
    tost = None if margin is None else tost_t(delta, se, math.inf, margin)
    return PooledComparison(value_a, value_b, delta, low, high, p, tost, margin, BOOTSTRAP_WALD,
                            m)


__all__ = ["BOOTSTRAP_WALD", "MCNEMAR", "PAIRED_T", "RESAMPLES", "SEED", "PooledComparison",
           "bootstrap_weights", "paired_means", "paired_radius_of_correct", "tost_t"]
