"""Axes helpers shared by the method's figures (`cbcert.report.method_figures`,
`cbcert.report.method_setting_figures`, which import this module and never each other)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cbcert.report.method_run import MethodRun
from cbcert.report.method_settings import world_of
from cbcert.report.plotting import model_colour

# A setting's line style where a panel draws several settings (the first solid).
SETTING_STYLES = ("-", "--", ":", "-.")


def wide_range(ax, values: Sequence[float], axis: str = "y") -> str:
    """A symlog scale where the positive values span more than two decades (a saturated
    world's Hamming radii beside a fragile world's), so the small ones stay readable, and the
    note for the axis label that says so; linear and ``""`` otherwise."""
    positive = [v for v in values if v is not None and np.isfinite(v) and v > 0]
    if not positive or max(positive) / min(positive) <= 100:
        return ""
    threshold = 10.0 ** math.floor(math.log10(min(positive)))
    (ax.set_xscale if axis == "x" else ax.set_yscale)("symlog", linthresh=threshold)
    return f"\n(symlog scale: linear below {threshold:g})"


def pfr_line(ax, run: MethodRun, world: str, kind: str, values: Sequence[float], model: str,
             style: str, label: str | None) -> list[float]:
    """PFR (%) of ``model`` at the ``values`` of ``kind`` (categorical x), mean ± sd over the
    subsets; the means drawn."""
    xs, means, sds = [], [], []
    for x, value in enumerate(values):
        b = run.budget(world, kind, value)
        if b is not None and model in b["pfr"]:
            xs.append(x)
            means.append(100.0 * b["pfr"][model]["mean"])
            sds.append(100.0 * b["pfr"][model]["sd"])
    if xs:
        ax.errorbar(xs, means, yerr=sds, color=model_colour(model), linestyle=style,
                    marker="o" if style == "-" else "s", markersize=4, capsize=2, label=label)
    return means


def categorical_x(ax, values: Sequence[float], symbol: str) -> None:
    """Ticks at 0, 1, … labelled by ``values`` (the method's budgets, evenly spaced) and the
    x label ``symbol``."""
    ax.set_xticks(range(len(values)), [f"{v:g}" for v in values])
    ax.set_xlabel(symbol)


def figure_note(run: MethodRun, settings: Sequence[str]) -> str:
    """A title's last line naming the ``settings`` whose world is not in the run, or ``""``."""
    gone = [s for s in settings if world_of(s) not in run.cells]
    return f"\n(not in this run: {', '.join(gone)})" if gone else ""


def smoothing_curve(run: MethodRun, world: str, noise: str, scales: Sequence[float],
                    model: str, metric: str) -> tuple[list[int], list[float], list[float]]:
    """Categorical x, mean and sd over the subsets of ``metric`` (``smoothed_accuracy`` in %,
    ``radius_of_correct``) of ``model`` at ``scales``."""
    xs, means, sds = [], [], []
    factor = 100.0 if metric == "smoothed_accuracy" else 1.0
    for x, scale in enumerate(scales):
        cell = run.certify(world, noise, scale)
        entry = ((cell.summary.get("subsets") or {}).get("models", {}).get(model, {})
                 .get(metric) if cell else None)
        if entry and entry.get("mean") is not None:
            xs.append(x)
            means.append(factor * entry["mean"])
            sds.append(factor * (entry.get("sd") or 0.0))
    return xs, means, sds


__all__ = ["SETTING_STYLES", "categorical_x", "figure_note", "pfr_line", "smoothing_curve",
           "wide_range"]
