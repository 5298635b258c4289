"""Certification runs: input pool → agreement set → Monte Carlo counts → certificates → records.

A run certifies (or smoothly predicts) every requested model on the same inputs under the same
noise (SPEC §4). Per-input records are appended to ``records.jsonl`` as each batch of inputs
finishes (as locuslab/smoothing's ``certify.py`` writes one line per input); a rerun with the
same output directory skips finished inputs, and because the noise of sample j of input i is a
function of ``(seed, i, j)`` only, the resumed run's records and summary equal an uninterrupted
run's. Analysis (``summarize_records``) is separate from sampling.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np

from cbcert.certify import metrics
from cbcert.certify.cohen import ABSTAIN, certify_counts, predict_counts
from cbcert.certify.hamming import BernoulliHammingRadius, FixedFlipHammingRadius
from cbcert.certify.l2 import L2Radius
from cbcert.engine.keys import STREAM_ESTIMATE, STREAM_SELECT, stream_key
from cbcert.engine.noise import BernoulliFlips, FixedFlips, Gaussian
from cbcert.engine.sampler import count_classes, map_inputs
from cbcert.pipeline import clean_predictor
from cbcert.runs.directory import (
    RECORDS,
    RUN,
    SUMMARY,
    RunMismatchError,
    check_field,
    check_writable,
    finite_or_none,
    hold,
    json_line,
    open_run,
    read_records,
    write_json,
)

# Streams of the root key besides the engine's selection/estimation streams.
STREAM_POOL = 2


class PoolTooSmallError(ValueError):
    """Too few generated inputs have std and cbm agreeing for the number of inputs asked."""


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
      batch: inputs per engine call (a unit of progress and of resumption).
      dtype: compute dtype of generator and classifiers (``float32`` or ``bfloat16``).
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

    def __post_init__(self) -> None:
        if len(set(self.models)) != len(self.models) or not self.models:
            raise ValueError(f"models={list(self.models)}: give each model once")
        if self.mode == "predict" and self.two_class:
            raise ValueError("two_class=True: PREDICT has no two-class form (its binomial test "
                             "already compares the top two counts); use it with certify")

    @property
    def space(self) -> str:
        return "latent" if self.noise == "gaussian" else "concept"

    @property
    def hamming(self) -> bool:
        return self.space == "concept"


@dataclass(frozen=True)
class Pool:
    """The agreement set of a generated input pool (SPEC §3).

    Attributes:
      indices: ``[M]`` pool indices where ``f_std`` and ``f_cbm`` agree on the clean image.
      labels: ``[M]`` the shared clean prediction, the reference label.
      true_labels: ``[M]`` ground-truth classes when the world knows them, else None.
      latents: ``[M, d]`` their latents.
      pool_size: how many latents were generated to find them.
    """

    indices: np.ndarray
    labels: np.ndarray
    true_labels: np.ndarray | None
    latents: np.ndarray
    pool_size: int


def pool_latents(world, seed: int, start: int, count: int) -> np.ndarray:
    """Latents ``z_i ~ N(0, I)``, i in ``[start, start + count)``: ``[count, d]``.

    ``z_i`` is drawn from ``fold_in(fold_in(root, STREAM_POOL), i)``, so the pool is the same
    whatever its size or the block in which an index is generated.
    """
    key = stream_key(jax.random.key(seed), STREAM_POOL)
    d = world.generator.latent_dim
    draw = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(key, i), (d,)))
    return np.asarray(draw(np.arange(start, start + count)))


def agreement_pool(
    world,
    seed: int,
    num_inputs: int,
    *,
    space: str = "latent",
    block: int = 256,
    max_pool: int | None = None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
) -> Pool:
    """First ``num_inputs`` pool inputs on which ``std`` and ``cbm`` agree on the clean image.

    For concept-space runs the clean image is the autoencoded ``g2(D(E(g1(z))))`` (SPEC §1).
    Latents are searched in blocks of ``block``; each block is classified by the engine in
    chunks within ``max_memory`` (or of ``chunk_size``), so a large generator never renders a
    whole block at once. Raises ValueError if fewer are found among ``max_pool`` (default
    ``20 · num_inputs``) latents.
    """
    max_pool = max_pool or max(20 * num_inputs, block)
    params = world.params
    predict = clean_predictor(world, space, ("std", "cbm"))

    found_idx, found_lab, found_z = [], [], []
    start = 0
    while sum(map(len, found_idx)) < num_inputs and start < max_pool:
        z = pool_latents(world, seed, start, block)
        pred = map_inputs(predict, params, z, chunk_size=chunk_size,
                          max_memory=max_memory)  # [B, 2]
        agree = np.flatnonzero(pred[:, 0] == pred[:, 1])
        found_idx.append(start + agree)
        found_lab.append(pred[agree, 0])
        found_z.append(z[agree])
        start += block
    indices = np.concatenate(found_idx)[:num_inputs]
    if len(indices) < num_inputs:
        raise PoolTooSmallError(
            f"only {len(indices)} of {start} generated inputs have std and cbm agreeing, "
            f"fewer than the {num_inputs} inputs asked for"
        )
    latents = np.concatenate(found_z)[:num_inputs]
    true = None
    if world.true_label is not None:
        true = map_inputs(_true_labels(world), params, latents, chunk_size=chunk_size,
                          max_memory=max_memory)
    return Pool(
        indices=indices,
        labels=np.concatenate(found_lab)[:num_inputs],
        true_labels=true,
        latents=latents,
        pool_size=start,
    )


@functools.lru_cache(maxsize=32)
def _true_labels(world) -> Callable:
    """``(params, z[B, d]) -> int32[B]`` ground-truth classes (one object per world: one jit)."""
    return lambda params, z: world.true_label(params["gen"], z)


def encode_inputs(world, latents: np.ndarray, *, chunk_size: int | None = None,
                  max_memory: int | None = None) -> np.ndarray:
    """``c = E(g1(z))`` of every latent, in memory-bounded chunks: ``[N, d] -> [N, 2K + U]``."""
    return map_inputs(_encoder(world), world.params, latents, chunk_size=chunk_size,
                      max_memory=max_memory)


@functools.lru_cache(maxsize=32)
def _encoder(world) -> Callable:
    return world.encode_latents


def certified_scale(noise, scale: float) -> float:
    """The noise scale a certificate may use: ``min(typed, drawn)`` (SPEC §4).

    The engine samples with the float32 scale (``noise.drawn``): σ rounded to float32, ρ to
    the 2⁻²³ grid of float32 uniforms. The Gaussian radius grows with σ and the Bernoulli
    Hamming radius with ρ ∈ (0, ½), so certifying with the smaller of the typed and the drawn
    value never claims more than holds for the noise actually drawn, nor for the one typed.
    """
    return min(float(scale), noise.drawn(scale))


def radius_rule(job: CertifyJob, num_concepts: int):
    """The radius rule of a job's noise: L2 (σ), Bernoulli Hamming (ρ, K) or fixed flips (m, K).

    σ and ρ are the conservative scales of `certified_scale`.
    """
    noise = noise_model(job, num_concepts)
    if job.noise == "gaussian":
        return L2Radius(certified_scale(noise, job.scale))
    if job.noise == "bernoulli":
        return BernoulliHammingRadius(certified_scale(noise, job.scale), num_concepts)
    return FixedFlipHammingRadius(int(job.scale), num_concepts)


def noise_model(job: CertifyJob, num_concepts: int):
    """The engine noise model of a job."""
    if job.noise == "gaussian":
        return Gaussian()
    if job.noise == "bernoulli":
        return BernoulliFlips(num_concepts)
    return FixedFlips(num_concepts)


def open_run_dir(out: Path, meta: dict[str, Any]) -> None:
    """``runs.directory.open_run`` with the versions and devices (see `run_info`)."""
    open_run(out, meta, run_info())


def run_info() -> dict[str, Any]:
    """What ``run.json`` records besides the settings: versions and devices."""
    import cbcert

    return {"versions": {"cbcert": cbcert.__version__, "jax": jax.__version__},
            "devices": [str(d) for d in jax.devices()]}


# Record fields and their JSON types (bool is not an int here); None marks "or null".
_RECORD_TYPES: dict[str, tuple] = {
    "index": (int,), "model": (str,), "label": (int,), "true_label": (int, None),
    "prediction": (int,), "count_top": (int,), "count_runner_up": (int,),
    "correct": (bool,), "seconds": (int, float),
}
_CERTIFY_TYPES = {"p_lower": (int, float), "p_upper": (int, float), "radius": (int, float, None)}
_PREDICT_TYPES = {"p_value": (int, float)}


def check_types(record: dict, types: dict[str, tuple]) -> None:
    """Raise ValueError naming the first field of ``record`` whose JSON type is not allowed."""
    for name, allowed in types.items():
        value = record[name]
        ok = (value is None and None in allowed) or (
            value is not None and not (isinstance(value, bool) and bool not in allowed)
            and isinstance(value, tuple(t for t in allowed if t is not None)))
        if not ok:
            raise ValueError(f"field {name!r} = {value!r} has the wrong type")


def records_of(path: Path, job: CertifyJob, indices) -> list[dict]:
    """The checked records of a certification run: one per (input, model) of ``job``.

    Raises `RecordsError` for a malformed line, an input index not among ``indices``, a model
    not in ``job.models``, a field of the wrong type, or two different records of one key.
    """
    indices = set(map(int, indices))
    models = set(job.models)
    types = {**_RECORD_TYPES, **(_CERTIFY_TYPES if job.mode == "certify" else _PREDICT_TYPES)}

    def check(record: dict) -> None:
        check_types(record, types)
        check_field(record, "index", indices, "an input of this run")
        check_field(record, "model", models, f"one of the run's models {sorted(models)}")

    return read_records(path, key=lambda r: (r["index"], r["model"]), check=check)


def run(
    world,
    job: CertifyJob,
    out: str | Path,
    *,
    progress: Callable[[int, int], None] | None = None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
) -> dict[str, Any]:
    """Certify (or predict) every model of ``job`` on the agreement pool; resumable.

    Writes ``run.json`` (settings), appends ``records.jsonl`` (one line per input and model:
    index, model, label, true_label, prediction, count_top, count_runner_up, p_lower, p_upper
    or p_value, radius, correct, seconds) and finally ``summary.json``. ``seconds`` is the wall
    time of the input's batch divided by its size (all models share the generated images).

    Returns the summary dict (per model metrics).
    """
    out = Path(out)
    check_writable(out)
    with hold(out):
        return _run(world, job, out, progress, chunk_size, max_memory)


def _run(world, job: CertifyJob, out: Path, progress, chunk_size, max_memory) -> dict[str, Any]:
    open_run_dir(out, {"job": asdict(job), "world": world.name})
    k = world.generator.num_concepts
    memory = dict(chunk_size=chunk_size, max_memory=max_memory)
    pool = agreement_pool(world, job.seed, job.num_inputs, space=job.space, **memory)
    records_path = out / RECORDS
    records = records_of(records_path, job, pool.indices)
    done = {(r["index"], r["model"]) for r in records}
    todo = [
        n
        for n in range(job.num_inputs)
        if any((int(pool.indices[n]), m) not in done for m in job.models)
    ]

    params = world.params
    if job.dtype == "bfloat16":
        params = jax.tree.map(
            lambda a: a.astype("bfloat16") if np.issubdtype(a.dtype, np.floating) else a, params
        )
    if job.space == "latent":
        apply_fn, inputs = world.latent_apply(job.models), pool.latents
    else:
        apply_fn = world.concept_apply(job.models)
        inputs = encode_inputs(world, pool.latents, **memory)
    noise = noise_model(job, k)
    rule = radius_rule(job, k) if job.mode == "certify" else None
    root = jax.random.key(job.seed)
    common = dict(
        num_classes=world.num_classes,
        chunk_size=chunk_size,
        max_memory=max_memory,
        progress=False,
        dtype="bfloat16" if job.dtype == "bfloat16" else None,
    )

    finished = job.num_inputs - len(todo)
    if progress:
        progress(finished, job.num_inputs)
    with records_path.open("a") as sink:
        for b in range(0, len(todo), job.batch):
            rows = np.asarray(todo[b : b + job.batch])
            idx = pool.indices[rows]
            start = time.perf_counter()
            counts = count_classes(
                apply_fn,
                params,
                inputs[rows],
                noise,
                job.scale,
                stream_key(root, STREAM_ESTIMATE),
                job.n,
                indices=idx,
                **common,
            )
            if job.mode == "certify":
                counts0 = count_classes(
                    apply_fn,
                    params,
                    inputs[rows],
                    noise,
                    job.scale,
                    stream_key(root, STREAM_SELECT),
                    job.n0,
                    indices=idx,
                    **common,
                )
            seconds = (time.perf_counter() - start) / len(rows)
            for h, model in enumerate(job.models):
                if job.mode == "certify":
                    result = certify_counts(
                        counts0[:, h], counts[:, h], job.alpha, rule, two_class=job.two_class
                    )
                    extra = {
                        "p_lower": result.p_lower,
                        "p_upper": result.p_upper,
                        "radius": result.radius,
                    }
                else:
                    result = predict_counts(counts[:, h], job.alpha)
                    extra = {"p_value": result.p_value}
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
                        "prediction": int(result.prediction[r]),
                        "count_top": int(result.count_top[r]),
                        "count_runner_up": int(result.count_runner_up[r]),
                        **{key: finite_or_none(value[r]) for key, value in extra.items()},
                        "correct": bool(result.prediction[r] == pool.labels[row]),
                        "seconds": seconds,
                    }
                    sink.write(json_line(record))
            sink.flush()
            finished += len(rows)
            if progress:
                progress(finished, job.num_inputs)

    summary = summarize_records(records_of(records_path, job, pool.indices), job, k)
    summary["pool"] = {"agreement_inputs": job.num_inputs, "pool_size": pool.pool_size}
    write_json(out / SUMMARY, summary)
    return summary


def radius_grid(job: CertifyJob, num_concepts: int) -> np.ndarray:
    """Radii at which certified accuracy is reported: σ/4 steps to 4σ, or 0…K for Hamming."""
    if job.hamming:
        return np.arange(num_concepts + 1, dtype=np.float64)
    return np.round(np.arange(0, 17) * job.scale / 4, 10)


def summarize_records(records: list[dict], job: CertifyJob, num_concepts: int) -> dict:
    """Per-model metrics (SmAcc, ACR or ACR-H, CA curve, abstain rate, time/input) from records.

    Records are sorted by input index first, so the summary does not depend on resumption.
    """
    grid = radius_grid(job, num_concepts)
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
            entry["radius_grid"] = s.radius_grid.tolist()
            entry["certified_accuracy"] = s.certified_accuracy.tolist()
        result["models"][model] = entry
    return result


__all__ = ["ABSTAIN", "RECORDS", "RUN", "SUMMARY", "CertifyJob", "Pool", "RunMismatchError",
           "agreement_pool", "run", "summarize_records"]
