"""The method's Figures 1(b), 1(c), 2–5 and 9: the f_std-vs-f_cbm gap across its settings and
the results on its two datasets (CUB, RIVAL-10), each drawn from a run's `MethodRun`.

Each ``figureN`` writes the method's figure N to ``path`` and returns it, or returns None where
the run has no data for it. The class-structure and vocabulary figures are
`cbcert.report.method_setting_figures`; `cbcert.report.method_outputs` writes both by number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cbcert.report.method_plotting import (
    SETTING_STYLES,
    categorical_x,
    figure_note,
    pfr_line,
    smoothing_curve,
    wide_range,
)
from cbcert.report.method_run import (
    ATTACK_EPS,
    CBM,
    CUB,
    EPS,
    F_NAMES,
    RHO,
    RIVAL,
    SIGMA,
    STD,
    TAU,
    MethodRun,
    setting_label,
)
from cbcert.report.method_settings import SETTINGS, world_of
from cbcert.report.plotting import KIND_TYPES, TYPE_COLOURS, model_colour, pyplot, save
from cbcert.robustness.protocol import BUDGET_SYMBOLS


def _cell_text(ax, values: np.ndarray, fmt: str, bound: float) -> None:
    """Each heatmap cell's value (``fmt``), "n/a" where it is missing."""
    for (i, j), v in np.ndenumerate(values):
        text = "n/a" if np.isnan(v) else format(v, fmt)
        colour = "0.4" if np.isnan(v) else "white" if abs(v) > 0.6 * bound else "black"
        ax.text(j, i, text, ha="center", va="center", fontsize=8, color=colour)


def _gap_rows(run: MethodRun) -> list[tuple[str, str]]:
    """``(row label, world)`` of every world standing for one of the method's settings, each
    world once, labelled by the settings it stands for."""
    by_world: dict[str, list[str]] = {}
    for setting, world in SETTINGS.items():
        if world in run.cells:
            by_world.setdefault(world, []).append(setting)
    return [(f"{world}: {'; '.join(settings)}", world) for world, settings in by_world.items()]


def figure1b(run: MethodRun, path: Path) -> Path | None:
    """Fig. 1(b): the std-vs-cbm robustness gap of every setting at the method's four
    representative budgets: ΔPFR = PFR(f_std) − PFR(f_cbm) at ε = 0.3 and τ = 5 (percentage
    points), ΔR = R̄(f_cbm) − R̄(f_std) at σ = 0.1 (L2) and ΔΔ⋆ at ρ = 0.1 (Hamming); positive
    = f_cbm more robust. A row per world, one heatmap per unit, each on its own symmetric
    scale; "n/a" where a world lacks the cell."""
    rows = _gap_rows(run)
    if not rows:
        return None
    pfr = np.full((len(rows), 2), np.nan)
    radius = np.full((len(rows), 2), np.nan)
    for i, (_, world) in enumerate(rows):
        for j, (kind, value) in enumerate((("eps", 0.3), ("tau", 5.0))):
            b = run.budget(world, kind, value)
            if b is not None and STD in b["pfr"] and CBM in b["pfr"]:
                pfr[i, j] = 100.0 * (b["pfr"][STD]["mean"] - b["pfr"][CBM]["mean"])
        for j, (noise, scale) in enumerate((("gaussian", 0.1), ("bernoulli", 0.1))):
            cell = run.certify(world, noise, scale)
            models = (cell.summary.get("subsets") or {}).get("models", {}) if cell else {}
            if STD in models and CBM in models:
                r_std, r_cbm = (models[m]["radius_of_correct"]["mean"] for m in (STD, CBM))
                if r_std is not None and r_cbm is not None:
                    radius[i, j] = r_cbm - r_std
    if np.isnan(pfr).all() and np.isnan(radius).all():
        return None
    panels = (("ΔPFR (pp)\nstd − cbm", pfr, ("ε = 0.3\n(geometric)", "τ = 5\n(semantic)"),
               ("geometric", "semantic"), "+.2f"),
              ("ΔR (L2 radius)\ncbm − std", radius[:, :1], ("σ = 0.1\n(geometric)",),
               ("geometric",), "+.2g"),
              ("ΔΔ⋆ (concept flips)\ncbm − std", radius[:, 1:], ("ρ = 0.1\n(semantic)",),
               ("semantic",), "+.2g"))
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, layout="constrained", sharey=True,
                             gridspec_kw={"width_ratios": (2, 1, 1)},
                             figsize=(9.5, 1.4 + 0.42 * len(rows)))
    for ax, (unit, values, labels, types, fmt) in zip(axes, panels, strict=True):
        bound = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 0.0
        bound = bound or 1.0
        image = ax.imshow(np.ma.masked_invalid(values), cmap="RdBu", vmin=-bound, vmax=bound,
                          aspect="auto")
        _cell_text(ax, values, fmt, bound)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        for tick, kind_type in zip(ax.get_xticklabels(), types, strict=True):
            tick.set_color(TYPE_COLOURS[kind_type])
        ax.xaxis.tick_top()
        bar = fig.colorbar(image, ax=ax, orientation="horizontal", location="bottom",
                           shrink=0.9, aspect=12, label=unit)
        bar.set_ticks([-bound, 0.0, bound], labels=[f"{-bound:.2g}", "0", f"{bound:+.2g}"])
        bar.ax.tick_params(labelsize=7)
    axes[0].set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    fig.suptitle("Fig. 1(b): f_cbm − f_std robustness gap (positive, blue: f_cbm more robust)",
                 fontsize=10)
    return save(fig, path, lay_out=False)


def figure1c(run: MethodRun, path: Path) -> Path | None:
    """Fig. 1(c): the certified concept radius Δ⋆ (R̄ over correct inputs) at ρ = 0.1 of f_std
    and f_cbm across the RIVAL-10 task settings, and the difference f_cbm − f_std (mean ± sd
    over the subsets) whose sign differs between settings."""
    entries = []
    for label, world in _gap_rows(run):
        if not any(s.startswith(RIVAL) for s in label.split(": ", 1)[1].split("; ")):
            continue
        cell = run.certify(world, "bernoulli", 0.1)
        if cell is None or not {STD, CBM} <= set(cell.summary["models"]):
            continue
        a, b = run.per_subset(cell, CBM)["radius"], run.per_subset(cell, STD)["radius"]
        usable = np.isfinite(a) & np.isfinite(b)
        if usable.sum() < 2:
            continue
        delta = a[usable] - b[usable]
        entries.append((label, float(np.nanmean(b)), float(np.nanmean(a)),
                        float(delta.mean()), float(delta.std(ddof=1))))
    if not entries:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, layout="constrained", sharey=True,
                             figsize=(11.5, 1.4 + 0.45 * len(entries)))
    y = np.arange(len(entries))
    height = 0.38
    for k, model in enumerate((STD, CBM)):
        axes[0].barh(y + (k - 0.5) * height, [e[1 + k] for e in entries], height,
                     color=model_colour(model), label=F_NAMES[model])
    for container in axes[0].containers:
        axes[0].bar_label(container, fmt="%.2g", fontsize=7, padding=2)
    note = wide_range(axes[0], [e[1 + k] for e in entries for k in (0, 1)], axis="x")
    axes[0].set(xlabel="Δ⋆ = R̄, Hamming, over correct inputs" + note,
                title="Δ⋆ of each model")
    axes[0].margins(x=0.15)
    axes[0].legend(fontsize=8, loc="center right")
    deltas = [e[3] for e in entries]
    axes[1].barh(y, deltas, 0.6, xerr=[e[4] for e in entries], capsize=3,
                 color=[model_colour(CBM) if d >= 0 else model_colour(STD) for d in deltas])
    for i, (d, sd) in enumerate((e[3], e[4]) for e in entries):
        axes[1].annotate(f"{d:+.2g} ± {sd:.2g}", (1.0, i), xycoords=("axes fraction", "data"),
                         xytext=(4, 0), textcoords="offset points", ha="left", va="center",
                         fontsize=7)
    axes[1].axvline(0, color="0.3", linewidth=0.8)
    from matplotlib.ticker import MaxNLocator

    axes[1].xaxis.set_major_locator(MaxNLocator(5, symmetric=True))
    axes[1].set(xlabel="Δ⋆(f_cbm) − Δ⋆(f_std)\nmean ± sd over subsets",
                title="gap (green: f_cbm larger, black: f_std)")
    axes[0].set_yticks(y, [e[0] for e in entries], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("Fig. 1(c): certified concept radius at ρ = 0.1 across task settings",
                 fontsize=10)
    return save(fig, path, lay_out=False)


def figure2(run: MethodRun, path: Path) -> Path | None:
    """Fig. 2: PFR (%) vs ε (geometric) and vs τ (semantic) of f_std and f_cbm, CUB on the
    left axis (solid) and RIVAL-10 on the right axis (dashed), each on its own scale as the
    method draws them."""
    present = [(s, w) for s, w in run.present((CUB, RIVAL)) if run.perturb(w)]
    if not present:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, layout="constrained", figsize=(10, 3.8))
    handles = []
    for ax, (kind, values) in zip(axes, (("eps", EPS), ("tau", TAU)), strict=True):
        sides = [ax] if len(present) == 1 else [ax, ax.twinx()]
        for side, (setting, world), style in zip(sides, present, SETTING_STYLES, strict=False):
            for model in (STD, CBM):
                pfr_line(side, run, world, kind, values, model, style,
                         f"{F_NAMES[model]}, {setting_label(setting, world)}")
            side.set_ylabel(f"PFR (%), {setting_label(setting, world)} "
                            f"({'solid' if style == '-' else 'dashed'})", fontsize=8)
            side.set_ylim(bottom=0)
        categorical_x(ax, values, f"{BUDGET_SYMBOLS[kind]} ({KIND_TYPES[kind]})")
        ax.set_title(f"{KIND_TYPES[kind]} perturbations", color=TYPE_COLOURS[KIND_TYPES[kind]])
        handles = [h for side in sides for h in side.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=8)
    fig.suptitle("Fig. 2: prediction flip rate under geometric and semantic perturbations"
                 + figure_note(run, (CUB, RIVAL)), fontsize=10)
    return save(fig, path, lay_out=False)


def _flip_curves(run: MethodRun, world: str) -> dict[str, dict[str, list[float]]]:
    """Per perturbation type, the per-budget means (ε or τ of Table 1, in order): CFR (concepts
    flipped), DFS of f_cbm and PFR (%) of f_std and f_cbm."""
    curves: dict[str, dict[str, list[float]]] = {}
    for kind, values in (("eps", EPS), ("tau", TAU)):
        for value in values:
            b = run.budget(world, kind, value)
            if b is None or not b.get("cfr_count") or CBM not in b["dfs"]:
                continue
            curve = curves.setdefault(KIND_TYPES[kind], {"cfr": [], "dfs": [], STD: [],
                                                         CBM: []})
            curve["cfr"].append(b["cfr_count"]["mean"])
            curve["dfs"].append(b["dfs"][CBM]["mean"])
            for model in (STD, CBM):
                curve[model].append(100.0 * b["pfr"][model]["mean"])
    return curves


def _type_legend(ax, plt, models: Sequence[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=t) for t, c in TYPE_COLOURS.items()]
    handles += [plt.Line2D([], [], color="0.3", linestyle=s, label=F_NAMES[m])
                for m, s in zip(models, ("-", "--"), strict=False)]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))


def _pfr_vs(ax, curves, x_key: str) -> None:
    for kind_type, curve in curves.items():
        for model, style in ((STD, "-"), (CBM, "--")):
            ax.plot(curve[x_key], curve[model], color=TYPE_COLOURS[kind_type], linestyle=style,
                    marker="o", markersize=4)


def _cub_curves(run: MethodRun) -> tuple[str, dict]:
    """The world standing for CUB and its flip curves (`_flip_curves`; empty if absent)."""
    world = world_of(CUB)
    return world, (_flip_curves(run, world) if world in run.cells else {})


def figure3(run: MethodRun, path: Path) -> Path | None:
    """Fig. 3: on CUB, PFR (%) of f_std (solid) and f_cbm (dashed) against DFS (left) and
    against CFR (right) over the budgets of Table 1, colour by perturbation type."""
    world, curves = _cub_curves(run)
    if not curves:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, layout="constrained", figsize=(10, 3.8))
    _pfr_vs(axes[0], curves, "dfs")
    _pfr_vs(axes[1], curves, "cfr")
    axes[0].set(xlabel="DFS: f_cbm's concept-score shift", ylabel="PFR (%)")
    axes[1].set(xlabel="CFR: concepts flipped per input", ylabel="PFR (%)")
    _type_legend(axes[1], plt, (STD, CBM))
    fig.suptitle(f"Fig. 3: prediction flips against concept-level measures on "
                 f"{setting_label(CUB, world)}", fontsize=10)
    return save(fig, path, lay_out=False)


def figure9(run: MethodRun, path: Path) -> Path | None:
    """Fig. 9: on CUB, mean PFR (%) of f_std (solid) and f_cbm (dashed) against mean DFS
    (left), and mean DFS against mean CFR (right; DFS is f_cbm's), colour by perturbation
    type."""
    world, curves = _cub_curves(run)
    if not curves:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, layout="constrained", figsize=(10, 3.8))
    _pfr_vs(axes[0], curves, "dfs")
    for kind_type, curve in curves.items():
        axes[1].plot(curve["cfr"], curve["dfs"], color=TYPE_COLOURS[kind_type], linestyle="--",
                     marker="o", markersize=4)
    axes[0].set(xlabel="DFS (mean)", ylabel="PFR (%) (mean)")
    axes[1].set(xlabel="CFR: concepts flipped per input (mean)", ylabel="DFS of f_cbm (mean)")
    _type_legend(axes[1], plt, (STD, CBM))
    fig.suptitle(f"Fig. 9: PFR vs DFS and DFS vs CFR on {setting_label(CUB, world)}", fontsize=10)
    return save(fig, path, lay_out=False)


def figure4(run: MethodRun, path: Path) -> Path | None:
    """Fig. 4: certified robustness of f_std and f_cbm on CUB (solid) and RIVAL-10 (dashed):
    (a) SmAcc (%) and (b) R̄ vs σ in latent space, (c) SmAcc (%) and (d) Δ⋆ vs ρ in concept
    space; mean ± sd over the subsets."""
    present = run.present((CUB, RIVAL))
    panels = (("gaussian", SIGMA, "smoothed_accuracy", "(a) latent: SmAcc (%)", "σ"),
              ("gaussian", SIGMA, "radius_of_correct", "(b) latent: R (L2, correct inputs)",
               "σ"),
              ("bernoulli", RHO, "smoothed_accuracy", "(c) concept: SmAcc (%)", "ρ"),
              ("bernoulli", RHO, "radius_of_correct",
               "(d) concept: Δ⋆ (Hamming, correct inputs)", "ρ"))
    if not any(run.certify(w, noise, s) for _, w in present for noise, scales, *_ in panels
               for s in scales):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, layout="constrained", figsize=(14, 4.4))
    for ax, (noise, scales, metric, title, symbol) in zip(axes, panels, strict=True):
        drawn = []
        for (setting, world), style in zip(present, SETTING_STYLES, strict=False):
            for model in (STD, CBM):
                xs, means, sds = smoothing_curve(run, world, noise, scales, model, metric)
                if xs:
                    ax.errorbar(xs, means, yerr=sds, color=model_colour(model), linestyle=style,
                                marker="o" if style == "-" else "s", markersize=4, capsize=2,
                                label=f"{F_NAMES[model]}, {setting_label(setting, world)}")
                    drawn += means
        if metric == "radius_of_correct":
            title += wide_range(ax, drawn)
            ax.set_ylim(bottom=0)
        categorical_x(ax, scales, symbol)
        ax.set_title(title, fontsize=9,
                     color=TYPE_COLOURS["geometric" if noise == "gaussian" else "semantic"])
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle("Fig. 4: certified robustness under latent and concept smoothing (mean ± sd "
                 "over subsets)" + figure_note(run, (CUB, RIVAL)), fontsize=10)
    return save(fig, path, lay_out=False)


def figure5(run: MethodRun, path: Path) -> Path | None:
    """Fig. 5: robust accuracy (%) under APGD-CE on CUB, (a) ε = 0.03 and (b) ε = 0.01: per
    attack space (latent z, concept c), f_std and f_cbm, vanilla (solid) and smoothed
    (hatched) bars."""
    world = world_of(CUB)
    cells = [c for c in run.cells.get(world, ()) if c.kind == "attack"]
    if not cells:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, layout="constrained", sharey=True, figsize=(10, 3.8))
    bars = [(model, smoothed) for model in (STD, CBM) for smoothed in (False, True)]
    width = 0.8 / len(bars)
    for ax, eps, letter in zip(axes, ATTACK_EPS, "ab", strict=True):
        for j, (model, smoothed) in enumerate(bars):
            xs, heights = [], []
            for i, space in enumerate(("latent", "concept")):
                cell = next((c for c in cells if c.summary["space"] == space
                             and bool(c.summary["smoothed"]) == smoothed), None)
                entry = cell.summary["models"].get(model) if cell else None
                budget = next((b for b in entry["budgets"] if math.isclose(b["eps"], eps)),
                              None) if entry else None
                if budget is not None:
                    xs.append(i + (j - (len(bars) - 1) / 2) * width)
                    heights.append(100.0 * budget["robust_accuracy"])
            bars_drawn = ax.bar(xs, heights, width,
                                color=model_colour(model) if not smoothed else "white",
                                edgecolor=model_colour(model), hatch="///" if smoothed else None,
                                label=f"{F_NAMES[model]}{' smoothed' if smoothed else ''}")
            ax.bar_label(bars_drawn, fmt="%.1f", fontsize=7, padding=2)
        ax.set_xticks((0, 1), ("latent space z", "concept space c"))
        for tick, kind_type in zip(ax.get_xticklabels(), ("geometric", "semantic"), strict=True):
            tick.set_color(TYPE_COLOURS[kind_type])
        ax.set(ylim=(0, 105), title=f"({letter}) ε = {eps:g}")
    axes[0].set_ylabel("robust accuracy (%)")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"Fig. 5: APGD-CE through the generator on {setting_label(CUB, world)}",
                 fontsize=10)
    return save(fig, path, lay_out=False)


__all__ = ["figure1b", "figure1c", "figure2", "figure3", "figure4", "figure5", "figure9"]
