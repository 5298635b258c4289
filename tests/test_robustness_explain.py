"""Explanations (`cbcert.robustness.explain`): contributions, top-k, stability, certified
concept signs (simulated trials), counterfactual checks, known-answer scores and judges."""

import math

import numpy as np
import pytest
import scipy.stats

from cbcert.robustness import explain as ex
from cbcert.robustness.stats import holm


def test_contributions_sum_to_the_logit_and_rank_by_magnitude():
    """Hand-built linear head: ``Σ_i c_i + b_y`` is the predicted logit; the ranking is by
    |c| with ties to the lower index; shares are L1-normalised over the top k."""
    a = np.array([[1.0, 2.0, -3.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    w = np.array([[1.0, 1.0, 1.0, 1.0], [2.0, -1.0, 0.5, 0.0]])
    b = np.array([0.3, -0.2])
    pred = np.array([1, 0])
    c = ex.contributions(a, w, pred)
    np.testing.assert_array_equal(c[0], [2.0, -2.0, -1.5, 0.0])
    logits = a @ w.T + b
    np.testing.assert_allclose(c.sum(axis=1) + b[pred], logits[np.arange(2), pred])
    e = ex.explain(c, k=3)
    np.testing.assert_array_equal(e.concepts, [[0, 1, 2], [-1, -1, -1]])
    np.testing.assert_allclose(e.shares[0], np.array([2.0, -2.0, -1.5]) / 5.5)
    np.testing.assert_array_equal(e.shares[1], 0.0)  # nothing to cite
    assert np.abs(e.shares[0]).sum() == pytest.approx(1.0)
    # k above K pads; a zero contribution falls under the floor.
    np.testing.assert_array_equal(ex.explain(c, k=6).concepts[0], [0, 1, 2, -1, -1, -1])
    np.testing.assert_array_equal(ex.explain(c, k=3).cited(4)[0], [True, True, True, False])


def test_tiny_shares_are_dropped_and_bad_arguments_named():
    e = ex.explain(np.array([[100.0, 0.5, -0.9, 2.0]]), k=4)
    np.testing.assert_array_equal(e.concepts, [[0, 3, -1, -1]])  # 0.9 / 103.4 < 0.01
    with pytest.raises(ValueError, match="k=0 must be an integer >= 1"):
        ex.explain(np.ones((1, 3)), k=0)
    with pytest.raises(ValueError, match=r"predicted must hold integer classes in \[0, 2\)"):
        ex.contributions(np.ones((1, 3)), np.ones((2, 3)), np.array([2]))


def test_device_members_are_the_cited_set_of_explain():
    """`top_k_members` (jax) cites exactly what `explain` (numpy) cites: random rows with ties
    (values on a coarse grid), zeros, all-zero rows, tiny shares under the floor, k above K."""
    rng = np.random.default_rng(0)
    c = rng.integers(-6, 7, size=(400, 12)).astype(np.float32) / 4  # many exact ties
    c[:40] = 0.0
    c[40:80, :3] *= 1000  # the rest fall under the 1 % floor
    for k in (1, 5, 12, 20):
        members = np.asarray(ex.top_k_members(c, k))
        np.testing.assert_array_equal(members, ex.explain(c, k).cited(12))
    assert not np.asarray(ex.top_k_members(c, 5))[:40].any()


def test_overlap_and_rank_correlation():
    a = np.array([[0, 1, 2], [3, -1, -1], [-1, -1, -1]])
    b = np.array([[2, 1, 4], [3, -1, -1], [-1, -1, -1]])
    np.testing.assert_allclose(ex.top_k_overlap(a, b), [2 / 4, 1.0, 1.0])
    clean = np.array([[3.0, 2.0, 1.0, 0.0, 0.5]] * 3)
    same_order = clean * 2
    reversed_order = np.array([[1.0, 2.0, 3.0, 0.0, 4.0]] * 3)
    tau_same = ex.rank_correlation(clean, same_order, a, b)
    assert tau_same[0] == pytest.approx(1.0) and np.isnan(tau_same[1:]).all()
    tau_rev = ex.rank_correlation(clean, reversed_order, a, a)  # over concepts 0, 1, 2
    assert tau_rev[0] == pytest.approx(-1.0)


def _simulate(p_positive, trials, n0, n, seed):
    """Selection and estimation counts of ``r_i > 0`` for concepts with P[r_i > 0] = p."""
    rng = np.random.default_rng(seed)
    shape = (trials, len(p_positive))
    return rng.binomial(n0, p_positive, shape), rng.binomial(n, p_positive, shape)


def test_certified_concept_stability_is_sound_in_simulated_trials():
    """Worst case for the test at radius R: every concept's agreement probability is exactly
    Φ(R/σ), so every claim is false; Holm keeps the rate of any claim per input ≤ α.

    4,000 trials (fixed seed): if the true rate were α = 0.05, the observed rate would exceed
    α + 3.5 sd (sd = √(α(1 − α)/4000) = 0.0034) with probability 2.3e-4.
    """
    sigma, radius, alpha, n0, n, trials = 0.5, 0.25, 0.05, 20, 200, 4000
    p0 = scipy.stats.norm.cdf(radius / sigma)
    select, counts = _simulate(np.full(5, p0), trials, n0, n, seed=0)
    cert = ex.certify_concept_signs(select, n0, counts, n, sigma, alpha, radius=radius)
    false_claims = cert.certified.any(axis=1)  # every claim is false here
    bound = alpha + 3.5 * math.sqrt(alpha * (1 - alpha) / trials)
    assert false_claims.mean() <= bound
    # Not vacuous: clearly stable concepts are certified.
    select, counts = _simulate(np.full(5, 0.995), 500, n0, n, seed=1)
    strong = ex.certify_concept_signs(select, n0, counts, n, sigma, alpha, radius=radius)
    assert strong.all_certified.mean() > 0.95 and (strong.sign == 1).all()


def test_certified_concept_radii_hold_together_in_simulated_trials():
    """Bonferroni radii: the chance that any concept's certified radius exceeds its true one,
    σ Φ⁻¹(p) of the selected sign, stays ≤ α (same tolerance and failure probability as
    above)."""
    sigma, alpha, n0, n, trials = 0.5, 0.05, 20, 100, 4000
    p = np.array([0.5, 0.6, 0.8, 0.9, 0.97])
    select, counts = _simulate(p, trials, n0, n, seed=2)
    cert = ex.certify_concept_signs(select, n0, counts, n, sigma, alpha)
    p_selected = np.where(cert.sign > 0, p, 1 - p)
    true_radius = sigma * scipy.stats.norm.ppf(np.maximum(p_selected, 0.5))
    wrong = ((cert.radius > true_radius) & (cert.radius > 0)).any(axis=1)
    assert wrong.mean() <= alpha + 3.5 * math.sqrt(alpha * (1 - alpha) / trials)
    assert (cert.radius[:, 4] > 0).mean() > 0.9  # p = 0.97 is usually certified


def test_family_restricts_the_correction_and_the_claims():
    select = np.array([[20, 20, 0, 10]])
    counts = np.array([[200, 200, 0, 100]])
    family = np.array([[True, False, True, False]])
    cert = ex.certify_concept_signs(select, 20, counts, 200, 0.5, 0.01, family=family)
    np.testing.assert_array_equal(cert.sign, [[1, 0, -1, 0]])
    np.testing.assert_array_equal(cert.certified, [[True, False, True, False]])
    assert np.isnan(cert.p_value[0, [1, 3]]).all() and cert.all_certified[0]
    np.testing.assert_array_equal(cert.radius[0, [1, 3]], 0.0)


def test_row_wise_holm_is_holm_on_each_family():
    rng = np.random.default_rng(3)
    p = rng.uniform(size=(50, 6)) ** 3
    family = rng.uniform(size=(50, 6)) < 0.6
    got = ex.holm_rows(p, family)
    for row in range(50):
        members = family[row]
        assert np.isnan(got[row, ~members]).all()
        if members.any():
            np.testing.assert_allclose(got[row, members], holm(p[row, members]))


def test_counterfactual_verification_rejects_an_edit_that_changes_a_second_concept():
    before = np.array([[1, 0, 1], [1, 0, 1], [1, 0, 1]], bool)
    targets = np.array([[1, 0, 0], [1, 0, 0], [1, 0, 0]], bool)
    after = np.array([[0, 0, 1],   # exactly the target flipped
                      [0, 1, 1],   # the target and a second concept
                      [1, 0, 1]],  # nothing flipped
                     bool)
    np.testing.assert_array_equal(ex.verify_edit(before, after, targets), [True, False, False])
    np.testing.assert_array_equal(
        ex.counterfactual_consistency(np.array([0, 1, 2]), np.array([1, 1, 0]),
                                      np.array([True, True, False])), [True, False, False])
    cited_after = np.array([[0, 2, -1], [2, -1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(ex.faithfulness(cited_after, targets), [False, True, True])


def test_bootstrap_interval_brackets_the_mean():
    values = np.r_[np.ones(80), np.zeros(20)]
    mean, low, high = ex.bootstrap_ci(values, seed=0, resamples=2000)
    assert mean == 0.8 and low < 0.8 < high and 0.69 < low and high < 0.89


def test_known_answer_scorer_gives_the_oracle_one_and_judges_agree_with_it():
    relevant = np.array([[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], bool)
    oracle = np.array([[2, 0, -1], [1, -1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(ex.known_answer_score(oracle, relevant), 1.0)
    partial = np.array([[0, 3, -1], [3, -1, -1], [1, -1, -1]])
    precision, recall = ex.cited_precision_recall(partial, relevant)
    np.testing.assert_allclose(precision, [0.5, 0.0, 0.0])
    np.testing.assert_allclose(recall[:2], [0.5, 0.0])
    assert np.isnan(recall[2])
    np.testing.assert_allclose(ex.known_answer_score(partial, relevant), [0.5, 0.0, 0.0])

    records = [{"cited": list(c), "relevant": list(r)} for c, r in zip(
        [*oracle, *partial], [*relevant, *relevant], strict=True)]
    oracle_judge = ex.as_judge(lambda r: r["cited"], lambda r: r["relevant"])
    lenient = lambda r: 9.0 if r["cited"][0] >= 0 else 1.0  # noqa: E731
    scores = ex.judge_scores([oracle_judge, lenient], records)
    np.testing.assert_array_equal(scores[0], [9, 9, 9, 5, 1, 1])
    np.testing.assert_array_equal(ex.score_sum(scores), scores.sum(axis=0))
    assert ex.pairwise_agreement(scores[0], scores[0]) == 1.0
    assert ex.pairwise_agreement(np.array([1.0, 2, 3]), np.array([3.0, 2, 1])) == 0.0
    assert ex.pairwise_agreement(np.array([1.0, 1, 2]), np.array([1.0, 2, 3])) == pytest.approx(
        (0.5 + 1 + 1) / 3)
    with pytest.raises(ValueError, match=r"judge 0 scored explanation 0 10; allowed: a number "
                                         r"in \[1, 9\]"):
        ex.judge_scores([lambda r: 10], records)


def test_certified_concept_stability_under_concept_flips_is_sound():
    """The Hamming version (Bernoulli ρ flips): p*(R) is where the two-sided Hamming radius
    reaches R; with every concept exactly there, Holm keeps the rate of any (false) claim ≤ α
    (4,000 trials; same tolerance and failure probability as the Gaussian test); radii are the
    rule's radii of p_lower."""
    from cbcert.certify.hamming import BernoulliHammingRadius

    rule = BernoulliHammingRadius(rho=0.1, num_concepts=12)
    p0 = ex.threshold(rule, 1.0)
    assert 0.5 < p0 < 1 and rule.radius(p0, 1 - p0) >= 1 > rule.radius(p0 - 1e-9, 1 - p0 + 1e-9)
    assert ex.threshold(rule, 0.0) == 0.5 and ex.threshold(rule, 13.0) == 1.0
    alpha, n0, n, trials = 0.05, 20, 200, 4000
    select, counts = _simulate(np.full(5, p0), trials, n0, n, seed=4)
    cert = ex.certify_concept_signs(select, n0, counts, n, None, alpha, radius=1.0, rule=rule)
    assert cert.certified.any(axis=1).mean() <= alpha + 3.5 * math.sqrt(
        alpha * (1 - alpha) / trials)
    select, counts = _simulate(np.full(5, 0.999), 200, n0, n, seed=5)
    strong = ex.certify_concept_signs(select, n0, counts, n, None, alpha, radius=1.0, rule=rule)
    assert strong.all_certified.mean() > 0.9 and (strong.radius >= 1).all()
    with pytest.raises(ValueError, match="either sigma"):
        ex.certify_concept_signs(select, n0, counts, n, 0.5, alpha, rule=rule)
