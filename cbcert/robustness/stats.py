"""Per-input reducers and paired statistics of the empirical robustness protocol (SPEC §3).

Pure numpy/scipy/statsmodels in float64, on host. The reducers turn raw model outputs on clean
and perturbed images into per-input (or per-input-per-sample) flip indicators and distances;
`subset_means` averages them over the protocol's random subsets; `paired_ttest` and `holm`
compare two models over those subsets.

Array conventions: ``N`` inputs, ``S`` perturbation samples per input (``S = 1`` when the
perturbed array has no sample axis), ``K`` binary concepts, ``D`` concept scores of a CBM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.stats
from statsmodels.stats.multitest import multipletests


def _with_sample_axis(name: str, clean: np.ndarray, perturbed: np.ndarray, event_ndim: int):
    """Return `perturbed` with an explicit sample axis: [N, S, *event]; check it matches `clean`."""
    clean = np.asarray(clean)
    perturbed = np.asarray(perturbed)
    if clean.ndim != 1 + event_ndim:
        raise ValueError(
            f"{name}: clean array must have {1 + event_ndim} dims [N{', ...' * event_ndim}], "
            f"got shape {clean.shape}"
        )
    if perturbed.ndim == clean.ndim:
        perturbed = perturbed[:, None]
    if perturbed.ndim != clean.ndim + 1 or (
        perturbed.shape[:1] + perturbed.shape[2:] != clean.shape
    ):
        raise ValueError(
            f"{name}: perturbed array must have shape [N, *event] or [N, S, *event] matching "
            f"clean {clean.shape}, got {perturbed.shape}"
        )
    return clean, perturbed


def prediction_flips(pred_clean: np.ndarray, pred_perturbed: np.ndarray) -> np.ndarray:
    """Prediction-flip indicators ``1[f(x) ≠ f(x̃)]`` (SPEC §3, PFR).

    Args:
      pred_clean: [N] int, predicted class of each clean image.
      pred_perturbed: [N] or [N, S] int, predicted class of each perturbed image.

    Returns:
      [N, S] bool; ``prediction_flip_rate = per_input_mean(...)`` averaged over inputs.
    """
    clean, perturbed = _with_sample_axis("prediction_flips", pred_clean, pred_perturbed, 0)
    return perturbed != clean[:, None]


def concept_flip_counts(state_clean: np.ndarray, state_perturbed: np.ndarray) -> np.ndarray:
    """Number of ground-truth concepts a perturbation flipped, ``Σ_i 1[C(c)_i ≠ C(c̃)_i]``.

    The concept fraction of SPEC §3 (CFR) is this count divided by ``K``.

    Args:
      state_clean: [N, K] bool/int, concept state ``C(c)`` of each clean input.
      state_perturbed: [N, K] or [N, S, K], concept state ``C(c̃)`` of each perturbed input.

    Returns:
      [N, S] int64 counts in ``0..K``.
    """
    clean, perturbed = _with_sample_axis("concept_flip_counts", state_clean, state_perturbed, 1)
    clean = clean.astype(bool)[:, None, :]  # [N, 1, K]
    return np.sum(perturbed.astype(bool) != clean, axis=-1, dtype=np.int64)


def decision_shifts(scores_clean: np.ndarray, scores_perturbed: np.ndarray) -> np.ndarray:
    """Concept-score shifts ``‖r(g(z)) − r(g(z̃))‖₂`` of a CBM (SPEC §3, DFS).

    Args:
      scores_clean: [N, D] float, concept scores ``r`` on the clean images.
      scores_perturbed: [N, D] or [N, S, D] float, concept scores on the perturbed images.

    Returns:
      [N, S] float64 L2 distances.
    """
    clean, perturbed = _with_sample_axis("decision_shifts", scores_clean, scores_perturbed, 1)
    diff = perturbed.astype(np.float64) - clean.astype(np.float64)[:, None, :]  # [N, S, D]
    return np.linalg.norm(diff, axis=-1)


def per_input_mean(values: np.ndarray) -> np.ndarray:
    """Average over perturbation samples: [N] or [N, S] -> [N] float64."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 1:
        return values
    if values.ndim != 2:
        raise ValueError(f"values: expected shape [N] or [N, S], got {values.shape}")
    return values.mean(axis=1)


def subset_means(values: np.ndarray, subsets: np.ndarray) -> np.ndarray:
    """Per-subset mean of a per-input metric (the unit of the paired design, SPEC §3).

    Args:
      values: [M] or [M, S], per-input(-per-sample) values indexed like the agreement set.
      subsets: [k, n] int, positions into ``values`` (see `protocol.draw_subsets`).

    Returns:
      [k] float64, ``mean_{i ∈ subset_j} mean_s values[i, s]``.
    """
    per_input = per_input_mean(values)
    subsets = np.asarray(subsets)
    if subsets.ndim != 2 or not np.issubdtype(subsets.dtype, np.integer):
        raise ValueError(f"subsets: expected int array [k, n], got {subsets.dtype} {subsets.shape}")
    if subsets.size and (subsets.min() < 0 or subsets.max() >= per_input.shape[0]):
        raise ValueError(
            f"subsets: positions must lie in [0, {per_input.shape[0]}), got range "
            f"[{subsets.min()}, {subsets.max()}]"
        )
    return per_input[subsets].mean(axis=1)


@dataclass(frozen=True)
class MeanSD:
    """Mean and sample standard deviation (``ddof=1``) over the k subsets."""

    mean: float
    sd: float

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "sd": self.sd}


def mean_sd(per_subset: np.ndarray) -> MeanSD:
    """Mean ± sample standard deviation (``ddof=1``) of [k] per-subset values, k ≥ 2."""
    per_subset = np.asarray(per_subset, dtype=np.float64)
    if per_subset.ndim != 1 or per_subset.shape[0] < 2:
        raise ValueError(f"per_subset: need shape [k] with k >= 2, got {per_subset.shape}")
    return MeanSD(float(per_subset.mean()), float(per_subset.std(ddof=1)))


def flip_count_histogram(counts: np.ndarray, num_concepts: int) -> np.ndarray:
    """Distribution of the number of flipped concepts.

    Args:
      counts: int array of any shape with values in ``0..num_concepts`` (e.g. [N, S] from
        `concept_flip_counts`, or the gathered [k, n, S] values of the subsets).
      num_concepts: K.

    Returns:
      [K + 1] float64 fractions summing to one; entry m is ``P[count = m]``.
    """
    if num_concepts < 1:
        raise ValueError(f"num_concepts: must be >= 1, got {num_concepts}")
    counts = np.asarray(counts).ravel()
    if counts.size == 0:
        raise ValueError("counts: empty array")
    if counts.min() < 0 or counts.max() > num_concepts:
        raise ValueError(
            f"counts: values must lie in [0, {num_concepts}], got [{counts.min()}, {counts.max()}]"
        )
    return np.bincount(counts.astype(np.int64), minlength=num_concepts + 1) / counts.size


@dataclass(frozen=True)
class PairedTest:
    """Paired two-sided t-test of ``a − b`` over the k subsets.

    ``mean`` and ``sd`` (``ddof=1``) describe the per-subset differences, ``statistic`` is
    Student's t with ``df = k − 1``.
    """

    mean: float
    sd: float
    statistic: float
    pvalue: float
    df: int


def paired_ttest(a: np.ndarray, b: np.ndarray) -> PairedTest:
    """Paired two-sided t-test of per-subset metrics ``a`` vs ``b`` (`scipy.stats.ttest_rel`).

    ``t = mean(d) / (sd(d) / √k)`` with ``d = a − b`` and ``df = k − 1``.

    Degenerate case, where scipy returns NaN or rounding noise: when the differences are
    constant up to float64 resolution of the inputs (``ptp(d) ≤ 4·eps·max|a|,|b|``; per-subset
    means of counts often are), the sample variance is zero and the test is decided by the
    sign of the constant: all differences zero gives ``t = 0, p = 1.0`` (no evidence of any
    difference, e.g. identical models); a constant non-zero difference gives ``t = ±inf,
    p = 0.0``, the limit of the t-test as the variance vanishes.

    Args:
      a: [k] per-subset metric of the first model.
      b: [k] per-subset metric of the second model, same subsets in the same order.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.shape[0] < 2:
        raise ValueError(
            f"paired_ttest: a and b must have the same shape [k] with k >= 2, "
            f"got {a.shape} and {b.shape}"
        )
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("paired_ttest: a and b must be finite")
    diff = a - b  # [k]
    k = a.shape[0]
    resolution = 4.0 * np.finfo(np.float64).eps * max(np.abs(a).max(), np.abs(b).max())
    if np.ptp(diff) <= resolution:
        if np.abs(diff).max() <= resolution:
            return PairedTest(0.0, 0.0, 0.0, 1.0, k - 1)
        constant = float(diff.mean())
        return PairedTest(constant, 0.0, float(np.copysign(np.inf, constant)), 0.0, k - 1)
    result = scipy.stats.ttest_rel(a, b)
    return PairedTest(
        float(diff.mean()), float(diff.std(ddof=1)), float(result.statistic),
        float(result.pvalue), k - 1,
    )


def holm(pvalues: np.ndarray) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values (Holm 1979), via statsmodels ``multipletests``.

    With sorted ``p_(1) ≤ … ≤ p_(m)``: ``p̃_(i) = min(1, max_{j ≤ i} (m − j + 1) p_(j))``,
    returned in the input order. Controls the family-wise error rate over all m tests.

    Args:
      pvalues: [m] p-values in [0, 1], m ≥ 1.

    Returns:
      [m] float64 adjusted p-values.
    """
    pvalues = np.asarray(pvalues, dtype=np.float64)
    if pvalues.ndim != 1 or pvalues.shape[0] < 1:
        raise ValueError(f"pvalues: expected shape [m] with m >= 1, got {pvalues.shape}")
    if not np.all((pvalues >= 0.0) & (pvalues <= 1.0)):
        raise ValueError(f"pvalues: must lie in [0, 1], got {pvalues}")
    return np.asarray(multipletests(pvalues, method="holm")[1], dtype=np.float64)
