"""Anytime-valid certification with a confidence sequence: bounds that hold at every n at once.

`--schedule sequential` (`cbcert.certify.sequential`) splits α over checkpoints fixed in
advance (union bound). Here the bound on the top class's probability is a *confidence
sequence*: one lower bound ``L_t`` per sample count ``t`` such that

    P(∃ t >= 1 : L_t > p)  <=  α        (p the true probability of the selected class),

so it may be read after every chunk, as often as one likes, at no cost in α; the checkpoints of
an `AnytimeSchedule` only say when the engine looks.

**The martingale.** For a candidate ``p`` and ``k`` votes in ``t`` samples let ``Λ_t(q, p) =
(q/p)^k ((1−q)/(1−p))^(t−k)``, the likelihood ratio of "rate q" against "rate p". Mix it over a
Beta(a, b) prior ``π`` (default Jeffreys, a = b = 1/2: the Krichevsky–Trofimov mixture that
Voráček, NeurIPS 2024, arXiv 2406.17830, uses), *one-sidedly*: alternatives ``q < p`` are
replaced by the constant 1,

    M_t(p) = π(q < p) + ∫_{q >= p} Λ_t(q, p) dπ(q)
           = I_p(a, b) + B(k+a, t−k+b)/B(a, b) · (1 − I_p(k+a, t−k+b)) / (p^k (1−p)^(t−k)).

Under any true rate ``p' <= p`` each ``Λ_t(q, p)`` with ``q >= p`` is a non-negative
supermartingale (one step multiplies it by ``p' q/p + (1−p')(1−q)/(1−p) <= 1``) and ``M_0 = 1``,
so by Ville's inequality ``P(∃ t: M_t(p') >= 1/α) <= α`` at ``p = p'``. ``L_t = inf{p : M_t(p) <
1/α}`` is then a lower confidence sequence. ``M_t`` is non-increasing in ``p`` on ``[0, k/t]``
and below 1 above ``k/t`` (the likelihood increases up to its maximum at ``k/t``), so the
rejected set is an interval ``[0, L_t)`` and bisection finds ``L_t`` exactly (up to a margin that
rounds toward the conservative side). Against the two-sided KT mixture ``∫ Λ_t(q, p) dπ(q)``
(whose interval Voráček's procedure reads) the one-sided mixture is never smaller for ``p <=
k/t`` (there ``Λ_t(q, p) < 1`` for ``q < p``), so ``L_t`` is never below the KT lower bound with
the same prior, on every stream and at every ``t``.

**Optional stopping and class selection.** The event ``{∃ t: L_t > p}`` concerns the whole
infinite sequence of estimation votes, so a certificate read at any time -- chosen by any rule
that looks at the counts, the best one seen, or the last -- is wrong with probability ``<= α``.
The class is picked by the separate selection samples (``n0``) before any estimation vote, so
``p`` is a fixed number for the estimation stream, as in ``CERTIFY``. Two-class certificates use
``α/2`` for ``pA_lower`` and ``α/2`` for the upper sequence of the largest other count, which
bounds every other class at once (the argument of `cbcert.certify.sequential`: the upper bound
grows with the count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special

from cbcert.certify.bounds import bonferroni_split, check_alpha, check_counts
from cbcert.certify.cohen import (
    ABSTAIN,
    Certificate,
    RadiusRule,
    _check_class_counts,
    _runner_up,
)
from cbcert.certify.schedule import Stopping, _error
from cbcert.certify.sequential import SequentialCertifier

JEFFREYS = (0.5, 0.5)
# Default checkpoints: every sample up to 20, then 5 % more samples at each, so a decision is
# read at most ~5 % after the sample that made it (benchmarks/sequential_anchor.py measured
# first 16 / ratio 1.1 at up to 2.2x the samples of a test read after every sample, on inputs
# that are hopeless after a few samples, and 1 / 1.05 within 7 %).
DEFAULT_FIRST_CHECKPOINT = 1
DEFAULT_CHECKPOINT_RATIO = 1.05
# Checkpoints added for a target radius: where an input with up to this many votes against the
# top class first certifies it (`AnytimeSchedule.with_target`).
DEFAULT_TARGET_POINTS = 1024
# Bisection: rejected only when log M exceeds log(1/α) by this much, so that float rounding in
# M can only shrink the bound (ties are decided conservatively).
_LOG_MARGIN = 1e-9
_BISECTIONS = 60
_BELOW_ONE = np.nextafter(1.0, 0.0)


def log_mixture(successes, trials, p, *, prior=JEFFREYS) -> np.ndarray:
    """``log M_t(p)`` of the one-sided Beta-mixture martingale (module docstring); shapes
    broadcast, float64.

    ``M_t(p) = I_p(a, b) + B(k+a, t−k+b)/B(a, b) · I_{1−p}(t−k+b, k+a) / (p^k (1−p)^(t−k))``,
    with ``I`` the regularized incomplete beta function; ``+inf`` at ``p = 0`` when ``k > 0``.

    Args:
      successes: counts ``k``; trials: ``t >= 1``; p: candidate rates in ``[0, 1)``.
      prior: ``(a, b)`` of the Beta prior, both > 0.
    """
    a, b = prior
    k = np.asarray(successes, np.float64)
    t = np.asarray(trials, np.float64)
    p = np.asarray(p, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_lik = special.xlogy(k, p) + special.xlog1py(t - k, -p)  # log p^k (1-p)^(t-k)
        log_tail = (special.betaln(k + a, t - k + b) - special.betaln(a, b)
                    + np.log(special.betainc(t - k + b, k + a, 1.0 - p)) - log_lik)
        return np.logaddexp(np.log(special.betainc(a, b, p)), log_tail)


def mixture_lower(successes, trials, alpha: float, *, prior=JEFFREYS) -> np.ndarray:
    """Anytime-valid lower confidence bound ``L_t = inf{p : M_t(p) < 1/α}``; broadcast shape.

    ``P(∃ t: L_t > p) <= α`` when the votes are i.i.d. Bernoulli(p) (Ville's inequality on the
    one-sided Beta(a, b) mixture martingale; module docstring). Exact bisection on
    ``[0, k/t]``, where ``M_t`` is non-increasing, returning the rejected end (never above the
    exact bound); 0 for ``k = 0``; capped below 1.

    Args:
      successes: integer counts ``k``, any shape broadcastable with ``trials``.
      trials: integer sample counts ``t >= 1``.
      alpha: error level in (0, 1), for all ``t`` together.
      prior: ``(a, b)`` of the Beta prior (default Jeffreys, the KT mixture).

    >>> round(float(mixture_lower(1000, 1000, 0.001)), 4)  # CP at fixed n = 1000: 0.9931
    0.9891
    """
    alpha = check_alpha(alpha)
    k, t = check_counts(successes, trials)
    level = math.log(1.0 / alpha) + _LOG_MARGIN
    low = np.zeros(k.shape)  # rejected (M >= 1/α), or 0
    high = k / t  # M(k/t) <= 1 < 1/α: not rejected
    for _ in range(_BISECTIONS):
        mid = 0.5 * (low + high)
        rejected = log_mixture(k, t, mid, prior=prior) >= level
        low = np.where(rejected, mid, low)
        high = np.where(rejected, high, mid)
    return np.minimum(np.where(k == 0, 0.0, low), _BELOW_ONE)


def mixture_upper(successes, trials, alpha: float, *, prior=JEFFREYS) -> np.ndarray:
    """Anytime-valid upper confidence bound: ``1 − L_t`` of the failures (prior mirrored).

    ``P(∃ t: U_t < p) <= α``. Rounded up by one ulp, so that ``1 − L`` in floating point never
    falls below the exact bound; 1 for ``k = t``.

    >>> round(float(mixture_upper(0, 1000, 0.001)), 4)
    0.0109
    """
    k, t = check_counts(successes, trials)
    lower = mixture_lower(t - k, t, alpha, prior=(prior[1], prior[0]))
    return np.minimum(1.0, np.nextafter(1.0 - lower, 2.0))


@dataclass(frozen=True)
class AnytimeSchedule:
    """When an anytime run looks at the counts, and the one level α of its confidence sequence.

    The checkpoints only decide when a bound is read: the confidence sequence holds at every
    sample count at once, so α is not split among them (contrast `cbcert.certify.schedule.
    Schedule`).

    Attributes:
      checkpoints: strictly increasing sample counts ``n_k >= 1``; the last is the maximum n.
      alpha: error level of every certificate, in (0, 1).
      prior: ``(a, b)`` of the Beta mixture (default Jeffreys).

    >>> AnytimeSchedule.geometric(100, 0.001, first=16, ratio=1.5).checkpoints
    (16, 24, 36, 54, 81, 100)
    """

    checkpoints: tuple[int, ...]
    alpha: float
    prior: tuple[float, float] = JEFFREYS

    def __post_init__(self) -> None:
        checkpoints = tuple(int(c) for c in self.checkpoints)
        if not checkpoints or checkpoints[0] < 1 or any(
                b <= a for a, b in zip(checkpoints, checkpoints[1:], strict=False)):
            raise _error("checkpoints", checkpoints, f"must be increasing integers >= 1, got "
                         f"{list(checkpoints)}")
        check_alpha(self.alpha)
        if not all(float(v) > 0 and math.isfinite(float(v)) for v in self.prior):
            raise _error("prior", self.prior, f"Beta prior parameters must be > 0, got "
                         f"{self.prior}")
        object.__setattr__(self, "checkpoints", checkpoints)

    @property
    def n(self) -> int:
        """The maximum number of estimation samples."""
        return self.checkpoints[-1]

    @classmethod
    def geometric(cls, n: int, alpha: float, *, first: int | None = None,
                  ratio: float | None = None) -> AnytimeSchedule:
        """Checkpoints ``first, ⌈ratio·first⌉, …`` below ``n``, then ``n`` (defaults 1, 1.05;
        each at least one more than the last).

        The checkpoints may depend on anything known before sampling (here ``n`` and the
        options); their spacing only trades how soon a decision is seen against how many
        samples an input gets between two looks.
        """
        first = DEFAULT_FIRST_CHECKPOINT if first is None else first
        ratio = DEFAULT_CHECKPOINT_RATIO if ratio is None else ratio
        points, c = [], int(first)
        while c < n:
            points.append(c)
            c = max(c + 1, math.ceil(c * ratio))
        return cls((*points, int(n)), check_alpha(alpha))

    def with_target(self, target_radius: float, radius_rule: RadiusRule, *,
                    max_failures: int = DEFAULT_TARGET_POINTS) -> AnytimeSchedule:
        """This schedule plus the sample counts at which a target can first be certified.

        ``T_f`` = the least ``t <= n`` whose bound certifies ``target_radius`` with ``f``
        votes against the top class (``radius_rule.radius(L_t(t − f, t)) >= target``), for
        ``f = 0 … max_failures``. An input with ``f`` votes against it when it first reaches
        the target does so exactly at ``T_f`` (the count against only grows, so the target is
        first met when the bound catches up with it), so these checkpoints read a success at the
        very sample that makes it, as a test read after every sample would. They depend on n,
        α, the prior, the rule and the target only -- never on the votes -- and the confidence
        sequence needs no α for them. One-class certificates (the two-class success also
        depends on the runner-up's count).
        """
        failures = np.arange(int(max_failures) + 1)
        n = self.n

        def certifies(t):  # [F] at trials t[F] >= failures
            bound = self.lower(np.maximum(t - failures, 0), np.maximum(t, 1))
            radius = radius_rule.radius(bound, None)
            return (t > failures) & (np.nan_to_num(radius, nan=-np.inf) >= target_radius)

        low, high = failures.copy(), np.full(failures.shape, n + 1)  # fails / certifies (or n+1)
        while np.any(high - low > 1):
            mid = (low + high) // 2
            ok = certifies(np.minimum(mid, n)) & (mid <= n)
            low, high = np.where(ok, low, mid), np.where(ok, mid, high)
        points = {int(t) for t in high if t <= n}
        return AnytimeSchedule(tuple(sorted(points | set(self.checkpoints))), self.alpha,
                               self.prior)

    def lower(self, successes, trials, alpha: float | None = None) -> np.ndarray:
        """`mixture_lower` at this schedule's prior (and α unless given)."""
        return mixture_lower(successes, trials, self.alpha if alpha is None else alpha,
                             prior=self.prior)

    def upper(self, successes, trials, alpha: float | None = None) -> np.ndarray:
        """`mixture_upper` at this schedule's prior (and α unless given)."""
        return mixture_upper(successes, trials, self.alpha if alpha is None else alpha,
                             prior=self.prior)


def certify_counts_anytime(counts_select: np.ndarray, counts_estimate: np.ndarray,
                           schedule: AnytimeSchedule, radius_rule: RadiusRule, *,
                           two_class: bool = False) -> Certificate:
    """``CERTIFY`` of `cbcert.certify.cohen.certify_counts` with the confidence sequence's bounds.

    ``ĉA = argmax counts_select``; ``pA_lower = L_t(nA)`` at α (two-class: ``α/2``, with
    ``pB_upper = U_t(nB)`` of the largest other count at ``α/2``); abstain if ``pA_lower <
    1/2`` (two-class: unless ``pA_lower > pB_upper``). Valid at every ``t`` at once.

    Args:
      counts_select, counts_estimate: ``[..., C]`` integer counts (separate streams).

    Returns:
      `Certificate` with fields ``[...]``.
    """
    select = _check_class_counts(counts_select, "counts_select")
    estimate = _check_class_counts(counts_estimate, "counts_estimate")
    if select.shape != estimate.shape:
        raise ValueError(f"counts_select has shape {select.shape} but counts_estimate has "
                         f"shape {estimate.shape}; they must match")
    top = np.argmax(select, axis=-1)  # [...]
    second = _runner_up(estimate, top)
    t = estimate.sum(axis=-1)
    count_top = np.take_along_axis(estimate, top[..., None], axis=-1)[..., 0]
    count_second = np.take_along_axis(estimate, second[..., None], axis=-1)[..., 0]
    if two_class:
        half = bonferroni_split(schedule.alpha, 2)
        p_lower = schedule.lower(count_top, t, half)
        p_upper = schedule.upper(count_second, t, half)
        abstain = ~(p_lower > p_upper)
        radius = radius_rule.radius(p_lower, p_upper)
    else:
        p_lower = schedule.lower(count_top, t)
        p_upper = 1.0 - p_lower
        abstain = p_lower < 0.5
        radius = radius_rule.radius(p_lower, None)
    return Certificate(prediction=np.where(abstain, ABSTAIN, top).astype(np.int64),
                       count_top=count_top, count_runner_up=count_second, p_lower=p_lower,
                       p_upper=p_upper, radius=np.where(abstain, np.nan, radius))


def projected_radius(count_top, count_runner_up, trials, schedule: AnytimeSchedule,
                     radius_rule: RadiusRule, *, two_class: bool = False) -> np.ndarray:
    """Radius at the last checkpoint ``n`` if the votes kept their optimistic rates ``[m]``.

    The top class's remaining ``n − t`` votes arrive at the rate of its *upper* confidence
    sequence (two-class: the runner-up's at its lower one), then the bound at ``n`` is taken;
    −inf where that abstains. A stopping heuristic only (a wrong guess costs samples or radius,
    never soundness); with more samples the sequence's bounds tighten, so ``n`` is where an
    optimistic continuation certifies the most.
    """
    top = np.asarray(count_top, np.int64)
    t = np.asarray(trials, np.int64)
    n, extra = schedule.n, schedule.n - t
    rate_top = schedule.upper(top, t)
    top_n = np.minimum(n, top + np.ceil(rate_top * extra).astype(np.int64))
    if two_class:
        runner = np.asarray(count_runner_up, np.int64)
        rate_runner = schedule.lower(runner, t)
        runner_n = np.minimum(n - top_n, runner + np.floor(rate_runner * extra).astype(np.int64))
        half = bonferroni_split(schedule.alpha, 2)
        p_lower, p_upper = schedule.lower(top_n, n, half), schedule.upper(runner_n, n, half)
        radius = np.where(p_lower > p_upper, radius_rule.radius(p_lower, p_upper), np.nan)
    else:
        p_lower = schedule.lower(top_n, n)
        radius = np.where(p_lower < 0.5, np.nan, radius_rule.radius(p_lower, None))
    return np.where(np.isnan(radius), -np.inf, radius)


class AnytimeCertifier(SequentialCertifier):
    """Online anytime ``CERTIFY`` of N inputs for one model (`SequentialCertifier`'s interface).

    At each checkpoint the confidence sequence's certificate (`certify_counts_anytime`) is
    taken, the best one seen is kept, and the stopping rules of `Stopping` apply (``success``,
    ``futility`` and ``precision`` judged by `projected_radius`, ``n``). Every certificate it
    can report holds with probability ``>= 1 − α`` simultaneously.
    """

    def __init__(self, counts_select: np.ndarray, schedule: AnytimeSchedule,
                 radius_rule: RadiusRule, *, stopping: Stopping | None = None,
                 two_class: bool = False, uniform: np.ndarray | None = None):
        if uniform is not None:
            raise ValueError("uniform: the anytime schedule has no randomized bound (its "
                             "confidence sequence is not a fixed-n Clopper–Pearson bound)")
        super().__init__(counts_select, schedule, radius_rule, stopping=stopping,
                         two_class=two_class)

    def _certify(self, rows: np.ndarray, counts: np.ndarray, k: int) -> Certificate:
        return certify_counts_anytime(self.select[rows], counts, self.schedule, self.rule,
                                      two_class=self.two_class)

    def _reach(self, cert: Certificate, k: int) -> np.ndarray:
        return projected_radius(cert.count_top, cert.count_runner_up,
                                self.schedule.checkpoints[k], self.schedule, self.rule,
                                two_class=self.two_class)


def certify_anytime(counts_select: np.ndarray, counts_path: np.ndarray,
                    schedule: AnytimeSchedule, radius_rule: RadiusRule, *,
                    stopping: Stopping | None = None, two_class: bool = False):
    """Anytime ``CERTIFY`` from cumulative counts ``[K, N, C]`` at the schedule's checkpoints.

    As `cbcert.certify.sequential.certify_sequential`, with the confidence sequence's bounds.
    Returns a `SequentialCertificate` ``[N]``, wrong with probability ``<= schedule.alpha`` per
    input whatever the stopping rule.
    """
    tracker = AnytimeCertifier(counts_select, schedule, radius_rule, stopping=stopping,
                               two_class=two_class)
    path = np.asarray(counts_path)
    if path.ndim != 3 or path.shape[0] != len(schedule.checkpoints):
        raise ValueError(f"counts_path has shape {path.shape}; expected [K="
                         f"{len(schedule.checkpoints)}, N, C]")
    rows = np.arange(path.shape[1])
    for k in range(path.shape[0]):
        live = rows[~tracker.done]
        if live.size == 0:
            break
        tracker.step(live, k, path[k, live])
    return tracker.results()


def largest_radius_anytime(schedule: AnytimeSchedule, radius_rule: RadiusRule, *,
                           two_class: bool = False) -> float:
    """Largest radius the schedule can certify: unanimous votes at ``n`` (the bounds tighten
    with t); NaN when even those abstain."""
    cert = certify_counts_anytime(np.array([[1, 0]]), np.array([[schedule.n, 0]]), schedule,
                                  radius_rule, two_class=two_class)
    return float(cert.radius[0])


def samples_needed_anytime(radius: float, alpha: float, radius_rule: RadiusRule, *,
                           two_class: bool = False, prior=JEFFREYS) -> int | None:
    """Smallest ``n`` whose unanimous votes certify ``radius`` under the confidence sequence
    (bisection); None if no ``n < 2³¹`` does."""
    def certifies(n: int) -> bool:
        schedule = AnytimeSchedule((n,), alpha, prior)
        value = largest_radius_anytime(schedule, radius_rule, two_class=two_class)
        return bool(np.nan_to_num(value, nan=-np.inf) >= radius)

    high = 1
    while not certifies(high):
        if high >= 2**30:
            return None
        high *= 2
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if certifies(mid) else (mid, high)
    return high


__all__ = [
    "DEFAULT_CHECKPOINT_RATIO", "DEFAULT_FIRST_CHECKPOINT", "JEFFREYS", "AnytimeCertifier",
    "AnytimeSchedule", "certify_anytime", "certify_counts_anytime", "largest_radius_anytime",
    "log_mixture", "mixture_lower", "mixture_upper", "projected_radius",
    "samples_needed_anytime",
]
