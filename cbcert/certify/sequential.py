"""Anytime-valid sequential ``CERTIFY`` and ``PREDICT`` over checkpoints fixed in advance.

Cohen et al.'s ``CERTIFY`` (``cbcert.certify.cohen``) spends the same ``n`` estimation samples
on every input, although an input whose votes are unanimous, or hopelessly split, is decided
after a few hundred. Here the estimation counts are examined at checkpoints
``n_1 < n_2 < … < n_K <= n``, checkpoint ``k`` at level ``α_k`` with ``Σ_k α_k <= α``
(a `Schedule`).

**Why the certificate stays valid.** Fix the true class probabilities. Let ``E_k`` be the event
that a Clopper–Pearson bound computed at checkpoint ``k`` is wrong (``pA < pA_lower_k``, or,
two-class, ``pB > pB_upper_k``). Because ``n_k`` and ``α_k`` are constants, chosen before any
sample is drawn, ``P(E_k) <= α_k`` exactly as for a fixed-n test, and the union bound gives
``P(E_1 ∪ … ∪ E_K) <= Σ_k α_k <= α``. Outside that event *every* bound of *every* checkpoint
holds at once -- including the checkpoints a run never reached, since the event concerns the
whole (hypothetical) sequence of samples. So a certificate taken from any checkpoint, at a time
chosen by any rule that looks at the counts, is wrong with probability at most α: the run may
stop when it likes and report the radius of the best lower bound it has seen. What would break
this is a schedule that depends on the data (checkpoints or levels picked after looking at
counts): `Schedule` depends only on ``n``, ``α`` and its options. The selection samples
(``n0``) that pick the top class stay a separate, independent stream, as in ``CERTIFY``; with
the single checkpoint ``n`` at level α everything here is exactly ``certify_counts``.

Stopping rules (`Stopping`) decide only *when* to stop, never what is certified:

* ``success``: the best radius so far reaches ``target_radius``;
* ``futility``: even optimistically the target is out of reach, or no later checkpoint can
  improve the best radius (with no target: nothing will ever be certified). "Optimistically"
  projects the top count at the rate of its Clopper–Pearson *upper* bound (and, two-class, the
  runner-up at its lower bound) to every later checkpoint and takes the largest radius;
* ``precision``: that optimistic radius exceeds the best radius by at most
  ``radius_tolerance``;
* ``n``: the last checkpoint.

Sequential ``PREDICT`` tests the top two counts at every checkpoint at level ``α_k`` and returns
the first significant top class: it returns a class other than the smoothed classifier's only if
the test at some checkpoint errs, with probability ``<= Σ_k α_k <= α``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from cbcert.certify.bounds import (
    binomial_test_half,
    bonferroni_split,
    check_alpha,
    clopper_pearson_lower,
    clopper_pearson_upper,
)
from cbcert.certify.cohen import ABSTAIN, Certificate, RadiusRule, certify_counts, predict_counts
from cbcert.schema import ConfigError

# Default first checkpoint: unanimous votes at 32 samples already certify R/σ ≈ 0.7 at
# α_1 = 10⁻⁴, and hopeless inputs (top class near 1/C) are recognised.
DEFAULT_FIRST_CHECKPOINT = 32
DEFAULT_CHECKPOINT_RATIO = 2.0
# Default share of α spent at the last checkpoint n: a run that goes to n loses little radius
# against the fixed schedule (saturated n = 1000, α = 0.001: R/σ 2.463 → 2.429 at 1/2).
DEFAULT_FINAL_SHARE = 0.5
STOP_REASONS = ("success", "futility", "precision", "n")


def _error(key: str, value, detail: str, allowed: str | None = None) -> ConfigError:
    return ConfigError(f"key '{key}': {detail}", key=key, value=value, allowed=allowed,
                       detail=detail)


@dataclass(frozen=True)
class Schedule:
    """Checkpoints ``n_1 < … < n_K`` and their levels ``α_1 … α_K`` (fixed before sampling).

    Attributes:
      checkpoints: strictly increasing sample counts ``n_k >= 1``; the last is the maximum n.
      alphas: level of each checkpoint's bounds, each in (0, 1); ``alpha = Σ α_k``.

    >>> Schedule.geometric(1000, 0.001).checkpoints
    (32, 64, 128, 256, 512, 1000)
    >>> Schedule.fixed(1000, 0.001)
    Schedule(checkpoints=(1000,), alphas=(0.001,))
    """

    checkpoints: tuple[int, ...]
    alphas: tuple[float, ...]

    def __post_init__(self) -> None:
        checkpoints = tuple(self.checkpoints)
        if not checkpoints or any(
            not isinstance(c, int | np.integer) or isinstance(c, bool) or c < 1
            for c in checkpoints
        ):
            raise _error("checkpoints", checkpoints, f"expected integers >= 1, got "
                         f"{list(checkpoints)}")
        if any(b <= a for a, b in zip(checkpoints, checkpoints[1:], strict=False)):
            raise _error("checkpoints", checkpoints,
                         f"must increase strictly, got {list(checkpoints)}")
        alphas = tuple(float(a) for a in self.alphas)
        if len(alphas) != len(checkpoints):
            raise _error("alphas", alphas, f"{len(alphas)} levels for {len(checkpoints)} "
                         "checkpoints; give one per checkpoint")
        for a in alphas:
            check_alpha(a)
        if math.fsum(alphas) >= 1.0:
            raise _error("alphas", alphas, f"sum {math.fsum(alphas)} must be below 1")
        object.__setattr__(self, "checkpoints", tuple(int(c) for c in checkpoints))
        object.__setattr__(self, "alphas", alphas)

    @property
    def n(self) -> int:
        """The maximum number of estimation samples, ``n_K``."""
        return self.checkpoints[-1]

    @property
    def alpha(self) -> float:
        """``Σ_k α_k``: the probability that any bound of any checkpoint is wrong is at most it."""
        return math.fsum(self.alphas)

    @classmethod
    def fixed(cls, n: int, alpha: float) -> Schedule:
        """The fixed-n ``CERTIFY`` schedule: one checkpoint ``n`` at level ``α``."""
        return cls((int(n),), (check_alpha(alpha),))

    @classmethod
    def geometric(cls, n: int, alpha: float, *, first: int | None = None,
                  ratio: float | None = None, final_share: float | None = None) -> Schedule:
        """Geometric checkpoints ``n_1 = first``, ``n_{k+1} = ⌈ratio · n_k⌉``, … ``n_K = n``.

        An intermediate checkpoint closer to ``n`` than a factor ``√ratio`` is dropped (it
        would spend α for almost no saving). Levels: ``α_K = s·α`` at ``n`` (``s`` =
        ``final_share``) and ``α_k = (1 − s)·α / (K−1)`` at each earlier checkpoint, so
        ``Σ α_k = α`` (rounded down to stay ``<= α`` in floating point). ``first >= n`` gives
        `fixed`. Depends only on ``n``, ``α`` and the options -- never on data -- as the union
        bound requires.

        Args:
          n: maximum estimation samples, ``>= 1``.
          alpha: total error level in (0, 1).
          first: first checkpoint (default 32).
          ratio: growth factor ``> 1`` (default 2).
          final_share: share of α spent at ``n``, in (0, 1) (default 1/2). A larger share
            loses less radius on inputs that need all n samples, a smaller one stops clear
            inputs a little earlier (the samples a bound needs grow like ``ln(1/α_k)``).
        """
        alpha = check_alpha(alpha)
        first = DEFAULT_FIRST_CHECKPOINT if first is None else first
        ratio = DEFAULT_CHECKPOINT_RATIO if ratio is None else ratio
        share = DEFAULT_FINAL_SHARE if final_share is None else final_share
        check_schedule_options(first, ratio, share)
        if first >= n:
            return cls.fixed(n, alpha)
        checkpoints = []
        c = int(first)
        while c < n:
            checkpoints.append(c)
            c = max(c + 1, math.ceil(c * ratio))
        while len(checkpoints) > 1 and n < checkpoints[-1] * math.sqrt(ratio):
            checkpoints.pop()
        checkpoints.append(int(n))
        early = len(checkpoints) - 1
        alphas = [alpha * (1 - share) / early] * early + [alpha * share]
        while math.fsum(alphas) > alpha:
            alphas[-1] = float(np.nextafter(alphas[-1], 0.0))
        return cls(tuple(checkpoints), tuple(alphas))

    @classmethod
    def of(cls, kind: str, n: int, alpha: float, *, first: int | None = None,
           ratio: float | None = None, final_share: float | None = None) -> Schedule:
        """The schedule of a run: ``fixed`` or ``sequential`` (`geometric`)."""
        if kind == "fixed":
            return cls.fixed(n, alpha)
        if kind == "sequential":
            return cls.geometric(n, alpha, first=first, ratio=ratio, final_share=final_share)
        raise _error("schedule", kind, f"got {kind!r}, allowed: fixed, sequential",
                     "fixed, sequential")


def check_schedule_options(first, ratio, final_share=None) -> None:
    """Raise `ConfigError` (keys ``first_checkpoint``, ``checkpoint_ratio``,
    ``final_alpha_share``) for options outside their ranges (None = default)."""
    if first is not None and (not isinstance(first, int | np.integer) or isinstance(first, bool)
                              or not 1 <= first < 2**31):
        raise _error("first_checkpoint", first, f"expected an integer in [1, 2**31), got "
                     f"{first!r}", "[1, 2**31)")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float)
                              or not math.isfinite(ratio) or not 1.0 < ratio <= 1e6):
        raise _error("checkpoint_ratio", ratio, f"expected a number in (1, 1e6], got "
                     f"{ratio!r}", "(1, 1e6]")
    if final_share is not None and (isinstance(final_share, bool)
                                    or not isinstance(final_share, int | float)
                                    or not 0.0 < final_share < 1.0):
        raise _error("final_alpha_share", final_share, f"expected a number in (0, 1), got "
                     f"{final_share!r}", "(0, 1)")


SCHEDULES = ("fixed", "sequential")
# The settings of a sequential run besides ``schedule`` (None: the default; off for stopping).
SEQUENTIAL_KEYS = ("target_radius", "radius_tolerance", "first_checkpoint", "checkpoint_ratio",
                   "final_alpha_share")


def check_settings(schedule: str, *, mode: str = "certify", **settings) -> None:
    """Raise `ConfigError` (naming the key) unless the schedule settings are valid together.

    ``schedule`` must be ``fixed`` or ``sequential``; ``settings`` are the `SEQUENTIAL_KEYS`
    (None = unset), checked against their ranges, refused with the fixed schedule (which
    would ignore them) and, for ``target_radius``/``radius_tolerance``, with ``PREDICT``.
    """
    if schedule not in SCHEDULES:
        raise _error("schedule", schedule, f"got {schedule!r}, allowed: fixed, sequential",
                     "fixed, sequential")
    unknown = set(settings) - set(SEQUENTIAL_KEYS)
    if unknown:
        raise ValueError(f"unknown schedule settings {sorted(unknown)}")
    Stopping(settings.get("target_radius"), settings.get("radius_tolerance"))
    check_schedule_options(settings.get("first_checkpoint"), settings.get("checkpoint_ratio"),
                           settings.get("final_alpha_share"))
    for key in SEQUENTIAL_KEYS:
        value = settings.get(key)
        if value is None:
            continue
        if schedule == "fixed":
            raise _error(key, value, f"got {value!r}, which only the sequential schedule uses")
        if mode == "predict" and key in ("target_radius", "radius_tolerance"):
            raise _error(key, value, f"got {value!r}; PREDICT certifies no radius")


@dataclass(frozen=True)
class Stopping:
    """When a sequential run stops early (never what it certifies).

    Attributes:
      target_radius: stop once certified at this radius (``success``), or once even the
        optimistic projection cannot reach it (``futility``); None: no target.
      radius_tolerance: stop once the optimistic radius exceeds the best certified radius by at
        most this much (``precision``); None: off.
    """

    target_radius: float | None = None
    radius_tolerance: float | None = None

    def __post_init__(self) -> None:
        for key, low_open in (("target_radius", False), ("radius_tolerance", True)):
            value = getattr(self, key)
            if value is None:
                continue
            ok = (isinstance(value, int | float) and not isinstance(value, bool)
                  and math.isfinite(value) and (value > 0 if low_open else value >= 0))
            if not ok:
                allowed = "(0, inf)" if low_open else "[0, inf)"
                raise _error(key, value, f"expected a number in {allowed}, got {value!r}",
                             allowed)


@dataclass(frozen=True)
class SequentialCertificate(Certificate):
    """`Certificate` of the best checkpoint seen, plus how the run stopped; fields ``[N]``.

    Attributes (besides `Certificate`'s, which are those of the reported checkpoint):
      samples: estimation samples drawn before stopping (the stopping checkpoint ``n_k``).
      certified_samples: ``n_k`` of the checkpoint whose bounds are reported.
      stop_reason: ``success``, ``futility``, ``precision`` or ``n`` (object array of str).
    """

    samples: np.ndarray
    certified_samples: np.ndarray
    stop_reason: np.ndarray


@dataclass(frozen=True)
class SequentialPrediction:
    """Result of sequential ``PREDICT``; every field ``[N]``.

    Attributes:
      prediction: the first significant top class, ``ABSTAIN`` if none by the stop.
      count_top, count_runner_up, p_value: the test at the stopping checkpoint.
      samples: samples drawn before stopping; stop_reason: ``success`` (significant),
        ``futility`` (cannot become significant) or ``n``.
    """

    prediction: np.ndarray
    count_top: np.ndarray
    count_runner_up: np.ndarray
    p_value: np.ndarray
    samples: np.ndarray
    stop_reason: np.ndarray


def _as_key(radius: np.ndarray) -> np.ndarray:
    """Radius with abstentions (NaN) as −inf, so that any certificate beats abstaining."""
    return np.where(np.isnan(radius), -np.inf, radius)


def _projected_radius(top, runner_up, trials, level, n_later, alpha_later, rule, two_class):
    """Radius at a later checkpoint if the counts grew at their optimistic rates ``[m]``.

    The top class's remaining votes arrive at the rate of its Clopper–Pearson upper bound and
    (two-class) the runner-up's at its lower bound, both at ``level``; a heuristic for stopping
    only, never a certificate.
    """
    extra = n_later - trials
    rate_top = clopper_pearson_upper(top, trials, level)
    top_later = np.minimum(n_later, top + np.ceil(rate_top * extra).astype(np.int64))
    if not two_class:
        p_lower = clopper_pearson_lower(top_later, n_later, alpha_later)
        return np.where(p_lower < 0.5, np.nan, rule.radius(p_lower, None))
    rate_runner = clopper_pearson_lower(runner_up, trials, level)
    runner_later = np.minimum(n_later - top_later,
                              runner_up + np.floor(rate_runner * extra).astype(np.int64))
    half = bonferroni_split(alpha_later, 2)
    p_lower = clopper_pearson_lower(top_later, n_later, half)
    p_upper = clopper_pearson_upper(runner_later, n_later, half)
    return np.where(p_lower > p_upper, rule.radius(p_lower, p_upper), np.nan)


def reachable_radius(count_top: np.ndarray, count_runner_up: np.ndarray, k: int,
                     schedule: Schedule, radius_rule: RadiusRule, *,
                     two_class: bool = False) -> np.ndarray:
    """Largest radius any checkpoint after ``k`` could certify, optimistically; ``[m]``.

    For each later checkpoint ``j``: the counts at ``n_k`` projected to ``n_j`` (see
    `_projected_radius`, at level ``α_k``), certified at ``α_j``. −inf where every later
    checkpoint would abstain, and after the last checkpoint.

    Args:
      count_top, count_runner_up: ``[m]`` estimation counts at checkpoint ``k``.
      k: checkpoint index (0-based).
    """
    top = np.asarray(count_top, np.int64)
    best = np.full(top.shape, -np.inf)
    trials, level = schedule.checkpoints[k], schedule.alphas[k]
    for n_later, alpha_later in zip(schedule.checkpoints[k + 1:], schedule.alphas[k + 1:],
                                    strict=True):
        radius = _projected_radius(top, np.asarray(count_runner_up, np.int64), trials, level,
                                   n_later, alpha_later, radius_rule, two_class)
        best = np.maximum(best, _as_key(radius))
    return best


class SequentialCertifier:
    """Online sequential ``CERTIFY`` of N inputs for one model: feed counts as checkpoints pass.

    ``step(rows, k, counts)`` takes the estimation counts of inputs ``rows`` over their first
    ``n_k`` samples, certifies them at ``α_k`` exactly as ``certify_counts``, keeps the best
    certificate seen (largest radius, then largest ``pA_lower``, ties to the later checkpoint)
    and returns which of them stop. `results` gives the `SequentialCertificate` of all inputs
    of the inputs that stopped. The engine's continuous sampler
    (``cbcert.engine.continuous``) and `certify_sequential` drive it.
    """

    def __init__(self, counts_select: np.ndarray, schedule: Schedule, radius_rule: RadiusRule,
                 *, stopping: Stopping = Stopping(), two_class: bool = False):
        self.select = np.asarray(counts_select)
        if self.select.ndim != 2:
            raise ValueError(f"counts_select has shape {self.select.shape}; expected [N, C]")
        self.schedule, self.rule = schedule, radius_rule
        self.stopping, self.two_class = stopping, two_class
        num = self.select.shape[0]
        self.done = np.zeros(num, bool)
        self.best_radius = np.full(num, -np.inf)
        self.best_p_lower = np.full(num, -np.inf)
        self.fields = {f.name: None for f in fields(Certificate)}
        self.samples = np.zeros(num, np.int64)
        self.certified_samples = np.zeros(num, np.int64)
        self.stop_reason = np.full(num, "", object)

    def step(self, rows, k: int, counts: np.ndarray) -> np.ndarray:
        """Take checkpoint ``k``'s counts ``[m, C]`` of inputs ``rows[m]``; return stop ``[m]``.

        Inputs that already stopped are ignored (their entry is True).
        """
        rows = np.asarray(rows, np.int64)
        counts = np.asarray(counts)
        stop = self.done[rows].copy()
        live = ~stop
        if not live.any():
            return stop
        r, c = rows[live], counts[live]
        schedule, last = self.schedule, k == len(self.schedule.checkpoints) - 1
        trials = schedule.checkpoints[k]
        if np.any(c.sum(axis=-1) != trials):
            raise ValueError(f"checkpoint {k} needs {trials} samples per input; got "
                             f"{sorted(set(c.sum(axis=-1).tolist()))}")
        cert = certify_counts(self.select[r], c, schedule.alphas[k], self.rule,
                              two_class=self.two_class)
        key = _as_key(cert.radius)
        better = (key > self.best_radius[r]) | (
            (key == self.best_radius[r]) & (cert.p_lower >= self.best_p_lower[r]))
        for name in self.fields:
            value = getattr(cert, name)
            if self.fields[name] is None:
                self.fields[name] = np.zeros(self.select.shape[0], value.dtype)
            self.fields[name][r[better]] = value[better]
        self.best_radius[r[better]] = key[better]
        self.best_p_lower[r[better]] = cert.p_lower[better]
        self.certified_samples[r[better]] = trials

        best = self.best_radius[r]
        target, tolerance = self.stopping.target_radius, self.stopping.radius_tolerance
        if last:
            reach = np.full(r.shape, -np.inf)
        else:
            reach = reachable_radius(cert.count_top, cert.count_runner_up, k, schedule,
                                     self.rule, two_class=self.two_class)
        success = np.zeros(r.shape, bool) if target is None else best >= target
        futile = reach <= best
        if target is not None:
            futile |= reach < target
        precise = np.zeros(r.shape, bool) if tolerance is None else (
            np.isfinite(best) & (reach <= best + tolerance))
        stopped = last | success | futile | precise
        reason = np.where(success, "success", np.where(
            last, "n", np.where(futile, "futility", "precision")))
        done_rows = r[stopped]
        self.done[done_rows] = True
        self.samples[done_rows] = trials
        self.stop_reason[done_rows] = reason[stopped]
        stop[live] = stopped
        return stop

    def results(self, rows=None) -> SequentialCertificate:
        """The `SequentialCertificate` of inputs ``rows[m]`` (default all), which have stopped."""
        rows = _stopped(self.done, rows)
        return SequentialCertificate(**{k: v[rows] for k, v in self.fields.items()},
                                     samples=self.samples[rows],
                                     certified_samples=self.certified_samples[rows],
                                     stop_reason=self.stop_reason[rows])


class SequentialPredictor:
    """Online sequential ``PREDICT`` of N inputs for one model (see `SequentialCertifier`).

    At checkpoint ``k`` the top two counts are tested at ``α_k`` (``predict_counts``); the first
    significant top class is returned (``success``). ``futility``: not even the optimistic
    projection of the counts (top at its upper, runner-up at its lower bound) would be
    significant at a later checkpoint; the input abstains.
    """

    def __init__(self, num_inputs: int, schedule: Schedule):
        self.schedule = schedule
        self.done = np.zeros(num_inputs, bool)
        self.prediction = np.full(num_inputs, ABSTAIN, np.int64)
        self.count_top = np.zeros(num_inputs, np.int64)
        self.count_runner_up = np.zeros(num_inputs, np.int64)
        self.p_value = np.ones(num_inputs)
        self.samples = np.zeros(num_inputs, np.int64)
        self.stop_reason = np.full(num_inputs, "", object)

    def step(self, rows, k: int, counts: np.ndarray) -> np.ndarray:
        """Take checkpoint ``k``'s counts ``[m, C]`` of inputs ``rows[m]``; return stop ``[m]``."""
        rows = np.asarray(rows, np.int64)
        stop = self.done[rows].copy()
        live = ~stop
        if not live.any():
            return stop
        r, c = rows[live], np.asarray(counts)[live]
        schedule, last = self.schedule, k == len(self.schedule.checkpoints) - 1
        trials, level = schedule.checkpoints[k], schedule.alphas[k]
        pred = predict_counts(c, level)
        success = pred.prediction != ABSTAIN
        futile = np.ones(r.shape, bool)
        rate_top = clopper_pearson_upper(pred.count_top, trials, level)
        rate_runner = clopper_pearson_lower(pred.count_runner_up, trials, level)
        for n_later, alpha_later in zip(schedule.checkpoints[k + 1:], schedule.alphas[k + 1:],
                                        strict=True):
            extra = n_later - trials
            top = np.minimum(n_later, pred.count_top + np.ceil(rate_top * extra).astype(np.int64))
            runner = np.minimum(n_later - top, pred.count_runner_up
                                + np.floor(rate_runner * extra).astype(np.int64))
            futile &= binomial_test_half(top, top + runner) > alpha_later
        stopped = last | success | futile
        reason = np.where(success, "success", np.where(last, "n", "futility"))
        s = r[stopped]
        self.done[s] = True
        self.prediction[s] = pred.prediction[stopped]
        self.count_top[s] = pred.count_top[stopped]
        self.count_runner_up[s] = pred.count_runner_up[stopped]
        self.p_value[s] = pred.p_value[stopped]
        self.samples[s] = trials
        self.stop_reason[s] = reason[stopped]
        stop[live] = stopped
        return stop

    def results(self, rows=None) -> SequentialPrediction:
        """The `SequentialPrediction` of inputs ``rows[m]`` (default all), which have stopped."""
        rows = _stopped(self.done, rows)
        return SequentialPrediction(self.prediction[rows], self.count_top[rows],
                                    self.count_runner_up[rows], self.p_value[rows],
                                    self.samples[rows], self.stop_reason[rows])


def _stopped(done: np.ndarray, rows) -> np.ndarray:
    rows = np.arange(done.size) if rows is None else np.asarray(rows, np.int64)
    if not done[rows].all():
        raise ValueError(f"{int((~done[rows]).sum())} inputs have not stopped yet")
    return rows


def _drive(tracker, counts_path: np.ndarray, schedule: Schedule) -> None:
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


def certify_sequential(counts_select: np.ndarray, counts_path: np.ndarray, schedule: Schedule,
                       radius_rule: RadiusRule, *, stopping: Stopping = Stopping(),
                       two_class: bool = False) -> SequentialCertificate:
    """Sequential ``CERTIFY`` from the cumulative estimation counts at every checkpoint.

    Args:
      counts_select: ``[N, C]`` selection counts (``n0`` samples of a separate stream).
      counts_path: ``[K, N, C]`` estimation counts over the first ``n_k`` samples of each input
        (nested: the samples of checkpoint k are the first of checkpoint k+1).
      schedule: the checkpoints and levels; with ``Schedule.fixed(n, α)`` the result equals
        ``certify_counts(counts_select, counts_path[0], α, radius_rule)``.
      radius_rule: e.g. ``L2Radius(σ)``, ``BernoulliHammingRadius(ρ, K)``.
      stopping: the stopping rules; two_class: the two-class bounds at ``α_k/2`` each.

    Returns:
      `SequentialCertificate` ``[N]``: wrong (radius above the true one) with probability
      ``<= schedule.alpha`` per input.
    """
    tracker = SequentialCertifier(counts_select, schedule, radius_rule, stopping=stopping,
                                  two_class=two_class)
    _drive(tracker, counts_path, schedule)
    return tracker.results()


def predict_sequential(counts_path: np.ndarray, schedule: Schedule) -> SequentialPrediction:
    """Sequential ``PREDICT`` from cumulative counts ``[K, N, C]`` (see `SequentialPredictor`)."""
    tracker = SequentialPredictor(np.asarray(counts_path).shape[1], schedule)
    _drive(tracker, counts_path, schedule)
    return tracker.results()


def largest_radius(schedule: Schedule, radius_rule: RadiusRule, *,
                   two_class: bool = False) -> float:
    """The largest radius the schedule can certify at all: unanimous votes, best checkpoint.

    NaN when even unanimous votes abstain at every checkpoint (``n`` too small for ``α``: the
    one-class saturated bound ``α_k^{1/n_k}`` must reach 1/2).
    """
    best = -np.inf
    for trials, level in zip(schedule.checkpoints, schedule.alphas, strict=True):
        counts = np.array([[trials, 0]])
        cert = certify_counts(np.array([[1, 0]]), counts, level, radius_rule,
                              two_class=two_class)
        best = max(best, float(_as_key(cert.radius)[0]))
    return float("nan") if best == -np.inf else best


def samples_needed(radius: float, alpha: float, radius_rule: RadiusRule, *,
                   two_class: bool = False) -> int | None:
    """Smallest ``n`` whose unanimous votes certify ``radius`` at level ``α`` (fixed n).

    For L2 one-class this is ``⌈ln α / ln Φ(r/σ)⌉`` (the saturated bound ``α^{1/n}`` must reach
    ``Φ(r/σ)``); computed by bisection through the radius rule so that it holds for every
    rule. None if no ``n < 2³¹`` suffices.
    """
    def certifies(n: int) -> bool:
        cert = certify_counts(np.array([1, 0]), np.array([n, 0]), alpha, radius_rule,
                              two_class=two_class)
        return bool(_as_key(cert.radius) >= radius)

    high = 1
    while not certifies(high):
        if high >= 2**30:
            return None
        high *= 2
    low = high // 2  # certifies(low) is False (or low = 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if certifies(mid) else (mid, high)
    return high


def pilot_hopeless(counts: np.ndarray, n: int, alpha: float, *, mode: str = "certify",
                   two_class: bool = False) -> np.ndarray:
    """Whether inputs are hopeless judged from a pilot's counts ``[..., C]`` of m samples.

    Hopeless: even if the rest of the ``n`` samples arrived at the optimistic rates (top class
    at its Clopper–Pearson upper bound, runner-up at its lower bound, level α), ``CERTIFY``
    would abstain at ``n`` (``pA_lower < 1/2``, two-class ``pA_lower <= pB_upper``) or
    ``PREDICT`` would not be significant. The pilot's own top class stands in for the
    selection. A pre-flight check only; it certifies nothing.

    Returns:
      bool ``[...]``.
    """
    arr = np.asarray(counts, np.int64)
    trials = arr.sum(axis=-1)
    ranked = np.sort(arr, axis=-1)
    top, runner = ranked[..., -1], ranked[..., -2]
    extra = np.maximum(n - trials, 0)
    top_n = np.minimum(trials + extra,
                       top + np.ceil(clopper_pearson_upper(top, trials, alpha) * extra)
                       .astype(np.int64))
    runner_n = np.minimum(trials + extra - top_n, runner + np.floor(
        clopper_pearson_lower(runner, trials, alpha) * extra).astype(np.int64))
    total = trials + extra
    if mode == "predict":
        return binomial_test_half(top_n, top_n + runner_n) > alpha
    if two_class:
        half = bonferroni_split(alpha, 2)
        return ~(clopper_pearson_lower(top_n, total, half)
                 > clopper_pearson_upper(runner_n, total, half))
    return clopper_pearson_lower(top_n, total, alpha) < 0.5


__all__ = [
    "DEFAULT_CHECKPOINT_RATIO", "DEFAULT_FINAL_SHARE", "DEFAULT_FIRST_CHECKPOINT", "SCHEDULES",
    "SEQUENTIAL_KEYS", "STOP_REASONS", "Schedule", "SequentialCertificate", "SequentialCertifier",
    "SequentialPrediction", "SequentialPredictor", "Stopping", "certify_sequential",
    "check_schedule_options", "check_settings", "largest_radius", "pilot_hopeless",
    "predict_sequential", "reachable_radius", "samples_needed",
]
