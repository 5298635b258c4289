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

* pool: ``Stream.POOL`` of ``cbcert.engine.keys`` (same inputs as certification runs);
* APGD random starts of input i (global pool index) for one (model, ε):
  ``fold_in(fold_in(fold_in(fold_in(root, Stream.ATTACK), model_id), bits(ε)), i)``, then
  ``fold_in(·, r)`` for restart r, with ``model_id`` the model's position in
  ``World.model_names`` and ``bits(ε)`` the float32 bit pattern of ε; so results do not
  depend on ``batch`` or on which other models or budgets a run includes, and a resumed run
  repeats exactly the first one;
* EOT noise of input i (global pool index): ``fold_in(fold_in(root, Stream.EOT), i)``,
  shared by models and budgets;
* PREDICT noise: ``Stream.ESTIMATE`` with ``sample_key(·, i, j)``, as ``certify predict``,
  for the clean and the adversarial point alike (common random numbers); independent of
  the EOT noise the attacker saw.

With ``explain`` (base attacks), each record of a model that explains (``cbm``, ``cbmh`` by
concepts, ``proto`` by prototypes; `cbcert.runs.explanations`) adds ``explain``: the model's
top-5 explanation at the clean and at the adversarial point (``clean``, ``adversarial``:
``[[unit, share], ...]``), their Jaccard ``overlap`` and Kendall τ-b (``kendall``, null where
undefined); the summary adds per model and ε the mean overlap and τ over inputs, overall and
over the inputs the attack fooled (correct at the clean point, wrong at the adversarial one).
Cost: one forward pass of the attacked model at the clean and at the adversarial point per
(batch, model, ε).

Per-input records go to ``records.jsonl`` as each (batch, model, ε) unit finishes; a rerun
with the same output directory skips finished units, and the resumed summary equals an
uninterrupted run's.

On CPU the units of a batch run two at a time (`cbcert.runs.units`): the same records, in the
same order, in about half the time on a 2-core machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from cbcert.certify.cohen import ABSTAIN
from cbcert.certify.smoothing import of_space
from cbcert.engine.sampler import map_inputs
from cbcert.runs import explanations
from cbcert.runs.attacker import Attacker
from cbcert.runs.budgets import observer
from cbcert.runs.certify import check_models
from cbcert.runs.directory import (
    RunSummary,
    check_field,
    check_types,
    finite_or_none,
    json_line,
    read_records,
)
from cbcert.runs.pool import agreement_pool, space_inputs
from cbcert.runs.session import Session, session
from cbcert.runs.units import Units, split_budget, units_at_once
from cbcert.schema import ConfigError, validate

EXPLAINS = explanations.EXPLAINED


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
      batch: inputs per APGD call (unit of progress and of resumption); records do not depend
        on it beyond float32 rounding (docs/reproducibility.md), so ``run.json`` records it
        but a rerun may change it.
      explain: record the explaining models' explanations at the clean and the adversarial
        point (base attacks; module docstring).
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
    explain: bool = False

    def __post_init__(self) -> None:
        noise = of_space(self.space)
        if not self.eps:
            raise _error("eps", (), "give one or more budgets")
        for value in self.eps:
            validate("eps", value, key="eps")
        if len(set(self.eps)) != len(self.eps):
            raise _error("eps", self.eps, f"give each budget once, got {list(self.eps)}")
        if self.smoothed and self.scale is None:
            raise _error(noise.key, None, f"smoothed attacks need the noise scale {noise.key}")
        if not self.smoothed and self.scale is not None:
            raise _error(noise.key, self.scale, "only meaningful with smoothed=True")
        if self.smoothed:
            noise.check(self.scale)
        for key in ("iters", "restarts", "num_inputs", "batch"):
            validate("count", getattr(self, key), key=key)
        for key in ("eot", "n"):
            validate("samples", getattr(self, key), key=key)
        validate("alpha", self.alpha, key="alpha")
        validate("seed", self.seed, key="seed")
        check_models(self.models)
        if not isinstance(self.explain, bool):
            raise _error("explain", self.explain, "expected true or false")
        if self.explain and self.smoothed:
            raise _error("explain", True, "explanations are recorded for base attacks only (a "
                                          "smoothed prediction has no single forward pass)")
        if self.explain and not self.explained:
            raise _error("explain", True, f"models {list(self.models)} name no model that "
                                          f"explains ({', '.join(EXPLAINS)})")

    @property
    def explained(self) -> tuple[str, ...]:
        """The attacked models whose explanations are recorded (with ``explain``)."""
        return tuple(m for m in self.models if m in EXPLAINS)

    def settings(self) -> dict[str, Any]:
        """What the records depend on, JSON-ready (pinned in ``run.json``)."""
        d = asdict(self)
        if not self.explain:  # runs from before the option pin the same settings
            del d["explain"]
        return d

    @property
    def noise_name(self) -> str:
        """``sigma`` (latent Gaussian) or ``rho`` (concept flips): the smoothing scale's name."""
        return of_space(self.space).key


def _error(key: str, value, detail: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {detail}", key=key, value=value, detail=detail)


def run(
    world,
    job: AttackJob,
    out: str | Path,
    *,
    progress: Callable[[int, int], None] | None = None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
    units: int | None = None,
) -> RunSummary:
    """Attack every model of ``job`` at every budget on the agreement pool; resumable.

    Writes ``run.json`` (settings), appends ``records.jsonl`` (one line per input, model and
    ε: index, model, eps, label, clean_prediction, adversarial_prediction, loss,
    perturbation_norm, attack_fooled, robust, seconds; plus clean/adversarial PREDICT
    p-values when smoothed; predictions are ``ABSTAIN`` = −1 when PREDICT abstains) and
    finally ``summary.json``. ``progress(done, total)`` counts (batch, model, ε) units.

    ``chunk_size`` caps the inputs per APGD call and the (input, sample) pairs per engine
    chunk; by default both come from ``max_memory`` (see `cbcert.runs.attacker.Attacker.chunk`).
    ``units``: (batch, model, ε) units run at once (`cbcert.runs.units.units_at_once`; None:
    its default, 2 on CPU). A record's ``seconds`` is the wall time from the previous unit's
    records (or the batch's clean predictions) to its own, over the batch's inputs, so a run's
    records sum to its attack time whatever ``units`` is.

    Returns the `RunSummary` (:func:`summarize_records`).
    """
    units = units_at_once(units)
    world.check_models(job.models)
    if job.explain:
        explanations.check(world, job.explained)
    with session(out, "attack", {"job": job.settings(), "world": world.name}, world,
                 free=("job.batch",)) as directory:
        return _run(world, job, directory, progress, chunk_size, max_memory, units)


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


def _run(world, job: AttackJob, directory: Session, progress, chunk_size,
         max_memory, at_once: int) -> RunSummary:
    memory = dict(chunk_size=chunk_size, max_memory=max_memory)
    pool = agreement_pool(world, job.seed, job.num_inputs, space=job.space, **memory)
    records_path = directory.path()
    records = records_of(records_path, job, pool.indices)
    done = {(r["index"], r["model"], r["eps"]) for r in records}
    inputs = space_inputs(world, pool.latents, job.space, **memory)
    # The units at once and the explainer (main thread, beside them) share an explicit budget.
    shared = dict(chunk_size=chunk_size, max_memory=split_budget(max_memory, at_once))
    attacker = Attacker(world, job, **shared)
    explainer = _Explainer(world, job, shared) if job.explain else None

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
    with directory.append() as sink, Units(at_once) as run_units:
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
            tic = time.perf_counter()
            results = run_units(lambda unit, x=x, labels=labels, idx=idx:
                                attacker.attack(*unit, x, labels, idx), todo)
            for (model, eps), adv in zip(todo, results, strict=True):
                toc = time.perf_counter()
                seconds, tic = (toc - tic) / len(rows), toc
                explained = (explainer(model, x, adv["point"])
                             if explainer and model in job.explained else None)
                for r, i in enumerate(idx):
                    if (int(i), model, eps) in done:
                        continue
                    record = _record(int(i), model, eps, int(labels[r]), clean[model], adv, r)
                    if explained is not None:
                        record["explain"] = explained[r]
                    sink.write(json_line({**record, **pool.input_fields(rows[r]),
                                          "seconds": seconds}))
                sink.flush()
                finished += 1
                if progress:
                    progress(finished, total)

    return directory.finish(summarize_records(records_of(records_path, job, pool.indices), job),
                            pool)


class _Explainer:
    """``(model, x[v], x_adv[v]) -> [v]`` explanation fields of one model at the clean and the
    adversarial points (`cbcert.runs.explanations.record_fields` with one "sample")."""

    def __init__(self, world, job: AttackJob, memory: dict):
        self.world, self.memory = world, memory
        self.heads = explanations.heads(world, job.explained)
        # One observer per model for the whole run: the engine's jit cache keys on it.
        self.observe = {m: observer(world, job.space, (m,), True,
                                    prototypes=m == explanations.PROTO) for m in job.explained}

    def __call__(self, model: str, x: np.ndarray, x_adv: np.ndarray) -> list[dict]:
        clean, adv = (map_inputs(self.observe[model], self.world.params, a, **self.memory)
                      for a in (x, x_adv))
        adv = {name: value[:, None] for name, value in adv.items()}  # one "sample"
        fields = explanations.record_fields({model: self.heads[model]}, (model,), clean, adv)
        return [{"clean": c[model], "adversarial": a[0][model]["cited"],
                 "overlap": a[0][model]["overlap"], "kendall": a[0][model]["kendall"]}
                for c, a in zip(*fields, strict=True)]


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
    """Per model: clean accuracy, and per ε robust accuracy, abstain rate, mean norm and loss
    (with ``explain``: ``explanation_{overlap,kendall}[_fooled]``, `_explanation_means`).

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
                    **_explanation_means(rows),
                }
            )
        result["models"][model] = {"clean_accuracy": clean_acc, "budgets": per_eps}
    return result


def _explanation_means(rows: list[dict]) -> dict[str, float | None]:
    """Mean explanation overlap and Kendall τ (defined ones) at the adversarial point, over
    all inputs and over those the attack fooled (correct at the clean point, wrong at the
    adversarial one); {} without explanations."""
    if not rows or "explain" not in rows[0]:
        return {}
    fooled = [r for r in rows if r["clean_prediction"] == r["label"]
              and r["adversarial_prediction"] != r["label"]]
    return {f"explanation_{name}{suffix}": _mean([r["explain"][name] for r in subset
                                                  if r["explain"][name] is not None])
            for suffix, subset in (("", rows), ("_fooled", fooled))
            for name in ("overlap", "kendall")}


def _mean(values) -> float | None:
    values = np.asarray(values, np.float64)
    return float(values.mean()) if values.size else None


__all__ = ["AttackJob", "records_of", "run", "summarize_records"]
