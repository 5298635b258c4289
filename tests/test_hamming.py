"""Tests of cbcert.certify.hamming: exact Neyman–Pearson Hamming certificates.

Oracles: a brute-force linear program over the whole cube {0,1}^K (small K), exact smoothed
probabilities by enumeration, and high-precision mpmath at K = 1000.
"""

import doctest
import itertools
import math

import mpmath
import numpy as np
import pytest
from scipy import optimize, stats

import cbcert.certify.hamming
from cbcert.certify.bounds import clopper_pearson_lower
from cbcert.certify.hamming import (
    BernoulliHammingRadius,
    FixedFlipHammingRadius,
    bernoulli_regions,
    fixed_flip_regions,
    hamming_radius,
    log_lower,
    log_upper,
)

P_GRID = np.array([0.0, 0.1, 0.37, 0.5, 0.73, 0.95, 0.999, 1.0])


def _cube(num_concepts):
    """All binary states ``[2^K, K]``."""
    return np.array(list(itertools.product((0, 1), repeat=num_concepts)))


def _bernoulli_law(center, rho, cube):
    """``[2^K]`` probability of each state under independent flips of ``center``."""
    d = (cube != center).sum(axis=1)
    return rho**d * (1 - rho) ** (cube.shape[1] - d)


def _fixed_flip_law(center, num_flips, cube):
    """``[2^K]`` probability of each state when exactly ``num_flips`` of K bits are flipped."""
    d = (cube != center).sum(axis=1)
    return (d == num_flips) / math.comb(cube.shape[1], num_flips)


def _lp_lower_upper(px, pxp, p):
    """Brute-force ``(L, U)`` over fractional sets ``a ∈ [0, 1]^(2^K)`` by linear programming.

    ``L = min Σ pxp·a s.t. Σ px·a >= p``; ``U = max Σ pxp·a s.t. Σ px·a <= p``.
    """
    tight = {"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10}
    low = optimize.linprog(pxp, A_ub=-px[None], b_ub=[-p], bounds=(0, 1), options=tight)
    high = optimize.linprog(-pxp, A_ub=px[None], b_ub=[p], bounds=(0, 1), options=tight)
    assert low.status == 0 and high.status == 0
    # HiGHS may overshoot a bound by ~1e-9 on states of tiny mass; score the clipped solution.
    return pxp @ np.clip(low.x, 0, 1), pxp @ np.clip(high.x, 0, 1)


def _laws(noise, param, delta, num_concepts):
    cube = _cube(num_concepts)
    x = np.zeros(num_concepts, dtype=int)
    x_prime = (np.arange(num_concepts) < delta).astype(int)
    law = _bernoulli_law if noise == "bernoulli" else _fixed_flip_law
    return law(x, param, cube), law(x_prime, param, cube)


def _regions(noise, param, delta, num_concepts):
    if noise == "bernoulli":
        return bernoulli_regions(delta, param)
    return fixed_flip_regions(delta, param, num_concepts)


CASES = [("bernoulli", rho, 5) for rho in (0.05, 0.2, 0.35, 0.5, 0.7)] + [
    ("fixed", m, 5) for m in range(6)
]


@pytest.mark.parametrize("noise, param, num_concepts", CASES)
def test_lower_and_upper_match_brute_force_lp_over_the_cube(noise, param, num_concepts):
    for delta in range(num_concepts + 1):
        px, pxp = _laws(noise, param, delta, num_concepts)
        regions = _regions(noise, param, delta, num_concepts)
        lower = np.exp(log_lower(regions, P_GRID))
        upper = np.exp(log_upper(regions, P_GRID))
        for p, low, high in zip(P_GRID, lower, upper, strict=True):
            # The cube's masses may sum to an ulp below 1; p = 1 must stay feasible.
            lp_low, lp_high = _lp_lower_upper(px, pxp, min(p, px.sum()))
            # HiGHS solves to ~1e-10 with the tolerances above; the region formula is exact.
            assert low == pytest.approx(lp_low, abs=1e-9), (delta, p)
            assert high == pytest.approx(lp_high, abs=1e-9), (delta, p)


def _brute_force_radius(noise, param, num_concepts, p_a, p_b):
    """Radius rule evaluated with LP bounds; returns (radius, smallest |L - U| margin seen)."""
    radius, margin = 0, np.inf
    for delta in range(1, num_concepts + 1):
        px, pxp = _laws(noise, param, delta, num_concepts)
        low, _ = _lp_lower_upper(px, pxp, p_a)
        _, high = _lp_lower_upper(px, pxp, p_b)
        margin = min(margin, abs(low - high))
        if not low > high:
            break
        radius = delta
    return radius, margin


@pytest.mark.parametrize(
    "noise, param", [("bernoulli", 0.1), ("bernoulli", 0.3), ("fixed", 2), ("fixed", 3)]
)
def test_radius_matches_brute_force_lp_rule(noise, param):
    num_concepts = 5
    rule = (
        BernoulliHammingRadius(param, num_concepts)
        if noise == "bernoulli"
        else FixedFlipHammingRadius(param, num_concepts)
    )
    for p_a, p_b in [(0.6, None), (0.91, None), (0.99, None), (0.9999, None), (0.97, 0.01)]:
        expected, margin = _brute_force_radius(
            noise, param, num_concepts, p_a, 1 - p_a if p_b is None else p_b
        )
        # The grid avoids exact ties L = U (e.g. rho = 0.3, pA = 0.9 gives L_2 = 1/2 exactly),
        # which rounding decides either way.
        assert margin > 1e-7, (p_a, p_b)
        assert rule.radius(np.array(p_a), p_b) == expected, (p_a, p_b)


def test_threshold_rule_equals_two_class_rule_with_complementary_bound():
    rule = BernoulliHammingRadius(rho=0.15, num_concepts=40)
    p = np.linspace(0.5001, 0.99999, 300)
    one_class = rule.radius(p, None)
    two_class = rule.radius(p, 1 - p)
    # Lee et al.'s rule L(pA) > 1/2 equals L(pA) > U(1 - pA) = 1 - L(pA) up to rounding at ties.
    assert np.mean(one_class == two_class) > 0.99
    assert np.all(np.abs(one_class - two_class) <= 1)


def _smoothed_probabilities(classifier, transition, num_classes):
    """``[2^K, C]`` exact smoothed class probabilities by enumerating all noisy states."""
    one_hot = np.eye(num_classes)[classifier]  # [2^K, C]
    return transition @ one_hot


@pytest.mark.parametrize("noise, param", [("bernoulli", 0.1), ("bernoulli", 0.25), ("fixed", 2)])
def test_certificates_are_sound_for_exact_smoothed_classifiers(noise, param):
    # Exact (noise-free) probabilities: no statistical failure probability; any violation is a bug.
    num_concepts, num_classes = 6, 3
    cube = _cube(num_concepts)
    law = _bernoulli_law if noise == "bernoulli" else _fixed_flip_law
    transition = np.stack([law(x, param, cube) for x in cube])  # [2^K, 2^K]
    distance = (cube[:, None, :] != cube[None, :, :]).sum(axis=-1)  # [2^K, 2^K]
    rule = (
        BernoulliHammingRadius(param, num_concepts)
        if noise == "bernoulli"
        else FixedFlipHammingRadius(param, num_concepts)
    )
    rng = np.random.default_rng(3)
    largest = 0
    for _ in range(40):
        # Classifiers biased to one class so that many points certify a positive radius.
        classifier = np.where(rng.random(len(cube)) < 0.75, 0, rng.integers(1, 3, len(cube)))
        probs = _smoothed_probabilities(classifier, transition, num_classes)  # [2^K, C]
        top = probs.argmax(axis=1)
        sorted_probs = np.sort(probs, axis=1)
        for two_class in (False, True):
            p_upper = sorted_probs[:, -2] if two_class else None
            radii = rule.radius(sorted_probs[:, -1], p_upper)
            for x in np.flatnonzero(~np.isnan(radii)):
                near = distance[x] <= radii[x]
                others = np.delete(probs[near], top[x], axis=1)
                assert np.all(probs[near, top[x]] > others.max(axis=1))
                largest = max(largest, radii[x])
    if noise == "bernoulli":
        assert largest >= 2  # the check exercised non-trivial radii
    else:
        assert largest == 0


def test_fixed_flips_certify_nothing_beyond_the_prediction():
    # Spheres of radius m around states at odd distance are disjoint: L_1 = 0 and U_1 = 1.
    for num_flips in range(1, 11):
        regions = fixed_flip_regions(1, num_flips, 10)
        assert np.exp(log_lower(regions, 1.0)) == 0.0
        assert np.exp(log_upper(regions, 0.0)) == pytest.approx(1.0, abs=1e-15)
        rule = FixedFlipHammingRadius(num_flips, 10)
        assert rule.radius(np.array([1.0, 0.99, 0.5]), None).tolist() == [0.0, 0.0, 0.0]


def test_known_values_saturated_counts():
    p_lower = clopper_pearson_lower(1000, 1000, 0.001)
    assert BernoulliHammingRadius(0.2, 1000).radius(p_lower, None) == 4
    # At rho = 0.05 no usual alpha lets n = 1000 samples certify Hamming radius 2.
    for alpha in (1e-6, 0.001, 0.05, 0.25):
        p_lower = clopper_pearson_lower(1000, 1000, alpha)
        assert BernoulliHammingRadius(0.05, 1000).radius(p_lower, None) == 1


def test_abstention_and_radius_zero_conventions():
    rule = BernoulliHammingRadius(0.2, 10)
    radii = rule.radius(np.array([0.3, np.nextafter(0.5, 0), 0.5, 0.6]), None)
    assert np.isnan(radii[0]) and np.isnan(radii[1])
    assert radii[2] == 0 and radii[3] == 0
    two = rule.radius(np.array([0.4, 0.45, 0.99]), np.array([0.4, 0.5, 0.001]))
    assert np.isnan(two[0]) and np.isnan(two[1]) and two[2] >= 1


def test_rho_one_half_certifies_everything():
    # The smoothed classifier is constant when every concept is a fair coin.
    assert BernoulliHammingRadius(0.5, 12).radius(np.array(0.51), None) == 12


def _mp_fill(px, pxp, p, ascending):
    """High-precision Neyman–Pearson fill from mpmath region masses."""
    order = sorted(range(len(px)), key=lambda i: pxp[i] / px[i], reverse=not ascending)
    mass, gain = mpmath.mpf(0), mpmath.mpf(0)
    for i in order:
        take = min(px[i], p - mass)
        if take <= 0:
            break
        mass += take
        gain += take * pxp[i] / px[i]
    return gain


def _mp_bernoulli(delta, rho):
    rho = mpmath.mpf(rho)
    px = [mpmath.binomial(delta, j) * (1 - rho) ** j * rho ** (delta - j) for j in range(delta + 1)]
    pxp = [mpmath.binomial(delta, j) * rho**j * (1 - rho) ** (delta - j) for j in range(delta + 1)]
    return px, pxp


@pytest.mark.parametrize(
    "rho, delta, p",
    [(0.2, 1000, 0.5), (0.2, 10, 0.99), (0.45, 1000, 1 - 1e-12), (0.05, 500, 0.3), (0.3, 999, 0.9)],
)
def test_k1000_agrees_with_mpmath(rho, delta, p):
    mpmath.mp.dps = 60
    px, pxp = _mp_bernoulli(delta, rho)
    regions = bernoulli_regions(delta, rho)
    exact_low = mpmath.log(_mp_fill(px, pxp, mpmath.mpf(p), ascending=True))
    exact_high = mpmath.log(_mp_fill(px, pxp, mpmath.mpf(p), ascending=False))
    # Relative accuracy 1e-11 on values as small as exp(-1345): float64 gammaln at arguments
    # ~1000 carries ~1e-13 absolute error per term (measured worst: 7e-13).
    assert float(log_lower(regions, p)) == pytest.approx(float(exact_low), abs=1e-11)
    assert float(log_upper(regions, p)) == pytest.approx(float(exact_high), abs=1e-11)


def test_k1000_is_finite_monotone_and_consistent():
    p = np.linspace(0.0, 1.0, 2001)
    for delta in (1, 37, 500, 1000):
        regions = bernoulli_regions(delta, 0.2)
        low, high = log_lower(regions, p), log_upper(regions, p)
        assert not np.any(np.isnan(low)) and not np.any(np.isnan(high))
        assert np.all(np.diff(low) >= 0) and np.all(np.diff(high) >= 0)
        assert low[0] == -np.inf and low[-1] == 0.0 and high[0] == -np.inf and high[-1] == 0.0
        assert np.all(low <= high + 1e-12)  # x' can only do worse for A than its best case
        # U(p) = 1 - L(1 - p) (complement of the optimal set), checked where both are O(1).
        moderate = (np.exp(high) > 1e-3) & (np.exp(high) < 1 - 1e-3)
        np.testing.assert_allclose(
            np.exp(high[moderate]), 1 - np.exp(log_lower(regions, 1 - p[moderate])), atol=1e-12
        )
    radii = BernoulliHammingRadius(0.45, 1000).radius(np.array([0.9, 0.999999]), None)
    assert np.all(np.isfinite(radii)) and radii[0] < radii[1]


def test_statistical_soundness_from_binomial_counts():
    # Wrong certificate: the radius from Binomial(n, p) counts exceeds the radius from the true p
    # (the tight radius for the worst-case base classifier). Per trial P[wrong] <= alpha.
    # One-sided binomial test at 1e-6: a correct implementation fails it with probability <= 1e-6.
    rng = np.random.default_rng(7)
    trials, n, alpha = 10_000, 1000, 0.05
    rule = BernoulliHammingRadius(rho=0.2, num_concepts=30)
    p_true = rng.uniform(0.85, 0.9999, size=trials)  # radius >= 1 needs p > 0.875 at rho = 0.2
    counts = rng.binomial(n, p_true)
    claimed = rule.radius(clopper_pearson_lower(counts, n, alpha), None)
    true = rule.radius(p_true, None)
    wrong = int(np.sum(claimed > true))  # NaN (abstain) compares False
    assert np.sum(claimed >= 1) > trials // 2  # not vacuous
    assert stats.binom.sf(wrong - 1, trials, alpha) > 1e-6, wrong


def test_generic_radius_respects_max_delta():
    radii = hamming_radius(np.array([0.9999]), None, lambda d: bernoulli_regions(d, 0.3), 3)
    assert radii.tolist() == [3.0]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: bernoulli_regions(2, 0.0), "rho=0.0"),
        (lambda: bernoulli_regions(-1, 0.2), "delta=-1"),
        (lambda: fixed_flip_regions(2, 11, 10), "num_flips=11"),
        (lambda: fixed_flip_regions(11, 2, 10), "delta=11"),
        (lambda: BernoulliHammingRadius(1.0, 10), "rho=1.0"),
        (lambda: BernoulliHammingRadius(0.2, 0), "num_concepts=0"),
        (lambda: log_lower(bernoulli_regions(2, 0.2), 1.5), "p=1.5"),
        (lambda: BernoulliHammingRadius(0.2, 5).radius(0.9, 2.0), "p_upper=2.0"),
    ],
)
def test_bad_input_names_parameter_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_docstring_examples():
    result = doctest.testmod(cbcert.certify.hamming)
    assert result.attempted > 0 and result.failed == 0
