"""The sequential and anytime schedules of certification runs: pre-flight checks,
continuous-batching sampling and its records, summary entries (``runs.certify`` calls these for
``job.schedule`` ``sequential`` or ``anytime``; ``job`` is a ``runs.certify.CertifyJob``).

Estimation samples of all unfinished inputs run through ``cbcert.engine.continuous`` at once;
each model keeps its own `cbcert.certify.sequential` tracker, an input stops when every model
has, and its records are appended then (the same ``sink`` as the fixed schedule's records).
Because every decision depends only on the input's own first ``n_k`` samples, the records are
identical whatever the chunk size, devices or resume point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cbcert.certify.anytime import largest_radius_anytime, samples_needed_anytime
from cbcert.certify.bounds import binomial_test_half
from cbcert.certify.monte_carlo import certify_heads, predict_heads
from cbcert.certify.randomized import bound_uniforms
from cbcert.certify.schedule import largest_radius, samples_needed
from cbcert.certify.sequential import STOP_REASONS, pilot_hopeless
from cbcert.engine.sampler import count_classes
from cbcert.runs.directory import finite_or_none, json_line
from cbcert.schema import ConfigError


def check_certifiable(job, num_concepts: int) -> None:
    """Raise `ConfigError` if ``job`` cannot certify (or predict) anything, before sampling.

    Even unanimous votes must give a certificate at some checkpoint (``n`` too small for ``α``
    otherwise: key ``n``), and ``target_radius`` must not exceed the largest radius the
    schedule can certify (key ``target_radius``). Saturated one-class L2 needs
    ``n >= ⌈ln α / ln Φ(r/σ)⌉`` for radius r: ``n = 1000`` caps R/σ at 2.463 at α = 0.001.
    """
    schedule = job.plan()
    if job.schedule == "anytime":
        _check_anytime(job, schedule, num_concepts)
        return
    if job.mode == "predict":
        if not any(binomial_test_half(c, c) <= a
                   for c, a in zip(schedule.checkpoints, schedule.alphas, strict=True)):
            detail = (f"n = {job.n} samples cannot make PREDICT significant at α = "
                      f"{job.alpha:g} even when unanimous; raise n")
            raise ConfigError(f"key 'n': {detail}", key="n", value=job.n, detail=detail)
        return
    rule = job.smoothing.radius_rule(job.scale, num_concepts)
    largest = largest_radius(schedule, rule, two_class=job.two_class)
    final = schedule.alphas[-1]
    if np.isnan(largest):
        need = samples_needed(0.0, final, rule, two_class=job.two_class)
        detail = (f"n = {job.n} samples cannot certify any radius at α = {job.alpha:g}: even "
                  f"unanimous votes abstain; n >= {need} needed")
        raise ConfigError(f"key 'n': {detail}", key="n", value=job.n, detail=detail)
    target = job.target_radius
    if target is not None and target > largest:
        need = samples_needed(target, final, rule, two_class=job.two_class)
        unit = "" if job.hamming else f" (R/{job.smoothing.symbol} = {largest / job.scale:.4g})"
        detail = (f"got {target:g}, but n = {job.n} at α = {job.alpha:g} certifies at most "
                  f"{largest:.4g}{unit}; "
                  + (f"n >= {need} needed" if need else "no n < 2**31 reaches it"))
        raise ConfigError(f"key 'target_radius': {detail}", key="target_radius",
                          value=target, detail=detail)


def _check_anytime(job, schedule, num_concepts: int) -> None:
    """`check_certifiable` for the anytime schedule: the confidence sequence's bound at n."""
    rule = job.smoothing.radius_rule(job.scale, num_concepts)
    largest = largest_radius_anytime(schedule, rule, two_class=job.two_class)
    if np.isnan(largest):
        need = samples_needed_anytime(0.0, job.alpha, rule, two_class=job.two_class)
        detail = (f"n = {job.n} samples cannot certify any radius at α = {job.alpha:g} with "
                  f"the anytime schedule: even unanimous votes abstain; n >= {need} needed")
        raise ConfigError(f"key 'n': {detail}", key="n", value=job.n, detail=detail)
    target = job.target_radius
    if target is not None and target > largest:
        need = samples_needed_anytime(target, job.alpha, rule, two_class=job.two_class)
        detail = (f"got {target:g}, but n = {job.n} at α = {job.alpha:g} certifies at most "
                  f"{largest:.4g} with the anytime schedule; "
                  + (f"n >= {need} needed" if need else "no n < 2**31 reaches it"))
        raise ConfigError(f"key 'target_radius': {detail}", key="target_radius",
                          value=target, detail=detail)


# Pilot of the pre-flight check: the first inputs' first estimation samples.
_PILOT_INPUTS, _PILOT_SAMPLES = 8, 64


def pilot(job, apply_fn, params, inputs, noise, key, common) -> None:
    """Raise `ConfigError` (the scale's key) if every model is hopeless on a pilot."""
    count, samples = min(_PILOT_INPUTS, len(inputs)), min(_PILOT_SAMPLES, job.n)
    counts = count_classes(apply_fn, params, inputs[:count], noise, key, samples,
                           scale=job.scale, **common)  # [count, H, C]
    hopeless = pilot_hopeless(counts, job.n, job.alpha, mode=job.mode,
                              two_class=job.two_class)  # [count, H]
    if hopeless.all():
        kind = job.smoothing
        what = "certify (pA_lower >= 1/2)" if job.mode == "certify" else "predict significantly"
        detail = (f"every model abstains at {kind.key} = {job.scale:g}: on a pilot of {samples} "
                  f"samples of {count} inputs no model could {what} at n = {job.n}, "
                  f"α = {job.alpha:g} even if its top class kept its most optimistic rate; "
                  f"use a smaller {kind.key} or a larger n")
        raise ConfigError(f"key '{kind.key}': {detail}", key=kind.key, value=job.scale,
                          detail=detail)


@dataclass(frozen=True)
class Sampling:
    """What the sampler needs besides the inputs: the models, noise, radius rule and keys."""

    apply_fn: Callable
    params: Any
    noise: Any
    rule: Any
    root: Any
    common: dict


def run_sequential(job, pool, rows: np.ndarray, done: set, inputs, model: Sampling,
                   sink, progress, finished: int) -> None:
    """Sequential CERTIFY/PREDICT of inputs ``rows`` (continuous batching); appends records.

    Runs through the one PREDICT/CERTIFY path (``cbcert.certify.monte_carlo.certify_heads`` /
    ``predict_heads``); records are written as inputs stop.
    """
    idx = pool.indices[rows]
    memory = {k: model.common[k] for k in ("num_classes", "chunk_size", "max_memory", "dtype")}

    def write(local, results, seconds):
        nonlocal finished
        for h, name in enumerate(job.models):
            for r, row in enumerate(rows[local]):
                if (int(pool.indices[row]), name) in done:
                    continue
                record = _sequential_record(pool, row, name, results[h], r)
                record["seconds"] = float(seconds[r])
                sink.write(json_line(record))
        sink.flush()
        finished += len(local)
        if progress:
            progress(finished, job.num_inputs)

    common = dict(scale=job.scale, plan=job.plan(), indices=idx, finished=write,
                  progress=model.common["progress"], **memory)
    if job.mode == "certify":
        uniform = bound_uniforms(model.root, idx) if job.bound == "randomized" else None
        certify_heads(model.apply_fn, model.params, inputs[rows], model.noise, model.root,
                      job.n0, job.n, job.alpha, rule=model.rule, two_class=job.two_class,
                      stopping=job.stopping, uniform=uniform, **common)
    else:
        predict_heads(model.apply_fn, model.params, inputs[rows], model.noise, model.root,
                      job.n, job.alpha, heads=len(job.models), **common)


def _sequential_record(pool, row: int, model: str, result, r: int) -> dict:
    """One record of a sequential run (fields as the fixed schedule's, plus the stop)."""
    record = {
        "index": int(pool.indices[row]),
        "model": model,
        "label": int(pool.labels[row]),
        "true_label": None if pool.true_labels is None else int(pool.true_labels[row]),
        **pool.input_fields(row),
        "prediction": int(result.prediction[r]),
        "count_top": int(result.count_top[r]),
        "count_runner_up": int(result.count_runner_up[r]),
    }
    if hasattr(result, "radius"):
        record.update(p_lower=finite_or_none(result.p_lower[r]),
                      p_upper=finite_or_none(result.p_upper[r]),
                      radius=finite_or_none(result.radius[r]),
                      certified_samples=int(result.certified_samples[r]))
    else:
        record["p_value"] = finite_or_none(result.p_value[r])
    record.update(correct=bool(result.prediction[r] == pool.labels[row]),
                  samples=int(result.samples[r]), stop_reason=str(result.stop_reason[r]))
    return record


def model_samples(rows: list[dict]) -> dict[str, Any]:
    """Summary entries of one model's records: estimation samples used, stop reasons."""
    used = [r["samples"] for r in rows]
    return {"samples_total": int(sum(used)),
            "samples_per_input": float(np.mean(used)) if used else None,
            "stop_reasons": {reason: sum(r["stop_reason"] == reason for r in rows)
                             for reason in STOP_REASONS}}


def samples_drawn(records: list[dict], job) -> dict[str, Any]:
    """Samples drawn per input (selection ``n0`` plus the estimation samples of the model that
    stopped last: all models share every sample), their total, mean and rate per second."""
    drawn: dict[int, int] = {}
    seconds: dict[int, float] = {}
    selection = job.n0 if job.mode == "certify" else 0
    for r in records:
        drawn[r["index"]] = max(drawn.get(r["index"], 0), selection + r["samples"])
        seconds[r["index"]] = r["seconds"]
    total, wall = sum(drawn.values()), sum(seconds.values())
    return {"total": total, "per_input": total / len(drawn) if drawn else None,
            "per_second": total / wall if wall > 0 else None,
            "fixed_schedule_per_input": selection + job.n}


__all__ = ["Sampling", "check_certifiable", "model_samples", "pilot", "run_sequential",
           "samples_drawn"]
