"""Certification runs: input pool → agreement set → Monte Carlo counts → certificates → records.

A run certifies (or smoothly predicts) every requested model on the same inputs under the same
noise (SPEC §4). Per-input records are appended to ``records.jsonl`` as each batch of inputs
finishes (as locuslab/smoothing's ``certify.py`` writes one line per input); a rerun with the
same output directory skips finished inputs, and because the noise of sample j of input i is a
function of ``(seed, i, j)`` only, the resumed run's records and summary equal an uninterrupted
run's. Analysis (``summarize_records``) is separate from sampling. With the fixed schedule,
batches run two at a time on CPU (`cbcert.runs.units`): the same records, in the same order.

Size: one runner with its job, record schema and summary (they change together).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from cbcert.certify import metrics
from cbcert.certify.anytime import AnytimeSchedule
from cbcert.certify.cohen import ABSTAIN
from cbcert.certify.monte_carlo import certify_heads, predict_heads
from cbcert.certify.randomized import BOUNDS, bound_uniforms
from cbcert.certify.schedule import SEQUENTIAL_KEYS, Schedule, Stopping, check_settings
from cbcert.certify.sequential import STOP_REASONS
from cbcert.certify.smoothing import Smoothing, smoothing
from cbcert.engine.keys import Stream, stream_key
from cbcert.engine.sampler import cast_floating
from cbcert.engine.validity import NonFiniteError
from cbcert.robustness.certification import records_subset_summary
from cbcert.runs import sequential
from cbcert.runs.directory import (
    RunSummary,
    check_field,
    check_types,
    finite_or_none,
    json_line,
    read_records,
)
from cbcert.runs.export import FORMATS, write_cohen
from cbcert.runs.pool import agreement_pool, space_inputs
from cbcert.runs.session import Session, session
from cbcert.runs.units import Units, split_budget, units_at_once
from cbcert.schema import ConfigError, validate, validate_sample_sizes


@dataclass(frozen=True)
class CertifyJob:
    """Settings of one certification run (everything that determines its results).

    Attributes:
      noise: ``gaussian`` (latent space, scale σ), ``bernoulli`` (concept flips, ρ) or
        ``fixed`` (exactly m concept flips).
      scale: σ, ρ or m.
      mode: ``certify`` (Cohen CERTIFY) or ``predict`` (Cohen PREDICT, abstaining).
      n0: selection samples (certify only); n: estimation / prediction samples; alpha: error level.
      two_class: two-class bound with the runner-up (α split between both bounds).
      models: model names, evaluated on the same noisy images.
      seed: root seed; num_inputs: inputs certified (taken from the agreement set, in pool order).
      batch: inputs per engine call (a unit of progress and of resumption; fixed schedule);
        it never changes records, so ``run.json`` records it but a rerun may change it.
      dtype: compute dtype of generator and classifiers (``float32`` or ``bfloat16``).
      schedule: ``fixed`` (Cohen's n for every input), ``sequential`` (anytime-valid
        checkpoints up to n, `cbcert.certify.sequential`; inputs stop early, records add
        ``samples`` and ``stop_reason``; not with ``fixed`` noise) or ``anytime`` (the same
        records from a confidence sequence read at every checkpoint, `cbcert.certify.anytime`;
        certify only).
      target_radius, radius_tolerance: the sequential stopping rules (`Stopping`; certify).
      first_checkpoint, checkpoint_ratio, final_alpha_share: the sequential checkpoints and
        levels (`Schedule.geometric`; anytime: `AnytimeSchedule.geometric`, which takes no
        ``final_alpha_share``; None = its default; ``first_checkpoint <= n``).
      bound: ``clopper_pearson`` (default) or ``randomized`` (the randomized Clopper–Pearson
        bound with each input's keyed uniform draw, `cbcert.certify.randomized`; fixed and
        sequential certify runs; pinned only when randomized).
      num_subsets, subset_size: the summary also reports SmAcc, ACR and the radius of correct
        inputs as mean ± sd over ``num_subsets`` random subsets of ``subset_size`` certified
        inputs, with paired permutation tests between models (`cbcert.robustness.
        certification`); 0 = off. Analysis only: not pinned, records do not depend on them.
    """

    noise: Literal["gaussian", "bernoulli", "fixed"]
    scale: float
    mode: Literal["certify", "predict"] = "certify"
    n0: int = 100
    n: int = 1000
    alpha: float = 0.001
    two_class: bool = False
    models: tuple[str, ...] = ("std", "cbm", "proto")
    seed: int = 0
    num_inputs: int = 100
    batch: int = 10
    dtype: str = "float32"
    schedule: Literal["fixed", "sequential", "anytime"] = "fixed"
    target_radius: float | None = None
    radius_tolerance: float | None = None
    first_checkpoint: int | None = None
    checkpoint_ratio: float | None = None
    final_alpha_share: float | None = None
    bound: Literal["clopper_pearson", "randomized"] = "clopper_pearson"
    num_subsets: int = 0
    subset_size: int = 0

    def __post_init__(self) -> None:
        self.smoothing.check(self.scale)
        validate("alpha", self.alpha, key="alpha")
        if self.mode == "certify":
            validate_sample_sizes(self.n0, self.n)
        else:
            validate("samples", self.n, key="n")
        for key in ("num_inputs", "batch"):
            validate("count", getattr(self, key), key=key)
        validate("seed", self.seed, key="seed")
        check_models(self.models)
        if self.mode == "predict" and self.two_class:
            detail = ("PREDICT has no two-class form (its binomial test already compares the "
                      "top two counts); use it with certify")
            raise ConfigError(f"two_class=True: {detail}", key="two_class", value=True,
                              detail=detail)
        self._check_schedule()
        self._check_bound()
        check_subsets(self.num_subsets, self.subset_size, self.num_inputs)

    def _check_schedule(self) -> None:
        check_settings(self.schedule, mode=self.mode, n=self.n,
                       **{key: getattr(self, key) for key in SEQUENTIAL_KEYS})
        if self.noise == "fixed" and self.schedule != "fixed":
            detail = (f"got {self.schedule!r}, allowed: fixed; the {self.schedule} schedule is "
                      "for Gaussian (σ) and Bernoulli (ρ) noise, not fixed-count flips")
            raise ConfigError(f"schedule={self.schedule!r}: {detail}", key="schedule",
                              value=self.schedule, allowed="fixed", detail=detail)

    def _check_bound(self) -> None:
        if self.bound not in BOUNDS:
            detail = f"got {self.bound!r}, allowed: {', '.join(BOUNDS)}"
        elif self.bound == "randomized" and (self.mode == "predict"
                                             or self.schedule == "anytime"):
            detail = ("got 'randomized', allowed with PREDICT or the anytime schedule: "
                      "clopper_pearson (the randomized bound is a fixed-n Clopper–Pearson bound)")
        else:
            return
        raise ConfigError(f"bound={self.bound!r}: {detail}", key="bound", value=self.bound,
                          allowed=", ".join(BOUNDS), detail=detail)

    def pinned(self) -> dict[str, Any]:
        """The settings ``run.json`` pins: the sequential keys only in sequential runs, so that
        fixed-schedule run directories made before they existed still resume."""
        settings = asdict(self)
        del settings["num_subsets"], settings["subset_size"]  # analysis only
        if self.bound == "clopper_pearson":  # run directories made before the key still resume
            del settings["bound"]
        if self.schedule == "fixed":
            for key in ("schedule", *SEQUENTIAL_KEYS):
                del settings[key]
        return settings

    def plan(self) -> Schedule | AnytimeSchedule:
        """The checkpoints and levels of this job (`Schedule.fixed` for the fixed schedule)."""
        if self.schedule == "anytime":
            return AnytimeSchedule.geometric(self.n, self.alpha, first=self.first_checkpoint,
                                             ratio=self.checkpoint_ratio)
        return Schedule.of(self.schedule, self.n, self.alpha, first=self.first_checkpoint,
                           ratio=self.checkpoint_ratio, final_share=self.final_alpha_share)

    @property
    def stopping(self) -> Stopping:
        return Stopping(self.target_radius, self.radius_tolerance)

    @property
    def smoothing(self) -> Smoothing:
        """This job's noise and certificate (`cbcert.certify.smoothing`)."""
        return smoothing(self.noise)

    @property
    def space(self) -> str:
        return self.smoothing.space

    @property
    def hamming(self) -> bool:
        return self.smoothing.hamming


def check_subsets(num_subsets: int, subset_size: int, num_inputs: int) -> None:
    """Raise `ConfigError` unless the subsets are off (both 0) or ``2 <= k`` and
    ``1 <= n <= num_inputs``."""
    if num_subsets == 0 and subset_size == 0:
        return
    validate("subsets", num_subsets, key="num_subsets")
    validate("count", subset_size, key="subset_size")
    if subset_size > num_inputs:
        detail = (f"got {subset_size}, allowed range [1, {num_inputs}] (the inputs certified)")
        raise ConfigError(f"subset_size={subset_size}: {detail}", key="subset_size",
                          value=subset_size, allowed=f"[1, {num_inputs}]", detail=detail)


def check_models(models: tuple[str, ...], minimum: int = 1) -> None:
    """Raise `ConfigError` (key ``models``) unless ``models`` has ≥ ``minimum`` distinct names
    and none twice (a repeated model would be evaluated, and recorded, twice)."""
    if len(set(models)) != len(models):
        need = "each model once"
    elif len(models) < minimum:
        need = f"at least {minimum} distinct models" if minimum > 1 else "at least one model"
    else:
        return
    detail = f"got {','.join(models)!r}; name {need}"
    raise ConfigError(f"models={list(models)}: {detail}", key="models", value=models,
                      detail=detail)


# Record fields and their JSON types (bool is not an int here); None marks "or null".
_RECORD_TYPES: dict[str, tuple] = {
    "index": (int,), "model": (str,), "label": (int,), "true_label": (int, None),
    "prediction": (int,), "count_top": (int,), "count_runner_up": (int,),
    "correct": (bool,), "seconds": (int, float),
}
# Multi-class conditional worlds only: the class the input asked the generator for.
_INPUT_TYPES = {"generator_class": (int,)}
_CERTIFY_TYPES = {"p_lower": (int, float), "p_upper": (int, float), "radius": (int, float, None)}
_PREDICT_TYPES = {"p_value": (int, float)}
# Sequential runs only (fixed-schedule records stay as they were).
_SEQUENTIAL_TYPES = {"samples": (int,), "stop_reason": (str,)}
_SEQUENTIAL_CERTIFY_TYPES = {"certified_samples": (int,)}


def records_of(path: Path, job: CertifyJob, indices) -> list[dict]:
    """The checked records of a certification run: one per (input, model) of ``job``.

    Raises `RecordsError` for a malformed line, an input index not among ``indices``, a model
    not in ``job.models``, a field of the wrong type, or two different records of one key.
    """
    indices = set(map(int, indices))
    models = set(job.models)
    types = {**_RECORD_TYPES, **(_CERTIFY_TYPES if job.mode == "certify" else _PREDICT_TYPES)}
    if job.schedule != "fixed":
        types.update(_SEQUENTIAL_TYPES)
        if job.mode == "certify":
            types.update(_SEQUENTIAL_CERTIFY_TYPES)

    def check(record: dict) -> None:
        check_types(record, types)
        check_types(record, {k: v for k, v in _INPUT_TYPES.items() if k in record})
        check_field(record, "index", indices, "an input of this run")
        check_field(record, "model", models, f"one of the run's models {sorted(models)}")
        if job.schedule != "fixed":
            check_field(record, "stop_reason", set(STOP_REASONS), f"one of {STOP_REASONS}")

    return read_records(path, key=lambda r: (r["index"], r["model"]), check=check)


def run(
    world,
    job: CertifyJob,
    out: str | Path,
    *,
    progress: Callable[[int, int], None] | None = None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
    preflight: bool = False,
    export: str | None = None,
    units: int | None = None,
) -> RunSummary:
    """Certify (or predict) every model of ``job`` on the agreement pool; resumable.

    Writes ``run.json`` (settings), appends ``records.jsonl`` (one line per input and model:
    index, model, label, true_label, prediction, count_top, count_runner_up, p_lower, p_upper
    or p_value, radius, correct, seconds; ``generator_class`` in a multi-class conditional
    world) and finally ``summary.json``. ``seconds`` is the wall time from the previous batch's
    records to its batch's, divided by its size (all models share the generated images), so a
    run's records sum to its time. ``units``: batches of the fixed schedule run at once
    (`cbcert.runs.units.units_at_once`; None: its default, 2 on CPU).

    With ``job.schedule`` ``sequential`` or ``anytime`` the estimation samples run through the
    continuous sampler (``cbcert.engine.continuous``) over all unfinished inputs at once; an input's
    records are appended when every model has stopped, with ``samples`` (estimation samples
    the model used), ``stop_reason`` and, certify only, ``certified_samples`` (``n_k`` of the
    reported bound); ``seconds`` is its share of the selection pass plus the time of the
    chunks its samples ran in.

    ``preflight``: first ``runs.sequential.check_certifiable`` (n large enough for α, a
    reachable target), then,
    for a fresh sequential run, count ``min(n, 64)`` samples of the first ``min(8,
    num_inputs)`` inputs and raise `ConfigError` (key ``sigma``/``rho``/``flips``) if every
    model is hopeless on every one of them (``runs.sequential.pilot``). The fixed schedule runs
    no pilot: it behaves exactly as it always has.

    ``export="cohen"``: also write ``cohen-<model>.tsv`` from the records
    (`cbcert.runs.export`). A world with fixed inputs (``world.dataset``, pixels) certifies
    them in order with their own labels.

    The scale was checked by the job (`CertifyJob`, the edge); here only its bound by the
    world's concepts (``m <= K``), which the job cannot know. Nothing below checks it again.

    Returns the `RunSummary` (per model metrics).
    """
    units = units_at_once(units)
    job.smoothing.check_concepts(job.scale, world.generator.num_concepts)
    if preflight:
        sequential.check_certifiable(job, world.generator.num_concepts)
    with session(out, "certify", {"job": job.pinned(), "world": world.name}, world,
                 free=("job.batch",)) as directory:
        return _run(world, job, directory, progress, chunk_size, max_memory, preflight, export,
                    units)


def _run(world, job: CertifyJob, directory: Session, progress, chunk_size, max_memory,
         preflight: bool = False, export: str | None = None, at_once: int = 1) -> RunSummary:
    k = world.generator.num_concepts
    memory = dict(chunk_size=chunk_size, max_memory=max_memory)
    pool = agreement_pool(world, job.seed, job.num_inputs, space=job.space, **memory)
    records_path = directory.path()
    records = records_of(records_path, job, pool.indices)
    done = {(r["index"], r["model"]) for r in records}
    todo = [
        n
        for n in range(job.num_inputs)
        if any((int(pool.indices[n]), m) not in done for m in job.models)
    ]

    params = world.params
    if job.dtype == "bfloat16":
        params = cast_floating(params, jnp.bfloat16)
    apply_fn = world.apply(job.space, job.models)
    inputs = space_inputs(world, pool.latents, job.space, **memory)
    noise = world.noise(job.smoothing.noise(k), job.space)
    rule = (job.smoothing.radius_rule(job.scale, k, inputs.dtype) if job.mode == "certify"
            else None)
    root = jax.random.key(job.seed)
    common = dict(
        num_classes=world.num_classes,
        chunk_size=chunk_size,
        max_memory=max_memory,
        progress=False,
        dtype="bfloat16" if job.dtype == "bfloat16" else None,
    )

    if preflight and job.schedule != "fixed" and not records:
        with _naming_models(job.models):
            sequential.pilot(job, apply_fn, params, inputs, noise,
                             stream_key(root, Stream.ESTIMATE), common)
    finished = job.num_inputs - len(todo)
    if progress:
        progress(finished, job.num_inputs)
    batches = ([np.asarray(todo[b : b + job.batch]) for b in range(0, len(todo), job.batch)]
               if job.schedule == "fixed" else [])
    engine = {key: common[key] for key in ("num_classes", "chunk_size", "dtype")}
    engine["max_memory"] = split_budget(max_memory, at_once)

    def certify_batch(rows):  # one batch's certificates (or predictions) of every model
        idx = pool.indices[rows]
        if job.mode == "certify":
            uniform = bound_uniforms(root, idx) if job.bound == "randomized" else None
            result = certify_heads(apply_fn, params, inputs[rows], noise, root, job.n0, job.n,
                                   job.alpha, scale=job.scale, rule=rule,
                                   two_class=job.two_class, indices=idx, uniform=uniform,
                                   **engine)  # [T, H]
            return result, {"p_lower": result.p_lower, "p_upper": result.p_upper,
                            "radius": result.radius}
        result = predict_heads(apply_fn, params, inputs[rows], noise, root, job.n, job.alpha,
                               scale=job.scale, heads=len(job.models), indices=idx,
                               **engine)  # [T, H]
        return result, {"p_value": result.p_value}

    with (directory.append() as sink, _naming_models(job.models, records_path),
          Units(at_once) as run_units):
        if job.schedule != "fixed" and todo:
            model = sequential.Sampling(apply_fn, params, noise, rule, root, common)
            sequential.run_sequential(job, pool, np.asarray(todo), done, inputs, model, sink,
                                      progress, finished)
        start = time.perf_counter()
        for rows, (result, extra) in zip(batches, run_units(certify_batch, batches),
                                         strict=True):
            now = time.perf_counter()
            seconds, start = (now - start) / len(rows), now
            for h, model in enumerate(job.models):
                for r, row in enumerate(rows):
                    if (int(pool.indices[row]), model) in done:
                        continue
                    record = {
                        "index": int(pool.indices[row]),
                        "model": model,
                        "label": int(pool.labels[row]),
                        "true_label": None
                        if pool.true_labels is None
                        else int(pool.true_labels[row]),
                        **pool.input_fields(row),
                        "prediction": int(result.prediction[r, h]),
                        "count_top": int(result.count_top[r, h]),
                        "count_runner_up": int(result.count_runner_up[r, h]),
                        **{key: finite_or_none(value[r, h]) for key, value in extra.items()},
                        "correct": bool(result.prediction[r, h] == pool.labels[row]),
                        "seconds": seconds,
                    }
                    sink.write(json_line(record))
            sink.flush()
            finished += len(rows)
            if progress:
                progress(finished, job.num_inputs)

    records = records_of(records_path, job, pool.indices)
    result = directory.finish(summarize_records(records, job, k), pool)
    if export is not None:
        if export not in FORMATS:
            raise ConfigError(f"export={export!r}: allowed {', '.join(FORMATS)}", key="export",
                              value=export, allowed=", ".join(FORMATS))
        write_cohen(directory.out, records, job.models, job.mode)
    return result


@contextlib.contextmanager
def _naming_models(models: tuple[str, ...], records: Path | None = None) -> Iterator[None]:
    """A `NonFiniteError` (NaN or inf logits or inputs) raised with the heads called by their
    model names and, once records are written, where the finished ones are kept."""
    try:
        yield
    except NonFiniteError as err:
        note = f"the records of finished inputs are kept in {records}" if records else ""
        raise err.renamed(models, note) from None


def summarize_records(records: list[dict], job: CertifyJob, num_concepts: int) -> dict:
    """Per-model metrics (SmAcc, ACR or ACR-H, the mean radius of correct inputs, CA curve,
    abstain rate, time/input) from records.

    Records are sorted by input index first, so the summary does not depend on resumption.
    """
    grid = job.smoothing.radius_grid(job.scale, num_concepts)
    result: dict[str, Any] = {
        "mode": job.mode,
        "noise": job.noise,
        "scale": job.scale,
        "models": {},
    }
    for model in job.models:
        rows = sorted((r for r in records if r["model"] == model), key=lambda r: r["index"])
        labels = np.array([r["label"] for r in rows], np.int64)
        preds = np.array([r["prediction"] for r in rows], np.int64)
        seconds = np.array([r["seconds"] for r in rows], np.float64)
        entry: dict[str, Any] = {
            "num_inputs": len(rows),
            "smoothed_accuracy": metrics.smoothed_accuracy(labels, preds),
            "abstain_rate": metrics.abstain_rate(preds),
            "seconds_per_input": metrics.mean_time_per_input(seconds),
        }
        if rows and rows[0].get("true_label") is not None:
            true = np.array([r["true_label"] for r in rows], np.int64)
            entry["smoothed_accuracy_true_label"] = metrics.smoothed_accuracy(true, preds)
        if job.mode == "certify":
            radii = np.array([np.nan if r["radius"] is None else r["radius"] for r in rows])
            s = metrics.summarize(labels, preds, radii, seconds, grid, hamming=job.hamming)
            entry["acr"] = s.acr
            entry["radius_of_correct"] = finite_or_none(s.radius_of_correct)
            entry["radius_grid"] = s.radius_grid.tolist()
            entry["certified_accuracy"] = s.certified_accuracy.tolist()
        if job.schedule != "fixed":
            entry.update(sequential.model_samples(rows))
        result["models"][model] = entry
    if job.schedule != "fixed":
        result["samples"] = sequential.samples_drawn(records, job)
    if job.num_subsets:
        result["subsets"] = records_subset_summary(
            records, job.models, num_subsets=job.num_subsets, subset_size=job.subset_size,
            seed=(job.seed, int(Stream.SUBSETS)))
    return result


__all__ = ["ABSTAIN", "CertifyJob", "check_models", "check_subsets", "records_of", "run",
           "summarize_records"]
