"""Pooled paired comparisons and the run-wide corrections (`cbcert.robustness.pooled`,
`stats.benjamini_hochberg`), against scipy and statsmodels on hand-made data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.weightstats import ttost_paired

from cbcert.robustness import pooled, stats


def test_benjamini_hochberg_is_scipys_and_statsmodels():
    rng = np.random.default_rng(3)
    p = np.concatenate([rng.uniform(size=40), rng.uniform(0, 0.01, size=10), [0.0, 1.0, 0.02]])
    ours = stats.benjamini_hochberg(p)
    np.testing.assert_allclose(ours, scipy.stats.false_discovery_control(p), rtol=1e-12)
    np.testing.assert_allclose(ours, multipletests(p, method="fdr_bh")[1], rtol=1e-12)
    np.testing.assert_allclose(stats.holm(p), multipletests(p, method="holm")[1], rtol=1e-12)


@pytest.mark.parametrize("bad", [np.array([]), np.array([0.2, 1.5]), np.array([[0.1]])])
def test_benjamini_hochberg_refuses_what_is_not_a_list_of_p_values(bad):
    with pytest.raises(ValueError, match="pvalues"):
        stats.benjamini_hochberg(bad)


def test_binary_outcomes_get_the_exact_mcnemar_p_and_the_mean_difference():
    rng = np.random.default_rng(0)
    a = rng.uniform(size=300) < 0.6
    b = np.where(rng.uniform(size=300) < 0.1, ~a, a)
    r = pooled.paired_means(a.astype(float), b.astype(float), margin=0.02)
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(~a & b))
    exact = scipy.stats.binomtest(only_a, only_a + only_b, 0.5).pvalue
    assert r.test == pooled.MCNEMAR and r.p == pytest.approx(exact, rel=1e-9)
    assert r.delta == pytest.approx(a.mean() - b.mean()) and r.inputs == 300
    assert r.ci_low < r.delta < r.ci_high


def test_continuous_values_get_scipys_paired_t_and_statsmodels_tost():
    rng = np.random.default_rng(1)
    a = rng.normal(1.0, 1.0, size=400)
    b = a + rng.normal(0.01, 0.2, size=400)
    r = pooled.paired_means(a, b, margin=0.05)
    assert r.test == pooled.PAIRED_T
    assert r.p == pytest.approx(scipy.stats.ttest_rel(a, b).pvalue, rel=1e-9)
    assert r.tost_p == pytest.approx(ttost_paired(a, b, -0.05, 0.05)[0], rel=1e-9)


@pytest.mark.parametrize("shift,margin", [(0.0, 0.1), (0.08, 0.1), (0.2, 0.1), (-0.05, 0.02)])
def test_tost_is_statsmodels_two_one_sided_tests(shift, margin):
    rng = np.random.default_rng(7)
    a = rng.normal(size=150)
    b = a - shift + rng.normal(0, 0.3, size=150)
    r = pooled.paired_means(a, b, margin=margin)
    assert r.tost_p == pytest.approx(ttost_paired(a, b, -margin, margin)[0], rel=1e-9)


def test_tost_without_variance_is_decided_exactly():
    assert pooled.tost_t(0.01, 0.0, 99, 0.02) == 0.0
    assert pooled.tost_t(0.02, 0.0, 99, 0.02) == 1.0
    assert pooled.tost_t(0.0, 0.1, 99, 0.0) == 1.0
    # Normal reference: both one-sided tails at the margins.
    assert pooled.tost_t(0.0, 1.0, math.inf, 1.96) == pytest.approx(
        scipy.stats.norm.sf(1.96), rel=1e-12)


def test_identical_models_have_no_difference_and_a_point_interval():
    x = (np.arange(50) % 3 == 0).astype(float)
    r = pooled.paired_means(x, x.copy(), margin=0.02)
    assert (r.delta, r.ci_low, r.ci_high, r.p) == (0.0, 0.0, 0.0, 1.0)
    assert r.tost_p == 0.0  # no discordant input: equivalent within any margin


def test_the_bootstrap_interval_covers_like_the_normal_interval():
    """Deterministic (fixed resamples): for a mean of 1,000 normal differences the 95 %
    percentile interval matches mean ± 1.96 se within 10 % of its width."""
    rng = np.random.default_rng(11)
    d = rng.normal(0.3, 1.0, size=1000)
    r = pooled.paired_means(d, np.zeros_like(d), margin=None)
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)
    assert r.ci_low == pytest.approx(d.mean() - half, abs=0.1 * half)
    assert r.ci_high == pytest.approx(d.mean() + half, abs=0.1 * half)
    assert r.tost_p is None and r.margin is None


def test_bootstrap_weights_are_resamples_of_every_input_and_cached():
    w = pooled.bootstrap_weights(37, 50, 0)
    assert w.shape == (50, 37) and (w.sum(axis=1) == 37).all() and not w.flags.writeable
    assert pooled.bootstrap_weights(37, 50, 0) is w
    with pytest.raises(ValueError, match="inputs"):
        pooled.bootstrap_weights(0, 10, 0)


def test_radius_of_correct_compares_each_models_own_correct_inputs():
    radius_a = np.array([0.1, 0.2, np.nan, 0.4, 0.3, 0.2])
    correct_a = np.array([True, True, False, True, True, False])
    radius_b = np.array([0.1, 0.1, 0.5, 0.2, 0.3, 0.1])
    correct_b = np.array([True, False, True, True, True, True])
    r = pooled.paired_radius_of_correct(radius_a, correct_a, radius_b, correct_b,
                                        relative_margin=0.05)
    assert r.value_a == pytest.approx(np.mean([0.1, 0.2, 0.4, 0.3]))
    assert r.value_b == pytest.approx(np.mean([0.1, 0.5, 0.2, 0.3, 0.1]))
    assert r.delta == pytest.approx(r.value_a - r.value_b)
    assert r.margin == pytest.approx(0.05 * r.value_a) and r.test == pooled.BOOTSTRAP_WALD


def test_radius_test_without_any_variation_has_no_answer():
    zeros, correct = np.zeros(20), np.ones(20, bool)
    r = pooled.paired_radius_of_correct(zeros, correct, zeros, correct, relative_margin=0.05)
    assert r.p is None and r.tost_p is None and r.delta == 0.0
    r = pooled.paired_radius_of_correct(zeros, correct, zeros, np.zeros(20, bool),
                                        relative_margin=0.05)
    assert r.p is None and math.isnan(r.value_b)


def test_the_radius_test_holds_its_level_when_the_models_are_exchangeable():
    """Fixed-key statistical test: 300 pools of 400 inputs whose two models' (radius, correct)
    pairs are exchangeable (drawn i.i.d. per input), so H0 holds. A level-0.05 test rejects
    each with probability ≈ 0.05; we require at most 27 rejections of 300 (9 %). If the
    test held its level exactly, P(X > 27) for X ~ Binomial(300, 0.05) is about 3e-4."""
    rng = np.random.default_rng(2024)
    rejected = 0
    for _ in range(300):
        common = rng.gamma(2.0, 0.05, size=400)
        ra = common + rng.normal(0, 0.02, size=400)
        rb = common + rng.normal(0, 0.02, size=400)
        ca, cb = rng.uniform(size=400) < 0.8, rng.uniform(size=400) < 0.8
        p = pooled.paired_radius_of_correct(ra, ca, rb, cb, relative_margin=None,
                                            resamples=400).p
        rejected += p < 0.05
    assert 3 <= rejected <= 27
