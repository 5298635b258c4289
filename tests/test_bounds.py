"""Tests of cbcert.certify.bounds: Clopper–Pearson bounds and the binomial test at 1/2."""

import doctest

import mpmath
import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.proportion import proportion_confint

import cbcert.certify.bounds
from cbcert.certify.bounds import (
    binomial_test_half,
    bonferroni_split,
    clopper_pearson_lower,
    clopper_pearson_upper,
    randomized_clopper_pearson_lower,
    randomized_clopper_pearson_upper,
)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000])
@pytest.mark.parametrize("alpha", [1e-6, 0.001, 0.05, 0.3])
def test_clopper_pearson_matches_statsmodels_two_sided_at_twice_alpha(n, alpha):
    k = np.arange(n + 1)
    low, high = proportion_confint(k, n, alpha=2 * alpha, method="beta")
    np.testing.assert_allclose(clopper_pearson_lower(k, n, alpha), low, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(clopper_pearson_upper(k, n, alpha), high, rtol=1e-12, atol=1e-15)


def test_edge_cases_are_exact():
    mpmath.mp.dps = 40
    for n in (1, 10, 1000):
        for alpha in (0.001, 0.05):
            saturated = mpmath.mpf(alpha) ** (mpmath.mpf(1) / n)
            low = clopper_pearson_lower(n, n, alpha)
            assert abs(low - float(saturated)) <= np.spacing(low)  # within one ulp
            assert clopper_pearson_lower(0, n, alpha) == 0.0
            assert clopper_pearson_upper(n, n, alpha) == 1.0
            high = clopper_pearson_upper(0, n, alpha)
            assert abs(high - float(1 - saturated)) <= 2 * np.spacing(high)


def test_bounds_are_a_one_sided_level_by_definition():
    # Defining property of the exact lower bound: P[Bin(n, p_lower) >= k] = alpha.
    n, alpha = 1000, 0.001
    k = np.arange(1, n + 1)
    p_low = clopper_pearson_lower(k, n, alpha)
    np.testing.assert_allclose(stats.binom.sf(k - 1, n, p_low), alpha, rtol=1e-8)
    p_up = clopper_pearson_upper(k - 1, n, alpha)
    np.testing.assert_allclose(stats.binom.cdf(k - 1, n, p_up), alpha, rtol=1e-8)


def test_vectorised_broadcasting_and_monotonicity():
    k = np.array([[0, 5, 10], [3, 3, 3]])
    n = np.array([10, 10, 10])
    low = clopper_pearson_lower(k, n, 0.01)
    assert low.shape == (2, 3) and low.dtype == np.float64
    grid = clopper_pearson_lower(np.arange(101), 100, 0.01)
    assert np.all(np.diff(grid) > 0)
    assert np.all(clopper_pearson_upper(np.arange(101), 100, 0.01) > grid)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 11, 57, 1000])
def test_binomial_test_half_matches_scipy_binomtest(n):
    k = np.arange(n + 1) if n < 100 else np.array([0, 1, 450, 480, 499, 500, 501, 531, 1000])
    expected = [stats.binomtest(int(ki), n, 0.5).pvalue for ki in k]
    np.testing.assert_allclose(binomial_test_half(k, n), expected, rtol=1e-12)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: clopper_pearson_lower(5, 4, 0.01), "successes=5"),
        (lambda: clopper_pearson_lower(-1, 4, 0.01), "successes=-1"),
        (lambda: clopper_pearson_lower(1, 0, 0.01), "trials=0"),
        (lambda: clopper_pearson_lower(1.5, 4, 0.01), "successes=1.5"),
        (lambda: clopper_pearson_upper(1, 4, 0.0), "alpha=0.0"),
        (lambda: clopper_pearson_upper(1, 4, 1.0), "alpha=1.0"),
        (lambda: binomial_test_half(3, 2), "successes=3"),
        (lambda: bonferroni_split(0.01, 0), "num_bounds=0"),
    ],
)
def test_bad_input_names_parameter_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bonferroni_split():
    assert bonferroni_split(0.001, 2) == 0.0005
    assert bonferroni_split(0.3, 3) == pytest.approx(0.1)


def test_docstring_examples():
    result = doctest.testmod(cbcert.certify.bounds)
    assert result.attempted > 0 and result.failed == 0


# --- the randomized Clopper–Pearson bound ----------------------------------------------------


def test_randomized_bounds_lie_between_the_standard_bounds_of_k_and_k_plus_one():
    n, alpha = 60, 0.01
    k = np.arange(n + 1)
    for u in (0.0, 0.3, 0.999):
        lower = randomized_clopper_pearson_lower(k, n, alpha, u)
        assert np.all(lower >= clopper_pearson_lower(k, n, alpha) - 1e-15)
        assert np.all(lower[:-1] <= clopper_pearson_lower(k[1:], n, alpha) + 1e-15)
        upper = randomized_clopper_pearson_upper(k, n, alpha, u)
        assert np.all(upper <= clopper_pearson_upper(k, n, alpha) + 1e-15)
    np.testing.assert_allclose(randomized_clopper_pearson_lower(k, n, alpha, 0.0),
                               clopper_pearson_lower(k, n, alpha), rtol=1e-12)
    with pytest.raises(ValueError, match="uniform=1.0"):
        randomized_clopper_pearson_lower(3, 10, 0.05, 1.0)


@pytest.mark.parametrize("p,n", [(0.3, 40), (0.97, 200)])
def test_randomized_bounds_cover_exactly_one_minus_alpha(p, n):
    # Exact coverage, both sides: the count of wrong bounds in 20,000 draws must be consistent
    # with rate α in a two-sided exact binomial test at 10⁻⁶ (fixed seed; a standard
    # Clopper–Pearson bound, conservative at this n, would fall far below).
    draws, alpha = 20_000, 0.05
    rng = np.random.default_rng(int(p * 100))
    k, u = rng.binomial(n, p, draws), rng.random(draws)
    for wrong in (randomized_clopper_pearson_lower(k, n, alpha, u) > p,
                  randomized_clopper_pearson_upper(k, n, alpha, u) < p):
        assert stats.binomtest(int(wrong.sum()), draws, alpha).pvalue >= 1e-6
