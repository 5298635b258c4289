"""Exact Hamming (L0) certificates for concept-flip smoothing, by Neyman–Pearson filling.

Lee, Yuan, Chang & Jaakkola, "Tight certificates of adversarial robustness for randomly
smoothed classifiers" (NeurIPS 2019). For binary concept states ``x, x'`` at Hamming distance
``Δ`` and a noise distribution ``P_x`` of the noisy state around ``x``, the noisy space splits
into *regions* on which the likelihood ratio ``P_x'(y) / P_x(y)`` is constant. The worst-case
(smallest) probability at ``x'`` of a set ``A`` with ``P_x(A) >= p`` is

    L_Δ(p) = min { P_x'(A) : P_x(A) >= p },

attained by filling regions in increasing likelihood ratio, the last one fractionally; the
best case for a competitor is ``U_Δ(p) = max { P_x'(A) : P_x(A) <= p }`` (decreasing ratio).
The smoothed prediction is certified at ``x'`` when ``L_Δ(pA_lower) > U_Δ(pB_upper)``, and the
certified radius is the largest ``Δ`` for which this holds at every ``Δ' <= Δ``.

Two noise models:

* independent flips with probability ``ρ`` (``engine.noise.BernoulliFlips``): region ``j`` =
  number of the ``Δ`` differing concepts on which the noisy state agrees with ``x``,
  ``P_x(j) = C(Δ,j)(1−ρ)^j ρ^(Δ−j)``, ``P_x'(j) = C(Δ,j) ρ^j (1−ρ)^(Δ−j)``;
* exactly ``m`` uniformly chosen flips out of ``K`` (``engine.noise.FixedFlips``): regions
  are intersections of the Hamming spheres of radius ``m`` around ``x`` and ``x'``
  (hypergeometric masses, see :func:`fixed_flip_regions`).

Everything is computed in log space (``gammaln``, ``logaddexp``), so the certificates are
exact for any number of concepts ``K`` (tested at ``K = 1000``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import special

from cbcert.certify.bounds import check_probability

_LOG_HALF = np.log(0.5)
# Certify only when L_Δ beats the bound by this much in log space (relative 1e-9 on the
# probabilities). The log-space computation is accurate to ~1e-12 (7e-13 worst at K = 1000 vs
# 60-digit mpmath), so a margin 1000× larger decides every exact tie -- L_Δ(p) = U_Δ(p') in
# exact arithmetic, e.g. ρ = 0.45, pA = 0.6, Δ = 2 -- conservatively instead of by the sign of
# a rounding error. Only certificates within 1e-9 of a tie are affected.
TIE_MARGIN = 1e-9


@dataclass(frozen=True)
class Regions:
    """Likelihood-ratio regions of a pair of noise distributions ``(P_x, P_x')``.

    Attributes:
      log_px: ``[R]`` natural log of the ``P_x`` mass of each region (``-inf`` for none).
      log_pxp: ``[R]`` natural log of the ``P_x'`` mass of each region.

    Both distributions are constant on each region's points, so their ratio is constant there.
    """

    log_px: np.ndarray
    log_pxp: np.ndarray


def _log_binom(n: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
    """``log C(n, k)`` for ``0 <= k <= n``, exact in float64 far beyond overflow of C(n, k)."""
    return (
        special.gammaln(np.add(n, 1.0))
        - special.gammaln(np.add(k, 1.0))
        - special.gammaln(np.subtract(n, k) + 1.0)
    )


def _check_int(value: int, name: str, low: int, high: int) -> int:
    if int(value) != value or not low <= value <= high:
        raise ValueError(f"{name}={value} is invalid; allowed range is integers in [{low}, {high}]")
    return int(value)


def check_rho(rho: float) -> float:
    """Return the flip probability as a float after checking it lies in (0, 1)."""
    value = float(rho)
    if not 0.0 < value < 1.0:
        raise ValueError(f"rho={rho} is invalid; allowed range is (0, 1)")
    return value


def bernoulli_regions(delta: int, rho: float) -> Regions:
    """Regions of independent Bernoulli(ρ) flips for two states at Hamming distance ``delta``.

    Region ``j ∈ {0..Δ}``: the noisy state agrees with ``x`` on ``j`` of the ``Δ`` differing
    concepts (concepts outside them have the same law under both and cancel from the ratio):
    ``P_x(j) = C(Δ,j)(1−ρ)^j ρ^(Δ−j)``, ``P_x'(j) = C(Δ,j) ρ^j (1−ρ)^(Δ−j)`` (Lee et al. 2019).

    Returns:
      :class:`Regions` with ``R = Δ + 1``.
    """
    return _bernoulli_regions(_check_int(delta, "delta", 0, np.iinfo(np.int32).max),
                              check_rho(rho))


def _bernoulli_regions(delta: int, rho: float) -> Regions:
    """`bernoulli_regions` for a checked ``delta`` and ``rho``."""
    j = np.arange(delta + 1, dtype=np.float64)  # [Δ+1]
    log_c = _log_binom(delta, j)
    log_keep, log_flip = np.log1p(-rho), np.log(rho)
    return Regions(
        log_px=log_c + j * log_keep + (delta - j) * log_flip,
        log_pxp=log_c + j * log_flip + (delta - j) * log_keep,
    )


def fixed_flip_regions(delta: int, num_flips: int, num_concepts: int) -> Regions:
    """Regions of "flip exactly ``m`` of ``K`` concepts, uniformly" for states at distance ``Δ``.

    ``P_x`` is uniform on the Hamming sphere ``S(x, m)``. A point of ``S(x, m)`` whose ``m``
    flips include ``i`` of the ``Δ`` differing concepts is at distance ``m + Δ − 2i`` from
    ``x'``; there are ``C(Δ,i) C(K−Δ,m−i)`` of them, so the sphere splits into regions of
    hypergeometric mass ``h(i) = C(Δ,i) C(K−Δ,m−i) / C(K,m)``. Only ``i = Δ/2`` (even ``Δ``) lies
    in ``S(x', m)`` too (``P_x = P_x' = h(Δ/2)``); every other region has ``P_x' = 0``, and its
    mirror image in ``S(x', m) \\ S(x, m)`` has ``P_x = 0``, ``P_x' = h(i)``. In particular for
    odd ``Δ`` the two distributions are mutually singular, so nothing is certified at ``Δ = 1``.

    Returns:
      :class:`Regions` with the shared region (if any) followed by the two mirrored families.
    """
    num_concepts = _check_int(num_concepts, "num_concepts", 1, np.iinfo(np.int32).max)
    num_flips = _check_int(num_flips, "num_flips", 0, num_concepts)
    delta = _check_int(delta, "delta", 0, num_concepts)
    i = np.arange(max(0, num_flips - (num_concepts - delta)), min(delta, num_flips) + 1)
    log_h = (
        _log_binom(delta, i)
        + _log_binom(num_concepts - delta, num_flips - i)
        - _log_binom(num_concepts, num_flips)
    )
    shared = 2 * i == delta
    none = np.full(int(np.sum(~shared)), -np.inf)
    return Regions(
        log_px=np.concatenate([log_h[shared], log_h[~shared], none]),
        log_pxp=np.concatenate([log_h[shared], none, log_h[~shared]]),
    )


def _log_ratio_or_zero(log_num: np.ndarray, log_den: np.ndarray) -> np.ndarray:
    """``log(num / den)``, with ``num = 0`` giving ``-inf`` even where ``den = 0`` too."""
    return np.where(
        log_num == -np.inf, -np.inf, log_num - np.where(log_num == -np.inf, 0.0, log_den)
    )


def _log_fill(log_mass: np.ndarray, log_gain: np.ndarray, p: np.ndarray, ascending: bool):
    """``log`` of the ``gain`` collected by filling regions up to ``mass`` ``p``, ratio-ordered.

    Regions (all of positive ``mass``, which totals 1) are taken in
    increasing (``ascending``) or decreasing ``gain/mass`` order; the region where the
    cumulative mass reaches ``p`` is taken fractionally, which is optimal for the linear
    program over region-constant sets. The crossing region is located with prefix sums for
    ``p <= 1/2`` and with suffix sums against ``1 − p`` above, so that ``p`` within a few ulps
    of 1 is resolved without cancellation.
    """
    log_ratio = log_gain - log_mass  # [R]; finite mass, gain may be -inf
    order = np.argsort(log_ratio if ascending else -log_ratio, kind="stable")
    log_mass, log_gain, log_ratio = log_mass[order], log_gain[order], log_ratio[order]
    log_head = np.logaddexp.accumulate(log_mass)  # [R] log mass of regions 0..k
    log_tail = np.logaddexp.accumulate(log_mass[::-1])[::-1]  # [R] log mass of regions k..R-1
    log_tail_after = np.append(log_tail[1:], -np.inf)  # [R] regions k+1..R-1, non-increasing
    last = len(log_mass) - 1
    low = p <= 0.5
    with np.errstate(divide="ignore"):  # log(0) = -inf is meaningful below
        log_p, log_q = np.log(p), np.log1p(-p)
        # First region k whose inclusion reaches p: head[k] >= p, equivalently tail_after[k] <= 1-p.
        k = np.minimum(
            np.where(
                low,
                np.searchsorted(log_head, log_p, side="left"),
                np.searchsorted(-log_tail_after, -log_q, side="left"),
            ),
            last,
        )
        log_head_before = np.where(k > 0, log_head[k - 1], -np.inf)
        # Mass taken from region k: p - head[k-1] = tail[k] - (1-p), each as log(a) + log1p(-b/a).
        log_partial = np.where(
            low,
            log_p + np.log1p(-np.exp(np.minimum(_log_ratio_or_zero(log_head_before, log_p), 0.0))),
            log_tail[k] + np.log1p(-np.exp(np.minimum(log_q - log_tail[k], 0.0))),
        )
    log_partial = np.minimum(log_partial, log_mass[k]) + log_ratio[k]
    log_gain_before = np.where(k > 0, np.logaddexp.accumulate(log_gain)[k - 1], -np.inf)
    return np.logaddexp(log_gain_before, log_partial)


def _at_most_one(log_prob: np.ndarray) -> np.ndarray:
    """Clamp log-probabilities to <= 0: summing masses can round an ulp above 1."""
    return np.minimum(log_prob, 0.0)


def _normalised(log_mass: np.ndarray) -> np.ndarray:
    """Shift log masses so they total exactly 1 in log space (removes common gammaln error)."""
    return log_mass - special.logsumexp(log_mass)


def log_lower(regions: Regions, p: np.ndarray | float) -> np.ndarray:
    """``log L_Δ(p)``, ``L_Δ(p) = min { P_x'(A) : P_x(A) >= p }`` (Neyman–Pearson lower bound).

    Every set with ``P_x(A) >= p`` has ``P_x'(A) >= L_Δ(p)``, so a smoothed class probability of
    at least ``p`` at ``x`` is at least ``L_Δ(p)`` at ``x'``. Regions without ``P_x`` mass are
    never worth including.

    Args:
      regions: regions of ``(P_x, P_x')``, see :func:`bernoulli_regions`.
      p: probabilities ``[...]`` in [0, 1].

    Returns:
      float64 ``[...]``; ``-inf`` where ``L_Δ(p) = 0``.
    """
    p = check_probability(p, "p")
    has_mass = regions.log_px > -np.inf
    log_px = _normalised(regions.log_px[has_mass])
    log_pxp = regions.log_pxp[has_mass] - special.logsumexp(regions.log_pxp)
    return _at_most_one(_log_fill(log_px, log_pxp, p, ascending=True))


def log_upper(regions: Regions, p: np.ndarray | float) -> np.ndarray:
    """``log U_Δ(p)``, ``U_Δ(p) = max { P_x'(A) : P_x(A) <= p }`` (Neyman–Pearson upper bound).

    Regions with ``P_x' > 0 = P_x`` (possible for fixed-count flips) are included for free;
    the rest are filled in decreasing likelihood ratio. ``U_Δ(p) = 1 − L_Δ(1 − p)``.

    Args/Returns: as :func:`log_lower`.
    """
    p = check_probability(p, "p")
    has_mass = regions.log_px > -np.inf
    free = ~has_mass & (regions.log_pxp > -np.inf)
    log_pxp = _normalised(regions.log_pxp)
    log_free = special.logsumexp(log_pxp[free]) if np.any(free) else -np.inf
    filled = _log_fill(_normalised(regions.log_px[has_mass]), log_pxp[has_mass], p, False)
    return _at_most_one(np.logaddexp(log_free, filled))


def hamming_radius(
    p_lower: np.ndarray | float,
    p_upper: np.ndarray | float | None,
    regions: Callable[[int], Regions],
    max_delta: int,
) -> np.ndarray:
    """Certified Hamming radius ``Δ* = max {Δ : L_Δ'(pA_lower) > U_Δ'(pB_upper) ∀ Δ' <= Δ}``.

    With ``p_upper=None`` the one-class form ``pB_upper = 1 − pA_lower`` is used, where the
    condition reads ``L_Δ(pA_lower) > 1/2`` (Lee et al. 2019's threshold rule), and the
    certificate abstains when ``pA_lower < 1/2`` (as Cohen et al. 2019). In the two-class form it
    abstains unless ``pA_lower > pB_upper``. A radius of 0 certifies the prediction only.

    "Exact" means: the Neyman–Pearson bounds are the exact optima of the linear program (no
    relaxation), computed in log space to ~1e-12; a comparison within ``TIE_MARGIN`` (1e-9
    relative) of a tie is decided against certifying, so the radius never exceeds the one exact
    rational arithmetic gives for the same bounds.

    Args:
      p_lower: lower bounds on the top-class probability ``[...]``.
      p_upper: upper bounds on the largest other-class probability ``[...]`` or None.
      regions: ``Δ -> Regions`` of the noise model, e.g. ``BernoulliHammingRadius.regions``.
      max_delta: largest distance considered (the number of concepts ``K``).

    Returns:
      float64 ``[...]`` integer-valued radii in ``[0, max_delta]``, NaN where abstaining.
    """
    pa = check_probability(p_lower, "p_lower")
    if p_upper is None:
        abstain = pa < 0.5
    else:
        pa, pb = np.broadcast_arrays(pa, check_probability(p_upper, "p_upper"))
        abstain = ~(pa > pb)
    radius = np.zeros(pa.shape)
    alive = np.array(~abstain)  # a writable copy, also for 0-d inputs
    for delta in range(1, max_delta + 1):
        if not np.any(alive):
            break
        reg = regions(delta)
        log_l = log_lower(reg, pa[alive])
        bound = _LOG_HALF if p_upper is None else log_upper(reg, pb[alive])
        certified = log_l > bound + TIE_MARGIN
        radius[alive] = np.where(certified, delta, radius[alive])
        alive[alive] = certified
    return np.where(abstain, np.nan, radius)


@dataclass(frozen=True)
class BernoulliHammingRadius:
    """Radius rule for independent concept flips with probability ``rho`` among ``num_concepts``.

    ``rho`` is checked once, here (an invariant of the rule; ρ as typed was checked at the edge).

    >>> rule = BernoulliHammingRadius(rho=0.2, num_concepts=1000)
    >>> rule.radius(0.001 ** (1 / 1000), None)  # saturated n = 1000 at alpha = 0.001
    array(4.)
    """

    rho: float
    num_concepts: int

    def __post_init__(self) -> None:
        check_rho(self.rho)
        _check_int(self.num_concepts, "num_concepts", 1, np.iinfo(np.int32).max)

    def regions(self, delta: int) -> Regions:
        """:func:`bernoulli_regions` at distance ``delta``."""
        return _bernoulli_regions(_check_int(delta, "delta", 0, self.num_concepts),
                                  float(self.rho))

    def radius(self, p_lower: np.ndarray, p_upper: np.ndarray | None) -> np.ndarray:
        """Certified Hamming radii ``[...]`` (float64, NaN = abstain); :func:`hamming_radius`."""
        return hamming_radius(p_lower, p_upper, self.regions, self.num_concepts)


@dataclass(frozen=True)
class FixedFlipHammingRadius:
    """Radius rule for flipping exactly ``num_flips`` uniformly chosen of ``num_concepts``.

    The noisy states around ``x`` and around any ``x'`` at odd distance never coincide, so this
    noise certifies radius 0 at most (see :func:`fixed_flip_regions`); it is provided so that
    this is computed, not assumed.

    >>> FixedFlipHammingRadius(num_flips=2, num_concepts=20).radius(0.999, None)
    array(0.)
    """

    num_flips: int
    num_concepts: int

    def __post_init__(self) -> None:
        _check_int(self.num_concepts, "num_concepts", 1, np.iinfo(np.int32).max)
        _check_int(self.num_flips, "num_flips", 0, self.num_concepts)

    def regions(self, delta: int) -> Regions:
        """:func:`fixed_flip_regions` at distance ``delta``."""
        return fixed_flip_regions(delta, self.num_flips, self.num_concepts)

    def radius(self, p_lower: np.ndarray, p_upper: np.ndarray | None) -> np.ndarray:
        """Certified Hamming radii ``[...]`` (float64, NaN = abstain); :func:`hamming_radius`."""
        return hamming_radius(p_lower, p_upper, self.regions, self.num_concepts)
