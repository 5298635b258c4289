"""Monte Carlo ``PREDICT`` and ``CERTIFY`` of a smoothed classifier: THE path from noisy samples
to predictions and certificates.

`predict_heads` and `certify_heads` sample through the engine (``count_classes`` for the fixed
schedule, ``count_classes_sequential`` with one tracker per head for a sequential `Schedule`)
and decide with `cbcert.certify.cohen` / `cbcert.certify.sequential`. `cbcert.api.Smoothed`,
the certification runs (``cbcert.runs.certify``, ``cbcert.runs.sequential``) and the smoothed
attacks' PREDICT (``cbcert.runs.attacker``) all call them, so one input gets one answer
whichever front end asked. Keys: selection samples from ``Stream.SELECT`` of the root key,
estimation samples from ``Stream.ESTIMATE`` (``cbcert.engine.keys``).

The scale arrives checked (by the edge: `cbcert.api.Noise` or a job) and the radius rule built
(``Smoothing.radius_rule``); nothing here checks either again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from cbcert.certify.anytime import AnytimeCertifier, AnytimeSchedule
from cbcert.certify.cohen import Certificate, Prediction, RadiusRule, certify_counts, predict_counts
from cbcert.certify.schedule import Schedule, Stopping
from cbcert.certify.sequential import (
    SequentialCertificate,
    SequentialCertifier,
    SequentialPrediction,
    SequentialPredictor,
)
from cbcert.engine.continuous import count_classes_sequential
from cbcert.engine.keys import Stream, stream_key
from cbcert.engine.sampler import count_classes

# ``finished(rows[m], results, seconds[m])``: inputs ``rows`` (indices into ``x``) stopped;
# ``results[h]`` is head h's sequential result for them (fields ``[m]``), ``seconds`` their wall
# time (their share of the selection pass plus the chunks their samples ran in).
Finished = Callable[[np.ndarray, list, np.ndarray], None]


def predict_heads(fn: Callable, params, x, noise, key: jax.Array, n: int, alpha: float, *,
                  scale, heads: int, plan: Schedule | None = None, indices=None,
                  progress=None, finished: Finished | None = None,
                  **engine: Any) -> Prediction | SequentialPrediction:
    """Cohen et al.'s ``PREDICT`` of every input and head: THE path of
    `cbcert.api.Smoothed.predict`, the certification runs (``cbcert.runs.certify``,
    ``cbcert.runs.sequential``) and the smoothed attacks (``cbcert.runs.attacker``).

    ``counts[N, H, C]`` of ``n`` estimation samples (stream ``Stream.ESTIMATE`` of ``key``);
    ``nA, nB`` the two largest of a head; abstain (``ABSTAIN``) if the two-sided binomial test
    of ``nA`` out of ``nA + nB`` at ½ has p-value ``> α`` (`predict_counts`). With a ``plan``,
    the same test at its checkpoints ``n_k`` and levels ``α_k`` (`SequentialPredictor`), each
    input stopping when every head has.

    Args:
      fn: ``(params, x[B, *event]) -> logits[B, H, C]``. params, x ``[N, *event]``, noise (an
        engine noise model), key (root key), n, alpha: as in `cbcert.api.Smoothed.predict`.
      scale: the noise's scale, keyword-only, already checked at the edge (`Noise`, a job).
      heads: H (the trackers' count under a plan).
      plan: None for the fixed schedule, else the sequential `Schedule` (ending at ``n``).
      indices, progress: as in ``count_classes`` (``progress``: fixed schedule only).
      finished: sequential only, `Finished` called as inputs stop (records are written there).
      engine: num_classes, chunk_size, max_memory, mesh, dtype (``count_classes``).

    Returns:
      `Prediction` with fields ``[N, H]``; `SequentialPrediction` under a plan.
    """
    estimate = stream_key(key, Stream.ESTIMATE)
    if plan is None:
        counts = count_classes(fn, params, x, noise, estimate, n, scale=scale, indices=indices,
                               progress=progress, **engine)  # [N, H, C]
        return predict_counts(counts, alpha)
    trackers = [SequentialPredictor(len(x), plan) for _ in range(heads)]
    return _sequential(fn, params, x, noise, estimate, plan, trackers, scale=scale,
                       indices=indices, finished=finished, selection_seconds=0.0, **engine)


def certify_heads(fn: Callable, params, x, noise, key: jax.Array, n0: int, n: int,
                  alpha: float, *, scale, rule: RadiusRule,
                  plan: Schedule | AnytimeSchedule | None = None, two_class: bool = False,
                  stopping: Stopping | None = None, indices=None, progress=None,
                  finished: Finished | None = None, uniform=None,
                  **engine: Any) -> Certificate | SequentialCertificate:
    """Cohen et al.'s ``CERTIFY`` of every input and head: THE path of
    `cbcert.api.Smoothed.certify` and the certification runs (fixed and sequential schedules).

    ``ĉA = argmax`` of ``n0`` selection counts (stream ``Stream.SELECT``), then ``n``
    estimation samples (``Stream.ESTIMATE``) give ``pA_lower = CP_lower(nA, n, α)`` and the
    radius ``rule.radius(pA_lower, ·)`` (`certify_counts`; ``two_class``: α/2 each for
    ``pA_lower`` and the runner-up's ``pB_upper``). With a ``plan``, the same at its
    checkpoints and levels (`SequentialCertifier`, ``stopping``), each input stopping when
    every head has; with an `AnytimeSchedule`, the anytime-valid bound read at its checkpoints
    (`AnytimeCertifier`; a one-class target radius adds the checkpoints at which an input first
    certifies it, ``AnytimeSchedule.with_target``).

    Args:
      fn, params, x, noise, key, scale, plan, indices, progress, finished, engine: as in
        `predict_heads` (``progress`` also counts the selection pass).
      n0, n, alpha, two_class: as in `cbcert.api.Smoothed.certify`.
      rule: the radius rule, built once (``Smoothing.radius_rule`` at the certified scale).
      stopping: the sequential stopping rules (`Stopping`; None: decided or n).
      uniform: ``[N]`` draws in [0, 1) for randomized Clopper–Pearson bounds (e.g.
        `cbcert.certify.randomized.bound_uniforms`); None: the standard bounds. Fixed and
        sequential schedules only.

    Returns:
      `Certificate` with fields ``[N, H]``; `SequentialCertificate` under a plan.
    """
    start = time.perf_counter()
    select = count_classes(fn, params, x, noise, stream_key(key, Stream.SELECT), n0,
                           scale=scale, indices=indices, progress=progress,
                           **engine)  # [N, H, C]
    estimate = stream_key(key, Stream.ESTIMATE)
    if plan is None:
        counts = count_classes(fn, params, x, noise, estimate, n, scale=scale, indices=indices,
                               progress=progress, **engine)  # [N, H, C]
        per_head = None if uniform is None else np.asarray(uniform)[:, None]  # [N, 1]
        return certify_counts(select, counts, alpha, rule, two_class=two_class,
                              uniform=per_head)
    tracker = SequentialCertifier
    if isinstance(plan, AnytimeSchedule):
        tracker = AnytimeCertifier  # refuses ``uniform``
        target = None if stopping is None else stopping.target_radius
        if target is not None and not two_class:
            plan = plan.with_target(target, rule)
    trackers = [tracker(select[:, h], plan, rule, stopping=stopping, two_class=two_class,
                        uniform=uniform) for h in range(select.shape[1])]
    return _sequential(fn, params, x, noise, estimate, plan, trackers, scale=scale,
                       indices=indices, finished=finished,
                       selection_seconds=(time.perf_counter() - start) / len(x), **engine)


def _sequential(fn, params, x, noise, key, plan: Schedule | AnytimeSchedule, trackers: list, *,
                scale, indices, finished: Finished | None, selection_seconds: float,
                **engine: Any):
    """Drive ``trackers`` (one per head) through the continuous sampler; their results
    stacked to fields ``[N, H]``, and ``finished`` told of inputs as they stop."""
    write = None
    if finished is not None:
        def write(rows, counts, samples, seconds):  # count_classes_sequential's Finished
            del counts, samples
            finished(rows, [t.results(rows) for t in trackers], selection_seconds + seconds)
    drive_trackers(fn, params, x, noise, key, plan.checkpoints, trackers, scale=scale,
                   indices=indices, finished=write, **engine)
    return _stack([t.results() for t in trackers])


def drive_trackers(fn: Callable, params, x, noise, key: jax.Array, checkpoints,
                   trackers: list, *, scale, finished=None, **engine: Any) -> None:
    """Drive one sequential tracker per head through the continuous sampler.

    An input stops once every head's tracker (`SequentialCertifier` / `SequentialPredictor`)
    has stopped it at a checkpoint: ``decide(rows, k, counts[m, H, C])`` is the AND over heads
    of ``trackers[h].step(rows, k, counts[:, h])``. ``scale`` (keyword-only), ``finished`` and
    ``engine`` (num_classes, indices, chunk_size, max_memory, mesh, dtype) are
    `count_classes_sequential`'s.
    """

    def decide(rows, k, counts):  # [m], [m, H, C]
        stop = np.ones(len(rows), bool)
        for h, tracker in enumerate(trackers):
            stop &= tracker.step(rows, k, counts[:, h])
        return stop

    count_classes_sequential(fn, params, x, noise, key, checkpoints, decide, scale=scale,
                             finished=finished, **engine)


def _stack(results: list):
    """Per-head results ``[N]`` → one result ``[N, H]``."""
    return dataclasses.replace(results[0], **{
        f.name: np.stack([getattr(r, f.name) for r in results], axis=1)
        for f in dataclasses.fields(results[0])})


__all__ = ["Finished", "certify_heads", "drive_trackers", "predict_heads"]
