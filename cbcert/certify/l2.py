"""Certified L2 radii of Gaussian randomized smoothing in the generator's latent space.

Cohen, Rosenfeld & Kolter, "Certified adversarial robustness via randomized smoothing"
(ICML 2019), Theorem 1: if ``P[f(z + δ) = A] >= pA_lower`` and ``max_{B≠A} P[f(z + δ) = B] <=
pB_upper`` for ``δ ~ N(0, σ² I)``, the smoothed classifier predicts ``A`` on the whole ball of
radius ``σ/2 (Φ⁻¹(pA_lower) − Φ⁻¹(pB_upper))`` around ``z``.

Abstention convention (shared with :mod:`cbcert.certify.cohen`): a radius of ``NaN`` means
"abstain"; a radius of ``0`` is a (trivial) certificate that the prediction itself is sound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from cbcert.certify.bounds import check_probability


def check_sigma(sigma: float) -> float:
    """Return ``sigma`` as a float after checking it is finite and positive."""
    value = float(sigma)
    if not (np.isfinite(value) and value > 0.0):
        raise ValueError(f"sigma={sigma} is invalid; allowed range is finite sigma > 0")
    return value


def l2_radius(p_lower: np.ndarray | float, sigma: float) -> np.ndarray:
    """One-class certified L2 radius ``R = σ Φ⁻¹(pA_lower)``; NaN (abstain) if ``pA_lower < 1/2``.

    This is the radius of Cohen et al. (2019) ``CERTIFY`` (the two-class form with the implied
    ``pB_upper = 1 − pA_lower``). ``pA_lower = 1/2`` exactly certifies radius 0, as in the
    reference implementation, which abstains only when ``pA_lower < 1/2``.

    Args:
      p_lower: lower confidence bounds on the top-class probability, any shape ``[...]``.
      sigma: standard deviation of the latent Gaussian noise, > 0.

    Returns:
      float64 radii ``[...]``, NaN where the certificate abstains.

    >>> float(l2_radius(0.001 ** (1 / 1000), sigma=1.0))  # saturated n = 1000, alpha = 0.001
    2.4632626147808114
    """
    return _one_class(p_lower, check_sigma(sigma))


def _one_class(p_lower, sigma: float) -> np.ndarray:
    """`l2_radius` for a checked ``sigma``."""
    p = check_probability(p_lower, "p_lower")
    return np.where(p < 0.5, np.nan, sigma * stats.norm.ppf(p))


def l2_radius_two_class(
    p_lower: np.ndarray | float, p_upper: np.ndarray | float, sigma: float
) -> np.ndarray:
    """Two-class certified L2 radius ``R = σ/2 (Φ⁻¹(pA_lower) − Φ⁻¹(pB_upper))``.

    Cohen et al. (2019), Theorem 1. Abstains (NaN) unless ``pA_lower > pB_upper``. When both
    bounds come from the same samples each must be computed at level ``1 − α/2``
    (:func:`cbcert.certify.bounds.bonferroni_split`).

    Args:
      p_lower: lower bounds on the top-class probability ``[...]``.
      p_upper: upper bounds on the largest other-class probability, broadcastable to ``[...]``.
      sigma: latent noise standard deviation, > 0.

    Returns:
      float64 radii of the broadcast shape, NaN where the certificate abstains.

    >>> float(l2_radius_two_class(0.9, 0.05, sigma=0.5))
    0.7316012981240183
    """
    return _two_class(p_lower, p_upper, check_sigma(sigma))


def _two_class(p_lower, p_upper, sigma: float) -> np.ndarray:
    """`l2_radius_two_class` for a checked ``sigma``."""
    pa = check_probability(p_lower, "p_lower")
    pb = check_probability(p_upper, "p_upper")
    with np.errstate(invalid="ignore"):  # inf - inf only arises in abstained entries
        radius = 0.5 * sigma * (stats.norm.ppf(pa) - stats.norm.ppf(pb))
    return np.where(pa > pb, radius, np.nan)


@dataclass(frozen=True)
class L2Radius:
    """Radius rule for Gaussian latent smoothing with standard deviation ``sigma``.

    ``radius(p_lower, None)`` is the one-class radius :func:`l2_radius`;
    ``radius(p_lower, p_upper)`` the two-class radius :func:`l2_radius_two_class`. ``sigma``
    is checked once, here (an invariant of the rule; σ as typed was checked at the edge).
    """

    sigma: float

    def __post_init__(self) -> None:
        check_sigma(self.sigma)

    def radius(self, p_lower: np.ndarray, p_upper: np.ndarray | None) -> np.ndarray:
        """Certified L2 radii ``[...]`` (float64, NaN = abstain) from bounds ``[...]``."""
        if p_upper is None:
            return _one_class(p_lower, float(self.sigma))
        return _two_class(p_lower, p_upper, float(self.sigma))
