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
    assert result.statistic == np.inf and result.pvalue == 0.0 and result.sd == 0.0
    assert result.mean == pytest.approx(0.1, rel=1e-12)
    assert stats.paired_ttest(b, a).statistic == -np.inf


def test_paired_ttest_rejects_bad_input():
    with pytest.raises(ValueError, match="k >= 2"):
        stats.paired_ttest(np.array([0.1]), np.array([0.2]))
    with pytest.raises(ValueError, match="finite"):
        stats.paired_ttest(np.array([0.1, np.nan]), np.array([0.2, 0.3]))


def test_holm_matches_statsmodels_and_step_down_formula():
    rng = np.random.default_rng(1)
    pvalues = rng.uniform(size=9) ** 3
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
