"""Tests of cbcert.certify.cohen: CERTIFY and PREDICT from counts (Cohen et al. 2019)."""

import doctest

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.proportion import proportion_confint

import cbcert.certify.cohen
from cbcert.certify.bounds import clopper_pearson_lower, clopper_pearson_upper
from cbcert.certify.cohen import ABSTAIN, certify_counts, predict_counts
from cbcert.certify.hamming import BernoulliHammingRadius, FixedFlipHammingRadius
from cbcert.certify.l2 import L2Radius


def _reference_certify(counts_select, counts_estimate, alpha, sigma):
    """The reference rule, written from the paper's pseudocode with statsmodels' bound."""
    top = int(np.argmax(counts_select))
    n_a, n = int(counts_estimate[top]), int(counts_estimate.sum())
    p_lower = proportion_confint(n_a, n, alpha=2 * alpha, method="beta")[0]
    if p_lower < 0.5:
        return ABSTAIN, 0.0
    return top, sigma * stats.norm.ppf(p_lower)


def test_matches_reference_rule_on_random_counts():
    rng = np.random.default_rng(0)
    select = rng.multinomial(100, [0.6, 0.3, 0.1], size=300)  # [300, 3]
    probs = rng.dirichlet([2.0, 1.0, 1.0], size=300)
    estimate = np.stack([rng.multinomial(1000, p) for p in probs])  # [300, 3]
    cert = certify_counts(select, estimate, 0.001, L2Radius(0.25))
    assert cert.prediction.shape == (300,) and cert.radius.shape == (300,)
    for i in range(300):
        prediction, radius = _reference_certify(select[i], estimate[i], 0.001, 0.25)
        assert cert.prediction[i] == prediction
        if prediction == ABSTAIN:
            assert np.isnan(cert.radius[i])
        else:
            assert cert.radius[i] == pytest.approx(radius, rel=1e-12)
    assert 0 < np.sum(cert.prediction == ABSTAIN) < 300  # both branches exercised


@pytest.mark.parametrize("alpha, expected", [(0.001, 2.4633), (0.05, 2.7487)])
def test_saturated_counts_known_radius(alpha, expected):
    cert = certify_counts(np.array([100, 0]), np.array([1000, 0]), alpha, L2Radius(1.0))
    assert round(float(cert.radius), 4) == expected
    assert cert.prediction == 0 and cert.count_top == 1000 and cert.count_runner_up == 0


def test_selection_ties_break_to_lowest_index_and_estimation_counts_are_used():
    cert = certify_counts(
        np.array([0, 40, 40, 20]), np.array([900, 50, 30, 20]), 0.001, L2Radius(1)
    )
    # Class 1 is selected (tie with class 2), even though class 0 dominates the estimation.
    assert cert.prediction == ABSTAIN and cert.count_top == 50 and cert.count_runner_up == 900
    cert = certify_counts(np.array([5, 60, 60]), np.array([10, 980, 10]), 0.001, L2Radius(1))
    assert cert.prediction == 1 and cert.count_top == 980 and cert.count_runner_up == 10


def test_strict_abstention_below_half_and_radius_zero_at_half():
    # n = 2 all-correct at alpha = 0.25: pA_lower = 0.25 ** (1/2) = 1/2 exactly.
    at_half = certify_counts(np.array([1, 0]), np.array([2, 0]), 0.25, L2Radius(1.0))
    assert at_half.p_lower == 0.5 and at_half.prediction == 0 and at_half.radius == 0.0
    below = certify_counts(np.array([1, 0]), np.array([2, 0]), 0.2499, L2Radius(1.0))
    assert below.p_lower < 0.5 and below.prediction == ABSTAIN and np.isnan(below.radius)
    hamming = certify_counts(
        np.array([1, 0]), np.array([2, 0]), 0.25, BernoulliHammingRadius(0.2, 8)
    )
    assert hamming.prediction == 0 and hamming.radius == 0.0


def test_two_class_form_splits_alpha_and_uses_runner_up():
    select = np.array([[80, 15, 5], [50, 50, 0], [60, 40, 0]])
    estimate = np.array([[900, 30, 70], [480, 500, 20], [530, 470, 0]])
    cert = certify_counts(select, estimate, 0.01, L2Radius(0.5), two_class=True)
    np.testing.assert_array_equal(cert.count_runner_up, [70, 500, 470])
    np.testing.assert_allclose(cert.p_lower, clopper_pearson_lower([900, 480, 530], 1000, 0.005))
    np.testing.assert_allclose(cert.p_upper, clopper_pearson_upper([70, 500, 470], 1000, 0.005))
    expected = 0.25 * (stats.norm.ppf(cert.p_lower[0]) - stats.norm.ppf(cert.p_upper[0]))
    assert cert.prediction[0] == 0 and cert.radius[0] == pytest.approx(expected, rel=1e-12)
    assert cert.prediction[1] == ABSTAIN  # selected class 0 is behind class 1 in estimation
    assert cert.prediction[2] == ABSTAIN  # 530 vs 470: bounds at alpha/2 overlap
    one_class = certify_counts(select, estimate, 0.01, L2Radius(0.5))
    assert cert.radius[0] > one_class.radius[0]  # a small runner-up helps


def test_batched_shapes_and_hamming_rules():
    select = np.tile(np.array([90, 10]), (2, 3, 1))  # [2, 3, C]
    estimate = np.tile(np.array([1000, 0]), (2, 3, 1))
    cert = certify_counts(select, estimate, 0.001, BernoulliHammingRadius(0.2, 50))
    assert cert.radius.shape == (2, 3) and np.all(cert.radius == 4)
    fixed = certify_counts(select, estimate, 0.001, FixedFlipHammingRadius(3, 50))
    assert np.all(fixed.radius == 0) and np.all(fixed.prediction == 0)


def test_predict_matches_binomtest_and_abstains_when_not_significant():
    rng = np.random.default_rng(1)
    counts = rng.multinomial(100, [0.45, 0.35, 0.2], size=200)  # [200, 3]
    pred = predict_counts(counts, alpha=0.05)
    for i in range(200):
        top2 = np.sort(counts[i])[::-1][:2]
        p_value = stats.binomtest(int(top2[0]), int(top2.sum()), 0.5).pvalue
        assert pred.p_value[i] == pytest.approx(p_value, rel=1e-12)
        expected = ABSTAIN if p_value > 0.05 else int(np.argmax(counts[i]))
        assert pred.prediction[i] == expected
    assert 0 < np.sum(pred.prediction == ABSTAIN) < 200


def test_predict_tie_abstains():
    pred = predict_counts(np.array([3, 40, 40, 17]), alpha=0.5)
    assert pred.p_value == 1.0 and pred.prediction == ABSTAIN
    assert pred.count_top == 40 and pred.count_runner_up == 40


def test_statistical_soundness_latent_linear_oracle():
    # Linear base classifier f(z) = 1[wᵀz + b > 0] at signed distance d from its boundary: the
    # smoothed probability of class 1 is Φ(d/σ) and the true robust radius is |d|. A wrong
    # certificate (wrong class, or radius > |d|) needs pA_lower > true pA: P[wrong] <= alpha.
    # 20000 fixed-seed trials; one-sided binomial test at 1e-6, so a correct implementation
    # fails it with probability <= 1e-6. An implementation at 2·alpha would fail it surely.
    rng = np.random.default_rng(2)
    trials, n0, n, alpha, sigma = 20_000, 100, 1000, 0.05, 0.5
    d = rng.uniform(-1.0, 1.0, size=trials)
    p1 = stats.norm.cdf(d / sigma)
    c1_select, c1_estimate = rng.binomial(n0, p1), rng.binomial(n, p1)
    select = np.stack([n0 - c1_select, c1_select], axis=-1)
    estimate = np.stack([n - c1_estimate, c1_estimate], axis=-1)
    cert = certify_counts(select, estimate, alpha, L2Radius(sigma))
    truth = (d > 0).astype(int)
    certified = cert.prediction != ABSTAIN
    wrong = certified & ((cert.prediction != truth) | (cert.radius > np.abs(d)))
    assert certified.sum() > trials // 2
    assert stats.binom.sf(wrong.sum() - 1, trials, alpha) > 1e-6, wrong.sum()
    assert wrong.sum() > 0.5 * alpha * trials  # the bound is nearly exact, not vacuous


def test_statistical_soundness_two_class_three_classes():
    # Three classes with known probabilities; the certificate is wrong if its radius exceeds
    # the two-class radius of the true (pA, max other) (monotone in both bounds), which needs
    # one of the two bounds (each at alpha/2) to fail: P[wrong] <= alpha. Test as above (1e-6).
    rng = np.random.default_rng(3)
    trials, n, alpha, sigma = 20_000, 1000, 0.05, 1.0
    p_a = rng.uniform(0.4, 0.8, size=trials)
    p_b = (1 - p_a) * rng.uniform(0.5, 1.0, size=trials)
    probs = np.stack([p_a, p_b, 1 - p_a - p_b], axis=-1)  # [trials, 3]
    estimate = np.stack([rng.multinomial(n, p) for p in probs])
    select = np.tile(np.array([100, 0, 0]), (trials, 1))
    cert = certify_counts(select, estimate, alpha, L2Radius(sigma), two_class=True)
    true_radius = 0.5 * sigma * (stats.norm.ppf(p_a) - stats.norm.ppf(probs[:, 1:].max(axis=1)))
    wrong = (cert.prediction != ABSTAIN) & (cert.radius > true_radius)
    assert np.sum(cert.prediction != ABSTAIN) > trials // 2
    assert stats.binom.sf(wrong.sum() - 1, trials, alpha) > 1e-6, wrong.sum()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: certify_counts(np.array([1]), np.array([1]), 0.01, L2Radius(1)), "C >= 2"),
        (lambda: certify_counts(np.array([1, 0]), np.array([1.0, 0]), 0.01, L2Radius(1)), "dtype"),
        (lambda: certify_counts(np.array([1, -1]), np.array([1, 0]), 0.01, L2Radius(1)), "-1"),
        (lambda: certify_counts(np.array([1, 0]), np.array([0, 0]), 0.01, L2Radius(1)), "sample"),
        (lambda: certify_counts(np.array([1, 0]), np.array([1, 0, 0]), 0.01, L2Radius(1)), "shape"),
        (lambda: certify_counts(np.array([1, 0]), np.array([1, 0]), 1.5, L2Radius(1)), "alpha=1.5"),
        (lambda: predict_counts(np.array([[1, 2], [0, 0]]), 0.01), "no samples"),
    ],
)
def test_bad_input_names_parameter_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_docstring_examples():
    result = doctest.testmod(cbcert.certify.cohen)
    assert result.attempted > 0 and result.failed == 0
