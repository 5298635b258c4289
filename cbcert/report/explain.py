"""Figures of explanations: `certify explain`'s images with their top-k concept bars, and the
report's per-model comparison of an explain cell's measures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from cbcert.report.plotting import model_colour, pyplot, save
from cbcert.report.tables import EXPLAIN_MEASURES


def draw_explanations(rows: Sequence[Mapping[str, dict]], titles: Mapping[str, str], model: str,
                      path: Path) -> Path:
    """One row per input, two panels per view (``titles``: clean, ε, τ): the image ``[H, W, 3]``
    titled with the prediction, and horizontal bars of the cited concepts' signed shares
    (positive: support for the predicted class, negative: against it).

    ``rows[r][view]``: ``{"image", "prediction", "cited": [{"name", "share"}, ...]}``.
    """
    plt = pyplot()
    views = list(titles)
    fig, axes = plt.subplots(len(rows), 2 * len(views), squeeze=False,
                             figsize=(3.2 * len(views) * 2, 2.4 * len(rows)))
    for r, row in enumerate(rows):
        for v, view in enumerate(views):
            entry = row[view]
            image_ax, bars_ax = axes[r, 2 * v], axes[r, 2 * v + 1]
            image_ax.imshow(np.clip(entry["image"], 0, 1))
            image_ax.set_title(f"{titles[view]}: {model} → {entry['prediction']}", fontsize=8)
            image_ax.axis("off")
            cited = entry["cited"][::-1]  # the top concept on top
            shares = [c["share"] for c in cited]
            bars_ax.barh(range(len(cited)), shares,
                         color=["tab:blue" if s >= 0 else "tab:red" for s in shares])
            bars_ax.set_yticks(range(len(cited)), [c["name"] for c in cited], fontsize=7)
            bars_ax.set_xlim(-1, 1)
            bars_ax.axvline(0, color="black", linewidth=0.5)
            bars_ax.tick_params(axis="x", labelsize=7)
    return save(fig, path)


def figure_explanations(summary: dict, path: Path) -> Path | None:
    """Every measure of an explain cell (`cbcert.report.tables.EXPLAIN_MEASURES` that lie in
    [0, 1]) as grouped bars per model with their 95 % bootstrap intervals; None without data."""
    models = list(summary["models"])
    measures = [(key, label) for key, label in EXPLAIN_MEASURES
                if "radius" not in key and any(summary["models"][m].get(key) for m in models)]
    if not models or not measures:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(measures) * len(models)), 4.5))
    width, bottom = 0.8 / len(models), 0.0
    for i, model in enumerate(models):
        entries = [summary["models"][model].get(key) for key, _ in measures]
        means = [e["mean"] if e else np.nan for e in entries]
        low = [e["mean"] - e["low"] if e else 0.0 for e in entries]
        high = [e["high"] - e["mean"] if e else 0.0 for e in entries]
        ax.bar(np.arange(len(measures)) + (i - (len(models) - 1) / 2) * width, means, width,
               yerr=[low, high], capsize=2, label=model, color=model_colour(model))
        bottom = min(bottom, *(e["low"] for e in entries if e))  # Kendall τ may be negative
    ax.set_xticks(range(len(measures)), [label for _, label in measures], rotation=35,
                  ha="right", fontsize=7)
    ax.set_ylim(bottom - 0.05 if bottom < 0 else 0.0, 1.05)
    ax.set_ylabel("mean over inputs (95 % bootstrap interval)")
    ax.set_title(f"Explanations of {summary['inputs']} inputs: stability, certificates, known "
                 "answer, counterfactuals", fontsize=9)
    ax.legend(fontsize=8)
    return save(fig, path)


def figure_perturb_explanations(summary: dict, path: Path) -> Path | None:
    """A perturb cell run with ``explain``: top-k overlap and Kendall τ of every explaining
    model against the budget, one column per budget kind (ε, τ, σ, ρ), mean ± sd over the PFR
    subsets; None without explanation data."""
    rows = summary.get("explanations") or []
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    if not kinds:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(2, len(kinds), squeeze=False, figsize=(4.0 * len(kinds), 6.0))
    for col, kind in enumerate(kinds):
        budgets = [r for r in rows if r["kind"] == kind]
        values = [r["value"] for r in budgets]
        for row, measure in enumerate(("overlap", "kendall")):
            ax = axes[row, col]
            for model in budgets[0][measure]:
                mean = [np.nan if r[measure][model]["mean"] is None else r[measure][model]["mean"]
                        for r in budgets]
                sd = [0.0 if r[measure][model]["sd"] is None else r[measure][model]["sd"]
                      for r in budgets]
                ax.errorbar(values, mean, yerr=sd, marker="o", capsize=2, label=model,
                            color=model_colour(model))
            ax.set_xlabel(kind)
            ax.set_ylabel(f"top-k {measure}" if measure == "overlap" else "Kendall τ")
            ax.set_ylim(-1.05 if measure == "kendall" else 0.0, 1.05)
            ax.legend(fontsize=7)
    fig.suptitle("Explanation stability under perturbation (mean ± sd over subsets)",
                 fontsize=9)
    return save(fig, path)


__all__ = ["draw_explanations", "figure_explanations", "figure_perturb_explanations"]
