"""Paired tests of robust accuracy under an attack (the report's ``attack_tests``).

An attack run attacks the same M inputs with every model at every budget ε; per input it
records whether the model's prediction was correct before the attack (``clean``) and after it
(``robust``; an abstention counts as not robust). Two models are compared on the same inputs:

* over all M inputs: ``d_i = robust_a,i − robust_b,i ∈ {−1, 0, 1}``, ``Δ = mean(d) =
  RobAcc_a − RobAcc_b``, the exact McNemar test (`stats.mcnemar_test`);
* over the inputs both models classify correctly unattacked (``clean_a,i ∧ clean_b,i``): the
  same test, where robust means the prediction survived the attack, so ``RobAcc|clean = 1 −``
  the attack's success rate. Robust accuracy counts clean errors as not robust; this isolates
  the attack.

Each family of p-values (all inputs; clean inputs) is Holm-corrected over the cell's tests —
every ε and pair — on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from cbcert.robustness import stats

# The fields of one test (`paired_attack_tests`), in table order.
FIELDS = ("eps", "model_a", "model_b", "inputs", "robust_a", "robust_b", "delta_mean",
          "delta_sd", "a_only", "b_only", "p", "p_holm", "clean_both", "robust_a_clean",
          "robust_b_clean", "delta_clean_mean", "delta_clean_sd", "a_only_clean",
          "b_only_clean", "p_clean", "p_holm_clean")


def _test(a: np.ndarray, b: np.ndarray, suffix: str) -> dict:
    test = stats.mcnemar_test(a, b)
    return {f"robust_a{suffix}": float(a.mean()), f"robust_b{suffix}": float(b.mean()),
            f"delta{suffix}_mean": test.mean, f"delta{suffix}_sd": test.sd,
            f"a_only{suffix}": test.a_only, f"b_only{suffix}": test.b_only,
            f"p{suffix}": test.pvalue}


def paired_attack_tests(budgets: Sequence[tuple[float, Mapping[str, np.ndarray],
                                                Mapping[str, np.ndarray]]],
                        models: Sequence[str]) -> list[dict]:
    """The first model against each other at every budget of one attack cell.

    Args:
      budgets: ``(ε, {model: robust[M] bool}, {model: clean[M] bool})`` per budget, every
        model's arrays over the same M ≥ 1 inputs in the same order.
      models: the compared models; ``models[0]`` is a, each other one b in turn.
    Returns:
      One dict per budget and pair with the keys `FIELDS`: ``inputs`` (M), the robust
      accuracies, ``Δ`` and the sd of the per-input differences (``ddof=1``), the discordant
      counts ``a_only``/``b_only``, the McNemar p and its Holm correction over the cell; then
      the same over the ``clean_both`` inputs both classify correctly unattacked (suffix
      ``_clean``; None where no input is clean for both, and such a test takes no part in
      the correction).
    """
    rows = []
    for eps, robust, clean in budgets:
        a = models[0]
        for b in models[1:]:
            ra, rb = np.asarray(robust[a], bool), np.asarray(robust[b], bool)
            both = np.asarray(clean[a], bool) & np.asarray(clean[b], bool)
            row = {"eps": eps, "model_a": a, "model_b": b, "inputs": int(ra.shape[0]),
                   **_test(ra, rb, ""), "clean_both": int(both.sum())}
            row.update(_test(ra[both], rb[both], "_clean") if both.any() else
                       {k: None for k in FIELDS[FIELDS.index("robust_a_clean"):]})
            rows.append(row)
    for suffix in ("", "_clean"):
        tested = [r for r in rows if r[f"p{suffix}"] is not None]
        adjusted = stats.holm(np.array([r[f"p{suffix}"] for r in tested])) if tested else []
        for r, p in zip(tested, adjusted, strict=True):
            r[f"p_holm{suffix}"] = float(p)
        for r in rows:
            r.setdefault(f"p_holm{suffix}", None)
    return [{k: r[k] for k in FIELDS} for r in rows]


__all__ = ["FIELDS", "paired_attack_tests"]
