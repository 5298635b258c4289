"""Pictures of a world: sample grids with concept vectors, and concept counterfactuals."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from cbcert.concepts import concept_state, flip_pairs
from cbcert.report.plotting import pyplot

# Formats matplotlib writes by itself or through Pillow's always-present codecs (not .pgf,
# which needs LaTeX, nor Pillow's optional ones); the file's suffix picks one.
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".eps", ".ps", ".jpg", ".jpeg", ".tif",
                  ".tiff")


def check_image_path(out: Path) -> None:
    """Raise ValueError unless ``out``'s suffix names a format `world_grid` can write.

    Checked before rendering, so a wrong suffix costs nothing (case-insensitive).
    """
    suffix = Path(out).suffix
    if suffix.lower() not in IMAGE_SUFFIXES:
        got = f"the suffix {suffix!r}" if suffix else "no suffix"
        raise ValueError(f"{out}: got {got}; allowed image suffixes: {', '.join(IMAGE_SUFFIXES)}")


def world_grid(world, *, n: int, seed: int, flip: int | None, out: Path) -> Path:
    """Save a grid of ``n`` samples titled with class and concept bits as an image in the
    format of ``out``'s suffix (``.png``, … `IMAGE_SUFFIXES`; any other: ValueError before
    any work).

    With ``flip = i`` every sample is followed by its counterfactual ``g2(D(F(E(g1(z)), e_i)))``.
    """
    check_image_path(out)
    plt = pyplot()
    gen = world.generator
    k = gen.num_concepts
    z = world.sample_latents(jax.random.key(seed), n)
    c = gen.concepts(gen.params, z)
    panels = [(gen.image_from_concepts(gen.params, c), c)]
    if flip is not None:
        eta = np.zeros((n, k), bool)
        eta[:, flip] = True
        c_flip = flip_pairs(c, eta, k)
        panels.append((gen.image_from_concepts(gen.params, c_flip), c_flip))
    cols = min(8, n) * len(panels)
    rows = int(np.ceil(n * len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.9 * rows + 0.6), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    slot = 0
    for i in range(n):
        for p, (images, reps) in enumerate(panels):
            ax = axes.flat[slot]
            slot += 1
            bits = np.asarray(concept_state(reps[i], k)).astype(int)
            label = int(world.label_of_concepts(gen.params, bits[None].astype(bool))[0])
            ax.imshow(np.asarray(images[i]), interpolation="nearest")
            tag = f"flip {gen.concept_names[flip]}" if p else world.class_names[label]
            ax.set_title(f"{tag}\n{''.join(map(str, bits))}", fontsize=7,
                         color="darkred" if p else "black")
    legend = "  ".join(f"{i}:{name}" for i, name in enumerate(gen.concept_names))
    fig.suptitle(f"{gen.name} — concept bits: {legend}", fontsize=7)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
