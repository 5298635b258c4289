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

**Two-class form.** At checkpoint k, ``pA_lower`` and ``pB_upper`` are each computed at
``α_k/2``. ``pB_upper`` is the upper bound of the *largest* other count ``n_B``, and it bounds
every other class at once: let ``B*`` be the class with the largest true probability among the
others. Its count ``n_B*`` is at most ``n_B``, and the Clopper–Pearson upper bound grows with
the count, so ``p_B* > CP_upper(n_B)`` implies ``p_B* > CP_upper(n_B*)`` -- an event of
probability ``<= α_k/2`` for the one fixed class ``B*``; every other class has ``p_B <= p_B*``.
No union over the classes is needed, whichever class happens to be the runner-up.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from cbcert.certify.bounds import (
    binomial_test_half,
    bonferroni_split,
    clopper_pearson_lower,
    clopper_pearson_upper,
)
from cbcert.certify.cohen import ABSTAIN, Certificate, RadiusRule, certify_counts, predict_counts
from cbcert.certify.schedule import Schedule, Stopping

STOP_REASONS = ("success", "futility", "precision", "n")


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
                 *, stopping: Stopping | None = None, two_class: bool = False,
                 uniform: np.ndarray | None = None):
        self.select = np.asarray(counts_select)
        # ``[N]`` draws of the randomized Clopper–Pearson bounds (one per input, used at every
        # checkpoint: the union bound needs no independence), or None.
        self.uniform = None if uniform is None else np.asarray(uniform, np.float64)
        if self.select.ndim != 2:
            raise ValueError(f"counts_select has shape {self.select.shape}; expected [N, C]")
        self.schedule, self.rule = schedule, radius_rule
        self.stopping, self.two_class = stopping or Stopping(), two_class
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
        cert = self._certify(r, c, k)
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
            reach = self._reach(cert, k)
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

    def _certify(self, rows: np.ndarray, counts: np.ndarray, k: int) -> Certificate:
        """Checkpoint ``k``'s certificate of inputs ``rows[m]`` with counts ``[m, C]``:
        Clopper–Pearson (randomized with ``uniform``) at ``α_k``."""
        uniform = None if self.uniform is None else self.uniform[rows]
        return certify_counts(self.select[rows], counts, self.schedule.alphas[k], self.rule,
                              two_class=self.two_class, uniform=uniform)

    def _reach(self, cert: Certificate, k: int) -> np.ndarray:
        """The optimistic radius ``[m]`` a later checkpoint could certify (`reachable_radius`)."""
        return reachable_radius(cert.count_top, cert.count_runner_up, k, self.schedule,
                                self.rule, two_class=self.two_class)

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
                       radius_rule: RadiusRule, *, stopping: Stopping | None = None,
                       two_class: bool = False) -> SequentialCertificate:
    """Sequential ``CERTIFY`` from the cumulative estimation counts at every checkpoint.

    Args:
      counts_select: ``[N, C]`` selection counts (``n0`` samples of a separate stream).
      counts_path: ``[K, N, C]`` estimation counts over the first ``n_k`` samples of each input
        (nested: the samples of checkpoint k are the first of checkpoint k+1).
      schedule: the checkpoints and levels; with ``Schedule.fixed(n, α)`` the result equals
        ``certify_counts(counts_select, counts_path[0], α, radius_rule)``.
      radius_rule: e.g. ``L2Radius(σ)``, ``BernoulliHammingRadius(ρ, K)``.
      stopping: the stopping rules (default: futility and n only); two_class: the two-class
        bounds at ``α_k/2`` each.

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
    "STOP_REASONS", "SequentialCertificate", "SequentialCertifier", "SequentialPrediction",
    "SequentialPredictor", "certify_sequential", "pilot_hopeless", "predict_sequential",
    "reachable_radius",
]
