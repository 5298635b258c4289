"""Tests of cbcert.robustness.stats: flip reducers, subset means, paired t-test, Holm."""

import numpy as np
import pytest
import scipy.stats
from statsmodels.stats.multitest import multipletests

from cbcert.robustness import stats


def test_prediction_flips_zero_when_unchanged():
    pred = np.array([0, 3, 1, 2])
    flips = stats.prediction_flips(pred, pred)
    assert flips.shape == (4, 1)
    assert stats.per_input_mean(flips).mean() == 0.0


def test_prediction_flips_with_samples():
    clean = np.array([0, 1])
    perturbed = np.array([[0, 1, 1, 0], [1, 1, 1, 2]])  # [N=2, S=4]
    flips = stats.prediction_flips(clean, perturbed)
    np.testing.assert_array_equal(stats.per_input_mean(flips), [0.5, 0.25])


def test_prediction_flips_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="perturbed array"):
        stats.prediction_flips(np.zeros(3, int), np.zeros((4, 2), int))


def test_concept_flip_counts_and_histogram():
    clean = np.array([[1, 0, 1], [0, 0, 0]], dtype=bool)  # [N=2, K=3]
    perturbed = np.array(
        [[[1, 0, 1], [0, 1, 1]], [[1, 1, 1], [0, 0, 1]]], dtype=bool
    )  # [N=2, S=2, K=3]
    counts = stats.concept_flip_counts(clean, perturbed)
    np.testing.assert_array_equal(counts, [[0, 2], [3, 1]])
    np.testing.assert_array_equal(stats.flip_count_histogram(counts, 3), [0.25, 0.25, 0.25, 0.25])
    with pytest.raises(ValueError, match=r"counts: values must lie in \[0, 2\]"):
        stats.flip_count_histogram(counts, 2)


def test_decision_shifts_is_l2_distance():
    clean = np.array([[0.0, 0.0], [1.0, 1.0]])
    perturbed = np.array([[3.0, 4.0], [1.0, 1.0]])
    np.testing.assert_allclose(stats.decision_shifts(clean, perturbed), [[5.0], [0.0]])


def test_subset_means_gathers_positions():
    values = np.array([0.0, 1.0, 2.0, 3.0])
    subsets = np.array([[0, 1], [2, 3], [0, 3]])
    np.testing.assert_array_equal(stats.subset_means(values, subsets), [0.5, 2.5, 1.5])
    with pytest.raises(ValueError, match=r"subsets: positions must lie in \[0, 4\)"):
        stats.subset_means(values, np.array([[0, 4]]))


def test_paired_ttest_matches_scipy():
    rng = np.random.default_rng(0)
    a = rng.uniform(size=5)
    b = a - 0.05 + rng.normal(scale=0.02, size=5)
    result = stats.paired_ttest(a, b)
    reference = scipy.stats.ttest_rel(a, b)
    assert result.statistic == pytest.approx(reference.statistic, rel=1e-12)
    assert result.pvalue == pytest.approx(reference.pvalue, rel=1e-12)
    assert result.df == 4
    assert result.mean == pytest.approx(np.mean(a - b), rel=1e-12)
    assert result.sd == pytest.approx(np.std(a - b, ddof=1), rel=1e-12)


def test_paired_ttest_identical_models_gives_p_one():
    a = np.array([0.1, 0.2, 0.3, 0.15, 0.4])
    result = stats.paired_ttest(a, a.copy())
    assert (result.mean, result.sd, result.statistic, result.pvalue) == (0.0, 0.0, 0.0, 1.0)


def test_paired_ttest_constant_difference_up_to_rounding():
    # Per-subset means of counts: 0.2-0.1 and 0.3-0.2 differ only in the last bit.
    a = np.array([20, 30, 40]) / 100
    b = np.array([10, 20, 30]) / 100
    result = stats.paired_ttest(a, b)
    # t has no answer for a zero variance: the limit t = inf, but no p (not 0: no certainty).
    assert result.statistic == np.inf and np.isnan(result.pvalue) and result.sd == 0.0
    assert result.mean == pytest.approx(0.1, rel=1e-12)
    assert stats.paired_ttest(b, a).statistic == -np.inf


def test_paired_ttest_rejects_bad_input():
    with pytest.raises(ValueError, match="k >= 2"):
        stats.paired_ttest(np.array([0.1]), np.array([0.2]))
    with pytest.raises(ValueError, match="finite"):
        stats.paired_ttest(np.array([0.1, np.nan]), np.array([0.2, 0.3]))


def test_permutation_test_constant_differences_get_the_exact_finite_p():
    """d_i = c for all M inputs: only the two constant sign vectors reach |Σ d| -> 2 / 2^M."""
    a = np.array([0.5, 0.7, 0.2, 0.9, 0.4])
    result = stats.paired_permutation_test(a, a - 0.25)
    assert result.exact and result.resamples == 32
    assert result.pvalue == 2 / 32 and result.mean == pytest.approx(0.25) and result.sd == 0.0
    large = stats.paired_permutation_test(np.ones(30), np.zeros(30))
    # Monte Carlo: a sign vector reaches |Σ d| = 30 with probability 2^-29 per draw.
    assert not large.exact and large.pvalue == 1 / 10_000
    assert stats.paired_permutation_test(a, a.copy()).pvalue == 1.0


def test_permutation_test_exact_matches_enumeration_by_hand():
    d = np.array([0.3, -0.1, 0.2, 0.05])
    signs = np.array(np.meshgrid(*[[-1, 1]] * 4)).reshape(4, -1).T  # the 16 sign vectors
    expected = np.mean(np.abs(signs @ d) >= abs(d.sum()) - 1e-12)
    # |Σ s d| >= 0.45 for s = 1, s flipping -0.1 (0.65), s flipping -0.1 and 0.05 (0.55), and
    # their negations: 6 of 16.
    assert stats.paired_permutation_test(d, np.zeros(4)).pvalue == expected == 6 / 16


def test_permutation_test_monte_carlo_agrees_with_exact():
    rng = np.random.default_rng(4)
    a, b = rng.uniform(size=16), rng.uniform(size=16)
    exact = stats.paired_permutation_test(a, b)
    d = np.concatenate([a - b, np.zeros(1)])  # one more (zero) difference: same distribution
    monte_carlo = stats.paired_permutation_test(d, np.zeros(17), resamples=40_000)
    assert exact.exact and not monte_carlo.exact
    # sd of the Monte Carlo estimate <= 0.5/sqrt(40000) = 0.0025: 5 sd, failure prob < 1e-6.
    assert abs(monte_carlo.pvalue - exact.pvalue) < 0.0125


def test_permutation_test_is_valid_under_the_null():
    """Exchangeable pairs: P(p <= 0.05) <= 0.05, checked over 400 fixed-seed simulations."""
    rng = np.random.default_rng(11)
    rejections = 0
    for _ in range(400):
        pair = rng.uniform(size=(2, 25)) < 0.3  # flip indicators of two equal models
        rejections += stats.paired_permutation_test(*pair.astype(float),
                                                    resamples=999).pvalue <= 0.05
    # Binomial(400, 0.05): mean 20, sd 4.4; > 36 has probability < 1e-4.
    assert rejections <= 36


def test_permutation_test_rejects_bad_input():
    with pytest.raises(ValueError, match="M >= 1"):
        stats.paired_permutation_test(np.array([]), np.array([]))
    with pytest.raises(ValueError, match="finite"):
        stats.paired_permutation_test(np.array([np.inf]), np.array([0.0]))


@pytest.mark.parametrize("a_only, b_only, concordant", [(4, 4, 192), (92, 7, 101), (18, 12, 170),
                                                     (1, 3, 0), (0, 5, 3), (0, 0, 9)])
def test_mcnemar_is_scipys_exact_binomial_test_of_the_discordant_pairs(a_only, b_only,
                                                                         concordant):
    a = np.array([True] * a_only + [False] * b_only + [True, False] * (concordant // 2)
                 + [True] * (concordant % 2))
    b = np.array([False] * a_only + [True] * b_only + [True, False] * (concordant // 2)
                 + [True] * (concordant % 2))
    test = stats.mcnemar_test(a, b)
    n = a_only + b_only
    expected = 1.0 if n == 0 else scipy.stats.binomtest(a_only, n, 0.5).pvalue
    assert test.pvalue == pytest.approx(expected, rel=1e-12, abs=1e-300)
    assert (test.a_only, test.b_only, test.num_pairs) == (a_only, b_only, a.size)
    d = a.astype(float) - b.astype(float)
    assert test.mean == pytest.approx(d.mean()) and test.sd == pytest.approx(d.std(ddof=1))


def test_mcnemar_is_the_exact_sign_flip_permutation_test_of_0_1_outcomes():
    rng = np.random.default_rng(5)
    a, b = rng.uniform(size=(2, 14)) < np.array([[0.7], [0.4]])
    exact = stats.paired_permutation_test(a.astype(float), b.astype(float))
    assert exact.exact
    assert stats.mcnemar_test(a, b).pvalue == pytest.approx(exact.pvalue, rel=1e-12)


def test_mcnemar_rejects_bad_input():
    with pytest.raises(ValueError, match="M >= 1"):
        stats.mcnemar_test(np.array([]), np.array([]))
    with pytest.raises(ValueError, match="0/1"):
        stats.mcnemar_test(np.array([0.5]), np.array([1.0]))


@pytest.mark.parametrize("pvalues", [
    np.random.default_rng(1).uniform(size=9) ** 3,
    np.array([0.5, 0.01, 1.0, 0.04, 0.01, 0.5, 0.0]),  # ties, 0 and 1, the cap at 1 reached
    np.array([0.3]),
])
def test_holm_matches_statsmodels_and_step_down_formula(pvalues):
    adjusted = stats.holm(pvalues)
    np.testing.assert_allclose(adjusted, multipletests(pvalues, method="holm")[1], rtol=0)
    order = np.argsort(pvalues)
    m = len(pvalues)
    step_down = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * pvalues[order]))
    np.testing.assert_allclose(adjusted[order], step_down, rtol=1e-15)


def test_holm_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"pvalues: must lie in \[0, 1\]"):
        stats.holm(np.array([0.2, 1.5]))


def test_mean_sd_uses_sample_sd():
    result = stats.mean_sd(np.array([1.0, 2.0, 3.0]))
    assert result == stats.MeanSD(2.0, 1.0)
