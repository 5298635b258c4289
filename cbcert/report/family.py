"""Every hypothesis a multi-world run tests, in one family: pooled tests, run-wide corrections,
equivalence, and the method's own subset test beside them.

For each world, each comparison of the standard model (``model_a``, the first model of a cell)
with another model (``model_b``), and each budget, one hypothesis "the two models are equally
robust here" per measure:

=====================  ==========================  ======================================
measure                cells                        per input, pooled test
=====================  ==========================  ======================================
``radius``             certification, σ and ρ       R̄ over each model's correct inputs,
                                                    bootstrap Wald (`pooled`)
``smoothed_accuracy``  certification, σ, ρ and m    correct (abstain = wrong), McNemar
``pfr``                perturb, every budget        flipped (mean over draws), McNemar / t
``robust_accuracy``    attack, every ε              robust, McNemar
``robust_accuracy``    attack, every ε, inputs      robust, McNemar
``_clean``             both classify correctly
=====================  ==========================  ======================================

Fixed-count flips (m) certify no Hamming radius (states at odd distance have disjoint noise
sets), so their cells test smoothed accuracy only.

**One sign convention.** ``delta`` is std's robustness advantage: ``value_std − value_b`` for
radii and accuracies, ``value_b − value_std`` for flip rates. ``delta > 0``: std is the more
robust; its 95 % interval is the paired input-level bootstrap's.

**One family.** Every p of the run is adjusted together, Holm (family-wise error) and
Benjamini–Hochberg (false discovery rate), whatever the world, pair, measure or budget. The
verdict of a hypothesis:

* ``std more robust`` / ``<b> more robust``: run-wide Holm ``p_holm < level``;
* ``equivalent``: otherwise, if TOST within ``±margin`` passes with Holm across every TOST of
  the run (``tost_p_holm < level``);
* ``inconclusive``: neither; the interval says what the data allow;
* ``untested``: no test has an answer (no variation in either model, or no correct input).

Margins (`AnalysisConfig`: the config's ``analysis`` section, fixed before a run):
``rate_margin`` for accuracies and flip rates (fractions), ``radius_margin`` relative to std's
R̄.

**The method's column** beside the pooled one: the method's subset design, as it states it — the
per-subset statistic over the cell's k subsets (`summary.json`'s subsets), Δ̄ ± sd over them, the
paired t-test with ``k − 1`` degrees of freedom, Holm across the budgets of one world, pair,
measure and space (σ cells; ρ cells; m cells; the flip-rate budgets; as the report did before).
Attack cells have no subsets: no method column.

Size: one module because the three readers (certification, perturb, attack), the run-wide
corrections and the tables share `Hypothesis` and its sign convention; split, each half would
re-derive it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cbcert.certify.smoothing import SMOOTHINGS
from cbcert.report.cells import CellResult, DamagedFileError
from cbcert.report.tables import Table
from cbcert.robustness import pooled, stats
from cbcert.runs.budgets import budget_name
from cbcert.runs.config import AnalysisConfig
from cbcert.runs.directory import RECORDS, RecordsError, read_records

# (name, family, cells) of one world, as `cbcert.report.worlds.WorldCells`.
WorldCells = tuple[str, str, tuple[CellResult, ...]]

MEASURES = {  # measure -> (label, larger value is more robust)
    "radius": ("certified radius R̄ (correct inputs)", True),
    "smoothed_accuracy": ("smoothed accuracy SmAcc", True),
    "pfr": ("prediction flip rate PFR", False),
    "robust_accuracy": ("robust accuracy RobAcc", True),
    "robust_accuracy_clean": ("robust accuracy on inputs clean for both", True),
}
RATE_MEASURES = ("smoothed_accuracy", "pfr", "robust_accuracy", "robust_accuracy_clean")
VERDICTS = ("std more robust", "other more robust", "equivalent", "inconclusive", "untested")
COLUMNS = ("world", "family", "measure", "cell", "budget", "type", "model_a", "model_b",
           "inputs", "value_a", "value_b", "delta", "ci_low", "ci_high", "test", "p", "p_holm",
           "p_bh", "margin", "tost_p", "tost_p_holm", "verdict", "method_delta",
           "method_delta_sd", "method_subsets", "method_p", "method_p_holm")


@dataclass(frozen=True)
class MethodColumn:
    """The method's subset test of one hypothesis: Δ̄ and its sd over the k subsets (std's
    advantage, the pooled sign convention), the paired t p and its Holm within the method's
    family (module docstring)."""

    delta: float | None
    sd: float | None
    subsets: int
    p: float | None
    group: tuple


@dataclass(frozen=True)
class Hypothesis:
    """One tested comparison (module docstring); ``budget`` is a key like ``sigma=0.1``,
    ``tau=5``, ``m=2``, ``eps=0.03``; ``kind`` ``geometric`` or ``semantic``."""

    world: str
    family: str
    measure: str
    cell: str
    budget: str
    kind: str
    model_a: str
    model_b: str
    result: pooled.PooledComparison
    method: MethodColumn | None

    @property
    def larger_is_robust(self) -> bool:
        """Whether a larger value of the measure is the more robust (not for flip rates)."""
        return MEASURES[self.measure][1]

    def advantage(self) -> tuple[float, float, float]:
        """``(Δ, low, high)``: std's robustness advantage and its 95 % interval (module
        docstring's sign convention)."""
        r = self.result
        if self.larger_is_robust:
            return r.delta, r.ci_low, r.ci_high
        return -r.delta, -r.ci_high, -r.ci_low


def _value(number: float) -> str:
    return f"{number:g}"


def _read(cell: CellResult, name: str, key) -> list[dict]:
    path = cell.path / name
    try:
        return read_records(path, key=key, repair=False)
    except RecordsError as err:
        raise DamagedFileError(f"{path}: {err}") from None


def _method(per_input_a: np.ndarray, per_input_b: np.ndarray, positions: np.ndarray | None,
            statistic, larger_is_robust: bool, group: tuple) -> MethodColumn | None:
    """The method's subset test from per-input values and ``positions`` ``[k, n]`` into them."""
    if positions is None or positions.shape[0] < 2:
        return None
    a = np.array([statistic(per_input_a, s) for s in positions])
    b = np.array([statistic(per_input_b, s) for s in positions])
    usable = np.isfinite(a) & np.isfinite(b)
    if usable.sum() < 2:
        return MethodColumn(None, None, int(usable.sum()), None, group)
    sign = 1.0 if larger_is_robust else -1.0
    test = stats.paired_ttest(a[usable], b[usable])
    p = test.pvalue if math.isfinite(test.pvalue) else None
    return MethodColumn(sign * test.mean, test.sd, int(usable.sum()), p, group)


def _mean_at(values: np.ndarray, subset: np.ndarray) -> float:
    return float(values[subset].mean())


def _positions(indices: Sequence[int], subsets: Any) -> np.ndarray | None:
    """``[k, n]`` positions of the subsets' input indices in ``indices``; None without
    subsets."""
    if not subsets:
        return None
    where = {index: i for i, index in enumerate(indices)}
    try:
        return np.array([[where[i] for i in subset] for subset in subsets], np.int64)
    except KeyError as err:
        raise ValueError(f"subset input {err} has no record") from None


def _certification(world: WorldCells, cell: CellResult, settings: AnalysisConfig):
    name, family, _ = world
    summary = cell.summary
    kind = SMOOTHINGS[summary["noise"]]
    scale = summary["scale"]
    fixed = kind.key == "flips"  # exactly m flips: an integer count, written m=…
    budget = f"{'m' if fixed else kind.key}={_value(int(scale) if fixed else scale)}"
    space = "semantic" if kind.hamming else "geometric"
    models = list(summary["models"])
    records = _read(cell, RECORDS, lambda r: (r["index"], r["model"]))
    by_model = {m: sorted((r for r in records if r["model"] == m), key=lambda r: r["index"])
                for m in models}
    indices = [r["index"] for r in by_model[models[0]]]
    for m in models:
        if [r["index"] for r in by_model[m]] != indices:
            raise ValueError(f"model {m!r} has records of other inputs than {models[0]!r}")
    correct = {m: np.array([r["prediction"] == r["label"] for r in by_model[m]])
               for m in models}
    radius = {m: np.array([np.nan if r.get("radius") is None else r["radius"]
                           for r in by_model[m]], np.float64) for m in models}
    positions = _positions(indices, (summary.get("subsets") or {}).get("indices"))
    out = []
    a = models[0]
    for b in models[1:]:
        measures = ["smoothed_accuracy"] if kind.symbol == "m" else ["radius",
                                                                     "smoothed_accuracy"]
        for measure in measures:
            group = (name, a, b, measure, summary["noise"])
            if measure == "radius":
                result = pooled.paired_radius_of_correct(
                    radius[a], correct[a], radius[b], correct[b],
                    relative_margin=settings.radius_margin)
                per_a = np.where(correct[a], np.nan_to_num(radius[a]), np.nan)
                per_b = np.where(correct[b], np.nan_to_num(radius[b]), np.nan)
                method = _method(per_a, per_b, positions, _mean_of_finite, True, group)
            else:
                result = pooled.paired_means(correct[a].astype(float), correct[b].astype(float),
                                             margin=settings.rate_margin)
                method = _method(correct[a].astype(float), correct[b].astype(float), positions,
                                 _mean_at, True, group)
            out.append(Hypothesis(name, family, measure, cell.name, budget, space, a, b,
                                  result, method))
    return out


def _mean_of_finite(values: np.ndarray, subset: np.ndarray) -> float:
    chosen = values[subset]
    chosen = chosen[np.isfinite(chosen)]
    return float(chosen.mean()) if chosen.size else math.nan


def _perturb(world: WorldCells, cell: CellResult, settings: AnalysisConfig):
    name, family, _ = world
    models = list(cell.run["settings"]["models"])
    out = []
    for entry in cell.summary["budgets"]:
        kind, value = entry["kind"], entry["value"]
        records = _read(cell, f"{budget_name(kind, value)}.jsonl", lambda r: r["index"])
        records.sort(key=lambda r: r["index"])
        # Per input: the share of its draws whose prediction left the clean one (plain Python:
        # numpy's mean over a handful of booleans costs more than the sum, 525k times a run).
        flips = {m: np.array([sum(s["pred"][m] != r["clean"]["pred"][m] for s in r["samples"])
                              / len(r["samples"]) for r in records])
                 for m in models}
        positions = _positions([r["index"] for r in records], cell.summary.get("subsets"))
        budget = f"{kind}={_value(value)}"
        space = "semantic" if kind in ("tau", "rho") else "geometric"
        for b in models[1:]:
            a = models[0]
            result = pooled.paired_means(flips[a], flips[b], margin=settings.rate_margin)
            method = _method(flips[a], flips[b], positions, _mean_at, False,
                             (name, a, b, "pfr"))
            out.append(Hypothesis(name, family, "pfr", cell.name, budget, space, a, b, result,
                                  method))
    return out


def _attack(world: WorldCells, cell: CellResult, settings: AnalysisConfig):
    name, family, _ = world
    models = list(cell.summary["models"])
    records = _read(cell, RECORDS, lambda r: (r["index"], r["model"], r["eps"]))
    space = "semantic" if cell.run["job"]["space"] == "concept" else "geometric"
    out = []
    for eps in sorted({r["eps"] for r in records}):
        rows = {(r["model"], r["index"]): r for r in records if r["eps"] == eps}
        a = models[0]
        inputs = sorted(i for (m, i) in rows if m == a)
        robust = {m: np.array([bool(rows[m, i]["robust"]) for i in inputs], float)
                  for m in models}
        clean = {m: np.array([rows[m, i]["clean_prediction"] == rows[m, i]["label"]
                              for i in inputs]) for m in models}
        budget = f"eps={_value(eps)}"
        if len(inputs) < 2:  # no paired test of a single input
            continue
        for b in models[1:]:
            result = pooled.paired_means(robust[a], robust[b], margin=settings.rate_margin)
            out.append(Hypothesis(name, family, "robust_accuracy", cell.name, budget, space, a,
                                  b, result, None))
            both = clean[a] & clean[b]
            if both.sum() >= 2:
                result = pooled.paired_means(robust[a][both], robust[b][both],
                                             margin=settings.rate_margin)
                out.append(Hypothesis(name, family, "robust_accuracy_clean", cell.name, budget,
                                      space, a, b, result, None))
    return out


def hypotheses(worlds: Sequence[WorldCells], settings: AnalysisConfig) -> list[Hypothesis]:
    """Every hypothesis of the run, world by world in the run's order, then certification
    cells, flip rates and attacks in each world's cell order (module docstring).

    Raises:
      DamagedFileError naming a cell whose records do not match its summary.
    """
    readers = {"certify": _certification, "perturb": _perturb, "attack": _attack}
    out = []
    for world in worlds:
        for cell in world[2]:
            reader = readers.get(cell.kind)
            if reader is None or cell.path is None:
                continue
            if cell.kind == "certify" and cell.summary.get("mode", "certify") != "certify":
                continue
            try:
                out += reader(world, cell, settings)
            except (KeyError, TypeError, ValueError) as err:
                raise DamagedFileError(f"{cell.path}: {err} (its records do not match its "
                                       "summary; rerun the cell)") from None
    return out


def _adjusted(pvalues: Sequence[float | None], adjust) -> list[float | None]:
    tested = [i for i, p in enumerate(pvalues) if p is not None]
    out: list[float | None] = [None] * len(pvalues)
    if tested:
        for i, q in zip(tested, adjust(np.array([pvalues[i] for i in tested])), strict=True):
            out[i] = float(q)
    return out


def verdict(delta: float, p_holm: float | None, tost_p_holm: float | None,
            level: float) -> str:
    """The verdict of one hypothesis (module docstring) from std's advantage ``delta`` and
    the run-wide adjusted p's."""
    if p_holm is None:
        return "untested"
    if p_holm < level and delta != 0:
        return "std more robust" if delta > 0 else "other more robust"
    if tost_p_holm is not None and tost_p_holm < level:
        return "equivalent"
    return "inconclusive"


@dataclass(frozen=True)
class Family:
    """The run's hypotheses with their run-wide adjusted p's and verdicts (same order)."""

    hypotheses: tuple[Hypothesis, ...]
    p_holm: tuple[float | None, ...]
    p_bh: tuple[float | None, ...]
    tost_p_holm: tuple[float | None, ...]
    method_p_holm: tuple[float | None, ...]
    verdicts: tuple[str, ...]
    settings: AnalysisConfig

    @property
    def tests(self) -> int:
        """The number of hypotheses with a p: the size of the run-wide family."""
        return sum(p is not None for p in self.p_holm)


def run_family(items: Sequence[Hypothesis], settings: AnalysisConfig) -> Family:
    """Adjust every p of the run together (Holm and BH), every TOST p together (Holm), the
    method's subset p's within their own families, and give each hypothesis its verdict."""
    p_holm = _adjusted([h.result.p for h in items], stats.holm)
    p_bh = _adjusted([h.result.p for h in items], stats.benjamini_hochberg)
    tost = _adjusted([h.result.tost_p if h.result.p is not None else None for h in items],
                     stats.holm)
    method: list[float | None] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    for i, h in enumerate(items):
        if h.method is not None:
            groups.setdefault(h.method.group, []).append(i)
    for members in groups.values():
        adjusted = _adjusted([items[i].method.p for i in members], stats.holm)
        for i, q in zip(members, adjusted, strict=True):
            method[i] = q
    verdicts = [verdict(h.advantage()[0], p, t, settings.level)
                for h, p, t in zip(items, p_holm, tost, strict=True)]
    return Family(tuple(items), tuple(p_holm), tuple(p_bh), tuple(tost), tuple(method),
                  tuple(verdicts), settings)


def family_table(family: Family) -> Table:
    """``worlds_hypotheses``: one row per hypothesis with its pooled test, run-wide Holm and BH,
    TOST and verdict, and the method's subset test beside it (`COLUMNS`)."""
    rows = []
    for i, h in enumerate(family.hypotheses):
        delta, low, high = h.advantage()
        m = h.method
        verdict_text = family.verdicts[i].replace("other", h.model_b)
        rows.append((h.world, h.family, h.measure, h.cell, h.budget, h.kind, h.model_a,
                     h.model_b, h.result.inputs, h.result.value_a, h.result.value_b, delta, low,
                     high, h.result.test, h.result.p, family.p_holm[i], family.p_bh[i],
                     h.result.margin, h.result.tost_p, family.tost_p_holm[i], verdict_text,
                     None if m is None else m.delta, None if m is None else m.sd,
                     None if m is None else m.subsets, None if m is None else m.p,
                     family.method_p_holm[i]))
    s = family.settings
    return Table("worlds_hypotheses",
                 f"Every hypothesis of the run, one family of {family.tests} tests: pooled "
                 "paired test over every input, Holm and BH across the whole run, TOST "
                 f"equivalence (margins ±{s.rate_margin:g} for rates, ±{s.radius_margin:.0%} of "
                 f"std's R̄), verdict at level {s.level:g}; delta = std's robustness advantage "
                 "(> 0: std more robust), 95 % paired bootstrap interval; the method's subset "
                 "t-test beside it", COLUMNS, tuple(rows))


def verdict_counts(family: Family, model_b: str | None = None) -> dict[str, int]:
    """How many hypotheses (of ``model_b`` only, if given) have each verdict, plus ``tests``
    (with a p) and ``raw_significant`` (raw p < level) and ``bh_significant``."""
    chosen = [i for i, h in enumerate(family.hypotheses)
              if model_b is None or h.model_b == model_b]
    counts = {v: 0 for v in VERDICTS}
    for i in chosen:
        counts[family.verdicts[i]] += 1
    level = family.settings.level
    counts["tests"] = sum(family.hypotheses[i].result.p is not None for i in chosen)
    counts["raw_significant"] = sum(
        (p := family.hypotheses[i].result.p) is not None and p < level for i in chosen)
    counts["bh_significant"] = sum(
        (q := family.p_bh[i]) is not None and q < level for i in chosen)
    return counts


def summary_table(family: Family) -> Table:
    """``worlds_hypotheses_summary``: per compared model and in all, the family's size, how
    many raw p's fall below the level (and how many chance alone would give), how many pass
    BH and Holm across the run, and the verdict counts."""
    level = family.settings.level
    rows = []
    models = list(dict.fromkeys(h.model_b for h in family.hypotheses))
    for model in [*models, None]:
        c = verdict_counts(family, model)
        rows.append(("all" if model is None else model, c["tests"], c["raw_significant"],
                     round(level * c["tests"], 1), c["bh_significant"],
                     c["std more robust"], c["other more robust"], c["equivalent"],
                     c["inconclusive"], c["untested"]))
    return Table("worlds_hypotheses_summary",
                 f"The run-wide family: {family.tests} tests (std against each model, every "
                 f"world, measure and budget); 'expected' = raw p < {level:g} by chance alone "
                 "if no difference existed anywhere",
                 ("model_b", "tests", "raw_p_below_level", "expected_by_chance",
                  "bh_below_level", "std_more_robust", "model_b_more_robust", "equivalent",
                  "inconclusive", "untested"), tuple(rows))


__all__ = ["COLUMNS", "MEASURES", "VERDICTS", "Family", "Hypothesis", "MethodColumn",
           "family_table", "hypotheses", "run_family", "summary_table",
           "verdict", "verdict_counts"]
