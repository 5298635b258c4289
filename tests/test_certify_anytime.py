"""The anytime schedule: the confidence sequence's bounds, its soundness at every sample and
under the stopping rules, and its settings.

Soundness is checked by fixed-seed simulation (pure numpy). A *crossing* is a stream on which
the lower bound ever exceeds the true probability (read after every sample, up to ``T``); an
*over-claim* is a certificate whose radius exceeds the true radius. Each count X is tested with a
one-sided exact binomial test of "rate <= α": it fails when ``P[Bin(trials, α) >= X] < 1e-6``,
so a sound procedure fails a configuration with probability < 10⁻⁶ (the seeds are fixed, so
the outcome is deterministic). A negative control shows the test catches a bound that is valid
at each fixed n but not at all n at once (pointwise Clopper–Pearson).
"""

import doctest
import math

import numpy as np
import pytest
from scipy import special, stats

import cbcert.certify.anytime
from cbcert.certify.anytime import (
    AnytimeSchedule,
    certify_anytime,
    certify_counts_anytime,
    largest_radius_anytime,
    log_mixture,
    mixture_lower,
    mixture_upper,
    samples_needed_anytime,
)
from cbcert.certify.bounds import clopper_pearson_lower
from cbcert.certify.hamming import BernoulliHammingRadius
from cbcert.certify.l2 import L2Radius
from cbcert.certify.schedule import Stopping, check_settings
from cbcert.certify.sequential import STOP_REASONS
from cbcert.schema import ConfigError

FAILURE_PROBABILITY = 1e-6
SIGMA = 0.5


def assert_rate_at_most(events: int, alpha: float, trials: int) -> None:
    p_value = stats.binom.sf(events - 1, trials, alpha)  # P[Bin(trials, alpha) >= events]
    assert p_value >= FAILURE_PROBABILITY, (
        f"{events} in {trials} trials at α = {alpha} (p = {p_value:.2g})")


def first_count(rejects, p: float, horizon: int) -> np.ndarray:
    """``S[t]``, t = 1…T: the least count above ``p·t`` with ``rejects(c, t)`` (monotone in c),
    t + 1 if none."""
    t = np.arange(1, horizon + 1)
    low, high = np.floor(p * t).astype(np.int64), t + 1  # not rejecting / rejecting (or t + 1)
    while np.any(high - low > 1):
        mid = (low + high) // 2
        ok = rejects(np.minimum(mid, t), t) & (mid <= t)
        low, high = np.where(ok, low, mid), np.where(ok, mid, high)
    return high


def first_count_rejecting(p: float, alpha: float, horizon: int) -> np.ndarray:
    """``S[t]``: the least count with ``L_t > p`` (``M_t(p) >= 1/α`` above ``p·t``)."""
    level = math.log(1 / alpha) + 1e-9
    return first_count(lambda c, t: log_mixture(c, t, p) >= level, p, horizon)


# --- the bounds ------------------------------------------------------------------------------


def test_bounds_bracket_the_estimate_and_grow_with_the_count():
    t = 500
    k = np.arange(t + 1)
    lower, upper = mixture_lower(k, t, 0.001), mixture_upper(k, t, 0.001)
    assert np.all(lower <= k / t) and np.all(upper >= k / t)
    assert np.all(np.diff(lower) > 0) and np.all(np.diff(upper) > 0)
    assert lower[0] == 0.0 and upper[-1] == 1.0 and lower[-1] < 1.0


def test_the_lower_bound_is_exactly_where_the_martingale_falls_below_one_over_alpha():
    k, t, alpha = np.array([7, 300, 9_990, 100_000]), np.array([10, 400, 10_000, 100_000]), 0.01
    lower = mixture_lower(k, t, alpha)
    assert np.all(log_mixture(k, t, lower) >= math.log(1 / alpha))
    assert np.all(log_mixture(k, t, np.nextafter(lower, 1) + 1e-12) < math.log(1 / alpha) + 1e-6)


def test_never_below_the_two_sided_kt_mixture_and_monotone_below_the_estimate():
    # The two-sided KT (Jeffreys) mixture bound of Voráček (2024), by bisection on its
    # convex log-martingale; the one-sided mixture rejects at least as much.
    rng = np.random.default_rng(0)
    t = rng.integers(1, 20_000, 300)
    k = rng.binomial(t, rng.uniform(0.3, 1.0, t.size))
    alpha = 0.001

    def log_kt(p):
        return (special.betaln(k + 0.5, t - k + 0.5) - special.betaln(0.5, 0.5)
                - special.xlogy(k, p) - special.xlog1py(t - k, -p))

    low, high = np.zeros(t.size), k / t
    for _ in range(60):
        mid = (low + high) / 2
        rejected = log_kt(mid) >= math.log(1 / alpha)
        low, high = np.where(rejected, mid, low), np.where(rejected, high, mid)
    assert np.all(mixture_lower(k, t, alpha) >= low)
    grid = np.linspace(0, 1, 41)[1:-1][:, None] * (k / t)  # [p, inputs] below k/t
    values = log_mixture(k, t, grid)
    assert np.all(np.diff(values, axis=0) <= 1e-9)


def test_saturated_bounds_need_a_few_more_samples_than_a_fixed_n_bound():
    # Unanimous votes: the sequence pays ~½ ln(πt) against Clopper–Pearson's α^(1/n).
    for n in (100, 1000, 100_000):
        cs, cp = mixture_lower(n, n, 0.001), clopper_pearson_lower(n, n, 0.001)
        assert cs < cp
        assert math.log(cs) * n == pytest.approx(math.log(0.001 / math.sqrt(math.pi * n)),
                                                 rel=0.02)
    assert samples_needed_anytime(0.0, 0.001, L2Radius(1.0)) == 13


# --- soundness -------------------------------------------------------------------------------


@pytest.mark.parametrize("p,alpha", [(0.5, 0.05), (0.9, 0.05), (0.99, 0.05), (0.7, 0.01)])
def test_the_lower_bound_exceeds_the_truth_at_some_sample_with_probability_at_most_alpha(
        p, alpha):
    streams, horizon = 4_000, 2_000
    threshold = first_count_rejecting(p, alpha, horizon)  # [T]
    rng = np.random.default_rng(int(1000 * p))
    counts = np.cumsum(rng.random((streams, horizon), np.float32) < p, axis=1)  # [N, T]
    crossed = int(np.any(counts >= threshold, axis=1).sum())
    assert_rate_at_most(crossed, alpha, streams)


def test_negative_control_pointwise_clopper_pearson_is_caught():
    streams, horizon, p, alpha = 4_000, 2_000, 0.9, 0.05
    threshold = first_count(lambda c, t: clopper_pearson_lower(c, t, alpha) > p, p, horizon)
    rng = np.random.default_rng(9)
    counts = np.cumsum(rng.random((streams, horizon), np.float32) < p, axis=1)
    crossed = int(np.any(counts >= threshold, axis=1).sum())
    with pytest.raises(AssertionError):
        assert_rate_at_most(crossed, alpha, streams)


def votes(seed, probs, checkpoints, trials):
    rng = np.random.default_rng(seed)
    steps = np.diff((0, *checkpoints))
    return np.cumsum(np.stack([rng.multinomial(s, probs, size=trials) for s in steps]), axis=0)


def selected(num_classes, trials):
    select = np.zeros((trials, num_classes), np.int64)
    select[:, 0] = 1
    return select


@pytest.mark.parametrize("stopping", [Stopping(), Stopping(target_radius=SIGMA / 2),
                                      Stopping(radius_tolerance=SIGMA / 4)])
def test_one_class_l2_over_claims_at_most_alpha(stopping):
    trials, alpha = 3_000, 0.05
    schedule = AnytimeSchedule.geometric(1000, alpha, first=16, ratio=2.0)
    p_true = float(stats.norm.cdf(0.5)) - 1e-9  # true radius just below σ/2
    path = votes(1, [p_true, 1 - p_true], schedule.checkpoints, trials)
    cert = certify_anytime(selected(2, trials), path, schedule, L2Radius(SIGMA),
                           stopping=stopping)
    over = np.nan_to_num(cert.radius, nan=-1.0) >= SIGMA / 2
    assert_rate_at_most(int(over.sum()), alpha, trials)
    assert set(cert.stop_reason) <= set(STOP_REASONS)
    assert np.all(cert.certified_samples <= cert.samples)


def test_two_class_and_hamming_over_claim_at_most_alpha():
    trials, alpha = 2_500, 0.05
    schedule = AnytimeSchedule.geometric(800, alpha, first=16, ratio=2.0)
    rule = L2Radius(SIGMA)
    probs = [0.6, 0.3, 0.1]
    true = SIGMA / 2 * (stats.norm.ppf(0.6) - stats.norm.ppf(0.3))
    path = votes(2, probs, schedule.checkpoints, trials)
    cert = certify_anytime(selected(3, trials), path, schedule, rule, two_class=True,
                           stopping=Stopping(target_radius=true))
    assert_rate_at_most(int((np.nan_to_num(cert.radius, nan=-1.0) > true).sum()), alpha, trials)
    hamming = BernoulliHammingRadius(0.2, 8)
    p_true = 0.9  # true Hamming radius: the largest Δ whose threshold 0.9 clears
    radius_true = float(hamming.radius(np.array(p_true), None))
    path = votes(3, [p_true, 1 - p_true], schedule.checkpoints, trials)
    cert = certify_anytime(selected(2, trials), path, schedule, hamming,
                           stopping=Stopping(target_radius=radius_true + 1))
    over = np.nan_to_num(cert.radius, nan=-1.0) > radius_true
    assert_rate_at_most(int(over.sum()), alpha, trials)


# --- stopping and settings -------------------------------------------------------------------


def test_clear_inputs_succeed_early_and_hopeless_inputs_stop_for_futility():
    schedule = AnytimeSchedule.geometric(10_000, 0.001)
    rule = L2Radius(SIGMA)
    path = np.array([[[c, 0], [c // 2, c - c // 2]] for c in schedule.checkpoints])  # [K, 2, 2]
    cert = certify_anytime(selected(2, 2), path, schedule, rule,
                           stopping=Stopping(target_radius=SIGMA))
    assert list(cert.stop_reason) == ["success", "futility"]
    assert cert.samples[0] < 100 and cert.samples[1] < 100
    assert cert.radius[0] >= SIGMA and np.isnan(cert.radius[1])


def test_certificate_fields_match_the_bounds():
    schedule = AnytimeSchedule((50, 100), 0.01)
    cert = certify_counts_anytime(np.array([[0, 9, 1]]), np.array([[5, 90, 5]]), schedule,
                                  L2Radius(1.0), two_class=True)
    assert int(cert.prediction[0]) == 1 and int(cert.count_runner_up[0]) == 5
    assert cert.p_lower[0] == mixture_lower(90, 100, 0.005)
    assert cert.p_upper[0] == mixture_upper(5, 100, 0.005)
    assert largest_radius_anytime(schedule, L2Radius(1.0)) == pytest.approx(
        float(stats.norm.ppf(mixture_lower(100, 100, 0.01))))


def test_module_doctests_run():
    result = doctest.testmod(cbcert.certify.anytime)
    assert result.attempted > 0 and result.failed == 0


def test_anytime_settings_are_checked_naming_the_key():
    check_settings("anytime", n=1000, target_radius=0.5, first_checkpoint=4,
                   checkpoint_ratio=1.1)
    for kwargs, key in ((dict(final_alpha_share=0.5), "final_alpha_share"),
                        (dict(mode="predict"), "schedule"),
                        (dict(n=10, first_checkpoint=20), "first_checkpoint"),
                        (dict(checkpoint_ratio=1.0), "checkpoint_ratio")):
        with pytest.raises(ConfigError) as err:
            check_settings("anytime", **kwargs)
        assert err.value.key == key
    assert AnytimeSchedule.geometric(1000, 0.01).checkpoints[:3] == (1, 2, 3)


def test_target_points_read_a_success_at_the_sample_that_makes_it():
    # Every stream's first certification at r, read after every sample, is a checkpoint of
    # with_target (for streams with at most max_failures votes against).
    base = AnytimeSchedule.geometric(3000, 0.01, first=16, ratio=2.0)
    rule, r = L2Radius(1.0), 1.0
    schedule = base.with_target(r, rule, max_failures=400)
    assert set(base.checkpoints) <= set(schedule.checkpoints)
    p0 = float(stats.norm.cdf(r))
    first = first_count(lambda c, t: log_mixture(c, t, p0) >= math.log(100) + 1e-9, p0, 3000)
    rng = np.random.default_rng(4)
    counts = np.cumsum(rng.random((300, 3000)) < 0.95, axis=1)
    hit = counts >= first  # [N, T]
    times = np.argmax(hit, axis=1)[hit.any(axis=1)] + 1
    assert times.size > 250 and set(times.tolist()) <= set(schedule.checkpoints)
