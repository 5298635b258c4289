"""The report's plotting helpers: matplotlib on the Agg backend (no display), saving a figure,
and drawing a list of planned figures. Every figure module builds on these; this module
imports no other figure module, so the figure modules never import each other."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from cbcert.certify.smoothing import SMOOTHINGS
from cbcert.robustness.protocol import BUDGET_SYMBOLS

# Perturbation types by colour in every cross-world figure: geometric (latent shifts ε, latent
# noise σ, latent attacks) and semantic (concept flips τ, flip noise ρ, m, concept attacks).
TYPE_COLOURS = {"geometric": "tab:blue", "semantic": "tab:orange"}
# The type of each flip-rate budget kind (`cbcert.robustness.protocol.BUDGET_SYMBOLS`).
KIND_TYPES = {"eps": "geometric", "sigma": "geometric", "tau": "semantic", "rho": "semantic"}
# Semantic budget symbols: the concept-flip budgets (τ, ρ) and every smoothing whose radii are
# Hamming distances between concept states (ρ, m); all others (ε, σ) are geometric.
_SEMANTIC_SYMBOLS = frozenset(
    {BUDGET_SYMBOLS[k] for k, kind_type in KIND_TYPES.items() if kind_type == "semantic"}
    | {s.symbol for s in SMOOTHINGS.values() if s.hamming})


# One colour per model in every figure, per-cell and cross-world, so a model is recognised by
# its colour across the report: near-black std beside Okabe–Ito's colour-blind-safe bluish
# green (cbm), reddish purple (cbmh) and vermillion (proto). None is a perturbation-type colour
# (`TYPE_COLOURS`), which colours titles and tick labels beside the models' lines and bars.
MODEL_COLOURS = {"std": "#222222", "cbm": "#009E73", "cbmh": "#CC79A7", "proto": "#D55E00"}
# Models outside `MODEL_COLOURS` (a library user's own names) take one of these, by name.
_SPARE_COLOURS = ("tab:olive", "tab:cyan", "tab:brown", "tab:gray")


def model_colour(model: str) -> str:
    """The colour of ``model`` in every figure: `MODEL_COLOURS` for the built-in roles (std,
    cbm, cbmh, proto), otherwise a spare colour chosen by a CRC-32 of the name — the same in
    every figure and run, whatever other models a figure draws."""
    if model in MODEL_COLOURS:
        return MODEL_COLOURS[model]
    return _SPARE_COLOURS[zlib.crc32(model.encode()) % len(_SPARE_COLOURS)]


def budget_type(label: str) -> str:
    """``geometric`` or ``semantic`` for a budget label (``"τ=1"``, ``"σ=0.1"``, ``"m=2"``, a
    bare symbol, or an attack budget ``"ε=0.03 attack-concept"``): semantic where the symbol
    before ``=`` is τ, ρ or m or the budget attacks the concepts, geometric otherwise."""
    if "attack-concept" in label or label.split("=")[0].strip() in _SEMANTIC_SYMBOLS:
        return "semantic"
    return "geometric"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, imported on first use (``import cbcert.report``
    stays free of matplotlib)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, *, lay_out: bool = True) -> Path:
    """Lay out ``fig``, write it to ``path`` (PNG at 120 dpi, cropped to what is drawn, so no
    title, label or colour-bar caption is cut off), close it; returns ``path``.

    Where the figure's suptitle would cover a panel (``tight_layout`` ignores it: on a tall
    figure it lands on the first row's titles), the panels are laid out again below it.
    ``lay_out=False`` keeps the figure's own layout (e.g. a colour bar shared by several
    panels, which ``tight_layout`` would lay over them) and only crops and writes it."""
    title = fig._suptitle  # matplotlib keeps no public handle on the suptitle's Text
    if lay_out:
        fig.tight_layout()
    if lay_out and title is not None and title.get_text():
        renderer = fig.canvas.get_renderer()
        box = title.get_window_extent(renderer)
        if any(box.overlaps(ax.get_tightbbox(renderer)) for ax in fig.axes if ax.get_visible()):
            height = box.height / fig.bbox.height
            fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 1.3 * height))
            title.set_y(1.0 - 0.3 * height)
            title.set_verticalalignment("top")
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.05)
    pyplot().close(fig)
    return path


def draw_plans(plans: Sequence[tuple[str, Callable[[Path], Path | None]]], out: Path,
               log: Callable[[str], None], why: str) -> list[Path]:
    """Draw each ``(file name, draw)`` plan into ``out``; the written paths, in order. A draw
    that returns None (no data) is noted as ``skipped <name> (<why>)``."""
    written = []
    for name, draw in plans:
        path = draw(out / name)
        if path is None:
            log(f"note: skipped {name} ({why})")
        else:
            written.append(path)
    return written


__all__ = ["KIND_TYPES", "MODEL_COLOURS", "TYPE_COLOURS", "budget_type", "draw_plans",
           "model_colour", "pyplot", "save"]
