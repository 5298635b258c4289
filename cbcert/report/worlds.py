"""Cross-world report of a multi-world sweep (``worlds:`` in the config).

Reads every world directory's finished cells (`find_cells`) and writes, into ``<run>/report/``:

* ``worlds_<table>.csv`` for every per-world table (certification, subsets and their tests,
  perturb and its tests, attack, the classes' distance matrices): the rows of every world
  under leading ``world`` and ``family`` columns (columns a world lacks are empty);
* ``worlds_hypotheses.csv`` and ``worlds_hypotheses_summary.csv``, first in ``report.md``:
  every hypothesis of the run in one family — pooled paired tests over every input, Holm and
  Benjamini–Hochberg across the whole run, TOST equivalence, the verdict, and the method's
  subset test beside it (`cbcert.report.family`);
* ``method_comparison.csv`` and ``method_comparison_headlines.csv``: the method's claims, its
  numbers beside the run's, and whether they agree (`cbcert.report.claims`);
* ``findings_<model>.png``: std against each model over the whole run, std's advantage with
  its interval on a scale of its own (`cbcert.report.findings`);
* ``worlds_gap.csv`` and ``robustness_gap_worlds.png``: the std-vs-cbm gaps (`robustness_gaps`),
  one row per world, one column per budget × metric; the figure draws one heatmap per unit
  (fractions of ΔPFR, ΔSmAcc, ΔRobAcc; L2 and Hamming ΔACR apart), each on its own scale;
* ``pfr_worlds_<kind>.png``: PFR vs ε (τ, σ, ρ), a row of panels per world family, a panel per
  model, a line per world;
* ``pfr_models_worlds.png``: every model's PFR in one panel, a row per world, a column per
  budget kind, titles coloured by perturbation type (geometric ε, σ; semantic τ, ρ);
* ``dfs_cfr_worlds.png``: the concept model's decision shift (DFS) against the fraction of
  concepts flipped (CFR) at every budget, colour by perturbation type, marker by world;
* ``radius_worlds.png``: the certified radius per world and model, rows σ R̄ (mean radius over
  correctly predicted inputs), σ ACR, ρ R̄, ρ ACR (ρ on a symlog scale), a panel per scale;
  the fixed-m cells, radius 0 by construction, are left out;
* ``delta_pfr_worlds.png``: ΔPFR = PFR_std − PFR_m at each world's largest ε (geometric) and
  smallest τ (semantic), with the Holm-corrected permutation p of the perturb tests;
* ``class_distances_worlds.png`` and ``worlds_class_similarity.csv``: the class-centroid
  distance heatmap of every world, and per world its mean and smallest centroid distance;
* ``attacks_worlds.png``: robust accuracy at each attack cell's largest ε per world and model.

A figure without data is skipped with a note; each world also gets its own report
(``<run>/<world>/report/``), linked from ``report.md``.

Every model keeps one colour in every figure (`cbcert.report.plotting.model_colour`).

Size: every cross-world table and figure in one place, on the shared `WorldCells` and the
perturbation-type and model colours; each figure is one function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cbcert.certify.smoothing import SMOOTHINGS
from cbcert.report.cells import CellResult, DamagedFileError, ReportError, find_cells
from cbcert.report.claims import comparison_table, headline_table, load_claims
from cbcert.report.family import Family, family_table, hypotheses, run_family, summary_table
from cbcert.report.figures import robustness_gaps
from cbcert.report.findings import figure_findings
from cbcert.report.plotting import (
    KIND_TYPES,
    TYPE_COLOURS,
    budget_type,
    draw_plans,
    model_colour,
    pyplot,
    save,
)
from cbcert.report.tables import Table, _num, tables
from cbcert.robustness.protocol import BUDGET_SYMBOLS
from cbcert.runs.config import AnalysisConfig

# One world's cells: (entry name, family, cells).
WorldCells = tuple[str, str, tuple[CellResult, ...]]
_PFR_AXES = {"eps": "ε", "tau": "τ", "sigma": "σ", "rho": "ρ"}


def world_cells(run_dir: Path, entries: Sequence[dict[str, Any]],
                log: Callable[[str], None] = print) -> list[WorldCells]:
    """The finished cells of every world entry (``{"name", "family"}`` from the manifest);
    worlds with none yet are skipped with a note. Raises ReportError if no world has any."""
    found = []
    for entry in entries:
        try:
            cells = find_cells(run_dir / entry["name"], log)
        except DamagedFileError:
            raise
        except (ReportError, FileNotFoundError):
            log(f"note: world {entry['name']} has no finished cell yet; left out")
            continue
        found.append((entry["name"], entry.get("family", ""), cells))
    if not found:
        raise ReportError(f"{run_dir}: no world of the manifest has a finished cell")
    return found


def run_analysis(worlds: Sequence[WorldCells], analysis: AnalysisConfig) -> Family | None:
    """Every hypothesis of the run in one family (`cbcert.report.family`), read with the
    run's ``analysis`` settings; None if the run tests none."""
    items = hypotheses(worlds, analysis)
    return run_family(items, analysis) if items else None


def analysis_tables(family: Family | None) -> list[Table]:
    """The run-wide family and its summary, and the comparison with the method's claims
    (`cbcert.report.claims`); [] without a family."""
    if family is None:
        return []
    claims, headlines = load_claims()
    comparison = comparison_table(claims, family)
    return [summary_table(family), family_table(family), comparison,
            headline_table(headlines, comparison, claims)]


def cross_world_tables(worlds: Sequence[WorldCells],
                       analysis: Family | None = None) -> list[Table]:
    """Every per-world table stacked over worlds, the gap table and the class summary, after
    the run-wide ``analysis`` (`analysis_tables`), which comes first."""
    stacked: dict[str, list[tuple[str, str, Table]]] = {}
    for name, family, cells in worlds:
        for table in tables(cells):
            stacked.setdefault(table.name, []).append((name, family, table))
    out = []
    for table_name, parts in stacked.items():
        columns = list(dict.fromkeys(c for _, _, t in parts for c in t.columns))
        rows = []
        for name, family, t in parts:
            index = {c: i for i, c in enumerate(t.columns)}
            rows += [(name, family, *(row[index[c]] if c in index else None for c in columns))
                     for row in t.rows]
        title = parts[0][2].title
        if table_name.startswith("perturb"):  # drop the trailing "(<cell>)"
            title = title.rsplit(" (", 1)[0]
        out.append(Table(f"worlds_{table_name}", f"{title} — every world",
                         ("world", "family", *columns), tuple(rows)))
    gap = gap_table(worlds)
    if gap is not None:
        out.append(gap)
    summary = [(name, family, len(c.summary["class_names"]), c.summary["samples"],
                c.summary["mean_off_diagonal"], *_closest_pair(c.summary))
               for name, family, cells in worlds for c in cells if c.kind == "classes"]
    if summary:
        out.append(Table("worlds_class_similarity", "Class similarity per world: mean and "
                         "smallest class-centroid distance in f_std's feature space",
                         ("world", "family", "classes", "samples", "mean_distance",
                          "min_distance", "closest_pair"), tuple(summary)))
    return [*analysis_tables(analysis), *out]


def _closest_pair(summary: dict[str, Any]) -> tuple[float | None, str | None]:
    pairs = [(v["distance"], f"{name}–{v['class']}") for name, v in summary["nearest"].items()
             if v["distance"] is not None]
    return min(pairs) if pairs else (None, None)


def gap_columns(worlds: Sequence[WorldCells]) -> tuple[list[str], np.ndarray]:
    """``(columns, values[W, G])``: every world's `robustness_gaps` flattened to
    ``"<metric> <budget>"`` columns (``ΔPFR ε=0.1``, ``ΔACR σ=0.25``, ``ΔRobAcc ε=0.03
    attack-latent``; metric order, then first seen); NaN where a world lacks one. Signs as in
    `robustness_gaps`: positive = CBM more robust."""
    per_world = []
    for _, _, cells in worlds:
        rows, columns, values = robustness_gaps(cells)
        per_world.append({_gap_label(c, r): v for r, row in zip(rows, values, strict=True)
                          for c, v in zip(columns, row, strict=True) if not math.isnan(v)})
    metrics = ("ΔPFR", "ΔSmAcc", "ΔACR", "ΔRobAcc")
    seen = list(dict.fromkeys(k for gaps in per_world for k in gaps))
    order = sorted(seen, key=lambda k: (next(i for i, m in enumerate(metrics)
                                             if k.startswith(m)), seen.index(k)))
    values = np.array([[gaps.get(k, math.nan) for k in order] for gaps in per_world],
                      dtype=np.float64).reshape(len(worlds), len(order))
    return order, values


def _gap_label(metric: str, budget: str) -> str:
    """``"ΔPFR (std−cbm)", "ε=0.1 (perturb)" -> "ΔPFR ε=0.1"``; an attack keeps its cell."""
    budget = budget.replace(" (perturb)", "").replace(" (certify)", "").replace(" (", " ")
    return f"{metric.split(' ')[0]} {budget.rstrip(')')}"


def gap_table(worlds: Sequence[WorldCells]) -> Table | None:
    """`gap_columns` as a table (one row per world)."""
    columns, values = gap_columns(worlds)
    if not columns:
        return None
    rows = tuple((name, family, *(None if math.isnan(v) else float(v) for v in row))
                 for (name, family, _), row in zip(worlds, values, strict=True))
    return Table("worlds_gap", "std vs cbm robustness gap per world (positive = CBM more "
                 "robust)", ("world", "family", *columns), rows)


def perturbation_type(column: str) -> str:
    """``geometric`` or ``semantic`` for a `gap_columns` column (``ΔPFR τ=1`` → semantic,
    ``ΔRobAcc ε=0.03 attack-concept`` → semantic, ``ΔACR σ=0.1`` → geometric)."""
    return budget_type(column.split(" ", 1)[1] if " " in column else column)


def _gap_groups(columns: Sequence[str]) -> list[tuple[str, list[int]]]:
    """Column indices per unit: ΔPFR, ΔSmAcc, ΔRobAcc (fractions, one panel each), ΔACR of
    L2 radii (σ cells) and ΔACR of Hamming radii (ρ, m cells) apart — one unit per scale."""
    groups: dict[str, list[int]] = {}
    names = {"ΔPFR": "ΔPFR = PFR_std − PFR_cbm", "ΔSmAcc": "ΔSmAcc = cbm − std",
             "ΔACR": "ΔACR = cbm − std (L2 radius)", "ΔACR-H": "ΔACR-H = cbm − std (Hamming)",
             "ΔRobAcc": "ΔRobAcc = cbm − std"}
    for j, column in enumerate(columns):
        metric = column.split(" ")[0]
        if metric == "ΔACR" and perturbation_type(column) == "semantic":
            metric = "ΔACR-H"
        groups.setdefault(metric, []).append(j)
    return [(names.get(m, m), idx) for m, idx in groups.items()]


def figure_gap_worlds(worlds: Sequence[WorldCells], path: Path) -> Path | None:
    """The std-vs-cbm gaps of `gap_columns` over every budget of the run (the method's Fig.
    1(b) picks four of them: `cbcert.report.method_outputs`): a heatmap per unit
    (`_gap_groups`), each with its own symmetric colour scale (positive = CBM more robust,
    blue), a row per world, budget labels coloured by perturbation type (`TYPE_COLOURS`),
    values annotated and "n/a" where a world lacks the budget. The fixed-count m cells'
    ΔACR-H is left out: their radius is 0 by construction."""
    columns, data = gap_columns(worlds)
    zero = {j for j, c in enumerate(columns) if c.startswith("ΔACR m=")}
    groups = [(title, [j for j in idx if j not in zero]) for title, idx in _gap_groups(columns)]
    groups = [(title, idx) for title, idx in groups if idx]
    if not groups:
        return None
    plt = pyplot()
    widest = max(len(idx) for _, idx in groups)
    fig, axes = plt.subplots(len(groups), 1, squeeze=False, figsize=(
        3.5 + 0.6 * widest, sum(1.4 + 0.32 * len(worlds) for _ in groups)))
    for ax, (title, idx) in zip(axes[:, 0], groups, strict=True):
        part = data[:, idx]
        bound = float(np.nanmax(np.abs(part))) if np.isfinite(part).any() else 0.0
        bound = bound or 1.0  # all gaps zero: a plain ±1 scale, not ±1e-9
        image = ax.imshow(np.ma.masked_invalid(part), cmap="RdBu", vmin=-bound, vmax=bound,
                          aspect="auto")
        labels = [columns[j].split(" ", 1)[1] for j in idx]
        ax.set_xticks(range(len(idx)), labels, rotation=40, ha="right", fontsize=7)
        for tick, j in zip(ax.get_xticklabels(), idx, strict=True):
            tick.set_color(TYPE_COLOURS[perturbation_type(columns[j])])
        ax.set_yticks(range(len(worlds)), [_world_label(w) for w in worlds], fontsize=7)
        for (i, j), v in np.ndenumerate(part):
            missing = np.isnan(v)
            ax.text(j, i, "n/a" if missing else f"{v:+.2g}", ha="center", va="center",
                    fontsize=6, color="0.45" if missing else
                    "white" if abs(v) > 0.6 * bound else "black")
        fig.colorbar(image, ax=ax, fraction=0.04, pad=0.01)
        ax.set_title(title, fontsize=9, loc="left")
    handles = [plt.Line2D([], [], color=c, marker="s", linestyle="", label=t)
               for t, c in TYPE_COLOURS.items()]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="lower right", bbox_to_anchor=(1, 1.02),
                      ncol=2, frameon=False, title="budget labels", title_fontsize=7)
    fig.suptitle("std vs cbm robustness gap per world (positive, blue = CBM more robust; n/a: "
                 "the world lacks the budget)", fontsize=10)
    return save(fig, path)


def _world_label(world: WorldCells) -> str:
    name, family, _ = world
    return f"{name} ({family})" if family else name


def _perturb(cells: Sequence[CellResult]) -> CellResult | None:
    return next((c for c in cells if c.kind == "perturb"), None)


def figure_pfr_worlds(worlds: Sequence[WorldCells], kind: str, path: Path) -> Path | None:
    """PFR (mean over subsets) vs the budgets of ``kind``: a row per family, a panel per
    model, a line per world."""
    curves: dict[str, list[tuple[str, dict[str, tuple[list, list]]]]] = {}
    models: list[str] = []
    for name, family, cells in worlds:
        cell = _perturb(cells)
        budgets = [b for b in cell.summary["budgets"] if b["kind"] == kind] if cell else []
        if not budgets:
            continue
        ms = cell.summary["settings"]["models"]
        models += [m for m in ms if m not in models]
        curves.setdefault(family, []).append(
            (name, {m: ([b["value"] for b in budgets], [b["pfr"][m]["mean"] for b in budgets])
                    for m in ms}))
    if not curves:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(len(curves), len(models), figsize=(3.3 * len(models),
                                                               2.8 * len(curves)),
                             squeeze=False, sharey=True)
    for row, (family, lines) in zip(axes, curves.items(), strict=True):
        for ax, model in zip(row, models, strict=True):
            for name, by_model in lines:
                if model in by_model:
                    ax.plot(*by_model[model], marker="o", label=name)
            ax.set(xlabel=_PFR_AXES[kind], title=f"{model}" + (f" — {family}" if family else ""))
        row[0].set_ylabel("PFR")
        row[0].legend(fontsize=7)
    fig.suptitle(f"Prediction flip rate vs {BUDGET_SYMBOLS[kind]} across worlds")
    return save(fig, path)


def figure_pfr_models_worlds(worlds: Sequence[WorldCells], path: Path) -> Path | None:
    """PFR (mean ± sd over subsets) of every model in one panel: a row per world, a column
    per budget kind (ε, τ, σ, ρ), panel titles coloured by perturbation type — std and the
    concept models side by side on the same budgets."""
    kinds = [k for k in ("eps", "tau", "sigma", "rho")
             if any((c := _perturb(cells)) and any(b["kind"] == k for b in c.summary["budgets"])
                    for _, _, cells in worlds)]
    rows = [(name, family, _perturb(cells)) for name, family, cells in worlds
            if _perturb(cells) is not None]
    if not kinds or not rows:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(len(rows), len(kinds), squeeze=False, sharey=True,
                             figsize=(1.0 + 2.7 * len(kinds), 0.6 + 2.2 * len(rows)))
    for r, (name, family, cell) in enumerate(rows):
        models = cell.summary["settings"]["models"]
        for ax, kind in zip(axes[r], kinds, strict=True):
            budgets = [b for b in cell.summary["budgets"] if b["kind"] == kind]
            for j, model in enumerate(models):
                if budgets:
                    ax.errorbar([b["value"] for b in budgets],
                                [b["pfr"][model]["mean"] for b in budgets],
                                yerr=[b["pfr"][model]["sd"] for b in budgets], marker="o",
                                markersize=3, capsize=2, color=model_colour(model),
                                label=model, linestyle=("-", "--", ":", "-.")[j % 4],
                                linewidth=2.2 if model == "std" else 1.2)
            symbol = _PFR_AXES[kind]
            ax.set_title(f"{name}: {symbol}" if family is None else
                         f"{name} ({family}): {symbol}", fontsize=8,
                         color=TYPE_COLOURS[KIND_TYPES[kind]])
            ax.set(ylim=(-0.02, 1.02))
            ax.tick_params(labelsize=7)
            if r == len(rows) - 1:
                ax.set_xlabel(symbol)
        axes[r, 0].set_ylabel("PFR")
    axes[0, -1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("Prediction flip rate of every model per world (titles: blue geometric, "
                 "orange semantic)", fontsize=10)
    return save(fig, path)


def figure_dfs_cfr_worlds(worlds: Sequence[WorldCells], path: Path) -> Path | None:
    """DFS (the concept model's decision shift, mean over subsets) against CFR (the fraction of
    concepts flipped) at every budget: a panel per concept model with DFS, a point per world
    and budget, colour by perturbation type (`TYPE_COLOURS`), marker by world — how far a
    budget moves the concept model's decision per concept it flips."""
    points: dict[str, list[tuple[int, str, float, float]]] = {}
    names = []
    for name, _, cells in worlds:
        cell = _perturb(cells)
        if cell is None:
            continue
        names.append(name)
        for b in cell.summary["budgets"]:
            for model, dfs in b.get("dfs", {}).items():
                points.setdefault(model, []).append((len(names) - 1, KIND_TYPES[b["kind"]],
                                                     b["cfr"]["mean"], dfs["mean"]))
    if not points:
        return None
    plt = pyplot()
    markers = "osD^v<>PX*"
    fig, axes = plt.subplots(1, len(points), squeeze=False, figsize=(1.5 + 3.8 * len(points),
                                                                      3.8))
    for ax, (model, pts) in zip(axes[0], points.items(), strict=True):
        for w, kind_type, cfr, dfs in pts:
            ax.scatter(cfr, dfs, color=TYPE_COLOURS[kind_type], marker=markers[w % len(markers)],
                       s=22, alpha=0.85)
        ax.set(xlabel="CFR (fraction of concepts flipped)", ylabel=f"DFS of {model}",
               title=f"{model}: decision shift vs concept flips")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=t) for t, c in TYPE_COLOURS.items()]
    handles += [plt.Line2D([], [], color="0.3", marker=markers[w % len(markers)],
                           linestyle="", label=n) for w, n in enumerate(names)]
    axes[0, -1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return save(fig, path)


def figure_radius_worlds(worlds: Sequence[WorldCells], path: Path) -> Path | None:
    """Certified radius per world and model, four rows of panels: σ R̄, σ ACR, ρ R̄, ρ ACR-H
    (R̄ the mean radius over correctly predicted inputs, the method's R; ACR over all inputs,
    wrong and abstaining ones counting 0), a panel per scale titled by it, groups of bars per
    world, one bar per model in its colour; the legend beside the first row, outside the data.

    The fixed-m cells are left out: they certify radius 0 by construction. The ρ rows' Hamming
    radii span decades across worlds (a saturated world's beside a fragile one's), so they are
    drawn on a symlog scale, which their y labels name; a row shares its y axis."""
    found = [c for _, _, cells in worlds for c in cells
             if c.kind == "certify" and c.summary["mode"] == "certify"]
    noises = []
    for kind in (SMOOTHINGS["gaussian"], SMOOTHINGS["bernoulli"]):
        names = sorted(dict.fromkeys(c.name for c in found if c.summary.get("noise") == kind.kind),
                       key=lambda n: next(c.summary["scale"] for c in found if c.name == n))
        if names:
            noises.append((kind, names))
    if not noises:
        return None
    models = list(dict.fromkeys(m for c in found for m in c.summary["models"]))
    measures = (("radius_of_correct", "R̄ over correct inputs"), ("acr", "ACR over all inputs"))
    columns = max(len(names) for _, names in noises)
    width = 0.8 / max(len(models), 1)
    plt = pyplot()
    fig, axes = plt.subplots(len(noises) * len(measures), columns, layout="constrained",
                             squeeze=False, sharey="row",
                             figsize=(1.5 + (1.0 + 0.3 * len(worlds)) * columns,
                                      0.8 + 2.4 * len(noises) * len(measures)))
    for n, (kind, names) in enumerate(noises):
        cells = [[next((c for c in held if c.name == name), None) for _, _, held in worlds]
                 for name in names]
        for m, (key, label) in enumerate(measures):
            row = axes[n * len(measures) + m]
            drawn = []
            for ax, column in zip(row, cells, strict=False):
                for j, model in enumerate(models):
                    xs, heights = [], []
                    for i, cell in enumerate(column):
                        value = cell.summary["models"].get(model, {}).get(key) if cell else None
                        if value is not None and math.isfinite(value):
                            xs.append(i + (j - (len(models) - 1) / 2) * width)
                            heights.append(value)
                    ax.bar(xs, heights, width, color=model_colour(model), label=model)
                    drawn += heights
                scale = next(c for c in column if c).summary["scale"]
                ax.set_title(f"{kind.symbol} = {scale:g}", fontsize=9)
                ax.set_xticks(range(len(worlds)), [w[0] for w in worlds], rotation=40,
                              ha="right", fontsize=7)
                ax.tick_params(axis="y", labelsize=7)
            for ax in row[len(cells):]:
                ax.axis("off")
            unit = "Hamming radius" if kind.hamming else "L2 radius"
            if kind.hamming:
                positive = [v for v in drawn if v > 0]
                threshold = 10.0 ** math.floor(math.log10(min(positive))) if positive else 1e-3
                row[0].set_yscale("symlog", linthresh=threshold)
                # symlog's autoscale ends at the tallest bar; leave it a third of a decade
                row[0].set_ylim(0, 2 * max(positive, default=threshold))
                unit += f",\nsymlog: linear below {threshold:g}"
            row[0].set_ylabel(f"{label}\n({kind.symbol}, {unit})", fontsize=8)
    axes[0][len(noises[0][1]) - 1].legend(fontsize=8, loc="upper left",
                                          bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("Certified radius per world and model: R̄ over correctly predicted inputs and "
                 "ACR over all inputs (σ: L2 in latent space; ρ: Hamming in concept space; "
                 "fixed m flips certify radius 0 and are left out)", fontsize=10)
    return save(fig, path, lay_out=False)


def figure_delta_pfr_worlds(worlds: Sequence[WorldCells], path: Path) -> Path | None:
    """ΔPFR = PFR_std − PFR_m (mean ± sd over subsets) per world and comparison, a panel per
    perturbation type: geometric at each world's largest ε, semantic at its smallest τ (the
    largest τ flips every prediction); Holm-corrected p beyond each error bar."""
    panels = []
    for kind, pick, kind_type in (("eps", max, "geometric"), ("tau", min, "semantic")):
        entries = []
        for name, _, cells in worlds:
            cell = _perturb(cells)
            budgets = [b for b in cell.summary["budgets"] if b["kind"] == kind] if cell else []
            if budgets:
                chosen = pick(budgets, key=lambda b: b["value"])
                entries.append((name, chosen["value"], [c for c in chosen["comparisons"]
                                                        if c["model_a"] == "std"]))
        if entries:
            panels.append((kind, kind_type, entries))
    if not panels:
        return None
    plt = pyplot()
    widest = max(len(entries) for _, _, entries in panels)
    fig, axes = plt.subplots(1, len(panels), squeeze=False, sharey=True,
                             figsize=(1.5 + (1.0 + 0.9 * widest) * len(panels), 3.8))
    for ax, (kind, kind_type, entries) in zip(axes[0], panels, strict=True):
        pairs = list(dict.fromkeys(c["model_b"] for _, _, cs in entries for c in cs))
        width = 0.8 / max(len(pairs), 1)
        for j, other in enumerate(pairs):
            for i, (_, _, comparisons) in enumerate(entries):
                c = next((c for c in comparisons if c["model_b"] == other), None)
                if c is None:
                    continue
                x = i + (j - (len(pairs) - 1) / 2) * width
                mean, sd = c["delta"]["mean"], c["delta"]["sd"]
                ax.bar(x, mean, width, yerr=sd, capsize=3, color=model_colour(other),
                       label=f"std − {other}" if i == 0 else None)
                tip = mean + sd if mean >= 0 else mean - sd
                ax.annotate(f"p={c['p_holm']:.2g}", (x, tip), fontsize=6, ha="center",
                            va="bottom" if mean >= 0 else "top", xytext=(0, 2 if mean >= 0
                                                                        else -2),
                            textcoords="offset points")
        ax.axhline(0, color="0.3", linewidth=0.8)
        symbol = _PFR_AXES[kind]
        ax.set_xticks(range(len(entries)), [f"{n}\n{symbol}={v:g}" for n, v, _ in entries],
                      fontsize=7)
        ax.set_title(f"{kind_type}: {'largest' if kind == 'eps' else 'smallest'} {symbol}",
                     fontsize=9, color=TYPE_COLOURS[kind_type])
        ax.margins(y=0.15)
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("ΔPFR (positive: the other model flips less)")
    fig.suptitle("ΔPFR between std and each model, per world", fontsize=10)
    return save(fig, path)


CLASS_DISTANCE_TITLE = ("Class-centroid distances in f_std's feature space (class index on the "
                        "axes)")


def figure_class_distances_worlds(worlds: Sequence[WorldCells], path: Path) -> Path | None:
    """One class-centroid distance heatmap per world (shared colour scale)."""
    results = [(name, c.summary) for name, _, cells in worlds for c in cells
               if c.kind == "classes"]
    if not results:
        return None
    matrices = [np.array([[np.nan if v is None else v for v in row] for row in s["distances"]])
                for _, s in results]
    top = max((float(np.nanmax(m)) for m in matrices if np.isfinite(m).any()), default=1.0)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(0.6 + 3.4 * len(results), 3.6),
                             squeeze=False)
    for ax, (name, s), m in zip(axes[0], results, matrices, strict=True):
        image = ax.imshow(m, cmap="viridis", vmin=0, vmax=top)
        ticks = range(len(s["class_names"]))
        ax.set_xticks(ticks, [str(i) for i in ticks], fontsize=6)
        ax.set_yticks(ticks, [str(i) for i in ticks], fontsize=6)
        ax.set_title(f"{name}: mean {_num(s['mean_off_diagonal'])}", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="‖μ_c − μ_c'‖₂")
    fig.suptitle(CLASS_DISTANCE_TITLE)
    # Cropped to what is drawn, title included (one world's panel is narrower than the title);
    # not laid out: tight_layout would lay the colour bar, shared by the panels, over them.
    return save(fig, path, lay_out=False)


def figure_attacks_worlds(worlds: Sequence[WorldCells], path: Path) -> Path | None:
    """Robust accuracy under APGD per world and model at every attack ε: a row per attack
    cell (vanilla and smoothed, latent and concept), a column per ε, bars per world and model
    with the model's clean accuracy hatched behind; the legend beside the first row, outside
    the data."""
    cell_names = list(dict.fromkeys(c.name for _, _, cells in worlds for c in cells
                                    if c.kind == "attack"))
    if not cell_names:
        return None
    eps_values = sorted({b["eps"] for _, _, cells in worlds for c in cells if c.kind == "attack"
                         for entry in c.summary["models"].values() for b in entry["budgets"]})
    plt = pyplot()
    fig, axes = plt.subplots(len(cell_names), len(eps_values), layout="constrained",
                             squeeze=False, sharey=True,
                             figsize=(1.5 + (1.0 + 0.55 * len(worlds)) * len(eps_values),
                                      0.8 + 2.3 * len(cell_names)))
    for r, cell_name in enumerate(cell_names):
        by_world = [(name, next((c for c in cells if c.name == cell_name), None))
                    for name, _, cells in worlds]
        models = list(dict.fromkeys(m for _, c in by_world if c for m in c.summary["models"]))
        width = 0.8 / max(len(models), 1)
        for ax, eps in zip(axes[r], eps_values, strict=True):
            for j, model in enumerate(models):
                xs, robust, clean = [], [], []
                for i, (_, cell) in enumerate(by_world):
                    entry = cell.summary["models"].get(model) if cell else None
                    budget = next((b for b in entry["budgets"] if math.isclose(b["eps"], eps)),
                                  None) if entry else None
                    if budget is None:
                        continue
                    xs.append(i + (j - (len(models) - 1) / 2) * width)
                    robust.append(budget["robust_accuracy"])
                    clean.append(entry["clean_accuracy"])
                ax.bar(xs, clean, width, color="none", edgecolor="0.6", hatch="//")
                ax.bar(xs, robust, width, color=model_colour(model), label=model)
            ax.set_xticks(range(len(by_world)), [n for n, _ in by_world], rotation=40,
                          ha="right", fontsize=7)
            ax.tick_params(axis="y", labelsize=7)
            ax.set(ylim=(0, 1.02))
            ax.set_title(f"{cell_name}, ε = {eps:g}", fontsize=9,
                         color=TYPE_COLOURS[budget_type(cell_name)])
        axes[r][0].set_ylabel("robust accuracy", fontsize=8)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("APGD across worlds: robust accuracy (bars) and clean accuracy (hatched) "
                 "per attack and ε (titles: blue geometric, orange semantic)", fontsize=10)
    return save(fig, path, lay_out=False)


def cross_world_figures(worlds: Sequence[WorldCells], out: Path, tables: Sequence[Table],
                        log: Callable[[str], None] = print,
                        analysis: Family | None = None) -> list[Path]:
    """Every cross-world figure the worlds have data for; notes for the skipped ones.
    ``tables``: `cross_world_tables(worlds, analysis)`; ``analysis``: the run-wide family
    (`run_analysis`), whose findings figures come first."""
    compared = [] if analysis is None else list(dict.fromkeys(h.model_b
                                                              for h in analysis.hypotheses))
    plans: list[tuple[str, Callable[[Path], Path | None]]] = [
        *((f"findings_{m}.png", lambda p, m=m: figure_findings(analysis, m, p))
          for m in compared),
        ("robustness_gap_worlds.png", lambda p: figure_gap_worlds(worlds, p)),
        *((f"pfr_worlds_{k}.png", lambda p, k=k: figure_pfr_worlds(worlds, k, p))
          for k in BUDGET_SYMBOLS),
        ("pfr_models_worlds.png", lambda p: figure_pfr_models_worlds(worlds, p)),
        ("dfs_cfr_worlds.png", lambda p: figure_dfs_cfr_worlds(worlds, p)),
        ("radius_worlds.png", lambda p: figure_radius_worlds(worlds, p)),
        ("delta_pfr_worlds.png", lambda p: figure_delta_pfr_worlds(worlds, p)),
        ("class_distances_worlds.png", lambda p: figure_class_distances_worlds(worlds, p)),
        ("attacks_worlds.png", lambda p: figure_attacks_worlds(worlds, p)),
    ]
    return draw_plans(plans, out, log, "no world has data for it")


__all__ = ["CLASS_DISTANCE_TITLE", "analysis_tables", "cross_world_figures",
           "cross_world_tables", "gap_columns", "gap_table", "run_analysis", "world_cells"]
