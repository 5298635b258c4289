"""The run-wide findings at a glance: one forest figure per compared model.

Draws `cbcert.report.family`'s hypotheses of std against one model (``findings_<model>.png``)
so that each comparison is read on a scale of its own — std-vs-cbm differences of a point or
two are not squashed by std-vs-proto's tens of points — and with one sign convention: every x
is std's robustness advantage (``> 0``: std the more robust; flip rates enter as ``PFR_b −
PFR_std``).

Two panels per figure: accuracies and flip rates in percentage points (smoothed accuracy,
prediction flip rate, robust accuracy, robust accuracy on inputs clean for both), and mean
certified radii over correct inputs in % of std's R̄. A band of rows per world and measure, one
thin line per budget (the 95 % paired bootstrap interval) with its point estimate: filled
where the run-wide Holm shows a difference, a diamond where TOST shows equivalence, hollow
where the answer is inconclusive. Colour by perturbation type (`TYPE_COLOURS`: geometric ε, σ
and latent attacks; semantic τ, ρ, m and concept attacks); the grey band is the equivalence
margin.
"""

from __future__ import annotations

import math
from pathlib import Path

from cbcert.report.family import Family
from cbcert.report.plotting import TYPE_COLOURS, pyplot, save

_SHORT = {"radius": "R̄", "smoothed_accuracy": "SmAcc", "pfr": "PFR",
          "robust_accuracy": "RobAcc", "robust_accuracy_clean": "RobAcc|clean"}


def _points(family: Family, model: str, radius: bool):
    """``(band label, budget, x, low, high, type, verdict)`` of one model's hypotheses on one
    panel's scale: 100·Δ (points) for rates, 100·Δ / R̄_std (%) for radii; radius rows whose
    std R̄ is 0 or undefined have no relative size and are left out."""
    out = []
    for h, verdict in zip(family.hypotheses, family.verdicts, strict=True):
        if h.model_b != model or (h.measure == "radius") != radius:
            continue
        delta, low, high = h.advantage()
        if radius:
            base = h.result.value_a
            if not base or not math.isfinite(base):
                continue
            factor = 100 / base
        else:
            factor = 100.0
        out.append((f"{h.world} · {_SHORT[h.measure]}", h.budget, factor * delta,
                    factor * low, factor * high, h.kind, verdict))
    return out


def _panel(ax, points, margin: float, unit: str) -> None:
    bands = list(dict.fromkeys(p[0] for p in points))
    for band_index, band in enumerate(bands):
        members = [p for p in points if p[0] == band]
        step = 0.8 / max(len(members), 1)
        for j, (_, _, x, low, high, kind, verdict) in enumerate(members):
            y = band_index - 0.4 + step * (j + 0.5)
            colour = TYPE_COLOURS[kind]
            if math.isfinite(low) and math.isfinite(high):
                ax.plot([low, high], [y, y], color=colour, lw=0.8, alpha=0.8)
            marker = "D" if verdict == "equivalent" else "o"
            filled = verdict in ("std more robust", "other more robust", "equivalent")
            ax.plot([x], [y], marker=marker, ms=3.5, color=colour, linestyle="none",
                    markerfacecolor=colour if filled else "white", markeredgewidth=0.8)
        if band_index % 2:
            ax.axhspan(band_index - 0.5, band_index + 0.5, color="0.94", zorder=0)
    ax.axvspan(-100 * margin, 100 * margin, color="0.85", zorder=0)
    ax.axvline(0, color="0.3", lw=0.8)
    ax.set_yticks(range(len(bands)), bands, fontsize=7)
    ax.set_ylim(len(bands) - 0.5, -0.5)
    ax.set_xlabel(f"std's advantage ({unit}); > 0: std more robust", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)


def figure_findings(family: Family | None, model: str, path: Path) -> Path | None:
    """``findings_<model>.png``: std against ``model`` over the whole run (module
    docstring); None if the family has no plottable hypothesis of that model."""
    if family is None:
        return None
    panels = [(title, pts, margin, unit) for title, pts, margin, unit in (
        ("accuracies and flip rates", _points(family, model, radius=False),
         family.settings.rate_margin, "points"),
        ("certified radius R̄ of correct inputs", _points(family, model, radius=True),
         family.settings.radius_margin, "% of std's R̄")) if pts]
    if not panels:
        return None
    rows = max(len(dict.fromkeys(p[0] for p in pts)) for _, pts, _, _ in panels)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 1.6 + 0.3 * rows),
                             squeeze=False)
    for ax, (title, pts, margin, unit) in zip(axes[0], panels, strict=True):
        _panel(ax, pts, margin, unit)
        ax.set_title(title, fontsize=9)
    handles = [plt.Line2D([], [], color=c, marker="o", lw=0.8, label=f"{k} perturbation")
               for k, c in TYPE_COLOURS.items()]
    handles += [plt.Line2D([], [], color="0.3", marker="o", linestyle="none",
                           label="difference shown (Holm across the run)"),
                plt.Line2D([], [], color="0.3", marker="D", linestyle="none",
                           label="equivalent (TOST, Holm)"),
                plt.Line2D([], [], color="0.3", marker="o", markerfacecolor="white",
                           linestyle="none", label="inconclusive"),
                plt.Rectangle((0, 0), 1, 1, color="0.85", label="equivalence margin")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7,
               bbox_to_anchor=(0.5, -0.01), frameon=False)
    counts = {v: sum(1 for h, x in zip(family.hypotheses, family.verdicts, strict=True)
                     if h.model_b == model and x == v)
              for v in ("std more robust", "other more robust", "equivalent", "inconclusive")}
    fig.suptitle(f"std against {model}: {counts['std more robust']} shown for std, "
                 f"{counts['other more robust']} for {model}, {counts['equivalent']} "
                 f"equivalent, {counts['inconclusive']} inconclusive "
                 f"(one family of {family.tests} tests)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    return save(fig, path, lay_out=False)


__all__ = ["figure_findings"]
