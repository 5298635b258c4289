"""Empirical robustness runs (SPEC §3): pool → agreement set → perturbations → records → table.

A run perturbs the first M inputs of the std/cbm agreement set of a generated pool at every
geometric budget ε (``z̃ = z + ε u``, u uniform on the unit sphere or in the unit ball), every
semantic budget τ (flip τ uniformly chosen concepts of ``c = E(g1(z))``) and every smoothing
budget — Gaussian σ (``z̃ = z + σ ε``) and Bernoulli ρ (each concept of c flipped w.p. ρ), the
noises of ``certify latent`` / ``certify concept`` — evaluates every model on the clean and the
perturbed images, and appends one JSONL record per input to ``<budget>.jsonl`` (e.g.
``eps0.3.jsonl``, ``tau5.jsonl``, ``sigma0.1.jsonl``, ``rho0.2.jsonl``) as each batch of inputs
finishes.
``summary.json`` is rebuilt from the records only: k random subsets of n agreement inputs,
mean ± sd over subsets of CFR, PFR per model and DFS, paired tests of PFR differences,
Holm–Bonferroni over every test of the run (`protocol.build_table`).

Clean references: the geometric clean image is ``g(z) = g2(D(E(g1(z))))``; the semantic one is
the autoencoded ``g2(D(E(g1(z))))`` (SPEC §1). With the `Generator` protocol both are the same
image, so one agreement set serves every budget; each record still stores the clean predictions
of its own kind.

Noise: sample j of global pool input i at any budget of one kind comes from
``sample_key(fold_in(root, Stream.GEOMETRIC or SEMANTIC), i, j)``. Sharing the draw across
the budgets of a kind (common random numbers) means an input moves in the same direction at
every ε and flips nested concept sets at every τ (``FixedFlips`` ranks concepts by one random
permutation), so differences between budgets are not sampling noise; each budget on its own has
exactly the distribution of SPEC §1. σ and ρ budgets draw sample j from
``sample_key(fold_in(root, Stream.ESTIMATE), i, j)``: exactly the estimation noise of ``certify
latent --sigma σ`` / ``certify concept --rho ρ`` with the same seed, so their PFR is the
fraction of the certificate's own noisy samples that leave the clean prediction. Records depend
only on ``(seed, i, j)`` (their float32 ``dfs`` also, up to rounding, on the batch and chunk an
input falls in: docs/reproducibility.md), so a resumed run writes the same records and summary
as an uninterrupted one, bit for bit with the same ``batch``.

Size: ~420 lines: the job, its budgets, the run loop with resumption, records and the summary
of the empirical protocol (its statistics live in `cbcert.robustness`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from cbcert.engine.keys import Stream, stream_key
from cbcert.engine.sampler import map_inputs, map_samples
from cbcert.robustness import protocol, stats
from cbcert.runs import explanations
from cbcert.runs.budgets import BUDGET_KINDS, budget_name, observer
from cbcert.runs.certify import check_models
from cbcert.runs.directory import RunSummary, check_field, json_line, read_records
from cbcert.runs.pool import agreement_pool, encode_inputs
from cbcert.runs.session import session
from cbcert.schema import ConfigError, validate

CONCEPT_MODELS = ("cbm", "cbmh")


@dataclass(frozen=True)
class PerturbJob:
    """Settings of one empirical robustness run.

    Attributes:
      eps: geometric budgets ε > 0 (latent L2 shift norms).
      tau: semantic budgets τ >= 1 (numbers of flipped concepts, at most K of the world).
      sigma: smoothing budgets σ (latent Gaussian noise std, `certify latent`'s noise).
      rho: smoothing budgets ρ in (0, ½) (independent concept flips, `certify concept`'s).
      models: models evaluated on the same images; PFR differences compare ``models[0]`` with
        each other model, so at least two are needed.
      seed: root seed of the pool, the noise and the subsets.
      samples: perturbations per input and budget, S >= 1.
      ball: ε-shifts uniform in the ball instead of on the sphere.
      num_subsets: k >= 2 subsets of the paired design; subset_size: n >= 1 inputs per subset.
      num_inputs: M agreement inputs perturbed (the subsets are drawn among them), >= n;
        0 means the default 2 n, so that subsets overlap by about half.
      batch: inputs per engine call (unit of progress and resumption); records do not depend
        on it beyond float32 rounding (docs/reproducibility.md), so ``run.json`` records it
        but a rerun may change it.
      explain: also record cbm/cbmh/proto explanations, clean and perturbed, and report their
        stability (`cbcert.runs.explanations`); off by default (larger records).
    """

    eps: tuple[float, ...] = (0.05, 0.1, 0.3, 0.5, 0.8)
    tau: tuple[int, ...] = (1, 2, 5, 10)
    models: tuple[str, ...] = ("std", "cbm", "proto")
    seed: int = 0
    samples: int = 1
    ball: bool = False
    num_subsets: int = 5
    subset_size: int = 200
    num_inputs: int = 0
    batch: int = 100
    sigma: tuple[float, ...] = ()
    rho: tuple[float, ...] = ()
    explain: bool = False

    def __post_init__(self):
        object.__setattr__(self, "eps", tuple(float(e) for e in self.eps))
        object.__setattr__(self, "tau", tuple(int(t) for t in self.tau))
        object.__setattr__(self, "sigma", tuple(float(s) for s in self.sigma))
        object.__setattr__(self, "rho", tuple(float(r) for r in self.rho))
        object.__setattr__(self, "models", tuple(self.models))
        if self.num_inputs == 0:
            object.__setattr__(self, "num_inputs", 2 * self.subset_size)
        if not (self.eps or self.tau or self.sigma or self.rho):
            raise _error("eps", (), "give at least one budget (eps, tau, sigma or rho)")
        for kind in BUDGET_KINDS:
            budgets, rule = getattr(self, kind), BUDGET_KINDS[kind].rule
            for value in budgets:
                validate(rule, value, key=kind)
            if len(set(budgets)) != len(budgets):
                raise _error(kind, budgets, f"give each budget once, got {list(budgets)}")
        check_models(self.models, minimum=2)
        if not isinstance(self.explain, bool):
            raise _error("explain", self.explain, "expected true or false")
        validate("seed", self.seed, key="seed")
        validate("samples", self.samples, key="samples")
        validate("subsets", self.num_subsets, key="num_subsets")
        for key in ("subset_size", "batch"):
            validate("count", getattr(self, key), key=key)
        if self.num_inputs < self.subset_size:
            raise _error("num_inputs", self.num_inputs,
                         f"got {self.num_inputs}, allowed range [subset_size="
                         f"{self.subset_size}, inf)")

    @property
    def budgets(self) -> tuple[tuple[str, float], ...]:
        """``(kind, value)`` of every budget: ε, τ, σ, ρ in that order."""
        return tuple((kind, v) for kind in BUDGET_KINDS for v in getattr(self, kind))

    @property
    def concept_models(self) -> tuple[str, ...]:
        """Requested models with concept scores r, whose DFS is reported."""
        return tuple(m for m in self.models if m in CONCEPT_MODELS)

    def settings(self) -> dict[str, Any]:
        """What the records depend on (everything but the budget lists), JSON-ready."""
        d = asdict(self)
        for kind in BUDGET_KINDS:
            del d[kind]
        if not self.explain:  # runs from before the option pin the same settings
            del d["explain"]
        else:  # runs from before proto explained its predictions stop instead of mixing
            d["explained_models"] = list(explanations.explained_models(self.models))
        return {**d, "models": list(self.models)}

    def budget_lists(self) -> dict[str, list]:
        """``{"eps": [...], "tau": [...]}`` plus ``sigma`` / ``rho`` when the run has any (a
        summary without smoothing budgets reads as before they existed)."""
        return {kind: list(getattr(self, kind)) for kind in BUDGET_KINDS
                if kind in ("eps", "tau") or getattr(self, kind)}


def _error(key: str, value, detail: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {detail}", key=key, value=value, detail=detail)


@dataclass(frozen=True)
class _Kind:
    """Everything one kind of budget (geometric or semantic) needs, built once per run."""

    inputs: np.ndarray  # [M, *event] in the perturbation space
    noise: Any
    key: jax.Array
    clean: Callable  # observe, for `map_inputs`
    perturbed: Callable  # map_samples body: observe on the noisy inputs


def _kinds(world, job: PerturbJob, latents: np.ndarray, root: jax.Array,
           memory: dict) -> dict[str, _Kind]:
    """The `_Kind` of every budget kind the job uses (concept inputs encoded once)."""
    scores, protos = bool(job.concept_models), job.explain and explanations.PROTO in job.models
    used = {kind for kind, _ in job.budgets}
    concepts = None
    kinds = {}
    for kind, spec in BUDGET_KINDS.items():
        if kind not in used:
            continue
        observe = observer(world, spec.space, job.models, scores, prototypes=protos)
        if spec.space == "latent":
            inputs = latents
        else:
            if concepts is None:
                concepts = encode_inputs(world, latents, **memory)
            inputs = concepts
        noise = world.noise(spec.noise(kind, world.generator.num_concepts, job.ball), spec.space)
        kinds[kind] = _Kind(inputs, noise, stream_key(root, spec.stream), observe,
                            lambda params, x_clean, x_noisy, f=observe: f(params, x_noisy))
    return kinds


def _bits(state: np.ndarray) -> str:
    return "".join("1" if s else "0" for s in state)


def _records(job: PerturbJob, pool, rows: np.ndarray, clean: dict, perturbed: dict,
             heads: dict | None = None) -> list[dict]:
    """JSON records of a batch: predictions, concept states, flips, DFS, explanations (heads)."""
    explained = None
    if job.explain:
        explained = explanations.record_fields(heads, job.models, clean, perturbed)
    dfs = None
    if "scores" in clean:
        dfs = stats.decision_shifts(clean["scores"], perturbed["scores"])  # [B, S]
    flips = stats.concept_flip_counts(clean["state"], perturbed["state"])  # [B, S]
    records = []
    for b, row in enumerate(rows):
        samples = []
        for s in range(job.samples):
            sample = {
                "pred": dict(zip(job.models, map(int, perturbed["pred"][b, s]), strict=True)),
                "concepts": _bits(perturbed["state"][b, s]),
                "concept_flips": int(flips[b, s]),
            }
            if dfs is not None:
                sample["dfs"] = float(dfs[b, s])
            if explained is not None:
                sample["explain"] = explained[1][b][s]
            samples.append(sample)
        clean_record = {"pred": dict(zip(job.models, map(int, clean["pred"][b]), strict=True)),
                        "concepts": _bits(clean["state"][b])}
        if explained is not None:
            clean_record["explain"] = explained[0][b]
        records.append({
            "index": int(pool.indices[row]),
            "label": int(pool.labels[row]),
            **pool.input_fields(row),
            "clean": clean_record,
            "samples": samples,
        })
    return records


def check_budgets(job: PerturbJob, num_concepts: int) -> None:
    """Raise `ConfigError` (key ``tau``) if a budget flips more than the world's K concepts,
    (key ``rho``/``tau``) if the world has no concepts but the job perturbs them."""
    if num_concepts == 0:
        for kind in ("tau", "rho"):
            if getattr(job, kind):
                raise _error(kind, getattr(job, kind), "the world has no concepts (no CB-AE); "
                                                       "concept budgets are unavailable")
    for t in job.tau:
        if t > num_concepts:
            raise _error("tau", t, f"got {t}, allowed range [1, K={num_concepts}] (concepts of "
                                   "the world)")


def run(
    world,
    job: PerturbJob,
    out: str | Path,
    *,
    progress: Callable[[int, int], None] | None = None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
) -> RunSummary:
    """Perturb the agreement inputs at every budget of ``job``, write records and the summary.

    Resumable: inputs already recorded in ``<out>/<budget>.jsonl`` are skipped (only whole
    batches are recomputed, so records stay bit-identical). ``run.json`` pins the settings
    except the budget lists and ``batch``, so a rerun may add budgets to a finished run.

    Args:
      world: a `cbcert.worlds.world.World` offering ``std``, ``cbm`` and ``job.models``.
      job: the run's settings.
      out: output directory.
      progress: ``callback(done, total)`` over (budget, input) pairs.
      chunk_size, max_memory: passed to the engine (``sampler.map_samples``).

    Returns:
      The `RunSummary`: the summary written to ``summary.json``, and the table rows as
      ``extras["rows"]`` (see `summarize`).
    """
    world.check_models(job.models)
    world.check_models(("std", "cbm"))
    k = world.generator.num_concepts
    check_budgets(job, k)
    if job.explain:
        explanations.check(world, job.models)
    heads = explanations.heads(world, job.models) if job.explain else None
    with session(out, "perturb", {"settings": job.settings(), "world": world.name}, world,
                 free=("settings.batch",)) as directory:
        memory = dict(chunk_size=chunk_size, max_memory=max_memory)
        pool = agreement_pool(world, job.seed, job.num_inputs, space="latent", **memory)
        kinds = _kinds(world, job, pool.latents, jax.random.key(job.seed), memory)
        blocks = [np.arange(s, min(s + job.batch, job.num_inputs))
                  for s in range(0, job.num_inputs, job.batch)]
        total, finished = len(job.budgets) * job.num_inputs, 0
        for kind, value in job.budgets:
            name = f"{budget_name(kind, value)}.jsonl"
            done = {r["index"] for r in budget_records(directory.path(name), job, pool.indices)}
            spec = kinds[kind]
            with directory.append(name) as sink:
                for rows in blocks:
                    todo = [row for row in rows if int(pool.indices[row]) not in done]
                    if todo:
                        clean = map_inputs(spec.clean, world.params, spec.inputs[rows], **memory)
                        perturbed = map_samples(
                            spec.perturbed, world.params, spec.inputs[rows], spec.noise,
                            spec.key, job.samples, scale=value, indices=pool.indices[rows],
                            **memory,
                        )
                        for record in _records(job, pool, rows, clean, perturbed, heads):
                            if record["index"] not in done:
                                sink.write(json_line(record))
                        sink.flush()
                    finished += len(rows)
                    if progress:
                        progress(finished, total)

        result = summarize(directory.out, job, pool.indices, k)
        return directory.finish(result.summary, pool, **result.extras)


def budget_records(path: Path, job: PerturbJob, indices) -> list[dict]:
    """The checked records of one budget file: one per agreement input of the run.

    Raises `RecordsError` for a malformed line, an index that is not an input of the run, a
    record missing a model's prediction, or two different records for one input.
    """
    indices = set(map(int, indices))
    models = list(job.models)

    def check(record: dict) -> None:
        check_field(record, "index", indices, "an input of this run")
        for where in (record["clean"]["pred"], *(s["pred"] for s in record["samples"])):
            if sorted(where) != sorted(models):
                raise ValueError(f"predictions for {sorted(where)}, the run's models are "
                                 f"{sorted(models)}")
        if len(record["samples"]) != job.samples:
            raise ValueError(f"{len(record['samples'])} samples, the run draws {job.samples}")

    return read_records(path, key=lambda r: r["index"], check=check)


def measurement(records: Sequence[dict], job: PerturbJob, kind: str, value: float,
                num_concepts: int) -> protocol.BudgetMeasurement:
    """Per-input flips and shifts of one budget from its records, in agreement-set order.

    Records must cover the agreement inputs exactly once each; they are sorted by pool index
    (the agreement set is in increasing pool order).
    """
    records = sorted(records, key=lambda r: r["index"])
    pred_clean = np.array([[r["clean"]["pred"][m] for m in job.models] for r in records])  # [M, H]
    pred_pert = np.array([[[s["pred"][m] for m in job.models] for s in r["samples"]]
                          for r in records])  # [M, S, H]
    flips = np.array([[s["concept_flips"] for s in r["samples"]] for r in records])  # [M, S]
    shifts = {}
    if job.concept_models:
        dfs = np.array([[s["dfs"] for s in r["samples"]] for r in records])  # [M, S]
        shifts = {m: dfs for m in job.concept_models}
    return protocol.BudgetMeasurement(
        kind=kind,
        value=value,
        prediction_flips={m: stats.prediction_flips(pred_clean[:, h], pred_pert[:, :, h])
                          for h, m in enumerate(job.models)},
        concept_flips=flips,
        num_concepts=num_concepts,
        decision_shifts=shifts,
    )


def summarize(out: str | Path, job: PerturbJob, agreement_indices: np.ndarray,
              num_concepts: int) -> RunSummary:
    """The table of a finished run from its records (analysis separate from sampling).

    Subsets: ``protocol.draw_subsets(M, k, n, seed=(job.seed, Stream.SUBSETS))``. Comparisons:
    ``PFR[models[0]] − PFR[m]`` for every other model m, Holm-corrected over all budgets and
    comparisons. DFS of ``cbm`` and ``cbmh`` is the same number, ``‖r(x) − r(x̃)‖₂`` of the
    shared PCBM concept scores.

    The summary is ``{"settings", "budgets": [row.to_dict()...], "subsets": [[pool indices]]}``;
    the rows are ``extras["rows"]`` (for `protocol.table_cells`). Nothing is written.
    """
    out = Path(out)
    expected = set(map(int, agreement_indices))
    measurements, explained = [], []
    for kind, value in job.budgets:
        records = budget_records(out / f"{budget_name(kind, value)}.jsonl", job, expected)
        if {r["index"] for r in records} != expected:
            raise ValueError(f"{out}: records of {budget_name(kind, value)} do not cover the "
                             f"{len(expected)} agreement inputs exactly once; rerun to finish")
        measurements.append(measurement(records, job, kind, value, num_concepts))
        if job.explain:
            records = sorted(records, key=lambda r: r["index"])
            explained.append((kind, value, explanations.measurements(records, job.models)))
    subsets = protocol.draw_subsets(len(expected), num_subsets=job.num_subsets,
                                    subset_size=job.subset_size,
                                    seed=(job.seed, int(Stream.SUBSETS)))
    first = job.models[0]
    rows = protocol.build_table(measurements, subsets,
                                comparisons=[(first, m) for m in job.models[1:]])
    summary = {
        "settings": {**job.settings(), **job.budget_lists()},
        "budgets": [row.to_dict() for row in rows],
        "subsets": np.asarray(agreement_indices)[subsets].tolist(),
    }
    if job.explain:
        summary["explanations"] = explanations.summary(explained, subsets, job.models)
    return RunSummary("perturb", summary, {"rows": rows})


__all__ = [
    "BUDGET_KINDS", "PerturbJob", "budget_name", "check_budgets", "measurement",
    "observer", "run", "summarize",
]
