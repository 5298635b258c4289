"""The findings of a multi-world run: where std and each other model differ, by how much, how sure.

One row per world, budget and pair (std against cbm, cbmh, proto), from the three tests the
report already runs — no new test, no new p-value:

* **certified radius** (`worlds_certification_radius_tests`, the method's test): ``Δ = R̄_std
  − R̄_b``, the mean certified radius over correctly predicted inputs, per subset; paired
  two-sided t-test over the subsets; Holm across the σ (ρ, m) of one world. Δ > 0: std has the
  larger radius.
* **smoothed accuracy under exactly m flips** (`worlds_certification_tests`): such noise
  certifies no Hamming radius (two states at odd distance have disjoint noise sets), so for
  those cells the findings compare what the method's Table 5 compares: ``Δ = SmAcc_std −
  SmAcc_b`` per subset; paired sign-flip permutation test over the subsets' inputs, Holm over
  the cell's tests. Δ > 0: std is the more robust.
* **flip rate** (`worlds_perturb_tests`): ``Δ = PFR_std − PFR_b`` per subset; paired sign-flip
  permutation test over the subsets' inputs, Holm over the budgets of one world. Δ > 0: std
  flips more, b is the more robust.
* **robust accuracy** under APGD (`worlds_attack_tests`): ``Δ = RobAcc_std − RobAcc_b`` over
  the inputs both were attacked on; exact McNemar test over the inputs, Holm over the ε and
  pairs of one attack cell. Δ > 0: std is the more robust. Robust accuracy counts clean errors
  as not robust, so each attack row is followed by the same test over the inputs both models
  classify correctly unattacked (``RobAcc|clean``: 1 − the attack's success rate; Holm over
  the cell's conditional tests), which isolates the attack.

Added per row: the first model's value (``R̄_std``, ``SmAcc_std`` or ``PFR_std``, mean over
subsets), the 95 %
t-interval of the mean difference over the k subsets, ``Δ ± t₀.₉₇₅,k−1 · sd/√k`` (the subsets
overlap when k·size exceeds the inputs, so read it as descriptive), Δ relative to the first
model's value, and which model is shown the more robust: the one ``p_holm < 0.05`` favours,
``none shown`` otherwise (``untested`` where the test has no p). For robust accuracy the
interval is the same t-interval over the inputs' differences ``d_i ∈ {−1, 0, 1}`` (k = the
inputs). Rows of the radius test run ``σ`` then ``ρ`` then ``m``, then the accuracies under m
flips, then the flip rates by budget kind, then the attack cells, then the attack cells on
the inputs clean for both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import scipy.stats

from cbcert.certify.smoothing import KINDS, SMOOTHINGS
from cbcert.report.plotting import KIND_TYPES, TYPE_COLOURS, budget_type, pyplot, save
from cbcert.report.tables import Table
from cbcert.robustness.protocol import BUDGET_SYMBOLS

LEVEL = 0.05
# The attack measured where it alone decides: robust accuracy over the inputs both models
# classify correctly unattacked (`attack_tests`' ``*_clean`` columns).
CLEAN_ATTACK = "robust accuracy on clean inputs RobAcc|clean"
# Noises under which no radius can be certified: the findings compare smoothed accuracy there.
ACCURACY_NOISES = ("fixed",)
COLUMNS = ("world", "family", "measure", "budget", "type", "model_a", "model_b", "value_a",
           "delta", "ci_low", "ci_high", "relative", "subsets", "test", "p_holm",
           "more_robust")


def t_interval(mean: float | None, sd: float | None, df: int | None,
               level: float = 0.95) -> tuple[float | None, float | None]:
    """The two-sided ``level`` t-interval of a mean over ``k = df + 1`` paired differences:
    ``mean ± t_{(1+level)/2, df} · sd / √k``; ``(None, None)`` where a value is missing or
    ``df < 1``."""
    if mean is None or sd is None or df is None or df < 1 or not math.isfinite(sd):
        return None, None
    half = float(scipy.stats.t.ppf(0.5 + level / 2, df)) * sd / math.sqrt(df + 1)
    return mean - half, mean + half


def more_robust(delta: float | None, p_holm: float | None, a: str, b: str,
                larger_is_robust: bool) -> str:
    """Which of ``a``, ``b`` the test shows the more robust at `LEVEL` after Holm:
    ``Δ = value_a − value_b``; with ``larger_is_robust`` (radii) Δ > 0 favours ``a``, without
    (flip rates) Δ > 0 favours ``b``. ``none shown`` if ``p_holm ≥ LEVEL`` or Δ = 0,
    ``untested`` without a p."""
    if p_holm is None or delta is None:
        return "untested"
    if p_holm >= LEVEL or delta == 0:
        return "none shown"
    return a if (delta > 0) == larger_is_robust else b


def _rows(table: Table | None) -> list[dict[str, Any]]:
    if table is None:
        return []
    return [dict(zip(table.columns, row, strict=True)) for row in table.rows]


def _noise_budget(noise: str, scale: float) -> tuple[str, str]:
    """``("σ=0.1", "geometric")``, ``("m=2", "semantic")``: a smoothing cell's budget label
    and perturbation type."""
    kind = SMOOTHINGS[noise]
    label = f"{kind.symbol}={int(scale) if kind.symbol == 'm' else scale:g}"
    return label, "semantic" if kind.hamming else "geometric"


def _radius_rows(tests: list[dict], subsets: list[dict]) -> list[tuple]:
    value = {(r["world"], r["cell"], r["model"]): r.get("radius_of_correct_mean")
             for r in subsets}
    out = []
    for r in sorted(tests, key=lambda r: KINDS.index(r["noise"])):
        value_a = value.get((r["world"], r["cell"], r["model_a"]))
        out.append(_row(r, "certified radius R̄", *_noise_budget(r["noise"], r["scale"]),
                        value_a, "paired t (subsets)", larger_is_robust=True))
    return out


def _accuracy_rows(tests: list[dict], radius: list[dict], subsets: list[dict]) -> list[tuple]:
    """Smoothed-accuracy rows of the cells whose noise is in `ACCURACY_NOISES` (the radius
    test's rows give each cell's noise and scale)."""
    cells = {(r["world"], r["cell"]): r for r in radius if r["noise"] in ACCURACY_NOISES}
    by_model = {(r["world"], r["cell"], r["model"]): r for r in subsets}
    out = []
    for r in tests:
        cell = cells.get((r["world"], r["cell"]))
        if cell is None or r["metric"] != "smoothed_accuracy":
            continue
        a = by_model.get((r["world"], r["cell"], r["model_a"]), {})
        k = a.get("subsets")
        out.append(_row({**r, "df": None if k is None else k - 1}, "smoothed accuracy SmAcc",
                        *_noise_budget(cell["noise"], cell["scale"]),
                        a.get("smoothed_accuracy_mean"), "permutation (inputs)",
                        larger_is_robust=True))
    return out


def _pfr_rows(tests: list[dict], perturb: list[dict]) -> list[tuple]:
    value = {(r["world"], r["cell"], r["budget"]): r for r in perturb}
    kinds = list(BUDGET_SYMBOLS)
    out = []
    tested = [(r, value[r["world"], r["cell"], r["budget"]]) for r in tests]
    for r, budget_row in sorted(tested, key=lambda pair: kinds.index(pair[1]["kind"])):
        kind = budget_row["kind"]
        out.append(_row(r, "flip rate PFR", f"{BUDGET_SYMBOLS[kind]}={budget_row['value']:g}",
                        KIND_TYPES[kind], budget_row.get(f"pfr_{r['model_a']}_mean"),
                        "permutation (inputs)", larger_is_robust=False))
    return out


def _attack_rows(tests: list[dict]) -> list[tuple]:
    out = []
    for r in tests:
        budget = f"ε={r['eps']:g} {r['cell']}"
        r = {**r, "df": None if r.get("inputs") is None else r["inputs"] - 1}
        out.append(_row(r, "robust accuracy RobAcc", budget, budget_type(budget), r["robust_a"],
                        "exact McNemar (inputs)", larger_is_robust=True))
    for r in tests:
        if not r.get("clean_both"):
            continue
        budget = f"ε={r['eps']:g} {r['cell']}"
        r = {**r, "delta_mean": r["delta_clean_mean"], "delta_sd": r["delta_clean_sd"],
             "df": r["clean_both"] - 1, "p_holm": r["p_holm_clean"]}
        out.append(_row(r, CLEAN_ATTACK, budget, budget_type(budget), r["robust_a_clean"],
                        "exact McNemar (inputs clean for both)", larger_is_robust=True))
    return out


def _row(r: dict, measure: str, budget: str, kind: str, value_a: float | None, test: str,
         larger_is_robust: bool) -> tuple:
    delta, sd, df = r.get("delta_mean"), r.get("delta_sd"), r.get("df")
    low, high = t_interval(delta, sd, df)
    relative = delta / value_a if delta is not None and value_a else None
    subsets = None if df is None else df + 1
    return (r["world"], r["family"], measure, budget, kind, r["model_a"], r["model_b"], value_a,
            delta, low, high, relative, subsets, test, r.get("p_holm"),
            more_robust(delta, r.get("p_holm"), r["model_a"], r["model_b"], larger_is_robust))


def findings_table(tables: Sequence[Table]) -> Table | None:
    """``worlds_findings``: every std-vs-model difference of the certification radius test,
    the flip-rate tests and the attack tests across worlds, with the first model's value, the
    95 % t-interval, the relative size and the model shown the more robust (module
    docstring). ``tables``: the cross-world tables
    (`cbcert.report.worlds.cross_world_tables`); None if no test ran.
    """
    by_name = {t.name: t for t in tables}
    radius = _rows(by_name.get("worlds_certification_radius_tests"))
    accuracy = _rows(by_name.get("worlds_certification_tests"))
    pfr = _rows(by_name.get("worlds_perturb_tests"))
    subsets = _rows(by_name.get("worlds_certification_subsets"))
    perturb = _rows(by_name.get("worlds_perturb"))
    attack = _rows(by_name.get("worlds_attack_tests"))
    rows = []
    worlds = list(dict.fromkeys(r["world"] for r in (*radius, *pfr, *attack)))
    for world in worlds:
        rows += _radius_rows([r for r in radius if r["world"] == world], subsets)
        rows += _accuracy_rows([r for r in accuracy if r["world"] == world], radius, subsets)
        rows += _pfr_rows([r for r in pfr if r["world"] == world], perturb)
        rows += _attack_rows([r for r in attack if r["world"] == world])
    if not rows:
        return None
    return Table("worlds_findings",
                 "Findings: std against each other model, every world and budget. Δ = value_std "
                 "− value_b (certified radius R̄ over correct inputs: Δ > 0, std more robust; "
                 "smoothed accuracy SmAcc under exactly m flips, which certify no radius: Δ > 0, "
                 "std more robust; "
                 "flip rate PFR: Δ > 0, b more robust; robust accuracy RobAcc under APGD: Δ > 0, "
                 "std more robust), 95 % t-interval over the subsets (RobAcc: over the inputs), "
                 "Δ relative to std's value, p_holm: Holm-adjusted p of the report's test "
                 "(radius: paired t over the subsets, Holm across one noise's scales; SmAcc: "
                 "paired permutation over the inputs, Holm within the cell; PFR: "
                 "paired permutation over the inputs, Holm across the budgets; RobAcc: exact "
                 "McNemar over the inputs, Holm across the cell's ε and pairs; RobAcc|clean: "
                 "the same over the inputs both models classify correctly unattacked, Holm "
                 "across the cell's conditional tests); more_robust: the "
                 f"model p_holm < {LEVEL} favours", COLUMNS, tuple(rows))


# The panels of `figure_findings`: one unit each (the smoothings' symbols by radius, the
# flip-rate budgets' symbols) and its scale. Radii have no common size across σ, ρ and worlds, so
# their Δ is drawn relative to std's radius ("relative", %); accuracies and flip rates are
# already fractions of the inputs, so theirs is drawn in percentage points ("points"), which
# stays readable where std's own value is near 0 (a relative Δ of a 0.015 flip rate reaches
# −750 %).
PANELS = (("L2 radius", "certified radius R̄",
           tuple(s.symbol for s in SMOOTHINGS.values() if not s.hamming), "relative"),
          ("Hamming radius", "certified radius R̄",
           tuple(s.symbol for s in SMOOTHINGS.values() if s.hamming), "relative"),
          ("accuracy under m flips", "smoothed accuracy SmAcc",
           tuple(SMOOTHINGS[n].symbol for n in ACCURACY_NOISES), "points"),
          ("flip rate", "flip rate PFR", tuple(BUDGET_SYMBOLS.values()), "points"),
          ("attack", "robust accuracy RobAcc", ("ε",), "points"),
          ("attack", CLEAN_ATTACK, ("ε",), "points"))
_MARKERS = "osD^v<>p"


def _plotted(r: dict, scale: str) -> tuple[float, float | None, float | None] | None:
    """``(Δ, interval low, interval high)`` of one findings row on its panel's scale: 100·Δ /
    std's value (%) for ``"relative"``, 100·Δ (percentage points) for ``"points"``; None for a
    relative row whose std value is 0 or missing (no relative size)."""
    if r["delta"] is None:
        return None
    if scale == "relative":
        if r["relative"] is None:
            return None
        factor = 100 / r["value_a"]
    else:
        factor = 100
    low = None if r["ci_low"] is None else factor * r["ci_low"]
    high = None if r["ci_high"] is None else factor * r["ci_high"]
    return factor * r["delta"], low, high


def figure_findings(table: Table | None, path: Path) -> Path | None:
    """The findings at a glance: every world's, budget's and model's Δ with its 95 %
    t-interval, a panel per unit (`PANELS`: L2 radii and Hamming radii relative to std's radius
    in %, accuracy under m flips, flip rates and robust accuracy under attack, over all
    attacked inputs and over those clean for both, in percentage points), a row per world and
    budget, a marker per compared model, colour by perturbation type (`TYPE_COLOURS`), filled
    where Holm shows a difference (``p_holm < LEVEL``), hollow where not. The sign is each
    measure's own: a radius or accuracy Δ > 0 favours std, a flip-rate Δ > 0 the other model.
    Radius rows whose std value is 0 (no relative size) are left out of the figure, not of the
    table. None without a plottable row."""
    if table is None:
        return None
    rows = _rows(table)
    panels = []
    for unit, measure, symbols, scale in PANELS:
        picked = [(r, xs) for r in rows if r["measure"] == measure
                  and r["budget"].split("=")[0] in symbols
                  and (xs := _plotted(r, scale)) is not None]
        if picked:
            panels.append((unit, measure, scale, picked))
    if not panels:
        return None
    models = list(dict.fromkeys(r["model_b"] for *_, picked in panels for r, _ in picked))
    height = max(len(dict.fromkeys((r["world"], r["budget"]) for r, _ in p))
                 for *_, p in panels)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 1.2 + 0.28 * height),
                             squeeze=False)
    for ax, (unit, measure, scale, picked) in zip(axes[0], panels, strict=True):
        labels = list(dict.fromkeys((r["world"], r["budget"]) for r, _ in picked))
        step = 0.7 / max(len(models), 1)
        for r, (x, low, high) in picked:
            j = models.index(r["model_b"])
            y = labels.index((r["world"], r["budget"])) + (j - (len(models) - 1) / 2) * step
            colour = TYPE_COLOURS[r["type"]]
            if low is not None:
                ax.plot([low, high], [y, y], color=colour, lw=1)
            shown = r["more_robust"] not in ("none shown", "untested")
            ax.plot([x], [y], marker=_MARKERS[j % len(_MARKERS)], ms=5, color=colour,
                    markerfacecolor=colour if shown else "white", linestyle="none")
        ax.axvline(0, color="0.4", lw=0.8)
        ax.set_yticks(range(len(labels)), [f"{w}  {b}" for w, b in labels], fontsize=7)
        types = {(r["world"], r["budget"]): r["type"] for r, _ in picked}
        for tick, label in zip(ax.get_yticklabels(), labels, strict=True):
            tick.set_color(TYPE_COLOURS[types[label]])
        ax.set_ylim(len(labels) - 0.5, -0.5)
        sign = "the other model" if measure.startswith("flip rate") else "std"
        unit_text = "Δ / std's value (%)" if scale == "relative" else "Δ (percentage points)"
        ax.set_xlabel(f"{unit_text}; > 0 favours {sign}", fontsize=8)
        ax.set_title(f"{unit}: {measure}", fontsize=9)
    handles = [plt.Line2D([], [], marker=_MARKERS[j % len(_MARKERS)], color="0.3",
                          linestyle="none", label=f"std vs {m}") for j, m in enumerate(models)]
    handles += [plt.Line2D([], [], marker="o", color="0.3", markerfacecolor="white",
                           linestyle="none", label=f"hollow: p_holm ≥ {LEVEL}")]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle("Findings: std against each model, Δ with its 95 % interval (radii relative "
                 "to std's, fractions in points; colour: blue geometric, orange semantic)",
                 fontsize=10)
    return save(fig, path)


__all__ = ["ACCURACY_NOISES", "CLEAN_ATTACK", "LEVEL", "PANELS", "figure_findings",
           "findings_table", "more_robust", "t_interval"]
