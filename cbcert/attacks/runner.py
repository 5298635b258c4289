"""Attack runs: APGD through generator and classifier, against base or smoothed classifiers.

SPEC §5. Inputs are the std/cbm agreement set of the generated pool (the same inputs as
``certify latent``/``certify concept`` with the same seed), labelled with the shared clean
prediction. Each model is attacked on its own: its logits function is one head of
``World.latent_apply`` (perturb the latent ``z``) or ``World.concept_apply`` (perturb the
continuous concept representation ``c = E(g1(z))`` before decoding).

* **Base**: APGD-CE (or APGD-DLR) maximises the loss of ``f_m(g(x))`` over the ε-ball
  around the clean ``x``. Robust means the attack found no misclassified point.
* **Smoothed**: APGD maximises the SmoothAdv loss ``-log p̂(x)_y`` with ``p̂`` the mean
  softmax over ``eot`` fixed noise samples (``cbcert.attacks.smoothed``); the adversarial
  point is then judged with Cohen et al.'s Monte Carlo ``PREDICT`` (``n`` samples, level α,
  abstain = wrong). The clean point is itself in the ε-ball, so robust means PREDICT is
  correct at *both* the clean and the adversarial point; robust accuracy ≤ clean accuracy.
  ``argmax p̂`` only estimates the smoothed prediction, so APGD runs with ``attack_all``:
  every input is attacked and its highest-loss point judged, even where ``p̂`` already
  misclassifies the clean point (``attack_fooled`` records ``argmax p̂ ≠ label`` at the
  returned point).

Keys (all from ``--seed``; ``root = jax.random.key(seed)``):

* pool: ``STREAM_POOL`` of ``cbcert.certify.runner`` (same inputs as certification runs);
* APGD random starts of input i (global pool index) for one (model, ε):
  ``fold_in(fold_in(fold_in(fold_in(root, STREAM_ATTACK), model_id), bits(ε)), i)``, then
  ``fold_in(·, r)`` for restart r, with ``model_id`` the model's position in
  ``World.model_names`` and ``bits(ε)`` the float32 bit pattern of ε; so results do not
  depend on ``batch`` or on which other models or budgets a run includes, and a resumed run
  repeats exactly the first one;
* EOT noise of input i (global pool index): ``fold_in(fold_in(root, STREAM_EOT), i)``,
  shared by models and budgets;
* PREDICT noise: ``STREAM_ESTIMATE`` with ``sample_key(·, i, j)``, as ``certify predict``,
  for the clean and the adversarial point alike (common random numbers); independent of
  the EOT noise the attacker saw.

Per-input records go to ``records.jsonl`` as each (batch, model, ε) unit finishes; a rerun
with the same output directory skips finished units, and the resumed summary equals an
uninterrupted run's.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import Partial

from cbcert.attacks.apgd import apgd
from cbcert.attacks.smoothed import smoothed_logits_fn
from cbcert.certify.cohen import ABSTAIN, predict_counts
from cbcert.certify.runner import (
    RECORDS,
    SUMMARY,
    agreement_pool,
    check_types,
    encode_inputs,
    open_run_dir,
)
from cbcert.engine.keys import STREAM_ESTIMATE, stream_key
from cbcert.engine.noise import BernoulliFlips, Gaussian
from cbcert.engine.sampler import batch_within_memory, count_classes, map_inputs
from cbcert.runs.directory import (
    check_field,
    check_writable,
    finite_or_none,
    hold,
    json_line,
    read_records,
    write_json,
)

# APGD's smallest sub-batch: XLA:CPU rounds a row differently in batches of 1-2 than in 4+.
MIN_ATTACK_CHUNK = 4

# Streams of the root key used by attack runs only (0, 1: engine; 2: the input pool).
STREAM_ATTACK = 3
STREAM_EOT = 4


@dataclass(frozen=True)
class AttackJob:
    """Settings of one attack run (everything that determines its results).

    Attributes:
      space: ``latent`` (perturb ``z``) or ``concept`` (perturb ``c = E(g1(z))``).
      eps: attack budgets ε, radii of the ``norm`` ball around the clean input.
      norm: ``linf`` or ``l2``.
      iters, restarts: APGD iterations per restart and number of restarts.
      loss: ``ce`` (APGD-CE) or ``dlr`` (APGD-DLR, needs ≥ 3 classes).
      smoothed: attack the smoothed classifier (EOT loss) and judge it with PREDICT.
      scale: noise scale of the smoothed classifier: σ (latent Gaussian) or ρ (concept
        Bernoulli flips); None for base attacks.
      eot: noise samples in the attack's expected softmax (smoothed only).
      n, alpha: PREDICT samples and level (smoothed only).
      models: models attacked, each on its own.
      seed: root seed; num_inputs: inputs attacked (agreement set, pool order).
      batch: inputs per APGD call (unit of progress and of resumption).
    """

    space: Literal["latent", "concept"] = "latent"
    eps: tuple[float, ...] = (0.01, 0.03)
    norm: Literal["linf", "l2"] = "linf"
    iters: int = 100
    restarts: int = 1
    loss: Literal["ce", "dlr"] = "ce"
    smoothed: bool = False
    scale: float | None = None
    eot: int = 8
    n: int = 1000
    alpha: float = 0.001
    models: tuple[str, ...] = ("std", "cbm", "proto")
    seed: int = 0
    num_inputs: int = 64
    batch: int = 16

    def __post_init__(self) -> None:
        if self.space not in ("latent", "concept"):
            raise ValueError(f"space={self.space!r} must be 'latent' or 'concept'")
        if not self.eps or any(not (np.isfinite(e) and e > 0) for e in self.eps):
            raise ValueError(f"eps={self.eps!r} must be a non-empty list of numbers in (0, inf)")
        if len(set(self.eps)) != len(self.eps):
            raise ValueError(f"eps={self.eps!r} lists a budget twice")
        if self.smoothed and self.scale is None:
            name = "sigma" if self.space == "latent" else "rho"
            raise ValueError(f"smoothed attacks need the noise scale {name}, got None")
        if not self.smoothed and self.scale is not None:
            raise ValueError(f"scale={self.scale!r} is only meaningful with smoothed=True")

    @property
    def noise_name(self) -> str:
        """``sigma`` (latent Gaussian) or ``rho`` (concept flips): the smoothing scale's name."""
        return "sigma" if self.space == "latent" else "rho"


@dataclass(frozen=True)
class _Head:
    """Logits of one head ``h`` of ``apply``: ``(params, x[B, *event]) -> [B, C]``.

    Compared by value, so every batch and budget of a model reuses one APGD compilation.
    """

    apply: Callable
    head: int

    def __call__(self, params, x):
        return self.apply(params, x)[:, self.head]


def attack_keys(root: jax.Array, model_id: int, eps: float, indices: np.ndarray) -> jax.Array:
    """APGD keys ``[B]`` of one (model, ε) for global inputs ``indices[B]``.

    ``fold_in(fold_in(fold_in(fold_in(root, STREAM_ATTACK), model_id), bits(ε)), i)`` with
    ``bits(ε)`` the float32 bit pattern of ε, so equal budgets give equal keys whatever the
    other budgets of the run, and an input's key does not depend on its batch.
    """
    eps_bits = int(np.float32(eps).view(np.uint32))
    key = jax.random.fold_in(stream_key(root, STREAM_ATTACK), model_id)
    key = jax.random.fold_in(key, eps_bits)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(indices, jnp.uint32))


def eot_keys(root: jax.Array, indices: np.ndarray) -> jax.Array:
    """EOT noise keys ``[B]`` of global inputs ``indices[B]``: ``fold_in(fold_in(root, 4), i)``."""
    key = stream_key(root, STREAM_EOT)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(indices, jnp.uint32))


def _pad(x: np.ndarray, size: int) -> np.ndarray:
    """Pad ``x[v, ...]`` to ``[size, ...]`` with copies of its last row (one compiled shape)."""
    if len(x) == size:
        return x
    return np.concatenate([x, np.repeat(x[-1:], size - len(x), axis=0)])


class _Attacker:
    """Everything one run needs per unit, built once so that each model compiles once."""

    def __init__(self, world, job: AttackJob, chunk_size: int | None = None,
                 max_memory: int | None = None):
        self.job = job
        self.world = world
        self.params = world.params
        self.memory = dict(chunk_size=chunk_size, max_memory=max_memory)
        self.root = jax.random.key(job.seed)
        k = world.generator.num_concepts
        if job.space == "latent":
            self.apply_of = world.latent_apply
            self.noise = Gaussian()
        else:
            self.apply_of = world.concept_apply
            self.noise = BernoulliFlips(k)
        self.apply_all = self.apply_of(job.models)
        # One single-head apply per model for PREDICT on its own adversarial points (the
        # all-heads one when there is a single model: one compilation fewer).
        self.apply_one = {
            m: self.apply_all if len(job.models) == 1 else self.apply_of((m,)) for m in job.models
        }
        self.logits = {
            m: Partial(_Head(self.apply_all, h), self.params) for h, m in enumerate(job.models)
        }
        self.model_id = {m: world.model_names.index(m) for m in job.models}
        # Takes the logits function as a pytree argument: params are traced, not baked in.
        self.evaluate = jax.jit(lambda logits_fn, x: logits_fn(x))
        self._chunks: dict[str, int] = {}

    def chunk(self, model: str, example: np.ndarray) -> int:
        """Inputs per APGD call for ``model``: ``--chunk-size``, or what ``max_memory`` fits.

        One attacked input costs a forward and backward pass of the generator and classifier
        (``eot`` of them when smoothed); the batch is the largest power of two of those within
        the memory budget, between ``MIN_ATTACK_CHUNK`` and ``--batch``. Sub-batches do not
        change results: every input has its own random starts and EOT noise.
        """
        job = self.job
        if self.memory["chunk_size"] is not None:
            return max(min(self.memory["chunk_size"], job.batch), 1)
        if model not in self._chunks:
            head = self.logits[model].func

            def gradient(params, x):
                y = jnp.zeros(x.shape[0], jnp.int32)
                return jax.grad(lambda x: -jnp.sum(jax.nn.log_softmax(head(params, x))[
                    jnp.arange(x.shape[0]), y]))(x)

            self._chunks[model] = batch_within_memory(
                gradient, self.params, example.shape[1:], example.dtype,
                max_memory=self.memory["max_memory"], factor=job.eot if job.smoothed else 1,
                minimum=min(MIN_ATTACK_CHUNK, job.batch), maximum=job.batch)
        return self._chunks[model]

    def clean_predictions(self, x: np.ndarray, idx: np.ndarray) -> dict[str, dict]:
        """Per model: clean prediction ``[v]`` (PREDICT when smoothed, argmax otherwise)."""
        if self.job.smoothed:
            counts = self._counts(self.apply_all, x, idx)  # [v, H, C]
            return {
                m: _prediction_fields(predict_counts(counts[:, h], self.job.alpha))
                for h, m in enumerate(self.job.models)
            }
        labels = map_inputs(_argmax(self.apply_all), self.params, x, **self.memory)  # [v, H]
        return {m: {"prediction": labels[:, h]} for h, m in enumerate(self.job.models)}

    def _counts(self, apply_fn, x, idx) -> np.ndarray:
        return count_classes(
            apply_fn,
            self.params,
            x,
            self.noise,
            self.job.scale,
            stream_key(self.root, STREAM_ESTIMATE),
            self.job.n,
            num_classes=self.world.num_classes,
            indices=idx,
            progress=False,
            **self.memory,
        )

    def attack(self, model: str, eps: float, x, labels, idx) -> dict[str, np.ndarray]:
        """Attack ``x[v, *event]`` (global inputs ``idx[v]``) at budget ε; fields ``[v]``.

        Runs APGD on sub-batches of `chunk` inputs (the last padded), so no call holds more
        than the memory budget whatever ``--batch`` is.
        """
        size = self.chunk(model, x)
        parts = [self._attack(model, eps, x[s:s + size], labels[s:s + size], idx[s:s + size],
                              size) for s in range(0, len(x), size)]
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}

    def _attack(self, model: str, eps: float, x, labels, idx, size: int) -> dict[str, np.ndarray]:
        job, valid = self.job, len(x)
        logits_fn = self.logits[model]
        padded_idx = _pad(idx, size)
        if job.smoothed:
            logits_fn = smoothed_logits_fn(
                logits_fn,
                noise=self.noise.perturb,
                noise_param=jnp.float32(job.scale),
                noise_keys=eot_keys(self.root, padded_idx),
                eot=job.eot,
            )
        x_adv, info = apgd(
            logits_fn,
            jnp.asarray(_pad(x, size)),
            jnp.asarray(_pad(labels, size), jnp.int32),
            eps=eps,
            norm=job.norm,
            key=attack_keys(self.root, self.model_id[model], eps, padded_idx),
            n_iter=job.iters,
            n_restarts=job.restarts,
            loss=job.loss,
            attack_all=job.smoothed,
        )
        x_adv = np.asarray(x_adv)[:valid]
        fields = {
            "loss": np.asarray(info.loss)[:valid],
            "perturbation_norm": np.asarray(info.perturbation_norm)[:valid],
            "attack_fooled": np.asarray(info.fooled)[:valid],
        }
        if job.smoothed:
            counts = self._counts(self.apply_one[model], x_adv, idx)[:, 0]  # [v, C]
            fields.update(_prediction_fields(predict_counts(counts, job.alpha)))
        else:
            logits = np.asarray(self.evaluate(self.logits[model], jnp.asarray(_pad(x_adv, size))))
            fields["prediction"] = np.argmax(logits[:valid], axis=-1)
        return fields


@functools.lru_cache(maxsize=32)
def _argmax(apply_fn: Callable) -> Callable:
    """``(params, x[B, *event]) -> int32[B, H]`` argmax of every head (one object: one jit)."""
    return lambda params, x: jnp.argmax(apply_fn(params, x), axis=-1).astype(jnp.int32)


def _prediction_fields(result) -> dict[str, np.ndarray]:
    return {"prediction": result.prediction, "p_value": result.p_value}


def run(
    world,
    job: AttackJob,
    out: str | Path,
    *,
    progress: Callable[[int, int], None] | None = None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
) -> dict[str, Any]:
    """Attack every model of ``job`` at every budget on the agreement pool; resumable.

    Writes ``run.json`` (settings), appends ``records.jsonl`` (one line per input, model and
    ε: index, model, eps, label, clean_prediction, adversarial_prediction, loss,
    perturbation_norm, attack_fooled, robust, seconds; plus clean/adversarial PREDICT
    p-values when smoothed; predictions are ``ABSTAIN`` = −1 when PREDICT abstains) and
    finally ``summary.json``. ``progress(done, total)`` counts (batch, model, ε) units.

    ``chunk_size`` caps the inputs per APGD call and the (input, sample) pairs per engine
    chunk; by default both come from ``max_memory`` (see `_Attacker.chunk`).

    Returns the summary (:func:`summarize_records`).
    """
    out = Path(out)
    world.check_models(job.models)
    check_writable(out)
    with hold(out):
        return _run(world, job, out, progress, chunk_size, max_memory)


# JSON types of the record fields (see `check_types`); smoothed runs add the p-values.
_RECORD_TYPES: dict[str, tuple] = {
    "index": (int,), "model": (str,), "eps": (int, float), "label": (int,),
    "clean_prediction": (int,), "adversarial_prediction": (int,), "loss": (int, float, None),
    "perturbation_norm": (int, float), "attack_fooled": (bool,), "robust": (bool,),
    "seconds": (int, float),
}
_SMOOTHED_TYPES = {"clean_p_value": (int, float), "adversarial_p_value": (int, float)}


def records_of(path: Path, job: AttackJob, indices) -> list[dict]:
    """The checked records of an attack run: one per (input, model, ε) of ``job``.

    Raises `RecordsError` for a malformed line, an input, model or budget that is not part of
    the run, a field of the wrong type, or two different records for one key.
    """
    indices, models, budgets = set(map(int, indices)), set(job.models), set(map(float, job.eps))
    types = {**_RECORD_TYPES, **(_SMOOTHED_TYPES if job.smoothed else {})}

    def check(record: dict) -> None:
        check_types(record, types)
        check_field(record, "index", indices, "an input of this run")
        check_field(record, "model", models, f"one of the run's models {sorted(models)}")
        check_field(record, "eps", budgets, f"one of the run's budgets {sorted(budgets)}")

    return read_records(path, key=lambda r: (r["index"], r["model"], r["eps"]), check=check)


def _run(world, job: AttackJob, out: Path, progress, chunk_size, max_memory) -> dict[str, Any]:
    open_run_dir(out, {"job": asdict(job), "world": world.name})
    memory = dict(chunk_size=chunk_size, max_memory=max_memory)
    pool = agreement_pool(world, job.seed, job.num_inputs, space=job.space, **memory)
    records_path = out / RECORDS
    records = records_of(records_path, job, pool.indices)
    done = {(r["index"], r["model"], r["eps"]) for r in records}
    if job.space == "latent":
        inputs = pool.latents
    else:
        inputs = encode_inputs(world, pool.latents, **memory)
    attacker = _Attacker(world, job, **memory)

    units = [
        (b, m, float(e))
        for b in range(0, job.num_inputs, job.batch)
        for m in job.models
        for e in job.eps
    ]
    total = len(units)
    finished = 0
    if progress:
        progress(finished, total)
    with records_path.open("a") as sink:
        for start in range(0, job.num_inputs, job.batch):
            rows = np.arange(start, min(start + job.batch, job.num_inputs))
            idx = pool.indices[rows]
            todo = [
                (m, e)
                for m in job.models
                for e in map(float, job.eps)
                if any((int(i), m, e) not in done for i in idx)
            ]
            finished += len(job.models) * len(job.eps) - len(todo)
            if not todo:
                continue
            x, labels = inputs[rows], pool.labels[rows]
            clean = attacker.clean_predictions(x, idx)
            for model, eps in todo:
                tic = time.perf_counter()
                adv = attacker.attack(model, eps, x, labels, idx)
                seconds = (time.perf_counter() - tic) / len(rows)
                for r, i in enumerate(idx):
                    if (int(i), model, eps) in done:
                        continue
                    record = _record(int(i), model, eps, int(labels[r]), clean[model], adv, r)
                    sink.write(json_line({**record, "seconds": seconds}))
                sink.flush()
                finished += 1
                if progress:
                    progress(finished, total)

    summary = summarize_records(records_of(records_path, job, pool.indices), job)
    summary["pool"] = {"agreement_inputs": job.num_inputs, "pool_size": pool.pool_size}
    write_json(out / SUMMARY, summary)
    return summary


def _record(index, model, eps, label, clean, adv, r) -> dict[str, Any]:
    """One JSONL record; ``robust`` = correct at the clean and at the adversarial point."""
    clean_pred, adv_pred = int(clean["prediction"][r]), int(adv["prediction"][r])
    record = {
        "index": index,
        "model": model,
        "eps": eps,
        "label": label,
        "clean_prediction": clean_pred,
        "adversarial_prediction": adv_pred,
        "loss": finite_or_none(adv["loss"][r]),
        "perturbation_norm": float(adv["perturbation_norm"][r]),
        "attack_fooled": bool(adv["attack_fooled"][r]),
        "robust": clean_pred == label and adv_pred == label,
    }
    if "p_value" in adv:
        record["clean_p_value"] = float(clean["p_value"][r])
        record["adversarial_p_value"] = float(adv["p_value"][r])
    return record


def summarize_records(records: list[dict], job: AttackJob) -> dict[str, Any]:
    """Per model: clean accuracy, and per ε robust accuracy, abstain rate, mean norm and loss.

    Clean accuracy is read from the first budget's records (all budgets share the clean
    prediction). Abstentions (``ABSTAIN``) count as wrong. Records are sorted by input index,
    so the summary does not depend on resumption.
    """
    result: dict[str, Any] = {
        "space": job.space,
        "norm": job.norm,
        "loss": job.loss,
        "smoothed": job.smoothed,
        job.noise_name: job.scale,
        "eps": [float(e) for e in job.eps],
        "models": {},
    }
    for model in job.models:
        per_eps = []
        clean_acc = None
        for eps in map(float, job.eps):
            rows = sorted(
                (r for r in records if r["model"] == model and r["eps"] == eps),
                key=lambda r: r["index"],
            )
            labels = np.array([r["label"] for r in rows], np.int64)
            clean = np.array([r["clean_prediction"] for r in rows], np.int64)
            adv = np.array([r["adversarial_prediction"] for r in rows], np.int64)
            robust = np.array([r["robust"] for r in rows], bool)
            if clean_acc is None:
                clean_acc = _mean(clean == labels)
            per_eps.append(
                {
                    "eps": eps,
                    "num_inputs": len(rows),
                    "robust_accuracy": _mean(robust),
                    "adversarial_abstain_rate": _mean(adv == ABSTAIN),
                    "mean_perturbation_norm": _mean([r["perturbation_norm"] for r in rows]),
                    "mean_loss": _mean([r["loss"] for r in rows if r["loss"] is not None]),
                }
            )
        result["models"][model] = {"clean_accuracy": clean_acc, "budgets": per_eps}
    return result


def _mean(values) -> float | None:
    values = np.asarray(values, np.float64)
    return float(values.mean()) if values.size else None


__all__ = ["AttackJob", "attack_keys", "eot_keys", "run", "summarize_records"]
