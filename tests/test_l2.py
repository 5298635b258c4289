"""Tests of cbcert.certify.l2: Gaussian smoothing radii, incl. a linear-classifier oracle."""

import doctest

import numpy as np
import pytest
from scipy import stats

import cbcert.certify.l2
from cbcert.certify.bounds import clopper_pearson_lower
from cbcert.certify.l2 import L2Radius, l2_radius, l2_radius_two_class


@pytest.mark.parametrize("alpha, expected", [(0.001, 2.4633), (0.05, 2.7487)])
def test_saturated_counts_known_radius(alpha, expected):
    # n = 1000 samples all of the top class: pA_lower = alpha ** (1/1000).
    p_lower = clopper_pearson_lower(1000, 1000, alpha)
    assert round(float(l2_radius(p_lower, sigma=1.0)), 4) == expected
    assert round(float(l2_radius(p_lower, sigma=0.5)), 4) == pytest.approx(expected / 2, abs=1e-4)


def test_abstain_below_half_and_zero_radius_at_half():
    radius = l2_radius(np.array([0.0, 0.3, np.nextafter(0.5, 0.0), 0.5, 0.8413447460685429]), 2.0)
    assert np.all(np.isnan(radius[:3]))
    assert radius[3] == 0.0
    assert radius[4] == pytest.approx(2.0, rel=1e-12)


def test_two_class_formula_and_abstention():
    radius = l2_radius_two_class(
        np.array([0.9, 0.6, 0.4, 0.4]), np.array([0.05, 0.4, 0.4, 0.5]), 0.5
    )
    expected = 0.25 * (stats.norm.ppf(0.9) - stats.norm.ppf(0.05))
    assert radius[0] == pytest.approx(expected, rel=1e-14)
    assert radius[1] == pytest.approx(0.5 * stats.norm.ppf(0.6), rel=1e-12)  # pB = 1 - pA
    assert np.isnan(radius[2]) and np.isnan(radius[3])  # pA_lower <= pB_upper abstains


def test_two_class_with_complementary_bound_equals_one_class():
    p = np.linspace(0.51, 0.999, 50)  # at exactly 1/2 the two-class form abstains (tie)
    np.testing.assert_allclose(l2_radius_two_class(p, 1 - p, 0.3), l2_radius(p, 0.3), atol=1e-12)


def test_radius_rule_dispatch():
    rule = L2Radius(sigma=0.25)
    assert rule.radius(np.array(0.9), None) == l2_radius(0.9, 0.25)
    assert rule.radius(np.array(0.9), np.array(0.02)) == l2_radius_two_class(0.9, 0.02, 0.25)


def _smoothed_linear_probability(w, b, x, sigma):
    """Oracle: P[wᵀ(x + δ) + b > 0] for δ ~ N(0, σ² I) is Φ((wᵀx + b) / (σ ‖w‖))."""
    return stats.norm.cdf((w @ x + b) / (sigma * np.linalg.norm(w)))


def test_linear_classifier_oracle_monte_carlo_and_exact_radius():
    rng = np.random.default_rng(0)
    d, sigma, n = 5, 0.7, 200_000
    w, b = rng.normal(size=d), 0.3
    x = rng.normal(size=d) * 0.3
    p = _smoothed_linear_probability(w, b, x, sigma)
    delta = rng.normal(scale=sigma, size=(n, d))  # [n, d]
    estimate = np.mean((x + delta) @ w + b > 0)
    # 5 standard errors: this fixed-seed check fails with probability < 6e-7 over seeds.
    assert abs(estimate - p) < 5 * np.sqrt(p * (1 - p) / n)
    # With the exact probability the radius is the exact distance to the decision boundary.
    distance = abs(w @ x + b) / np.linalg.norm(w)
    top = max(p, 1 - p)
    assert float(l2_radius(top, sigma)) == pytest.approx(distance, rel=1e-10)


def test_certified_radius_from_counts_never_exceeds_true_distance():
    # 1000 draws at alpha = 1e-9: any violation happens with probability <= 1000 * 1e-9 = 1e-6.
    rng = np.random.default_rng(1)
    sigma, n, alpha = 0.5, 1000, 1e-9
    distance = rng.uniform(0.0, 2.0, size=1000)  # distance of x to the boundary, class 1 side
    p_true = stats.norm.cdf(distance / sigma)
    counts = rng.binomial(n, p_true)
    radius = l2_radius(clopper_pearson_lower(counts, n, alpha), sigma)
    certified = ~np.isnan(radius)
    assert certified.sum() > 500  # the check is not vacuous
    assert np.all(radius[certified] <= distance[certified])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: l2_radius(0.9, 0.0), "sigma=0.0"),
        (lambda: l2_radius(0.9, float("nan")), "sigma=nan"),
        (lambda: l2_radius(1.2, 1.0), "p_lower=1.2"),
        (lambda: l2_radius_two_class(0.9, -0.1, 1.0), "p_upper=-0.1"),
        (lambda: L2Radius(sigma=-1.0), "sigma=-1.0"),
    ],
)
def test_bad_input_names_parameter_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_docstring_examples():
    result = doctest.testmod(cbcert.certify.l2)
    assert result.attempted > 0 and result.failed == 0
