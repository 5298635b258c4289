"""Monte Carlo ``CERTIFY`` and ``PREDICT`` of Cohen et al. (2019) from class counts.

Cohen, Rosenfeld & Kolter, "Certified adversarial robustness via randomized smoothing"
(ICML 2019), Pseudocode 1; the statistics follow the reference ``core.py`` of
locuslab/smoothing (re-derived here, not copied):

* ``CERTIFY``: the top class ``ĉA`` is the argmax of ``n0`` *selection* counts; ``n`` fresh
  *estimation* samples give ``nA``; ``pA_lower`` is the one-sided Clopper–Pearson lower bound
  at level ``1 − α``; abstain if ``pA_lower < 1/2``, else the radius rule turns the bound into
  a radius (``σ Φ⁻¹(pA_lower)`` for latent Gaussian noise, Hamming certificates for flips).
* ``PREDICT``: the top two classes of ``n`` counts; abstain if the two-sided binomial test of
  ``nA`` out of ``nA + nB`` at 1/2 has p-value ``> α``.

The counts come from ``cbcert.engine`` (one integer per class and input); everything here is
float64 numpy on host. ``ABSTAIN`` (−1) marks abstentions in ``prediction``; abstained radii
are NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cbcert.certify.bounds import (
    binomial_test_half,
    bonferroni_split,
    check_alpha,
    clopper_pearson_lower,
    clopper_pearson_upper,
    randomized_clopper_pearson_lower,
    randomized_clopper_pearson_upper,
)

ABSTAIN = -1


class RadiusRule(Protocol):
    """Turns probability bounds into certified radii (NaN = abstain).

    Implementations: ``cbcert.certify.l2.L2Radius``, ``cbcert.certify.hamming.
    BernoulliHammingRadius``, ``cbcert.certify.hamming.FixedFlipHammingRadius``.
    ``p_upper=None`` asks for the one-class form (``pB_upper = 1 − pA_lower``).
    """

    def radius(self, p_lower: np.ndarray, p_upper: np.ndarray | None) -> np.ndarray: ...


@dataclass(frozen=True)
class Certificate:
    """Result of ``CERTIFY`` for a batch of inputs; every field has the batch shape ``[...]``.

    Attributes:
      prediction: int64 class of the smoothed classifier, ``ABSTAIN`` (−1) when abstaining.
      count_top: estimation count of the class picked by the selection counts.
      count_runner_up: largest estimation count among the other classes.
      p_lower: lower confidence bound on the picked class's probability.
      p_upper: upper bound on every other class's probability: the Clopper–Pearson bound of
        the runner-up in the two-class form, ``1 − p_lower`` in the one-class form.
      radius: float64 certified radius, NaN when abstaining.
    """

    prediction: np.ndarray
    count_top: np.ndarray
    count_runner_up: np.ndarray
    p_lower: np.ndarray
    p_upper: np.ndarray
    radius: np.ndarray


@dataclass(frozen=True)
class Prediction:
    """Result of ``PREDICT`` for a batch of inputs; every field has the batch shape ``[...]``.

    Attributes:
      prediction: int64 top class, ``ABSTAIN`` (−1) when the test is not significant.
      count_top: count of the top class (ties → lowest index).
      count_runner_up: count of the runner-up class.
      p_value: two-sided binomial test p-value of ``count_top`` out of
        ``count_top + count_runner_up`` against 1/2.
    """

    prediction: np.ndarray
    count_top: np.ndarray
    count_runner_up: np.ndarray
    p_value: np.ndarray


def _check_class_counts(counts: np.ndarray, name: str) -> np.ndarray:
    """Validate ``[..., C]`` non-negative integer counts with ``C >= 2`` and a positive total."""
    arr = np.asarray(counts)
    if arr.ndim < 1 or arr.shape[-1] < 2:
        raise ValueError(f"{name} has shape {arr.shape}; expected [..., C] with C >= 2 classes")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} has dtype {arr.dtype}; expected integer class counts")
    if np.any(arr < 0):
        raise ValueError(f"{name} contains {arr[arr < 0].flat[0]}; counts must be >= 0")
    if np.any(arr.sum(axis=-1) == 0):
        raise ValueError(f"{name} has an input with no samples; every input needs >= 1 sample")
    return arr.astype(np.int64)


def _runner_up(counts: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Index ``[...]`` of the largest count other than class ``top`` (ties → lowest index)."""
    others = counts.copy()
    np.put_along_axis(others, top[..., None], -1, axis=-1)
    return np.argmax(others, axis=-1)


def certify_counts(
    counts_select: np.ndarray,
    counts_estimate: np.ndarray,
    alpha: float,
    radius_rule: RadiusRule,
    *,
    two_class: bool = False,
    uniform: np.ndarray | None = None,
) -> Certificate:
    """Cohen et al. (2019) ``CERTIFY`` from selection and estimation class counts.

    One-class form (the reference): ``ĉA = argmax counts_select`` (ties → lowest index, as
    ``np.argmax``), ``nA = counts_estimate[ĉA]``, ``pA_lower = CP_lower(nA, n, α)`` with ``n``
    the number of estimation samples (equal to ``proportion_confint(nA, n, alpha=2α,
    method="beta")[0]``); abstain if ``pA_lower < 1/2``; radius ``radius_rule.radius(pA_lower,
    None)``.

    Two-class form: the runner-up ``ĉB`` is the largest other estimation count, so its
    upper bound ``pB_upper = CP_upper(nB, n, α/2)`` bounds every other class; together with
    ``pA_lower = CP_lower(nA, n, α/2)`` both hold with probability ``>= 1 − α`` (Bonferroni);
    abstain unless ``pA_lower > pB_upper``.

    Args:
      counts_select: ``[..., C]`` integer counts of the ``n0`` selection samples.
      counts_estimate: ``[..., C]`` integer counts of the ``n`` estimation samples, drawn
        independently of the selection samples.
      alpha: probability that a returned certificate is wrong, in (0, 1).
      radius_rule: e.g. ``L2Radius(sigma)`` or ``BernoulliHammingRadius(rho, num_concepts)``.
      two_class: use the two-class bound with the runner-up (α split in two).
      uniform: ``[...]`` draws in [0, 1) for the randomized Clopper–Pearson bounds
        (`cbcert.certify.bounds.randomized_clopper_pearson_lower`, same ``u`` for both
        two-class bounds); None (default): the standard bounds.

    Returns:
      :class:`Certificate` with fields of shape ``[...]``.

    >>> from cbcert.certify.l2 import L2Radius
    >>> cert = certify_counts(np.array([90, 10]), np.array([1000, 0]), 0.001, L2Radius(0.25))
    >>> int(cert.prediction), round(float(cert.radius), 4)  # 0.25 * 2.4633
    (0, 0.6158)
    """
    alpha = check_alpha(alpha)
    select = _check_class_counts(counts_select, "counts_select")
    estimate = _check_class_counts(counts_estimate, "counts_estimate")
    if select.shape != estimate.shape:
        raise ValueError(
            f"counts_select has shape {select.shape} but counts_estimate has shape "
            f"{estimate.shape}; they must match"
        )
    top = np.argmax(select, axis=-1)  # [...]
    second = _runner_up(estimate, top)  # [...]
    n = estimate.sum(axis=-1)
    count_top = np.take_along_axis(estimate, top[..., None], axis=-1)[..., 0]
    count_second = np.take_along_axis(estimate, second[..., None], axis=-1)[..., 0]
    if uniform is None:
        lower, upper = clopper_pearson_lower, clopper_pearson_upper
    else:
        def lower(k, trials, level):
            return randomized_clopper_pearson_lower(k, trials, level, uniform)

        def upper(k, trials, level):
            return randomized_clopper_pearson_upper(k, trials, level, uniform)
    if two_class:
        level = bonferroni_split(alpha, 2)
        p_lower = lower(count_top, n, level)
        p_upper = upper(count_second, n, level)
        abstain = ~(p_lower > p_upper)
        radius = radius_rule.radius(p_lower, p_upper)
    else:
        p_lower = lower(count_top, n, alpha)
        p_upper = 1.0 - p_lower
        abstain = p_lower < 0.5
        radius = radius_rule.radius(p_lower, None)
    return Certificate(
        prediction=np.where(abstain, ABSTAIN, top).astype(np.int64),
        count_top=count_top,
        count_runner_up=count_second,
        p_lower=p_lower,
        p_upper=p_upper,
        radius=np.where(abstain, np.nan, radius),
    )


def predict_counts(counts: np.ndarray, alpha: float) -> Prediction:
    """Cohen et al. (2019) ``PREDICT``: top class if significantly more frequent than the next.

    ``nA, nB`` = the two largest counts (top = lowest index among ties; a tie ``nA = nB`` has
    p-value 1 and abstains, so tie-breaking never changes the prediction). Abstain if
    ``binomtest(nA, nA + nB, 1/2).pvalue > α``. The probability of returning a class other than
    the smoothed classifier's is at most α.

    Args:
      counts: ``[..., C]`` integer class counts of ``n`` noisy samples.
      alpha: error level in (0, 1).

    Returns:
      :class:`Prediction` with fields of shape ``[...]``.

    >>> pred = predict_counts(np.array([3, 60, 37]), alpha=0.05)
    >>> int(pred.prediction), round(float(pred.p_value), 4)
    (1, 0.025)
    """
    alpha = check_alpha(alpha)
    arr = _check_class_counts(counts, "counts")
    top = np.argmax(arr, axis=-1)
    second = _runner_up(arr, top)
    count_top = np.take_along_axis(arr, top[..., None], axis=-1)[..., 0]
    count_second = np.take_along_axis(arr, second[..., None], axis=-1)[..., 0]
    p_value = binomial_test_half(count_top, count_top + count_second)
    return Prediction(
        prediction=np.where(p_value > alpha, ABSTAIN, top).astype(np.int64),
        count_top=count_top,
        count_runner_up=count_second,
        p_value=p_value,
    )
