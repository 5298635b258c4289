"""Exact binomial confidence bounds and tests for Monte Carlo certification.

All functions work in float64 on host, are vectorised over integer counts (numpy broadcasting)
and follow Cohen, Rosenfeld & Kolter, "Certified adversarial robustness via randomized
smoothing" (ICML 2019): one-sided Clopper–Pearson bounds for CERTIFY, a two-sided exact binomial
test at 1/2 for PREDICT.
"""

from __future__ import annotations

import numpy as np
from scipy import special, stats

_BELOW_ONE = np.nextafter(1.0, 0.0)


def check_alpha(alpha: float, name: str = "alpha") -> float:
    """Return ``alpha`` as a float after checking it lies in the open interval (0, 1)."""
    value = float(alpha)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name}={alpha} is not a valid error level; allowed range is (0, 1)")
    return value


def check_probability(p: np.ndarray | float, name: str) -> np.ndarray:
    """Return ``p`` as a float64 array after checking every entry lies in [0, 1]."""
    arr = np.asarray(p, dtype=np.float64)
    bad = ~((arr >= 0.0) & (arr <= 1.0))
    if np.any(bad):
        raise ValueError(
            f"{name}={arr[bad].flat[0].item()!r} is not a probability; allowed range [0, 1]"
        )
    return arr


def check_counts(
    successes: np.ndarray | int, trials: np.ndarray | int
) -> tuple[np.ndarray, np.ndarray]:
    """Validate and broadcast binomial counts ``0 <= successes <= trials``, ``trials >= 1``.

    Returns both as int64 arrays of the broadcast shape. Raises ValueError naming the first
    offending value.
    """
    k = np.asarray(successes)
    n = np.asarray(trials)
    for name, arr in (("successes", k), ("trials", n)):
        if arr.size and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
            bad = arr[~(np.isfinite(arr) & (arr == np.round(arr)))].flat[0].item()
            raise ValueError(f"{name}={bad!r} is not an integer count")
    k, n = np.broadcast_arrays(k.astype(np.int64), n.astype(np.int64))
    if np.any(n < 1):
        raise ValueError(f"trials={n[n < 1].flat[0].item()} is invalid; allowed range is >= 1")
    bad = (k < 0) | (k > n)
    if np.any(bad):
        raise ValueError(
            f"successes={k[bad].flat[0].item()} is outside the allowed range "
            f"[0, trials={n[bad].flat[0].item()}]"
        )
    return k, n


def clopper_pearson_lower(
    successes: np.ndarray | int, trials: np.ndarray | int, alpha: float
) -> np.ndarray:
    """One-sided Clopper–Pearson lower bound on a binomial proportion at level ``1 - alpha``.

    ``p_lower = Beta⁻¹(alpha; k, n - k + 1)``, with the exact edge cases ``p_lower = 0`` for
    ``k = 0`` and ``p_lower = alpha**(1/n)`` for ``k = n``, capped at the largest double below
    1 (a finite sample never proves probability 1). Equal to
    ``statsmodels.stats.proportion.proportion_confint(k, n, alpha=2 * alpha, method="beta")[0]``,
    the bound used by Cohen et al. (2019), ``core.py``.

    Args:
      successes: integer counts ``k``, any shape broadcastable with ``trials``.
      trials: integer numbers of samples ``n >= 1``.
      alpha: error level in (0, 1).

    Returns:
      float64 array of the broadcast shape.

    >>> round(float(clopper_pearson_lower(1000, 1000, 0.001)), 15)  # 0.001 ** (1/1000)
    0.993116048420934
    """
    alpha = check_alpha(alpha)
    k, n = check_counts(successes, trials)
    shape_a = np.maximum(k, 1)  # keeps the unused k = 0 branch away from an invalid Beta(0, .)
    interior = special.betaincinv(shape_a, n - shape_a + 1, alpha)
    saturated = np.power(alpha, 1.0 / n)
    bound = np.where(k == 0, 0.0, np.where(k == n, saturated, interior))
    # A lower bound from finitely many samples is < 1; at astronomically large n it rounds to
    # 1.0, which would certify an infinite radius. The largest double below 1 is below the
    # true bound there, so capping keeps the certificate sound and finite.
    return np.minimum(bound, _BELOW_ONE)


def clopper_pearson_upper(
    successes: np.ndarray | int, trials: np.ndarray | int, alpha: float
) -> np.ndarray:
    """One-sided Clopper–Pearson upper bound on a binomial proportion at level ``1 - alpha``.

    ``p_upper = Beta⁻¹(1 - alpha; k + 1, n - k)`` (computed as the complementary inverse at
    ``alpha``), exact edge cases ``p_upper = 1`` for
    ``k = n`` and ``p_upper = 1 - alpha**(1/n)`` for ``k = 0`` (computed as ``-expm1`` so that
    small bounds keep their relative precision). Equal to ``proportion_confint(k, n,
    alpha=2 * alpha, method="beta")[1]``.

    Args/Returns: as :func:`clopper_pearson_lower`.

    >>> round(float(clopper_pearson_upper(0, 1000, 0.001)), 6)
    0.006884
    """
    alpha = check_alpha(alpha)
    k, n = check_counts(successes, trials)
    shape_k = np.minimum(k, n - 1)  # keeps the unused k = n branch away from Beta(., 0)
    # The complementary inverse avoids forming 1 - alpha, which rounds for small alpha.
    interior = special.betainccinv(shape_k + 1, n - shape_k, alpha)
    zero_successes = -np.expm1(np.log(alpha) / n)
    return np.where(k == n, 1.0, np.where(k == 0, zero_successes, interior))


def _randomized_tail(successes, trials, p, uniform):
    """``P_p(X > k) + (1 − u)·P_p(X = k)`` for ``X ~ Bin(n, p)``, via regularized incomplete
    beta functions (``P_p(X >= j) = I_p(j, n − j + 1)``, 1 for j = 0, 0 for j = n + 1)."""
    k, n = successes, trials
    at_least_k = np.where(k == 0, 1.0, special.betainc(np.maximum(k, 1), n - k + 1, p))
    above_k = np.where(k == n, 0.0, special.betainc(k + 1, np.maximum(n - k, 1), p))
    return uniform * above_k + (1.0 - uniform) * at_least_k


def randomized_clopper_pearson_lower(
    successes: np.ndarray | int, trials: np.ndarray | int, alpha: float,
    uniform: np.ndarray | float,
) -> np.ndarray:
    """Randomized one-sided Clopper–Pearson lower bound at level ``1 − alpha`` (exact coverage).

    With ``T = X + U`` (``U ~ Uniform[0, 1)`` independent of ``X ~ Bin(n, p)``), ``P_p(T >=
    k + u) = P_p(X > k) + (1 − u) P_p(X = k)`` grows with ``p``; the bound is the ``p`` where it
    equals α, so ``P(bound > p) = α`` exactly (Stevens 1950; the randomized interval of
    Voráček, NeurIPS 2024). ``u = 0`` gives `clopper_pearson_lower` (to rounding); ``u > 0`` a
    larger bound, at most the Clopper–Pearson bound of ``k + 1`` successes. The certificate then
    depends on ``u``: a different draw certifies a (slightly) different radius, and only the
    draw's independence of the votes makes it valid. Exact bisection (60 steps), returning the
    side where the tail is ``<= α``; capped below 1.

    Args:
      successes, trials: integer counts ``0 <= k <= n``, ``n >= 1``, broadcastable.
      alpha: error level in (0, 1).
      uniform: ``u`` in [0, 1), broadcastable with the counts.

    >>> # u = 0: the Clopper–Pearson bound to within 2 ulp (the two are computed by different
    >>> # special functions, whose last bit differs between CPU instruction sets)
    >>> bisected = float(randomized_clopper_pearson_lower(1000, 1000, 0.001, 0.0))
    >>> closed = float(clopper_pearson_lower(1000, 1000, 0.001))
    >>> bool(abs(bisected - closed) <= 2 * np.spacing(closed))
    True
    >>> round(float(randomized_clopper_pearson_lower(1000, 1000, 0.001, 0.5)), 6)  # (2α)^(1/n)
    0.993805
    """
    alpha = check_alpha(alpha)
    k, n = check_counts(successes, trials)
    u = np.asarray(uniform, np.float64)
    if np.any(~((u >= 0.0) & (u < 1.0))):
        raise ValueError(f"uniform={u[~((u >= 0) & (u < 1))].flat[0].item()!r} is outside the "
                         "allowed range [0, 1)")
    k, n, u = np.broadcast_arrays(k, n, u)
    low, high = np.zeros(k.shape), np.ones(k.shape)  # tail(low) <= α < tail(high), or ends
    for _ in range(60):
        mid = 0.5 * (low + high)
        above = _randomized_tail(k, n, mid, u) > alpha
        low, high = np.where(above, low, mid), np.where(above, mid, high)
    return np.minimum(low, _BELOW_ONE)


def randomized_clopper_pearson_upper(
    successes: np.ndarray | int, trials: np.ndarray | int, alpha: float,
    uniform: np.ndarray | float,
) -> np.ndarray:
    """Randomized one-sided Clopper–Pearson upper bound: ``1 −`` the lower bound of the
    failures (same ``u``), rounded up one ulp; ``P(bound < p) = α``.

    >>> float(randomized_clopper_pearson_upper(0, 1000, 0.001, 0.0)) >= float(
    ...     clopper_pearson_upper(0, 1000, 0.001))
    True
    """
    k, n = check_counts(successes, trials)
    lower = randomized_clopper_pearson_lower(n - k, n, alpha, uniform)
    return np.minimum(1.0, np.nextafter(1.0 - lower, 2.0))


def binomial_test_half(successes: np.ndarray | int, trials: np.ndarray | int) -> np.ndarray:
    """Two-sided exact binomial test p-value of ``k`` successes in ``n`` trials against p = 1/2.

    The null distribution is symmetric, so the p-value of ``scipy.stats.binomtest(k, n, 0.5)``
    (sum of the probabilities of all outcomes no more likely than ``k``) has the closed form
    ``min(1, 2 · P[Bin(n, 1/2) <= min(k, n - k)])``, which vectorises. This is the test of
    Cohen et al. (2019) ``PREDICT`` on the top two counts ``(nA, nA + nB)``.

    Returns:
      float64 array of the broadcast shape, values in (0, 1].

    >>> float(binomial_test_half(5, 10))
    1.0
    """
    k, n = check_counts(successes, trials)
    return np.minimum(1.0, 2.0 * stats.binom.cdf(np.minimum(k, n - k), n, 0.5))


def bonferroni_split(alpha: float, num_bounds: int) -> float:
    """Error level for each of ``num_bounds`` bounds computed from the same samples.

    By the union bound, ``num_bounds`` statements each holding with probability ``1 - alpha /
    num_bounds`` hold jointly with probability ``>= 1 - alpha``. The two-class certificates
    (top-class lower bound and runner-up upper bound from one set of estimation counts) use
    ``num_bounds = 2``.

    >>> bonferroni_split(0.001, 2)
    0.0005
    """
    alpha = check_alpha(alpha)
    if int(num_bounds) != num_bounds or num_bounds < 1:
        raise ValueError(f"num_bounds={num_bounds} is invalid; allowed range is integers >= 1")
    return alpha / int(num_bounds)
