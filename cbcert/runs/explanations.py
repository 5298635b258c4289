"""Explanations in run records: perturb runs (`PerturbJob.explain`), attack runs
(`AttackJob.explain`) and the heads `certify explain` uses.

With ``explain`` on, a perturb record carries, for every model m that explains (``cbm``,
``cbmh`` by the world's concepts; ``proto`` by its prototypes):

* ``clean.explain[m]``: the clean explanation, ``[[unit, share], ...]`` ranked (top k = 5,
  `cbcert.robustness.explain.explain`; a unit is a concept, or a prototype for proto), and
* ``samples[s].explain[m]``: ``{"cited": [[unit, share], ...], "overlap": J, "kendall": τ}``,
  the perturbed explanation, its top-k Jaccard overlap with the clean one and the Kendall τ-b of
  their contributions over the units either cites (null where undefined).

Contributions are ``a_i · W[y, i]`` (`Head`), y the model's own prediction on the (clean or
perturbed) image: for cbm/cbmh a = r, the PCBM's concept scores, and W the world's concept head
(`World.concept_head`; both share W, PCBM-h's residual on e cites no concept — `certify explain`
reports its share of the logit); for proto a = s,
its prototype similarities, and W its readout (`World.prototype_head`). Cost: the concept
scores are already computed for DFS; proto's similarities are one more output of the observer
(its backbone features are the ones the proto logits use); the host ranks K concepts (P
prototypes) per model and sample, and the records grow by about 100 bytes per model and sample.

`summary` adds per budget and explaining model the mean ± sd over the run's subsets of the
overlap and of τ (τ averaged over the inputs where it is defined), and paired sign-flip
permutation tests over inputs of the overlap of the first explaining model against each other,
Holm-corrected over the run's budgets — the statistics PFR gets (`cbcert.robustness.protocol`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbcert.engine.keys import Stream, sample_key, stream_key
from cbcert.robustness import explain as ex
from cbcert.robustness import stats
from cbcert.schema import ConfigError

TOP_K = ex.DEFAULT_TOP_K
PROTO = "proto"
CONCEPT_MODELS = ("cbm", "cbmh")  # explained by the world's concepts
EXPLAINED = (*CONCEPT_MODELS, PROTO)  # proto: by its prototypes


def edit_keys(seed: int, indices: np.ndarray, slots: int) -> jax.Array:
    """``[N · slots]`` keys of counterfactual edits (`World.edit`), input-major: edit slot j
    of global input i draws from ``sample_key(stream_key(key(seed), EDIT), i, j)``, so an
    edit's draws do not depend on the other inputs or on the model explained."""
    stream = stream_key(jax.random.key(seed), Stream.EDIT)
    i = jnp.repeat(jnp.asarray(indices, jnp.int32), slots)
    j = jnp.tile(jnp.arange(slots, dtype=jnp.int32), len(indices))
    return jax.vmap(lambda a, b: sample_key(stream, a, b))(i, j)


def explained_models(models: Sequence[str]) -> tuple[str, ...]:
    """The models of ``models`` whose explanations are recorded (concept models and proto)."""
    return tuple(m for m in models if m in EXPLAINED)


def check(world, models: Sequence[str]) -> None:
    """`ConfigError` unless ``models`` name a model that explains (key ``explain``) and the
    world exposes its head: the concept head for ``cbm``/``cbmh`` (key ``explain``), the
    prototype head for ``proto`` (key ``world``)."""
    if not explained_models(models):
        detail = f"models {list(models)} name no model that explains ({', '.join(EXPLAINED)})"
        raise ConfigError(f"explain: {detail}", key="explain", value=True, detail=detail)
    if any(m in CONCEPT_MODELS for m in models) and world.concept_head is None:
        detail = f"{world.name} does not expose its CBM's concept head"
        raise ConfigError(f"explain: {detail}", key="explain", value=True, detail=detail)
    shared = (world.metadata or {}).get("concept_head_models", CONCEPT_MODELS)
    other = [m for m in models if m in CONCEPT_MODELS and m not in shared]
    if other:
        detail = (f"{world.name}: {', '.join(other)} does not share the cbm's concept "
                  "bottleneck (backbone, CAVs, head), so the concept head does not explain it; "
                  f"explain {', '.join(shared)}")
        raise ConfigError(f"models: {detail}", key="models", value=list(models), detail=detail)
    if PROTO in models and (world.prototypes is None or world.prototype_head is None):
        detail = f"{world.name} does not expose its prototype network's head (built-in worlds do)"
        raise ConfigError(f"world: {detail}", key="world", value=world.name, detail=detail)


def head(world) -> np.ndarray:
    """``W[C, K]`` of the world's concept head, float64 on host."""
    w, _ = world.concept_head(world.params["clf"])
    return np.asarray(w, np.float64)


def concept_names(world) -> tuple[str, ...]:
    """Names of the CBM's concepts (the units cbm/cbmh cite): the generator's on built-in worlds
    (the PCBM reads the world's own concepts), the PCBM's concept bank on world directories
    (``metadata["cbm_concept_names"]``; unrelated to the CB-AE's concepts)."""
    names = (world.metadata or {}).get("cbm_concept_names")
    return tuple(names) if names else tuple(world.generator.concept_names)


def edit_mapping(world) -> np.ndarray | None:
    """``[units]`` int: the generator concept each concept of the CBM names (the same name;
    ``-1`` where the generator has none), so that a cited concept can be edited in the
    generator's concept space; None when none can (a generator without concepts, or no name in
    common). On built-in worlds the PCBM reads the generator's own concepts: the identity."""
    gen = world.generator
    if not gen.num_concepts or world.concept_head is None:
        return None
    index = {name: i for i, name in enumerate(gen.concept_names)}
    mapping = np.array([index.get(name, -1) for name in concept_names(world)], np.int64)
    return mapping if (mapping >= 0).any() else None


@dataclass(frozen=True)
class Head:
    """What one explained model cites: ``unit`` (``concept`` or ``prototype``), the observer
    key of its activations (``scores``: concept scores r; ``prototypes``: similarities s), its
    weights ``W[C, units]`` (float64), the units' names, the key of its certificate counts in
    `cbcert.runs.explain` (``signs`` / ``members``), the head's bias ``b[C]`` (concept heads;
    None for prototypes) and whether the model adds a residual on the embedding to ``r Wᵀ + b``
    (``cbmh``, PCBM-h: its logit is ``Σ_i r_i W[y, i] + b_y + ρ_y(e)``)."""

    unit: str
    activations: str
    weights: np.ndarray
    names: tuple[str, ...]
    counts: str
    bias: np.ndarray | None = None
    residual: bool = False


def heads(world, models: Sequence[str]) -> dict[str, Head]:
    """`Head` of every model of ``models`` that explains: ``cbm``/``cbmh`` by the world's
    concepts (`World.concept_head`; the cbmh's head is the same ``W, b`` plus its residual, as
    PCBM-h is trained), ``proto`` by its prototypes (`World.prototype_head`,
    named ``p<j> (<class it was made for>)``)."""
    out = {}
    concept = [m for m in models if m in CONCEPT_MODELS]
    if concept:
        w, b = world.concept_head(world.params["clf"])
        w, b = np.asarray(w, np.float64), np.asarray(b, np.float64)
        names = concept_names(world)
        out |= {m: Head("concept", "scores", w, names, "signs", b, residual=m == "cbmh")
                for m in concept}
    if PROTO in models:
        w, owner = world.prototype_head(world.params["clf"])
        names = tuple(f"p{j} ({world.class_names[int(c)]})" for j, c in enumerate(owner))
        out[PROTO] = Head("prototype", "prototypes", np.asarray(w, np.float64), names, "members")
    return out


def _cited(e: ex.Explanation, row: int) -> list[list]:
    return [[int(i), float(s)] for i, s in zip(e.concepts[row], e.shares[row], strict=True)
            if i >= 0]


def record_fields(explained: dict[str, Head], models: Sequence[str], clean: dict,
                  perturbed: dict) -> tuple[list[dict], list[list[dict]]]:
    """Explanation fields of one batch of records.

    Args:
      explained: the `Head` of every explained model (`heads`).
      models: the run's models (the order of the ``pred`` columns).
      clean: observer outputs on the clean images: ``pred[B, H]`` and each head's
        activations (``scores[B, K]``, ``prototypes[B, P]``).
      perturbed: the same on the perturbed images, ``[B, S, ...]``.

    Returns:
      ``(clean_fields[B], sample_fields[B][S])``: ``{model: cited}`` and ``{model: {"cited",
      "overlap", "kendall"}}`` for every explained model.
    """
    b, s = perturbed["pred"].shape[:2]
    clean_fields: list[dict] = [{} for _ in range(b)]
    sample_fields: list[list[dict]] = [[{} for _ in range(s)] for _ in range(b)]
    for m, hd in explained.items():
        h = list(models).index(m)
        k = hd.weights.shape[1]
        c_clean = ex.contributions(clean[hd.activations], hd.weights, clean["pred"][:, h])
        c_pert = ex.contributions(perturbed[hd.activations].reshape(b * s, k), hd.weights,
                                  perturbed["pred"][:, :, h].reshape(b * s))  # [B S, K]
        e_clean, e_pert = ex.explain(c_clean, TOP_K), ex.explain(c_pert, TOP_K)
        repeat = np.repeat(np.arange(b), s)
        overlap = ex.top_k_overlap(e_clean.concepts[repeat], e_pert.concepts)
        kendall = ex.rank_correlation(c_clean[repeat], c_pert, e_clean.concepts[repeat],
                                      e_pert.concepts)
        for row in range(b):
            clean_fields[row][m] = _cited(e_clean, row)
            for j in range(s):
                flat = row * s + j
                sample_fields[row][j][m] = {
                    "cited": _cited(e_pert, flat), "overlap": float(overlap[flat]),
                    "kendall": None if np.isnan(kendall[flat]) else float(kendall[flat])}
    return clean_fields, sample_fields


def measurements(records: Sequence[dict], models: Sequence[str]) -> dict[str, dict]:
    """Per explained model: ``{"overlap": [M, S], "kendall": [M, S]}`` (NaN: undefined) from
    records sorted by pool index."""
    out = {}
    for m in explained_models(models):
        fields = [[sample["explain"][m] for sample in r["samples"]] for r in records]
        out[m] = {
            "overlap": np.array([[f["overlap"] for f in row] for row in fields], np.float64),
            "kendall": np.array([[np.nan if f["kendall"] is None else f["kendall"]
                                  for f in row] for row in fields], np.float64)}
    return out


def _defined_mean(values: np.ndarray, subsets: np.ndarray) -> stats.MeanSD:
    """Mean ± sd over subsets of the per-input mean of the defined (non-NaN) values; NaN when a
    subset has no defined value."""
    with warnings.catch_warnings():  # "mean of empty slice": NaN is the documented result
        warnings.simplefilter("ignore", RuntimeWarning)
        per_input = np.nanmean(values, axis=1)  # [M], NaN where no sample defines it
        per_subset = np.array([np.nanmean(per_input[sub]) for sub in subsets])
    if np.isnan(per_subset).any():
        return stats.MeanSD(float("nan"), float("nan"))
    return stats.mean_sd(per_subset)


def summary(per_budget: Sequence[tuple[str, float, dict]], subsets: np.ndarray,
            models: Sequence[str]) -> list[dict[str, Any]]:
    """The ``explanations`` block of a perturb summary (module docstring).

    Args:
      per_budget: ``(kind, value, measurements(...))`` of every budget, in run order.
      subsets: ``[k, n]`` positions into the agreement set (the PFR subsets).
      models: the run's models.
    """
    explained = explained_models(models)
    rows, tests = [], []
    for kind, value, measured in per_budget:
        row = {"kind": kind, "value": value, "overlap": {}, "kendall": {}, "comparisons": []}
        for m in explained:
            row["overlap"][m] = stats.mean_sd(
                stats.subset_means(measured[m]["overlap"], subsets)).to_dict()
            kendall = _defined_mean(measured[m]["kendall"], subsets)
            row["kendall"][m] = ({"mean": None, "sd": None} if np.isnan(kendall.mean)
                                 else kendall.to_dict())
        first = explained[0]
        for other in explained[1:]:
            a = stats.per_input_mean(measured[first]["overlap"])
            b = stats.per_input_mean(measured[other]["overlap"])
            test = stats.paired_permutation_test(a, b)
            row["comparisons"].append({"model_a": first, "model_b": other,
                                       "metric": "overlap", "delta": float(np.mean(a - b)),
                                       "pvalue": float(test.pvalue)})
            tests.append(row["comparisons"][-1])
        rows.append(row)
    if tests:
        for test, adjusted in zip(tests, stats.holm(np.array([t["pvalue"] for t in tests])),
                                  strict=True):
            test["pvalue_holm"] = float(adjusted)
    return rows


__all__ = ["CONCEPT_MODELS", "EXPLAINED", "PROTO", "TOP_K", "Head", "check", "edit_keys",
           "edit_mapping", "explained_models", "head", "heads", "measurements",
           "record_fields", "summary"]
