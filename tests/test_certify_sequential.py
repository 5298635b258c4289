"""Anytime-valid sequential CERTIFY / PREDICT: schedules, exact fixed-n agreement, stopping
rules, and soundness by simulation.

The soundness tests draw binomial (multinomial) votes with known class probabilities directly
in numpy -- no models -- 10⁴ fixed-seed trials per configuration, true probabilities just below
radius thresholds, under several stopping rules. A certificate is an *over-claim* when its
radius exceeds the true radius of the smoothed classifier. Each configuration's over-claim count
X is checked with a one-sided exact binomial test of "rate <= α": it fails when
``P[Bin(T, α) >= X] < 1e-6``, so a sound procedure fails a configuration with probability
< 10⁻⁶ (the seeds are fixed, so the outcome is deterministic). A negative control shows the test
has the power to catch an invalid scheme (every checkpoint at the full α).
"""

import numpy as np
import pytest
from scipy import stats

from cbcert.certify.cohen import ABSTAIN, certify_counts, predict_counts
from cbcert.certify.hamming import BernoulliHammingRadius
from cbcert.certify.l2 import L2Radius
from cbcert.certify.schedule import (
    Schedule,
    Stopping,
    check_settings,
    largest_radius,
    samples_needed,
)
from cbcert.certify.sequential import (
    STOP_REASONS,
    SequentialCertifier,
    certify_sequential,
    pilot_hopeless,
    predict_sequential,
    reachable_radius,
)
from cbcert.schema import ConfigError

TRIALS = 10_000
FAILURE_PROBABILITY = 1e-6
SIGMA = 0.5


def votes(seed: int, probs, checkpoints, trials: int = TRIALS) -> np.ndarray:
    """Cumulative multinomial counts ``[K, trials, C]`` at each checkpoint (nested samples)."""
    rng = np.random.default_rng(seed)
    steps = np.diff((0, *checkpoints))
    return np.cumsum(np.stack([rng.multinomial(s, probs, size=trials) for s in steps]), axis=0)


def selected(num_classes: int, trials: int = TRIALS) -> np.ndarray:
    """Selection counts that pick class 0, the true top class (selection is separate)."""
    select = np.zeros((trials, num_classes), np.int64)
    select[:, 0] = 1
    return select


def assert_rate_at_most(over: int, alpha: float, trials: int = TRIALS) -> None:
    """One-sided exact binomial test of ``over`` events in ``trials`` against rate ``alpha``."""
    p_value = stats.binom.sf(over - 1, trials, alpha)  # P[Bin(trials, alpha) >= over]
    assert p_value >= FAILURE_PROBABILITY, (
        f"{over} over-claims in {trials} trials at α = {alpha} (p = {p_value:.2g})")


def threshold(rule, radius: float) -> float:
    """Smallest pA whose exact (population, one-class) radius reaches ``radius``, by bisection."""
    low, high = 0.5, 1.0 - 1e-12
    for _ in range(100):
        mid = (low + high) / 2
        r = rule.radius(np.array(mid), None)
        low, high = (low, mid) if np.nan_to_num(r, nan=-1.0) >= radius else (mid, high)
    return high


# --- schedules -------------------------------------------------------------------------------


def test_geometric_schedule_is_increasing_ends_at_n_and_spends_at_most_alpha():
    for n, alpha, first, ratio in [(1000, 0.001, None, None), (1100, 0.05, 10, 1.5),
                                   (100_000, 1e-6, 32, 2.0), (33, 0.01, 32, 3.0)]:
        s = Schedule.geometric(n, alpha, first=first, ratio=ratio)
        assert s.checkpoints[-1] == n
        assert all(b > a for a, b in zip(s.checkpoints, s.checkpoints[1:], strict=False))
        assert s.alpha <= alpha and s.alpha == pytest.approx(alpha, rel=1e-12)
        assert s.alphas[-1] == pytest.approx(alpha / 2)
    assert Schedule.geometric(1000, 0.001).checkpoints == (32, 64, 128, 256, 512, 1000)
    # A checkpoint within √ratio of n is dropped: it would spend α for almost nothing.
    assert Schedule.geometric(1100, 0.001).checkpoints == (32, 64, 128, 256, 512, 1100)
    assert Schedule.geometric(1000, 0.001, first=1000) == Schedule.fixed(1000, 0.001)
    share = Schedule.geometric(1000, 0.001, final_share=0.9)
    assert share.alphas[-1] == pytest.approx(0.0009) and share.alphas[0] == pytest.approx(2e-5)


@pytest.mark.parametrize("kwargs,key", [
    (dict(schedule="adaptive"), "schedule"),
    (dict(schedule="fixed", target_radius=0.1), "target_radius"),
    (dict(schedule="sequential", target_radius=-0.1), "target_radius"),
    (dict(schedule="sequential", radius_tolerance=0.0), "radius_tolerance"),
    (dict(schedule="sequential", first_checkpoint=0), "first_checkpoint"),
    (dict(schedule="sequential", checkpoint_ratio=1.0), "checkpoint_ratio"),
    (dict(schedule="sequential", final_alpha_share=1.0), "final_alpha_share"),
    (dict(schedule="sequential", mode="predict", target_radius=0.1), "target_radius"),
])
def test_bad_settings_name_their_key(kwargs, key):
    schedule = kwargs.pop("schedule")
    with pytest.raises(ConfigError) as err:
        check_settings(schedule, **kwargs)
    assert err.value.key == key


def test_schedule_rejects_unordered_checkpoints():
    with pytest.raises(ConfigError, match="increase strictly"):
        Schedule((64, 32), (0.001, 0.001))
    with pytest.raises(ConfigError, match="one per checkpoint"):
        Schedule((32, 64), (0.001,))


# --- exact agreement with the fixed schedule --------------------------------------------------


@pytest.mark.parametrize("rule,two_class", [
    (L2Radius(0.25), False), (L2Radius(0.25), True),
    (BernoulliHammingRadius(0.2, 12), False), (BernoulliHammingRadius(0.2, 12), True),
])
def test_single_checkpoint_equals_certify_counts_exactly(rule, two_class):
    rng = np.random.default_rng(0)
    estimate = rng.multinomial(500, [0.7, 0.2, 0.1], size=300)  # [300, 3]
    select = rng.multinomial(50, [0.7, 0.2, 0.1], size=300)
    fixed = certify_counts(select, estimate, 0.001, rule, two_class=two_class)
    seq = certify_sequential(select, estimate[None], Schedule.fixed(500, 0.001), rule,
                             stopping=Stopping(target_radius=0.1), two_class=two_class)
    for name in ("prediction", "count_top", "count_runner_up", "p_lower", "p_upper", "radius"):
        np.testing.assert_array_equal(getattr(seq, name), getattr(fixed, name), err_msg=name)
    assert set(seq.stop_reason) <= {"success", "n"} and (seq.samples == 500).all()


def test_single_checkpoint_predict_equals_predict_counts():
    counts = np.random.default_rng(1).multinomial(200, [0.4, 0.35, 0.25], size=200)
    fixed = predict_counts(counts, 0.01)
    seq = predict_sequential(counts[None], Schedule.fixed(200, 0.01))
    np.testing.assert_array_equal(seq.prediction, fixed.prediction)
    np.testing.assert_array_equal(seq.p_value, fixed.p_value)


# --- stopping rules ---------------------------------------------------------------------------


def test_clear_inputs_stop_at_the_first_checkpoint_that_certifies_the_target():
    schedule = Schedule.geometric(1000, 0.001)
    unanimous = np.array([[[c, 0]] for c in schedule.checkpoints])  # [K, 1, 2]
    for target in (0.1, 0.3, 0.6):
        cert = certify_sequential(selected(2, 1), unanimous, schedule, L2Radius(SIGMA),
                                  stopping=Stopping(target_radius=target))
        k = next(i for i, (c, a) in enumerate(zip(schedule.checkpoints, schedule.alphas,
                                                 strict=True))
                 if SIGMA * stats.norm.ppf(a ** (1 / c)) >= target)
        assert cert.stop_reason[0] == "success" and cert.samples[0] == schedule.checkpoints[k]
        assert cert.radius[0] >= target


def test_hopeless_inputs_stop_for_futility_and_abstain():
    schedule = Schedule.geometric(1000, 0.001)
    split = votes(2, [0.3, 0.3, 0.2, 0.2], schedule.checkpoints, trials=200)
    cert = certify_sequential(selected(4, 200), split, schedule, L2Radius(SIGMA))
    assert (cert.stop_reason == "futility").all() and (cert.prediction == ABSTAIN).all()
    # pA = 0.3 < 1/2: every input is decided long before n = 1000 (fixed seed).
    assert cert.samples.max() <= 256 and cert.samples.mean() < 100


def test_the_reported_bound_is_the_best_seen_not_the_last():
    schedule = Schedule((100, 200), (0.0005, 0.0005))
    # 100/100 at n_1 certifies more than 150/200 at n_2 (the same samples, then a bad streak).
    path = np.array([[[100, 0]], [[150, 50]]])
    cert = certify_sequential(selected(2, 1), path, schedule, L2Radius(1.0),
                              stopping=Stopping(radius_tolerance=1e-9))
    first = certify_counts(np.array([1, 0]), np.array([100, 0]), 0.0005, L2Radius(1.0))
    assert cert.samples[0] == 200 and cert.certified_samples[0] == 100
    assert cert.radius[0] == first.radius and cert.count_top[0] == 100


def test_precision_stops_when_little_radius_is_left_to_gain():
    schedule = Schedule.geometric(4000, 0.001)
    path = votes(3, [0.9, 0.1], schedule.checkpoints, trials=300)
    loose = certify_sequential(selected(2, 300), path, schedule, L2Radius(SIGMA),
                               stopping=Stopping(radius_tolerance=0.25 * SIGMA))
    full = certify_sequential(selected(2, 300), path, schedule, L2Radius(SIGMA))
    assert (loose.stop_reason == "precision").mean() > 0.5
    assert loose.samples.mean() < 0.5 * full.samples.mean()
    assert (loose.radius <= full.radius + 0.25 * SIGMA + 1e-12).all()


def test_reachable_radius_bounds_what_optimistic_counts_certify():
    schedule = Schedule.geometric(1000, 0.001)
    reach = reachable_radius(np.array([20, 32]), np.array([12, 0]), 0, schedule, L2Radius(1.0))
    assert reach[1] == pytest.approx(float(stats.norm.ppf(schedule.alphas[-1] ** (1 / 1000))))
    assert 0 < reach[0] < reach[1]
    assert np.isneginf(reachable_radius(np.array([5]), np.array([27]), 0, schedule,
                                        L2Radius(1.0)))[0]


def test_certifier_ignores_inputs_that_already_stopped():
    schedule = Schedule.geometric(1000, 0.001)
    tracker = SequentialCertifier(selected(2, 2), schedule, L2Radius(1.0),
                                  stopping=Stopping(target_radius=0.1))
    stop = tracker.step(np.array([0, 1]), 0, np.array([[32, 0], [20, 12]]))
    np.testing.assert_array_equal(stop, [True, False])
    np.testing.assert_array_equal(tracker.step(np.array([0, 1]), 1, np.array([[0, 64],
                                                                              [40, 24]])),
                                  [True, False])
    assert tracker.results(np.array([0])).samples[0] == 32
    with pytest.raises(ValueError, match="not stopped"):
        tracker.results()


# --- pre-flight helpers -----------------------------------------------------------------------


def test_largest_radius_and_samples_needed_match_the_saturated_table():
    fixed = Schedule.fixed(1000, 0.001)
    assert largest_radius(fixed, L2Radius(1.0)) == pytest.approx(2.4632626147808)
    assert np.isnan(largest_radius(Schedule.fixed(9, 0.001), L2Radius(1.0)))
    assert largest_radius(fixed, BernoulliHammingRadius(0.2, 12)) == 4
    for r in (0.5, 1.0, 2.0, 2.4632):
        expected = int(np.ceil(np.log(0.001) / np.log(stats.norm.cdf(r))))
        assert samples_needed(r, 0.001, L2Radius(1.0)) == expected
    assert samples_needed(0.0, 0.001, L2Radius(1.0)) == 10  # 0.5 ** 10 < 0.001 < 0.5 ** 9


def test_pilot_flags_chance_level_votes_only():
    rng = np.random.default_rng(4)
    chance = rng.multinomial(64, [0.1] * 10, size=8)
    clear = rng.multinomial(64, [0.7] + [0.3 / 9] * 9, size=8)
    assert pilot_hopeless(chance, 1000, 0.001).all()
    assert not pilot_hopeless(clear, 1000, 0.001).any()
    # PREDICT compares the top two classes: at chance the optimistic projection (top at its
    # upper bound, runner-up at its lower one) may still separate them, unless no sample is left.
    assert pilot_hopeless(np.array([[32, 32]]), 64, 0.001, mode="predict").all()
    assert not pilot_hopeless(clear, 1000, 0.001, mode="predict").any()
    assert not pilot_hopeless(clear, 1000, 0.001, two_class=True).any()


# --- soundness by simulation ------------------------------------------------------------------

L2 = L2Radius(SIGMA)
HAMMING = BernoulliHammingRadius(0.2, 12)


def _stopping(kind, target):
    if kind == "target":
        return Stopping(target_radius=target)
    if kind == "tolerance":
        return Stopping(radius_tolerance=0.05 * SIGMA)
    return Stopping()


@pytest.mark.parametrize("stopping", ["futility", "target", "tolerance"])
@pytest.mark.parametrize("p_true", [0.6, 0.9, 0.99])
def test_one_class_l2_over_claims_at_most_alpha(p_true, stopping):
    alpha = 0.05
    schedule = Schedule.geometric(1000, alpha)
    true_radius = SIGMA * stats.norm.ppf(p_true)
    path = votes(int(p_true * 1000), [p_true, 1 - p_true], schedule.checkpoints)
    # With the target at the true radius (plus a hair), every success is an over-claim.
    cert = certify_sequential(selected(2), path, schedule, L2,
                              stopping=_stopping(stopping, true_radius + 1e-12))
    over = int(np.sum(np.nan_to_num(cert.radius, nan=-1.0) > true_radius))
    assert_rate_at_most(over, alpha)
    assert set(cert.stop_reason) <= set(STOP_REASONS)


@pytest.mark.parametrize("stopping", ["futility", "target"])
def test_two_class_l2_over_claims_at_most_alpha(stopping):
    alpha, pa, pb = 0.05, 0.6, 0.3
    schedule = Schedule.geometric(1000, alpha)
    true_radius = SIGMA / 2 * (stats.norm.ppf(pa) - stats.norm.ppf(pb))
    path = votes(11, [pa, pb, 0.05, 0.05], schedule.checkpoints)
    cert = certify_sequential(selected(4), path, schedule, L2, two_class=True,
                              stopping=_stopping(stopping, true_radius + 1e-12))
    assert_rate_at_most(int(np.sum(np.nan_to_num(cert.radius, nan=-1.0) > true_radius)), alpha)


@pytest.mark.parametrize("stopping", ["futility", "target"])
@pytest.mark.parametrize("delta", [1, 2, 3])
def test_hamming_over_claims_at_most_alpha(delta, stopping):
    # pA just below the threshold of radius Δ: the true radius is Δ − 1.
    alpha = 0.05
    schedule = Schedule.geometric(1000, alpha)
    p_true = threshold(HAMMING, delta) - 1e-4
    true_radius = float(HAMMING.radius(np.array(p_true), None))
    assert true_radius == delta - 1
    path = votes(20 + delta, [p_true, 1 - p_true], schedule.checkpoints)
    cert = certify_sequential(selected(2), path, schedule, HAMMING,
                              stopping=_stopping(stopping, float(delta)))
    assert_rate_at_most(int(np.sum(np.nan_to_num(cert.radius, nan=-1.0) > true_radius)), alpha)


def test_over_claims_at_most_alpha_at_the_default_level():
    alpha, p_true = 0.001, 0.99
    schedule = Schedule.geometric(1000, alpha)
    true_radius = SIGMA * stats.norm.ppf(p_true)
    path = votes(30, [p_true, 1 - p_true], schedule.checkpoints)
    cert = certify_sequential(selected(2), path, schedule, L2,
                              stopping=Stopping(target_radius=true_radius + 1e-12))
    assert_rate_at_most(int(np.sum(cert.stop_reason == "success")), alpha)


def test_sequential_predict_errs_at_most_alpha():
    alpha = 0.05
    schedule = Schedule.geometric(1000, alpha)
    # Class 0 is the smoothed prediction; returning class 1 (or 2) is an error.
    pred = predict_sequential(votes(40, [0.46, 0.44, 0.10], schedule.checkpoints), schedule)
    wrong = int(np.sum((pred.prediction != ABSTAIN) & (pred.prediction != 0)))
    assert_rate_at_most(wrong, alpha)


def test_negative_control_full_alpha_at_every_checkpoint_is_caught():
    # Testing every checkpoint at the full α (no union bound) and keeping the best bound is
    # invalid; the same binomial test must reject it, or the tests above prove nothing.
    alpha, p_true = 0.05, 0.9
    valid = Schedule.geometric(1000, alpha)
    naive = Schedule(valid.checkpoints, (alpha,) * len(valid.checkpoints))
    true_radius = SIGMA * stats.norm.ppf(p_true)
    path = votes(50, [p_true, 1 - p_true], valid.checkpoints)
    cert = certify_sequential(selected(2), path, naive, L2,
                              stopping=Stopping(target_radius=true_radius + 1e-12))
    with pytest.raises(AssertionError, match="over-claims"):
        assert_rate_at_most(int(np.sum(cert.stop_reason == "success")), alpha)
