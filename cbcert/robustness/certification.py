"""Certification over random subsets (the method's protocol for SmAcc and radii).

A certification run certifies M inputs once; the method reports its metrics as mean ± sd over k
random subsets of n of them, with paired tests between models and Holm–Bonferroni. Here the
subsets are `protocol.draw_subsets(M, k, n, seed)` over the certified inputs (in index order),
and per subset j:

* ``SmAcc_j = mean_{i ∈ S_j} 1[ŷ_i = y_i]`` (abstain counts as wrong),
* ``ACR_j = mean_{i ∈ S_j} R_i 1[ŷ_i = y_i]``,
* ``R̄_j`` = the mean radius of the subset's correctly predicted inputs (NaN if none).

Models are compared on SmAcc and ACR with the paired sign-flip permutation test over the
distinct inputs of the subsets (`stats.paired_permutation_test` on the per-input indicator or
radius of the two models; the subsets overlap, so their means are not independent), Holm-
corrected over every test of the run. ``Δ`` is also given as mean ± sd over the subsets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from cbcert.robustness import stats
from cbcert.robustness.protocol import draw_subsets

TESTED = ("smoothed_accuracy", "acr")


def _per_input(labels: np.ndarray, predictions: np.ndarray, radii: np.ndarray) -> dict:
    """``{"smoothed_accuracy": 1[ŷ = y], "acr": R·1[ŷ = y]}`` per input, ``[M]`` float64."""
    correct = np.asarray(predictions) == np.asarray(labels)
    radius = np.where(correct, np.nan_to_num(np.asarray(radii, np.float64)), 0.0)
    return {"smoothed_accuracy": correct.astype(np.float64), "acr": radius}


def _radius_of_correct(per_input: dict, subset: np.ndarray) -> float:
    correct = per_input["smoothed_accuracy"][subset] > 0
    return float(per_input["acr"][subset][correct].mean()) if correct.any() else float("nan")


def subset_summary(labels: np.ndarray, predictions: Mapping[str, np.ndarray],
                   radii: Mapping[str, np.ndarray], subsets: np.ndarray,
                   comparisons: Sequence[tuple[str, str]]) -> dict:
    """Mean ± sd over subsets per model and paired model comparisons (module docstring).

    Args:
      labels: ``[M]`` reference labels of the certified inputs (index order).
      predictions: model → ``[M]`` smoothed predictions (``-1`` = abstain).
      radii: model → ``[M]`` certified radii (NaN when abstaining).
      subsets: ``[k, n]`` positions into the M inputs (`protocol.draw_subsets`).
      comparisons: ``(a, b)`` model pairs; Δ = metric_a − metric_b.

    Returns:
      JSON-ready ``{"num_subsets", "subset_size", "models": {m: {metric: {"mean", "sd"}}},
      "comparisons": [{"metric", "model_a", "model_b", "delta": {"mean", "sd"}, "test",
      "inputs", "p", "p_holm"}]}``; ``radius_of_correct``'s mean/sd skip subsets without a
      correct input (null if all lack one).
    """
    subsets = np.asarray(subsets)
    if subsets.ndim != 2 or subsets.shape[0] < 2:
        raise ValueError(f"subsets: expected shape [k, n] with k >= 2, got {subsets.shape}")
    values = {m: _per_input(labels, predictions[m], radii[m]) for m in predictions}
    models = {}
    for model, per_input in values.items():
        entry = {metric: stats.mean_sd(stats.subset_means(per_input[metric], subsets)).to_dict()
                 for metric in TESTED}
        radius = np.array([_radius_of_correct(per_input, s) for s in subsets])
        radius = radius[np.isfinite(radius)]
        entry["radius_of_correct"] = (stats.mean_sd(radius).to_dict() if len(radius) >= 2
                                      else {"mean": None, "sd": None})
        models[model] = entry
    inputs = np.unique(subsets)
    tests = []
    for a, b in comparisons:
        for metric in TESTED:
            delta = (stats.subset_means(values[a][metric], subsets)
                     - stats.subset_means(values[b][metric], subsets))
            test = stats.paired_permutation_test(values[a][metric][inputs],
                                                 values[b][metric][inputs])
            tests.append({"metric": metric, "model_a": a, "model_b": b,
                          "delta": stats.mean_sd(delta).to_dict(),
                          "test": stats.PERMUTATION_TEST, "inputs": test.num_inputs,
                          "p": test.pvalue})
    if tests:
        for test, adjusted in zip(tests, stats.holm(np.array([t["p"] for t in tests])),
                                  strict=True):
            test["p_holm"] = float(adjusted)
    return {"num_subsets": int(subsets.shape[0]), "subset_size": int(subsets.shape[1]),
            "models": models, "comparisons": tests}


def records_subset_summary(records: Sequence[dict], models: Sequence[str], *, num_subsets: int,
                           subset_size: int, seed) -> dict:
    """`subset_summary` of a certification run's records (``index``, ``model``, ``label``,
    ``prediction``, ``radius`` or none for PREDICT), comparing ``models[0]`` with each other;
    subsets from ``draw_subsets(M, num_subsets, subset_size, seed)`` over the inputs in index
    order, their input indices under ``"indices"``."""
    by_model = {m: sorted((r for r in records if r["model"] == m), key=lambda r: r["index"])
                for m in models}
    first = by_model[models[0]]
    labels = np.array([r["label"] for r in first], np.int64)
    radius = {m: np.array([np.nan if r.get("radius") is None else r["radius"] for r in rows],
                          np.float64) for m, rows in by_model.items()}
    prediction = {m: np.array([r["prediction"] for r in rows], np.int64)
                  for m, rows in by_model.items()}
    subsets = draw_subsets(len(labels), num_subsets=num_subsets, subset_size=subset_size,
                           seed=seed)
    out = subset_summary(labels, prediction, radius, subsets,
                         [(models[0], m) for m in models[1:]])
    out["indices"] = np.array([r["index"] for r in first])[subsets].tolist()
    return out


def radius_of_correct_by_subset(records: Sequence[dict], model: str,
                                indices: Sequence[Sequence[int]]) -> np.ndarray:
    """``R̄_j``, the mean certified radius over the correctly predicted inputs of subset j, for
    one model: ``[k]`` float64, NaN for a subset without a correct input.

    Args:
      records: a certification run's records (``index``, ``model``, ``label``,
        ``prediction``, ``radius``; abstentions ``prediction = -1``, ``radius = None``).
      indices: ``[k][n]`` input indices of the subsets (the summary's ``subsets.indices``).
    Raises:
      ValueError naming the model and index if a subset's input has no record.
    """
    by_index = {r["index"]: r for r in records if r["model"] == model}
    out = np.full(len(indices), np.nan)
    for j, subset in enumerate(indices):
        radii = []
        for i in subset:
            if i not in by_index:
                raise ValueError(f"model {model!r}: no record of input {i} (subset {j})")
            r = by_index[i]
            if r["prediction"] == r["label"] and r.get("radius") is not None:
                radii.append(float(r["radius"]))
        if radii:
            out[j] = float(np.mean(radii))
    return out


def radius_tests(cells: Sequence[tuple[str, Mapping[str, np.ndarray]]],
                 comparisons: Sequence[tuple[str, str]]) -> list[dict]:
    """The method's certification test: ΔR̄ between two models, paired t-test over the
    subsets, Holm across the cells (σ, or ρ) of one space.

    For cell c and pair (a, b): ``Δ_j = R̄_a,j − R̄_b,j`` over the subsets j where both models
    have a correct input (`radius_of_correct_by_subset`), and the paired two-sided t-test of
    `stats.paired_ttest` (``df = k' − 1``; needs k' ≥ 2, else p is None). The p-values of one
    pair across the cells are Holm-corrected together (`stats.holm`); a test without a p
    (fewer than 2 usable subsets, or a constant non-zero Δ, where the t-test has no answer)
    takes no part in the correction and gets no adjusted p.

    Args:
      cells: ``(cell name, {model: R̄[k]})`` for the cells of one family (e.g. every σ of
        the latent space), in report order.
      comparisons: ``(a, b)`` model pairs; Δ = R̄_a − R̄_b.
    Returns:
      One dict per cell and pair: ``{"cell", "model_a", "model_b", "subsets", "delta":
      {"mean", "sd"}, "t", "df", "p", "p_holm"}`` (None where undefined).
    """
    rows = []
    for a, b in comparisons:
        family = []
        for name, per_model in cells:
            if a not in per_model or b not in per_model:
                continue
            ra, rb = np.asarray(per_model[a]), np.asarray(per_model[b])
            usable = np.isfinite(ra) & np.isfinite(rb)
            row = {"cell": name, "model_a": a, "model_b": b, "subsets": int(usable.sum()),
                   "delta": {"mean": None, "sd": None}, "t": None, "df": None, "p": None,
                   "p_holm": None}
            if usable.sum() >= 2:
                test = stats.paired_ttest(ra[usable], rb[usable])
                row.update(delta={"mean": test.mean, "sd": test.sd}, df=test.df,
                           t=test.statistic if np.isfinite(test.statistic) else None,
                           p=test.pvalue if np.isfinite(test.pvalue) else None)
            family.append(row)
        tested = [row for row in family if row["p"] is not None]
        if tested:
            for row, adjusted in zip(tested, stats.holm(np.array([r["p"] for r in tested])),
                                     strict=True):
                row["p_holm"] = float(adjusted)
        rows += family
    return rows


__all__ = ["TESTED", "radius_of_correct_by_subset", "radius_tests", "records_subset_summary",
           "subset_summary"]
