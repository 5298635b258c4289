"""Report figures (matplotlib, Agg): PFR vs ε and τ, certified accuracy, SmAcc/ACR vs scale,
the std-vs-cbm robustness-gap heatmap and CFR/DFS vs PFR. A figure without data is skipped."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from cbcert.certify.smoothing import SMOOTHINGS, Smoothing, smoothing
from cbcert.report.cells import CellResult
from cbcert.report.explain import figure_explanations, figure_perturb_explanations
from cbcert.report.plotting import TYPE_COLOURS, budget_type, draw_plans, model_colour, pyplot, save
from cbcert.report.tables import _budget_label
from cbcert.robustness.protocol import BUDGET_SYMBOLS

_AXES = {"eps": "ε (latent L2 shift)", "tau": "τ (concepts flipped)",
         "sigma": "σ (latent Gaussian noise)", "rho": "ρ (concept flip probability)"}


def figure_pfr(cell: CellResult, kind: str, path: Path) -> Path | None:
    """PFR (mean ± sd over subsets) per model vs the budgets of one kind: ε (``kind='eps'``),
    τ (``'tau'``), σ (``'sigma'``) or ρ (``'rho'``)."""
    budgets = [b for b in cell.summary["budgets"] if b["kind"] == kind]
    if not budgets:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = [b["value"] for b in budgets]
    for model in cell.summary["settings"]["models"]:
        ax.errorbar(x, [b["pfr"][model]["mean"] for b in budgets],
                    yerr=[b["pfr"][model]["sd"] for b in budgets], marker="o", capsize=3,
                    label=model, color=model_colour(model))
    ax.set(xlabel=_AXES[kind], ylabel="PFR",
           title=f"Prediction flip rate vs {BUDGET_SYMBOLS[kind]}")
    ax.legend()
    return save(fig, path)


def figure_certified_accuracy(cell: CellResult, path: Path) -> Path | None:
    """Certified accuracy vs radius, one curve per model, for one certification cell."""
    s = cell.summary
    if s["mode"] != "certify":
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for model, m in s["models"].items():
        ax.step(m["radius_grid"], m["certified_accuracy"], where="post", label=model,
                color=model_colour(model))
    kind = smoothing(s["noise"])
    symbol, unit = kind.symbol, "Hamming radius" if kind.hamming else "L2 radius"
    ax.set(xlabel=unit, ylabel="certified accuracy", ylim=(0, 1.02),
           title=f"Certified accuracy, {symbol} = {s['scale']:g}")
    ax.legend()
    return save(fig, path)


def figure_vs_scale(cells: Sequence[CellResult], kind: Smoothing, path: Path) -> Path | None:
    """SmAcc, R̄ and ACR (ACR-H) per model vs the scale of one smoothing ``kind`` (σ or ρ):
    R̄ is the mean radius over correctly predicted inputs, the radius the method plots (its R
    and Δ⋆); ACR averages over all inputs, wrong and abstaining ones counting 0."""
    chosen = sorted((c for c in cells if c.kind == "certify" and c.summary["noise"] == kind.kind
                     and c.summary["mode"] == "certify"), key=lambda c: c.summary["scale"])
    if not chosen:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    scales = [c.summary["scale"] for c in chosen]
    keys = ("smoothed_accuracy", "radius_of_correct", "acr")
    for model in chosen[0].summary["models"]:
        for ax, key in zip(axes, keys, strict=True):
            values = [c.summary["models"][model].get(key) for c in chosen]
            ax.plot(scales, [math.nan if v is None else v for v in values], marker="o",
                    label=model, color=model_colour(model))
    symbol, acr = kind.symbol, "ACR-H" if kind.hamming else "ACR"
    unit = "Hamming radius" if kind.hamming else "L2 radius"
    axes[0].set(xlabel=symbol, ylabel="smoothed accuracy", title=f"SmAcc vs {symbol}")
    axes[1].set(xlabel=symbol, ylabel=f"R̄ ({unit})",
                title=f"R̄ over correct inputs vs {symbol}")
    axes[2].set(xlabel=symbol, ylabel=f"{acr} ({unit})", title=f"{acr} over all inputs vs {symbol}")
    axes[0].legend()
    return save(fig, path)


def robustness_gaps(cells: Sequence[CellResult]) -> tuple[list[str], list[str], list[list[float]]]:
    """Rows (budgets), columns (metrics) and values of the std-vs-cbm gap, positive = CBM better.

    Metrics: ``ΔPFR = PFR_std − PFR_cbm`` (perturb), ``ΔSmAcc`` and ``ΔACR = cbm − std``
    (certification), ``ΔRobAcc = cbm − std`` (attacks). Missing combinations are NaN.
    """
    columns = ["ΔPFR (std−cbm)", "ΔSmAcc (cbm−std)", "ΔACR (cbm−std)", "ΔRobAcc (cbm−std)"]
    rows: dict[str, dict[str, float]] = {}
    for cell in cells:
        s = cell.summary
        if cell.kind == "perturb" and {"std", "cbm"} <= set(s["settings"]["models"]):
            for b in s["budgets"]:
                label = f"{BUDGET_SYMBOLS[b['kind']]}={b['value']:g} (perturb)"
                rows.setdefault(label, {})[columns[0]] = (
                    b["pfr"]["std"]["mean"] - b["pfr"]["cbm"]["mean"])
        elif cell.kind == "certify" and {"std", "cbm"} <= set(s["models"]):
            std, cbm = s["models"]["std"], s["models"]["cbm"]
            symbol = smoothing(s["noise"]).symbol
            entry = rows.setdefault(f"{symbol}={s['scale']:g} ({s['mode']})", {})
            entry[columns[1]] = cbm["smoothed_accuracy"] - std["smoothed_accuracy"]
            if "acr" in std:
                entry[columns[2]] = cbm["acr"] - std["acr"]
        elif cell.kind == "attack" and {"std", "cbm"} <= set(s["models"]):
            for b_std, b_cbm in zip(s["models"]["std"]["budgets"], s["models"]["cbm"]["budgets"],
                                    strict=True):
                label = f"ε={b_std['eps']:g} ({cell.name})"
                rows.setdefault(label, {})[columns[3]] = (
                    b_cbm["robust_accuracy"] - b_std["robust_accuracy"])
    values = [[row.get(c, math.nan) for c in columns] for row in rows.values()]
    return list(rows), columns, values


def figure_gap_heatmap(cells: Sequence[CellResult], path: Path) -> Path | None:
    """Heatmap of `robustness_gaps`, values annotated. Every colour scale holds one unit: the
    colour of a cell is its gap divided by the largest |gap| of its column — and within
    ΔR̄ and ΔACR, of its unit (L2 radii on the σ rows, Hamming radii on the ρ and m rows) — so
    a fraction is never compared with a radius by colour; budget labels are coloured by
    perturbation type (blue geometric ε, σ, latent attacks; orange semantic τ, ρ, m). ΔR̄ =
    R̄_cbm − R̄_std over correctly predicted inputs (the method's radius gap) stands beside
    ΔACR over all inputs."""
    import numpy as np

    rows, columns, values = robustness_gaps(cells)
    if not rows:
        return None
    # ΔR̄ beside ΔACR: the method's radius is R̄, over correctly predicted inputs only.
    radius = _radius_of_correct_gaps(cells)
    at = columns.index("ΔACR (cbm−std)")
    columns = [*columns[:at], "ΔR̄ (cbm−std)", *columns[at:]]
    values = [[*row[:at], radius.get(label, math.nan), *row[at:]]
              for label, row in zip(rows, values, strict=True)]
    data = np.array(values, dtype=np.float64)  # [budgets, metrics]
    keep = ~np.all(np.isnan(data), axis=0)
    data, columns = data[:, keep], [c for c, k in zip(columns, keep, strict=True) if k]
    semantic = np.array([budget_type(r) == "semantic" for r in rows])
    scaled = np.full_like(data, np.nan)
    for j, column in enumerate(columns):
        groups = ([semantic, ~semantic] if column.startswith(("ΔACR", "ΔR̄"))
                  else [np.ones_like(semantic)])
        for rows_of_unit in groups:
            part = data[rows_of_unit, j]
            bound = float(np.nanmax(np.abs(part))) if np.isfinite(part).any() else 0.0
            scaled[rows_of_unit, j] = part / (bound or 1.0)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(columns), 1.2 + 0.35 * len(rows)))
    image = ax.imshow(np.ma.masked_invalid(scaled), cmap="RdBu", vmin=-1, vmax=1,
                      aspect="auto")
    ax.set_xticks(range(len(columns)), columns, rotation=20, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    for tick, row in zip(ax.get_yticklabels(), rows, strict=True):
        tick.set_color(TYPE_COLOURS[budget_type(row)])
    for (i, j), v in np.ndenumerate(data):
        if not np.isnan(v):
            ax.text(j, i, f"{v:+.3g}", ha="center", va="center", fontsize=8,
                    color="white" if abs(scaled[i, j]) > 0.6 else "black")
    fig.colorbar(image, ax=ax, label="gap ÷ largest |gap| of its column and unit\n"
                                     "(positive = CBM more robust)")
    ax.set_title("std vs cbm robustness gap (labels: blue geometric, orange semantic)")
    return save(fig, path)


def _radius_of_correct_gaps(cells: Sequence[CellResult]) -> dict[str, float]:
    """``R̄_cbm − R̄_std`` (mean radius over correctly predicted inputs) per certification
    cell, keyed like the rows of `robustness_gaps` (``"σ=0.1 (certify)"``)."""
    gaps = {}
    for cell in cells:
        s = cell.summary
        if cell.kind == "certify" and {"std", "cbm"} <= set(s["models"]):
            std, cbm = (s["models"][m].get("radius_of_correct") for m in ("std", "cbm"))
            if std is not None and cbm is not None:
                gaps[f"{smoothing(s['noise']).symbol}={s['scale']:g} ({s['mode']})"] = cbm - std
    return gaps


def figure_flips_vs_pfr(cell: CellResult, path: Path) -> Path | None:
    """CFR vs PFR (every model) and DFS vs PFR (concept models), one point per budget."""
    budgets = [b for b in cell.summary["budgets"] if b["cfr"] is not None]
    if not budgets:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for model in cell.summary["settings"]["models"]:
        pfr = [b["pfr"][model]["mean"] for b in budgets]
        style = {"label": model, "color": model_colour(model)}
        axes[0].scatter(pfr, [b["cfr"]["mean"] for b in budgets], **style)
        if all(model in b["dfs"] for b in budgets):
            axes[1].scatter(pfr, [b["dfs"][model]["mean"] for b in budgets], **style)
    for b in budgets:
        axes[0].annotate(_budget_label(b["kind"], b["value"]),
                         (b["pfr"]["std"]["mean"] if "std" in b["pfr"] else 0, b["cfr"]["mean"]),
                         fontsize=7)
    axes[0].set(xlabel="PFR", ylabel="CFR", title="Concept vs prediction flips")
    axes[1].set(xlabel="PFR", ylabel="DFS ‖r(x) − r(x̃)‖₂", title="Decision shift vs PFR")
    axes[0].legend()
    if axes[1].has_data():
        axes[1].legend()
    return save(fig, path)


def figure_attacks(cells: Sequence[CellResult], path: Path) -> Path | None:
    """Robust accuracy per attack cell (vanilla / smoothed × latent / concept) and model: one
    panel per ε, bars grouped by cell; a hatched bar behind each shows its clean accuracy."""
    attacks = [c for c in cells if c.kind == "attack"]
    if not attacks:
        return None
    plt = pyplot()
    eps_values = sorted({b["eps"] for c in attacks for m in c.summary["models"].values()
                         for b in m["budgets"]})
    models = list(dict.fromkeys(m for c in attacks for m in c.summary["models"]))
    fig, axes = plt.subplots(1, len(eps_values), figsize=(2.2 + 2.2 * len(attacks)
                                                           * len(eps_values), 3.8), squeeze=False)
    width = 0.8 / len(models)
    for ax, eps in zip(axes[0], eps_values, strict=True):
        for j, model in enumerate(models):
            xs, robust, clean = [], [], []
            for i, cell in enumerate(attacks):
                entry = cell.summary["models"].get(model)
                budget = next((b for b in entry["budgets"] if b["eps"] == eps), None) \
                    if entry else None
                if budget is not None:
                    xs.append(i + (j - (len(models) - 1) / 2) * width)
                    robust.append(budget["robust_accuracy"])
                    clean.append(entry["clean_accuracy"])
            ax.bar(xs, clean, width, color="none", edgecolor="0.6", hatch="//")
            ax.bar(xs, robust, width, label=model, color=model_colour(model))
        ax.set_xticks(range(len(attacks)), [_attack_label(c) for c in attacks], rotation=20,
                      ha="right", fontsize=8)
        ax.set(ylim=(0, 1), title=f"ε = {eps:g}", ylabel="robust accuracy")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("APGD: robust accuracy (bars) and clean accuracy (hatched), vanilla vs smoothed")
    return save(fig, path)


def figure_class_distances(result: dict, path: Path) -> Path:
    """Heatmap of a world's class-centroid distances (``runs.classes.class_distances``)."""
    plt = pyplot()
    names = result["class_names"]
    values = np.array([[np.nan if v is None else v for v in row] for row in result["distances"]])
    size = 1.2 + 0.55 * len(names)
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    image = ax.imshow(values, cmap="viridis")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    if len(names) <= 12:
        for i in range(len(names)):
            for j in range(len(names)):
                if np.isfinite(values[i, j]):
                    ax.text(j, i, f"{values[i, j]:.2g}", ha="center", va="center", fontsize=6,
                            color="white")
    fig.colorbar(image, ax=ax, label="‖μ_c − μ_c'‖₂")
    ax.set_title(f"Class-centroid distances, f_std features ({result['world']}, "
                 f"{result['samples']} samples)", fontsize=9)
    return save(fig, path)


def _attack_label(cell: CellResult) -> str:
    s = cell.summary
    label = f"{s['space']} {s['norm']}"
    if s["smoothed"]:
        key = "sigma" if s["space"] == "latent" else "rho"
        label += f"\nsmoothed {'σ' if key == 'sigma' else 'ρ'}={s.get(key, float('nan')):g}"
    return label


def write_figures(cells: Sequence[CellResult], out: Path,
                  log: Callable[[str], None] = print) -> list[Path]:
    """Every figure the cells have data for, as PNGs in ``out``; notes for the skipped ones."""
    plans: list[tuple[str, Callable[[Path], Path | None]]] = []
    perturbs = [c for c in cells if c.kind == "perturb"]
    for cell in perturbs:
        prefix = "" if len(perturbs) == 1 else f"{cell.name}_"
        smoothing_kinds = [k for k in ("sigma", "rho") if cell.summary["settings"].get(k)]
        for kind in ("eps", "tau", *smoothing_kinds):
            plans.append((f"{prefix}pfr_vs_{kind}.png",
                          lambda p, c=cell, k=kind: figure_pfr(c, k, p)))
        plans.append((f"{prefix}cfr_dfs_vs_pfr.png", lambda p, c=cell: figure_flips_vs_pfr(c, p)))
        if "explanations" in cell.summary:
            plans.append((f"{prefix}explanation_stability.png",
                          lambda p, c=cell: figure_perturb_explanations(c.summary, p)))
    for cell in cells:
        if cell.kind == "certify":
            plans.append((f"certified_accuracy_{cell.name}.png",
                          lambda p, c=cell: figure_certified_accuracy(c, p)))
    for kind in (SMOOTHINGS["gaussian"], SMOOTHINGS["bernoulli"]):
        plans.append((f"smacc_acr_vs_{kind.key}.png",
                      lambda p, k=kind: figure_vs_scale(cells, k, p)))
    plans.append(("robustness_gap.png", lambda p: figure_gap_heatmap(cells, p)))
    if any(c.kind == "attack" for c in cells):
        plans.append(("attacks.png", lambda p: figure_attacks(cells, p)))
    for cell in cells:
        if cell.kind == "classes":
            plans.append(("class_distances.png",
                          lambda p, c=cell: figure_class_distances(c.summary, p)))
        if cell.kind == "explain":
            plans.append((f"explanations_{cell.name}.png",
                          lambda p, c=cell: figure_explanations(c.summary, p)))
    if not perturbs:
        log("note: no perturb cell; skipped pfr_vs_eps, pfr_vs_tau and cfr_dfs_vs_pfr")
    return draw_plans(plans, out, log, "no data for it in this run")

