"""The figure of `certify explain`: images with their top-k concept bars, clean and perturbed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from cbcert.report.figures import _pyplot, _save


def draw_explanations(rows: Sequence[Mapping[str, dict]], titles: Mapping[str, str], model: str,
                      path: Path) -> Path:
    """One row per input, two panels per view (``titles``: clean, ε, τ): the image ``[H, W, 3]``
    titled with the prediction, and horizontal bars of the cited concepts' signed shares
    (positive: support for the predicted class, negative: against it).

    ``rows[r][view]``: ``{"image", "prediction", "cited": [{"name", "share"}, ...]}``.
    """
    plt = _pyplot()
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
    return _save(fig, path)


__all__ = ["draw_explanations"]
