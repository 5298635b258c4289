"""Per-input reducers and paired statistics of the empirical robustness protocol (SPEC §3).

Pure numpy/scipy in float64, on host. The reducers turn raw model outputs on clean
and perturbed images into per-input (or per-input-per-sample) flip indicators and distances;
`subset_means` averages them over the protocol's random subsets; `paired_ttest` compares two
models over those subsets (SPEC §3), `paired_permutation_test` over the inputs themselves (the
subsets overlap, so their means are not independent), `mcnemar_test` compares paired binary
outcomes (robust under an attack or not), and `holm` corrects a family of p-values.

Array conventions: ``N`` inputs, ``S`` perturbation samples per input (``S = 1`` when the
perturbed array has no sample axis), ``K`` binary concepts, ``D`` concept scores of a CBM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.stats


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
    means of counts often are), the sample variance is zero: all differences zero gives
    ``t = 0, p = 1.0`` (no evidence of any difference, e.g. identical models); a constant
    non-zero difference gives ``t = ±inf`` (the limit) and ``p = NaN``: the t-test has no
    answer there (a p of 0 would claim certainty that k overlapping subsets cannot give); use
    `paired_permutation_test` over the inputs, which always has one.

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
        return PairedTest(constant, 0.0, float(np.copysign(np.inf, constant)), float("nan"),
                          k - 1)
    result = scipy.stats.ttest_rel(a, b)
    return PairedTest(
        float(diff.mean()), float(diff.std(ddof=1)), float(result.statistic),
        float(result.pvalue), k - 1,
    )


PERMUTATION_TEST = "paired sign-flip permutation test over inputs"
# Inputs up to which the permutation distribution is enumerated exactly (2**16 sign vectors).
EXACT_INPUTS = 16


@dataclass(frozen=True)
class PermutationTest:
    """Paired sign-flip permutation test of per-input differences ``d_i = a_i − b_i``.

    ``mean`` and ``sd`` (``ddof=1``; 0 for one input) describe the d_i; ``pvalue`` is two-sided;
    ``exact``: every sign vector enumerated (``resamples = 2**M``), else ``resamples`` random
    ones from a fixed seed.
    """

    mean: float
    sd: float
    num_inputs: int
    pvalue: float
    exact: bool
    resamples: int


def paired_permutation_test(a: np.ndarray, b: np.ndarray, *, resamples: int = 9999,
                            seed: int = 0) -> PermutationTest:
    """Two-sided paired sign-flip permutation test over inputs of ``a`` vs ``b``.

    Under H0 (the two models' per-input values are exchangeable within each input) every
    difference ``d_i = a_i − b_i`` is as likely to have either sign, so ``T = |Σ_i d_i|``
    is compared with ``T(s) = |Σ_i s_i d_i|`` over sign vectors ``s ∈ {±1}^M``:

    * ``M ≤ 16``: exactly, ``p = #{s : T(s) ≥ T} / 2^M`` (the identity ``s = 1`` included);
    * else ``B = resamples`` uniform sign vectors from ``numpy.random.default_rng(seed)``:
      ``p = (1 + #{b : T(s_b) ≥ T}) / (B + 1)``, a valid p-value for any B.

    ``P(p ≤ α) ≤ α`` under H0 in both cases. Constant differences ``d_i = c ≠ 0`` get the
    finite ``p = 2 / 2^M`` (exact) or ``≈ 1/(B + 1)``, all-zero differences ``p = 1``. Ties
    ``T(s) = T`` are decided with a tolerance of ``1e-12 · Σ|d_i|`` (float sums).

    Args:
      a, b: [M] per-input values (e.g. each input's PFR over its samples), same inputs in the
        same order, M ≥ 1, finite.
      resamples: B for the Monte Carlo case, >= 1.
      seed: seed of the sign vectors (fixed: the test is reproducible).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.shape[0] < 1:
        raise ValueError(f"paired_permutation_test: a and b must have the same shape [M] with "
                         f"M >= 1, got {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("paired_permutation_test: a and b must be finite")
    if resamples < 1:
        raise ValueError(f"resamples: must be >= 1, got {resamples}")
    d = a - b
    m = d.shape[0]
    sd = float(d.std(ddof=1)) if m > 1 else 0.0
    scale = float(np.abs(d).sum())
    if scale == 0.0:
        return PermutationTest(0.0, sd, m, 1.0, m <= EXACT_INPUTS, 2**m if m <= EXACT_INPUTS
                               else resamples)
    observed = abs(float(d.sum())) - 1e-12 * scale
    if m <= EXACT_INPUTS:
        bits = (np.arange(2**m)[:, None] >> np.arange(m)) & 1  # [2^M, M]
        totals = np.abs((1 - 2 * bits) @ d)
        return PermutationTest(float(d.mean()), sd, m, float(np.mean(totals >= observed)), True,
                               2**m)
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, resamples, 1024):  # bounded memory: 1024 x M signs at a time
        signs = rng.choice(np.array([-1.0, 1.0]), size=(min(1024, resamples - start), m))
        hits += int(np.sum(np.abs(signs @ d) >= observed))
    return PermutationTest(float(d.mean()), sd, m, (1 + hits) / (resamples + 1), False,
                           resamples)


@dataclass(frozen=True)
class McNemarTest:
    """Exact McNemar test of paired binary outcomes (`mcnemar_test`).

    ``mean`` and ``sd`` (``ddof=1``; 0 for one pair) describe the per-pair differences
    ``d_i = a_i − b_i ∈ {−1, 0, 1}``; ``a_only``/``b_only`` count the discordant pairs (true for
    ``a`` only, for ``b`` only); ``pvalue`` is two-sided.
    """

    mean: float
    sd: float
    num_pairs: int
    a_only: int
    b_only: int
    pvalue: float


def mcnemar_test(a: np.ndarray, b: np.ndarray) -> McNemarTest:
    """Two-sided exact McNemar test of paired binary outcomes ``a`` vs ``b`` (e.g. whether
    each input stayed robust under an attack on two models).

    Under H0 (the two outcomes of a pair are exchangeable) each of the ``n = a_only + b_only``
    discordant pairs favours ``a`` with probability ½, so ``a_only ~ Binomial(n, ½)`` and
    ``p = min(1, 2 · P(X ≤ min(a_only, b_only)))`` with ``X ~ Binomial(n, ½)`` (``p = 1``
    without a discordant pair); concordant pairs carry no information. This is the paired
    sign-flip permutation test (`paired_permutation_test`) of ``d_i = a_i − b_i``, enumerated
    exactly, for 0/1 outcomes. ``P(p ≤ α) ≤ α`` under H0.

    Args:
      a, b: [M] bool (or 0/1) outcomes of the same M ≥ 1 pairs in the same order.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.ndim != 1 or a.shape != b.shape or a.shape[0] < 1:
        raise ValueError(f"mcnemar_test: a and b must have the same shape [M] with M >= 1, "
                         f"got {a.shape} and {b.shape}")
    if not (np.isin(a, (0, 1)).all() and np.isin(b, (0, 1)).all()):
        raise ValueError("mcnemar_test: a and b must hold booleans or 0/1")
    a, b = a.astype(bool), b.astype(bool)
    d = a.astype(np.float64) - b.astype(np.float64)
    m = d.shape[0]
    a_only, b_only = int(np.sum(a & ~b)), int(np.sum(~a & b))
    n = a_only + b_only
    p = 1.0 if n == 0 else min(1.0, 2.0 * float(scipy.stats.binom.cdf(min(a_only, b_only), n,
                                                                        0.5)))
    return McNemarTest(float(d.mean()), float(d.std(ddof=1)) if m > 1 else 0.0, m, a_only,
                       b_only, p)


def holm(pvalues: np.ndarray) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values (Holm 1979).

    With sorted ``p_(1) ≤ … ≤ p_(m)``: ``p̃_(i) = min(1, max_{j ≤ i} (m − j + 1) p_(j))``,
    returned in the input order. Controls the family-wise error rate over all m tests.

    Args:
      pvalues: [m] p-values in [0, 1], m ≥ 1.

    Returns:
      [m] float64 adjusted p-values.
    """
    # statsmodels' multipletests gives the same numbers (the test compares them) but runs a full
    # gc.collect() on every call: 0.3 s each in a process holding JAX's objects.
    pvalues, order = _sorted_pvalues(pvalues)
    m = pvalues.shape[0]
    steps = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * pvalues[order]))
    return _in_input_order(steps, order)


def benjamini_hochberg(pvalues: np.ndarray) -> np.ndarray:
    """Benjamini–Hochberg adjusted p-values (Benjamini & Hochberg 1995).

    With sorted ``p_(1) ≤ … ≤ p_(m)``: ``p̃_(i) = min(1, min_{j ≥ i} m p_(j) / j)``, returned in
    the input order; rejecting every ``p̃ ≤ q`` controls the false discovery rate at ``q`` for
    independent or positively dependent tests (scipy's ``false_discovery_control`` gives the
    same numbers; the test compares them).

    Args:
      pvalues: [m] p-values in [0, 1], m ≥ 1.

    Returns:
      [m] float64 adjusted p-values.
    """
    pvalues, order = _sorted_pvalues(pvalues)
    m = pvalues.shape[0]
    scaled = pvalues[order] * m / np.arange(1, m + 1)
    steps = np.minimum(1.0, np.minimum.accumulate(scaled[::-1])[::-1])
    return _in_input_order(steps, order)


def _sorted_pvalues(pvalues: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``pvalues`` as float64 ``[m]`` and their stable ascending order; ValueError unless they
    are m ≥ 1 values in [0, 1]."""
    pvalues = np.asarray(pvalues, dtype=np.float64)
    if pvalues.ndim != 1 or pvalues.shape[0] < 1:
        raise ValueError(f"pvalues: expected shape [m] with m >= 1, got {pvalues.shape}")
    if not np.all((pvalues >= 0.0) & (pvalues <= 1.0)):
        raise ValueError(f"pvalues: must lie in [0, 1], got {pvalues}")
    return pvalues, np.argsort(pvalues, kind="stable")


def _in_input_order(steps: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Adjusted p's computed in sorted ``order``, put back in the input order."""
    adjusted = np.empty(steps.shape[0], np.float64)
    adjusted[order] = steps
    return adjusted
