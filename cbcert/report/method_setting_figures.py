"""The method's Figures 6, 7 and 10: its class-structure (+5/+10 similar or dissimilar
classes) and concept-vocabulary settings, each drawn from a run's `MethodRun`.

Each ``figureN`` writes the method's figure N to ``path`` and returns it, or returns None where
none of its settings' worlds is in the run; `cbcert.report.method_outputs` writes them by
number.
"""

from __future__ import annotations

import math
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
    CBM,
    CLASS_SETTINGS,
    EPS,
    F_NAMES,
    RHO,
    SIGMA,
    STD,
    TAU,
    VOCABULARY_SETTINGS,
    MethodRun,
    setting_label,
)
from cbcert.report.method_settings import CLASS_BASE, world_of
from cbcert.report.plotting import KIND_TYPES, TYPE_COLOURS, model_colour, pyplot, save
from cbcert.robustness.protocol import BUDGET_SYMBOLS

# A setting's bar hatch where a panel draws several settings (the first plain).
_SETTING_HATCHES = ("", "//", "..", "xx")


def figure6(run: MethodRun, path: Path) -> Path | None:
    """Fig. 6: class structure. (a) PFR (%) vs ε with +5 (solid) and +10 (dashed) dissimilar
    classes, (b) the same with similar classes, for f_std and f_cbm; (c) ΔPFR = PFR(f_cbm) −
    PFR(f_std) (pp, mean ± sd over the subsets; lower favours f_cbm) per setting at ε = 0.8
    (geometric) and at the largest τ (semantic), colour by perturbation type."""
    present = run.present(CLASS_SETTINGS)
    present = [(s, w) for s, w in present if run.perturb(w)]
    if not present:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, layout="constrained", figsize=(14, 4.4),
                             gridspec_kw={"width_ratios": (1, 1, 1.2)})
    for ax, kind_of, letter in ((axes[0], "dissimilar", "a"), (axes[1], "similar", "b")):
        for setting, world in present:
            if not setting.endswith(f" {kind_of}"):
                continue
            style = "-" if "+5 " in setting else "--"
            for model in (STD, CBM):
                pfr_line(ax, run, world, "eps", EPS, model, style,
                         f"{F_NAMES[model]}, {setting.removeprefix('RIVAL-10 ')}")
        categorical_x(ax, EPS, "ε (geometric)")
        ax.set(ylabel="PFR (%)", title=f"({letter}) {kind_of} classes")
        if ax.has_data():
            ax.legend(fontsize=7, loc="upper left")
        ax.set_ylim(bottom=0)
    order = [s for s in ("RIVAL-10 +10 dissimilar", "RIVAL-10 +5 dissimilar",
                         "RIVAL-10 +5 similar", "RIVAL-10 +10 similar")
             if s in {p for p, _ in present}]
    taus = [max((b["value"] for b in run.perturb(world_of(s)).summary["budgets"]
                 if b["kind"] == "tau"), default=math.nan) for s in order]
    width = 0.38
    for k, kind in enumerate(("eps", "tau")):
        xs, means, sds = [], [], []
        for i, setting in enumerate(order):
            value = 0.8 if kind == "eps" else taus[i]
            b = run.budget(world_of(setting), kind, value)
            c = next((c for c in b["comparisons"] if c["model_a"] == STD
                      and c["model_b"] == CBM), None) if b else None
            if c is not None:
                xs.append(i + (k - 0.5) * width)
                means.append(-100.0 * c["delta"]["mean"])
                sds.append(100.0 * c["delta"]["sd"])
        axes[2].bar(xs, means, width, yerr=sds, capsize=3,
                    color=TYPE_COLOURS[KIND_TYPES[kind]],
                    label=("geometric, ε = 0.8" if kind == "eps" else "semantic, largest τ ("
                           + ", ".join(sorted({f"{t:g}" for t in taus if t == t})) + ")"))
    axes[2].axhline(0, color="0.3", linewidth=0.8)
    axes[2].set_xticks(range(len(order)), [s.removeprefix("RIVAL-10 ") for s in order],
                       fontsize=8)
    axes[2].set(ylabel="ΔPFR (pp) = f_cbm − f_std", title="(c) ΔPFR; lower favours f_cbm")
    axes[2].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("Fig. 6: class structure and semantic similarity" + figure_note(run,
                 CLASS_SETTINGS), fontsize=10)
    return save(fig, path, lay_out=False)


def figure7(run: MethodRun, path: Path) -> Path | None:
    """Fig. 7: concept vocabulary (the method's K = 27 solid/plain, K = 36 dashed/hatched):
    (a) PFR (%) vs ε, (b) PFR (%) vs τ of f_std and f_cbm; (c) R̄ vs σ and (d) Δ⋆ vs ρ as
    bars, mean ± sd over the subsets."""
    present = run.present(VOCABULARY_SETTINGS[1:])
    if not present:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, layout="constrained", figsize=(15, 4.6))
    for ax, kind, values, letter in ((axes[0], "eps", EPS, "a"), (axes[1], "tau", TAU, "b")):
        for (setting, world), style in zip(present, SETTING_STYLES, strict=False):
            for model in (STD, CBM):
                pfr_line(ax, run, world, kind, values, model, style,
                         f"{F_NAMES[model]}, {setting_label(setting, world)}")
        categorical_x(ax, values, f"{BUDGET_SYMBOLS[kind]} ({KIND_TYPES[kind]})")
        ax.set(ylabel="PFR (%)", title=f"({letter}) {KIND_TYPES[kind]} perturbation")
        ax.set_ylim(bottom=0)
    bars = [(model, (setting, world), hatch) for (setting, world), hatch
            in zip(present, _SETTING_HATCHES, strict=False) for model in (STD, CBM)]
    width = 0.8 / len(bars)
    for ax, noise, scales, symbol, title in (
            (axes[2], "gaussian", SIGMA, "σ", "(c) certified, latent: R (L2)"),
            (axes[3], "bernoulli", RHO, "ρ", "(d) certified, concept: Δ⋆ (Hamming)")):
        drawn = []
        for j, (model, (setting, world), hatch) in enumerate(bars):
            xs, means, sds = smoothing_curve(run, world, noise, scales, model,
                                             "radius_of_correct")
            ax.bar([x + (j - (len(bars) - 1) / 2) * width for x in xs], means, width, yerr=sds,
                   capsize=2, color=model_colour(model), edgecolor="white", hatch=hatch,
                   label=f"{F_NAMES[model]}, {setting_label(setting, world)}")
            drawn += means
        categorical_x(ax, scales, symbol)
        ax.set(ylabel="R̄ over correct inputs" + wide_range(ax, drawn), title=title)
        ax.set_ylim(bottom=0)
    handles = axes[0].get_legend_handles_labels()[0] + axes[2].get_legend_handles_labels()[0]
    labels = axes[0].get_legend_handles_labels()[1] + axes[2].get_legend_handles_labels()[1]
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle("Fig. 7: concept vocabulary size (lines and bars: solid/plain "
                 f"{present[0][0].removeprefix('RIVAL-10 ')}"
                 + (f", dashed/hatched {present[1][0].removeprefix('RIVAL-10 ')}"
                    if len(present) > 1 else "") + ")"
                 + figure_note(run, VOCABULARY_SETTINGS[1:]), fontsize=10)
    return save(fig, path, lay_out=False)


def figure10(run: MethodRun, path: Path) -> Path | None:
    """Fig. 10: class-centroid distances among the 20 classes of the +10 similar and +10
    dissimilar settings (f_std's features), one heatmap each on one shared colour scale."""
    panels = []
    for setting in ("RIVAL-10 +10 similar", "RIVAL-10 +10 dissimilar"):
        world = world_of(setting)
        cell = next((c for c in run.cells.get(world, ()) if c.kind == "classes"), None)
        if cell is not None:
            s = cell.summary
            panels.append((setting_label(setting, world), s["class_names"], np.array(
                [[np.nan if v is None else v for v in row] for row in s["distances"]],
                dtype=np.float64)))
    if not panels:
        return None
    top = max((float(np.nanmax(m)) for _, _, m in panels if np.isfinite(m).any()), default=1.0)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), layout="constrained", squeeze=False,
                             figsize=(0.8 + 5.2 * len(panels), 5.0))
    base = next((c.summary["class_names"] for c in run.cells.get(world_of(CLASS_BASE), ())
                 if c.kind == "classes"), None)
    for ax, (label, names, matrix) in zip(axes[0], panels, strict=True):
        image = ax.imshow(matrix, cmap="viridis", vmin=0, vmax=top)
        if base is not None and 0 < len(base) < len(names):
            for line in (ax.axhline, ax.axvline):
                line(len(base) - 0.5, color="white", linewidth=1.2, linestyle="--")
        ticks = range(len(names))
        ax.set_xticks(ticks, names, rotation=90, fontsize=6)
        ax.set_yticks(ticks, names, fontsize=6)
        ax.set_title(label, fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8,
                 label="class-centroid distance ‖μ_c − μ_c'‖₂ (f_std features)")
    split = (f"; dashed: the base task's {len(base)} classes | the added ones"
             if base is not None else "")
    fig.suptitle("Fig. 10: distances among the classes of the +10 similar and +10 dissimilar "
                 "settings" + split + figure_note(run, ("RIVAL-10 +10 similar",
                                                        "RIVAL-10 +10 dissimilar")), fontsize=10)
    return save(fig, path, lay_out=False)


__all__ = ["figure6", "figure7", "figure10"]
