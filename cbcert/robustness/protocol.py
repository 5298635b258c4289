"""The empirical robustness protocol of SPEC §3: paired subsets and table rows.

Pipeline (the caller runs the models; this module only indexes and reduces):

1. The agreement set of the clean pool (`cbcert.runs.pool.agreement_pool`): inputs where
   ``f_std`` and ``f_cbm`` predict the same class; that class is the reference label.
2. `draw_subsets(M, num_subsets=k, subset_size=n, seed=...)`: k subsets of n positions into the
   agreement set, without replacement within a subset (subsets may overlap).
3. The caller perturbs the agreement-set inputs at each budget and evaluates every model on the
   same perturbed images, then reduces them with `stats.prediction_flips`,
   `stats.concept_flip_counts` and `stats.decision_shifts` into a `BudgetMeasurement`. PFR
   compares each model with its own clean prediction; for τ budgets the clean image is the
   autoencoded one, ``g2(D(E(g1(z))))`` (SPEC §1), not ``g(z)``.
4. `build_table(measurements, subsets)`: per budget, mean ± sd over subsets of CFR, PFR per model
   and DFS; paired tests of PFR differences (SPEC's t-test over subsets, and the sign-flip
   permutation test over inputs that the table decides with); Holm–Bonferroni across every
   permutation test of the table.

Seeds: subsets come from ``numpy.random.default_rng(seed)``. The caller derives ``seed`` from
the run's root seed and a stream tag, e.g. ``seed=(cli_seed, Stream.SUBSETS)`` (numpy accepts a
sequence of non-negative ints as entropy), so the subsets never share randomness with the
generator's latent pool or the perturbation noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from cbcert.robustness import stats

BUDGET_KINDS = ("eps", "tau", "sigma", "rho")
# How a budget reads in tables and figures.
BUDGET_SYMBOLS = {"eps": "ε", "tau": "τ", "sigma": "σ", "rho": "ρ"}
DFS_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.array(array, copy=True)
    array.setflags(write=False)
    return array


def draw_subsets(
    num_candidates: int, *, num_subsets: int, subset_size: int, seed: int | Sequence[int]
) -> np.ndarray:
    """k random subsets of n positions in ``range(num_candidates)``, reproducible from ``seed``.

    Each subset is drawn without replacement (no repeats within a subset) and independently of
    the others (subsets may overlap), then sorted. The same seed gives the same subsets.

    Args:
      num_candidates: M, the size of the agreement set.
      num_subsets: k >= 2 (a standard deviation over subsets needs two).
      subset_size: n, 1 <= n <= M.
      seed: non-negative int or sequence of them, entropy for ``numpy.random.default_rng``.

    Returns:
      [k, n] int64 positions into the agreement set.
    """
    if num_subsets < 2:
        raise ValueError(f"num_subsets: must be >= 2 (mean ± sd over subsets), got {num_subsets}")
    if subset_size < 1:
        raise ValueError(f"subset_size: must be >= 1, got {subset_size}")
    if num_candidates < subset_size:
        raise ValueError(
            f"agreement set has {num_candidates} inputs, fewer than subset_size={subset_size}; "
            "generate a larger pool of inputs or lower the subset size"
        )
    entropy = np.atleast_1d(np.asarray(seed))
    if entropy.ndim != 1 or not np.issubdtype(entropy.dtype, np.integer) or entropy.min() < 0:
        raise ValueError(f"seed: expected a non-negative int or a sequence of them, got {seed!r}")
    rng = np.random.default_rng(seed)
    subsets = [
        np.sort(rng.choice(num_candidates, size=subset_size, replace=False))
        for _ in range(num_subsets)
    ]
    return _frozen(np.stack(subsets).astype(np.int64))


@dataclass(frozen=True, eq=False)
class BudgetMeasurement:
    """Per-input results at one perturbation budget, aligned with the agreement set.

    Every array has leading dimension M (agreement-set order) and an optional sample axis S.

    Attributes:
      kind: "eps" (geometric, latent shift of norm ε), "tau" (semantic, τ concept flips),
        "sigma" (latent Gaussian noise σ) or "rho" (Bernoulli concept flips ρ).
      value: the budget ε or τ.
      prediction_flips: model name -> [M] or [M, S] bool, from `stats.prediction_flips`.
      concept_flips: [M] or [M, S] int counts from `stats.concept_flip_counts`, or None when
        the generator has no concept space.
      num_concepts: K (needed for CFR when ``concept_flips`` is given).
      decision_shifts: concept-model name -> [M] or [M, S] float, from `stats.decision_shifts`.
    """

    kind: str
    value: float
    prediction_flips: Mapping[str, np.ndarray]
    concept_flips: np.ndarray | None = None
    num_concepts: int | None = None
    decision_shifts: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class DFSSummary:
    """DFS of one concept model: mean ± sd over subsets and quantiles of the pooled distances."""

    over_subsets: stats.MeanSD
    quantiles: tuple[tuple[float, float], ...]

    def to_dict(self) -> dict:
        return {
            **self.over_subsets.to_dict(),
            "quantiles": {f"{level:g}": value for level, value in self.quantiles},
        }


@dataclass(frozen=True)
class Comparison:
    """Paired comparison ``Δ = PFR_a − PFR_b``: over the subsets and over their inputs.

    Attributes:
      delta: Δ mean ± sd over the k subsets (SPEC §3's description).
      statistic, df, pvalue_t: SPEC §3's paired t-test over the subsets (t = ±inf and
        p_t = NaN when the differences are constant: the t-test has no answer there).
      num_inputs, pvalue: the paired sign-flip permutation test over the M distinct inputs of
        the subsets (`stats.paired_permutation_test`): the test the table decides with, since
        overlapping subsets are not independent samples.
      pvalue_holm: ``pvalue`` Holm-corrected over every comparison of the table.
    """

    model_a: str
    model_b: str
    delta: stats.MeanSD
    statistic: float
    df: int
    pvalue_t: float
    num_inputs: int
    pvalue: float
    pvalue_holm: float

    def to_dict(self) -> dict:
        return {
            "model_a": self.model_a,
            "model_b": self.model_b,
            "delta": self.delta.to_dict(),
            "t": self.statistic if math.isfinite(self.statistic) else None,  # strict JSON
            "df": self.df,
            "p_t": self.pvalue_t if math.isfinite(self.pvalue_t) else None,
            "test": stats.PERMUTATION_TEST,
            "inputs": self.num_inputs,
            "p": self.pvalue,
            "p_holm": self.pvalue_holm,
        }


@dataclass(frozen=True)
class BudgetRow:
    """One row of the empirical table (SPEC §3): everything reported at one budget.

    Attributes:
      kind, value: the budget ("eps", ε) or ("tau", τ).
      num_subsets, subset_size: k and n.
      pfr: model name -> PFR mean ± sd over subsets.
      cfr: CFR (fraction of the K concepts flipped) mean ± sd, or None without concepts.
      cfr_count: mean number of flipped concepts, mean ± sd over subsets, or None.
      cfr_histogram: [K + 1] fractions of flip counts 0..K over the subsets' inputs (pooled
        with multiplicity, samples included), or None.
      dfs: concept-model name -> `DFSSummary`.
      comparisons: the paired tests of this budget.
    """

    kind: str
    value: float
    num_subsets: int
    subset_size: int
    pfr: Mapping[str, stats.MeanSD]
    cfr: stats.MeanSD | None
    cfr_count: stats.MeanSD | None
    cfr_histogram: tuple[float, ...] | None
    dfs: Mapping[str, DFSSummary]
    comparisons: tuple[Comparison, ...]

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict (floats, ints, strings, lists, dicts)."""
        return {
            "kind": self.kind,
            "value": self.value,
            "num_subsets": self.num_subsets,
            "subset_size": self.subset_size,
            "pfr": {name: value.to_dict() for name, value in self.pfr.items()},
            "cfr": None if self.cfr is None else self.cfr.to_dict(),
            "cfr_count": None if self.cfr_count is None else self.cfr_count.to_dict(),
            "cfr_histogram": None if self.cfr_histogram is None else list(self.cfr_histogram),
            "dfs": {name: value.to_dict() for name, value in self.dfs.items()},
            "comparisons": [comparison.to_dict() for comparison in self.comparisons],
        }


def _check_measurement(m: BudgetMeasurement, num_agree: int, pairs: Sequence[tuple[str, str]]):
    if m.kind not in BUDGET_KINDS:
        raise ValueError(f"kind: must be one of {BUDGET_KINDS}, got {m.kind!r}")
    arrays = {f"prediction_flips[{k!r}]": v for k, v in m.prediction_flips.items()}
    arrays |= {f"decision_shifts[{k!r}]": v for k, v in m.decision_shifts.items()}
    if m.concept_flips is not None:
        arrays["concept_flips"] = m.concept_flips
        if m.num_concepts is None or m.num_concepts < 1:
            raise ValueError(
                f"num_concepts: must be >= 1 when concept_flips is given, got {m.num_concepts}"
            )
    for name, array in arrays.items():
        shape = np.shape(array)
        if len(shape) not in (1, 2) or shape[0] != num_agree:
            raise ValueError(
                f"{m.kind}={m.value}: {name} must have shape [M] or [M, S] with M={num_agree} "
                f"(agreement-set order), got {shape}"
            )
    for a, b in pairs:
        for model in (a, b):
            if model not in m.prediction_flips:
                raise ValueError(
                    f"{m.kind}={m.value}: comparison model {model!r} has no prediction_flips "
                    f"(models: {sorted(m.prediction_flips)})"
                )


def _dfs_summary(shifts: np.ndarray, subsets: np.ndarray) -> DFSSummary:
    shifts = np.asarray(shifts, dtype=np.float64)
    pooled = shifts[subsets]  # [k, n] or [k, n, S]
    values = np.quantile(pooled.ravel(), DFS_QUANTILES)
    return DFSSummary(
        stats.mean_sd(stats.subset_means(shifts, subsets)),
        tuple((level, float(v)) for level, v in zip(DFS_QUANTILES, values, strict=True)),
    )


def build_table(
    measurements: Sequence[BudgetMeasurement],
    subsets: np.ndarray,
    *,
    comparisons: Sequence[tuple[str, str]] = (("std", "cbm"),),
) -> tuple[BudgetRow, ...]:
    """Reduce per-budget measurements to table rows with paired, Holm-corrected tests.

    For every budget and every pair ``(a, b)`` in ``comparisons``:
    ``Δ_j = PFR_a(subset j) − PFR_b(subset j)``, reported as mean ± sd (``ddof=1``) with
    SPEC §3's paired t-test over the subsets (two-sided, df = k − 1), and tested with
    `stats.paired_permutation_test` over the distinct inputs of the subsets (per-input PFR of
    a vs b): the subsets overlap, so the t-test's independence assumption fails, and constant
    differences leave it undefined. The family for Holm–Bonferroni is every permutation test
    in this call (all budgets × all comparisons), so call it once per table.

    Args:
      measurements: one per budget, arrays in agreement-set order [M] or [M, S].
      subsets: [k, n] positions into the agreement set (`draw_subsets`).
      comparisons: pairs of model names ``(a, b)`` to test; defaults to PFR_std − PFR_cbm.

    Returns:
      One `BudgetRow` per measurement, in the given order.
    """
    subsets = np.asarray(subsets)
    if subsets.ndim != 2:
        raise ValueError(f"subsets: expected shape [k, n], got {subsets.shape}")
    if not measurements or not all(m.prediction_flips for m in measurements):
        raise ValueError("measurements: need at least one budget, each with prediction_flips")
    num_agree = int(np.shape(next(iter(measurements[0].prediction_flips.values())))[0])
    seen = set()
    for m in measurements:
        _check_measurement(m, num_agree, comparisons)
        if (m.kind, m.value) in seen:
            raise ValueError(f"measurements: budget {m.kind}={m.value} appears twice")
        seen.add((m.kind, m.value))

    pfr_subsets = [
        {name: stats.subset_means(flips, subsets) for name, flips in m.prediction_flips.items()}
        for m in measurements
    ]
    tests = [
        [stats.paired_ttest(pfr[a], pfr[b]) for a, b in comparisons] for pfr in pfr_subsets
    ]
    inputs = np.unique(subsets)  # the distinct inputs of the subsets, agreement-set positions
    permutation = [
        [stats.paired_permutation_test(stats.per_input_mean(m.prediction_flips[a])[inputs],
                                       stats.per_input_mean(m.prediction_flips[b])[inputs])
         for a, b in comparisons] for m in measurements
    ]
    adjusted = stats.holm(np.array([t.pvalue for row in permutation for t in row])).reshape(
        len(measurements), len(comparisons)
    )

    rows = []
    for m, pfr, row_tests, row_permutation, row_adjusted in zip(
        measurements, pfr_subsets, tests, permutation, adjusted, strict=True
    ):
        cfr = cfr_count = histogram = None
        if m.concept_flips is not None:
            count_means = stats.subset_means(m.concept_flips, subsets)  # [k]
            cfr = stats.mean_sd(count_means / m.num_concepts)
            cfr_count = stats.mean_sd(count_means)
            pooled = np.asarray(m.concept_flips)[subsets]
            histogram = tuple(float(v) for v in stats.flip_count_histogram(pooled, m.num_concepts))
        rows.append(
            BudgetRow(
                kind=m.kind,
                value=float(m.value),
                num_subsets=int(subsets.shape[0]),
                subset_size=int(subsets.shape[1]),
                pfr={name: stats.mean_sd(values) for name, values in pfr.items()},
                cfr=cfr,
                cfr_count=cfr_count,
                cfr_histogram=histogram,
                dfs={name: _dfs_summary(v, subsets) for name, v in m.decision_shifts.items()},
                comparisons=tuple(
                    Comparison(a, b, stats.MeanSD(t.mean, t.sd), t.statistic, t.df, t.pvalue,
                               perm.num_inputs, perm.pvalue, float(p_holm))
                    for (a, b), t, perm, p_holm in zip(comparisons, row_tests, row_permutation,
                                                       row_adjusted, strict=True)
                ),
            )
        )
    return tuple(rows)


def _pm(value: stats.MeanSD | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value.mean:.{digits}f} ± {value.sd:.{digits}f}"


def table_cells(rows: Sequence[BudgetRow]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Headers and string cells of the table, ready for ``rich.table.Table.add_row``.

    Columns: budget, CFR, flipped concepts, PFR per model, DFS per concept model, then
    Δ mean ± sd, p and p_Holm per comparison (models and comparisons of the first row).
    """
    if not rows:
        raise ValueError("rows: need at least one row")
    models = list(rows[0].pfr)
    concept_models = list(rows[0].dfs)
    headers = ["budget", "CFR", "#flipped"]
    headers += [f"PFR {name}" for name in models]
    headers += [f"DFS {name}" for name in concept_models]
    for c in rows[0].comparisons:
        headers += [f"Δ {c.model_a}−{c.model_b}", "p", "p_Holm"]
    body = []
    for row in rows:
        budget = f"{BUDGET_SYMBOLS[row.kind]}={row.value:g}"
        cells = [budget, _pm(row.cfr), _pm(row.cfr_count, 2)]
        cells += [_pm(row.pfr[name]) for name in models]
        cells += [_pm(row.dfs[name].over_subsets) for name in concept_models]
        for c in row.comparisons:
            cells += [_pm(c.delta), f"{c.pvalue:.2g}", f"{c.pvalue_holm:.2g}"]
        body.append(tuple(cells))
    return tuple(headers), body
