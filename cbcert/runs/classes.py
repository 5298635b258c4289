"""``certify world classes``: the class-distance matrix of a world (SPEC's class similarity).

Draws ``samples`` latents of the pool (``z_i`` from ``--seed``, as every runner), labels them
with the world's ground truth when it has one (the built-in worlds) or with ``f_std``'s clean
prediction otherwise, embeds the generated images with the standard classifier's penultimate
features (``World.embed``, memory-bounded through the engine) and reduces them to class
centroids and their pairwise L2 distances (`cbcert.robustness.classes`). A pixels world uses
its images and labels instead of generated ones.

`run` is the sweep's ``classes`` cell: the same measurement written as ``run.json`` (the job
and world) and ``summary.json`` (the `class_distances` dict), so reports read it like any
other cell; a finished cell is not recomputed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from cbcert.engine.sampler import map_inputs
from cbcert.robustness import classes
from cbcert.runs.directory import SUMMARY, RunSummary, finite_or_none, read_json
from cbcert.runs.pool import pool_latents
from cbcert.runs.session import session
from cbcert.schema import ConfigError, validate


@functools.lru_cache(maxsize=8)
def _observer(world) -> Callable:
    """``(params, z[B, d]) -> {"embed": e[B, D], "label": int[B]}`` (one object per world)."""

    def observe(params, z):
        image = world.latent_images(params, z)
        if world.true_label is not None:
            label = world.true_label(params["gen"], z)
        else:
            label = jnp.argmax(world.classify(params["clf"], image, ("std",))[:, 0], axis=-1)
        return {"embed": world.embed(params["clf"], image), "label": label.astype(jnp.int32)}

    return observe


def class_distances(world, *, samples: int, seed: int, chunk_size: int | None = None,
                    max_memory: int | None = None) -> dict[str, Any]:
    """The world's class centroids' distances in ``f_std``'s feature space (module docstring).

    Returns a JSON-ready dict: ``world``, ``samples``, ``seed``, ``labels`` (``ground truth``
    or ``std prediction``), ``class_names``, ``counts[C]``, ``distances[C][C]`` (null for absent
    classes), ``mean_off_diagonal`` and ``nearest`` (per class: the closest other class and
    its distance).

    Raises:
      ConfigError: ``samples`` out of range (key ``samples``), a world without embeddings.
    """
    validate("samples", samples, key="samples")
    validate("seed", seed, key="seed")
    if world.embed is None:
        raise ConfigError(f"{world.name} gives no classifier features (World.embed)",
                          key="world", value=world.name)
    memory = dict(chunk_size=chunk_size, max_memory=max_memory)
    if world.dataset is not None:
        count = min(samples, len(world.dataset.labels))
        z, labels = world.dataset.latents[:count], world.dataset.labels[:count]
        embed = map_inputs(lambda p, v: world.embed(p["clf"], world.latent_images(p, v)),
                           world.params, z, **memory)
        source = "file labels"
    else:
        z = pool_latents(world, seed, 0, samples)
        out = map_inputs(_observer(world), world.params, z, **memory)
        embed, labels = out["embed"], out["label"]
        source = "ground truth" if world.true_label is not None else "std prediction"
    centroids, counts = classes.class_centroids(embed, labels, world.num_classes)
    distances = classes.centroid_distances(centroids)
    names = list(world.class_names)
    return {
        "world": world.name, "samples": int(len(labels)), "seed": seed, "labels": source,
        "class_names": names, "counts": counts.tolist(),
        "distances": [[None if not np.isfinite(v) else float(v) for v in row]
                      for row in distances],
        "mean_off_diagonal": finite_or_none(classes.mean_off_diagonal(distances)),
        "nearest": {names[c]: {"class": names[j] if j >= 0 else None,
                               "distance": d if np.isfinite(d) else None}
                    for c, (j, d) in enumerate(classes.nearest_classes(distances))},
    }


@dataclass(frozen=True)
class ClassesJob:
    """Settings of a ``classes`` cell: pool latents measured and the pool's root seed."""

    samples: int = 400
    seed: int = 0

    def __post_init__(self) -> None:
        validate("samples", self.samples, key="samples")
        validate("seed", self.seed, key="seed")


def run(world, job: ClassesJob, out: str | Path, *,
        progress: Callable[[int, int], None] | None = None, chunk_size: int | None = None,
        max_memory: int | None = None) -> RunSummary:
    """Measure `class_distances` of ``world`` into ``out`` (``run.json`` pins ``classes``:
    the job, and the world); returns the `RunSummary`. A finished directory is read, not
    redone.

    Raises:
      RunMismatchError: ``out`` holds a run with other settings or another world.
    """
    with session(out, "classes", {"classes": asdict(job), "world": world.name},
                 world) as directory:
        if directory.path(SUMMARY).is_file():
            result = RunSummary("classes", read_json(directory.path(SUMMARY)))
        else:
            measured = class_distances(world, samples=job.samples, seed=job.seed,
                                       chunk_size=chunk_size, max_memory=max_memory)
            directory.writing()  # the summary is this run's only record
            result = directory.finish(measured)
        if progress:
            progress(1, 1)
        return result


__all__ = ["ClassesJob", "class_distances", "run"]
