"""Explanation stability in perturb runs: records and summary (`PerturbJob.explain`).

With ``explain`` on, a perturb record carries, for every concept model m (``cbm``, ``cbmh``):

* ``clean.explain[m]``: the clean explanation, ``[[concept, share], ...]`` ranked (top k = 5,
  `cbcert.robustness.explain.explain`), and
* ``samples[s].explain[m]``: ``{"cited": [[concept, share], ...], "overlap": J, "kendall": τ}``,
  the perturbed explanation, its top-k Jaccard overlap with the clean one and the Kendall τ-b of
  their contributions over the concepts either cites (null where undefined).

Contributions are ``r_i · W[y, i]``: r the PCBM's concept scores on the (clean or perturbed)
image, y the model's own prediction there, W the world's concept head (`World.concept_head`);
``cbm`` and ``cbmh`` share W (PCBM-h's residual on e cites no concept). Cost: the concept scores
are already computed for DFS, so the engine does no extra work; the host ranks K concepts per
model and sample, and the records grow by about 100 bytes per model and sample.

`summary` adds per budget and concept model the mean ± sd over the run's subsets of the overlap
and of τ (τ averaged over the inputs where it is defined), and paired sign-flip permutation
tests over inputs of the overlap of the first concept model against each other, Holm-corrected
over the run's budgets — the statistics PFR gets (`cbcert.robustness.protocol`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbcert.robustness import explain as ex
from cbcert.robustness import stats
from cbcert.schema import ConfigError

TOP_K = ex.DEFAULT_TOP_K
EXPLAINED = ("cbm", "cbmh")


def explained_models(models: Sequence[str]) -> tuple[str, ...]:
    """The concept models of ``models`` whose explanations are recorded."""
    return tuple(m for m in models if m in EXPLAINED)


def check(world, models: Sequence[str]) -> None:
    """`ConfigError` (key ``explain``) unless the world gives its concept head and ``models``
    name a concept model."""
    if world.concept_head is None:
        detail = (f"{world.name} does not expose its CBM's concept head (built-in worlds do; "
                  "world directories not yet)")
        raise ConfigError(f"explain: {detail}", key="explain", value=True, detail=detail)
    if not explained_models(models):
        detail = f"models {list(models)} name no concept model ({', '.join(EXPLAINED)})"
        raise ConfigError(f"explain: {detail}", key="explain", value=True, detail=detail)


def head(world) -> np.ndarray:
    """``W[C, K]`` of the world's concept head, float64 on host."""
    w, _ = world.concept_head(world.params["clf"])
    return np.asarray(w, np.float64)


def _cited(e: ex.Explanation, row: int) -> list[list]:
    return [[int(i), float(s)] for i, s in zip(e.concepts[row], e.shares[row], strict=True)
            if i >= 0]


def record_fields(weights: np.ndarray, models: Sequence[str], clean: dict, perturbed: dict
                  ) -> tuple[list[dict], list[list[dict]]]:
    """Explanation fields of one batch of records.

    Args:
      weights: ``W[C, K]``.
      models: the run's models (the order of the ``pred`` columns).
      clean: observer outputs on the clean images: ``pred[B, H]``, ``scores[B, K]``.
      perturbed: the same on the perturbed images, ``[B, S, ...]``.

    Returns:
      ``(clean_fields[B], sample_fields[B][S])``: ``{model: cited}`` and ``{model: {"cited",
      "overlap", "kendall"}}`` for every explained model.
    """
    b, s = perturbed["pred"].shape[:2]
    k = weights.shape[1]
    clean_fields: list[dict] = [{} for _ in range(b)]
    sample_fields: list[list[dict]] = [[{} for _ in range(s)] for _ in range(b)]
    for m in explained_models(models):
        h = list(models).index(m)
        c_clean = ex.contributions(clean["scores"], weights, clean["pred"][:, h])  # [B, K]
        c_pert = ex.contributions(perturbed["scores"].reshape(b * s, k), weights,
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


__all__ = ["EXPLAINED", "TOP_K", "check", "explained_models", "head", "measurements",
           "record_fields", "summary"]
