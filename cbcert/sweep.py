"""Sweeps: expand an `ExperimentConfig` into runner cells, run them all, resumably.

A config becomes a list of *cells*, each one run of an existing runner in its own directory
``<out>/<cell>/``:

* ``latent``: one `CertifyJob` (Gaussian, Cohen ``CERTIFY``) per σ — ``latent-sigma0.25``;
* ``concept``: one per Bernoulli ρ — ``concept-rho0.2`` — and one per fixed flip count m —
  ``concept-flips2``;
* ``perturb``: one `PerturbJob` with every ε and τ budget — ``perturb``;
* ``attack``: one `AttackJob` for the section's (space, smoothed) pair — ``attack-latent`` or
  ``attack-latent-smoothed-sigma0.25`` (``attack-concept-smoothed-rho0.2``).

Inputs: certification and perturbation cells use the first ``world.num_inputs`` inputs of the
std/cbm agreement set drawn from ``world.seed``; the attack cell the first ``attack.inputs`` of
the same set. Models: certification cells use their section's ``models``; perturbation and
attack cells ``std, cbm, proto`` (PFR differences are std − other). Smoothed attacks judge with
``PREDICT`` using the ``n`` and ``alpha`` of the latent (or concept) section.

Resumption is the runners': a rerun re-enters every cell, and each skips its finished inputs, so
a sweep killed at any point (even ``kill -9`` mid-write: torn JSONL lines are dropped) ends with
the summaries of an uninterrupted one. ``manifest.json`` (written before the first cell) pins
the resolved config; a rerun with another config into the same directory is refused.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from cbcert.attacks import runner as attack_runner
from cbcert.certify import runner as certify_runner
from cbcert.certify.runner import RunMismatchError
from cbcert.config import ConfigError, ExperimentConfig
from cbcert.robustness import runner as perturb_runner
from cbcert.runs.directory import (
    RecordsError,
    check_writable,
    hold,
    read_json,
    value_name,
    write_json,
)

SECTIONS = ("latent", "concept", "perturb", "attack")
MANIFEST = "manifest.json"
# The runners' default models; the agreement set itself needs std and cbm.
EMPIRICAL_MODELS = ("std", "cbm", "proto")


@dataclass(frozen=True)
class Cell:
    """One runner invocation of a sweep.

    Attributes:
      name: directory name under the sweep's output directory.
      kind: which runner: ``certify``, ``perturb`` or ``attack``.
      job: the runner's settings (`CertifyJob`, `PerturbJob` or `AttackJob`).
    """

    name: str
    kind: Literal["certify", "perturb", "attack"]
    job: Any


def sections_in_file(path: str | Path) -> tuple[str, ...]:
    """Sections a YAML config asks to sweep: those it names, or all four if it names none.

    A file with only a ``latent:`` section sweeps σ only, although the loaded config (filled
    from its preset) has every section.
    """
    data = yaml.safe_load(Path(path).read_bytes().decode("utf-8")) or {}
    named = tuple(s for s in SECTIONS if isinstance(data, dict) and s in data)
    return named or SECTIONS


def plan_cells(config: ExperimentConfig, sections: Sequence[str] = SECTIONS) -> tuple[Cell, ...]:
    """The cells of a sweep, in run order (latent, concept, perturb, attack).

    Raises:
      ConfigError: ``sections`` names something other than latent, concept, perturb, attack.
    """
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ConfigError(f"sections {unknown}: allowed {', '.join(SECTIONS)}")
    config.check_sections(tuple(sections))
    w = config.world
    cells: list[Cell] = []
    if "latent" in sections:
        c = config.latent
        for sigma in c.sigmas:
            job = certify_runner.CertifyJob(
                noise="gaussian", scale=sigma, n0=c.n0, n=c.n, alpha=c.alpha,
                two_class=c.two_class, models=c.models, seed=w.seed, num_inputs=w.num_inputs)
            cells.append(Cell(f"latent-sigma{value_name(sigma)}", "certify", job))
    if "concept" in sections:
        c = config.concept
        common = dict(n0=c.n0, n=c.n, alpha=c.alpha, models=c.models, seed=w.seed,
                      num_inputs=w.num_inputs)
        for rho in c.rhos:
            job = certify_runner.CertifyJob(noise="bernoulli", scale=rho, **common)
            cells.append(Cell(f"concept-rho{value_name(rho)}", "certify", job))
        for m in c.flips:
            job = certify_runner.CertifyJob(noise="fixed", scale=m, **common)
            cells.append(Cell(f"concept-flips{m}", "certify", job))
    if "perturb" in sections:
        p = config.perturb
        job = perturb_runner.PerturbJob(
            eps=p.eps, tau=p.tau, models=EMPIRICAL_MODELS, seed=w.seed, samples=p.samples,
            ball=p.ball, num_subsets=p.subsets, subset_size=p.subset_size,
            num_inputs=w.num_inputs)
        cells.append(Cell("perturb", "perturb", job))
    if "attack" in sections:
        cells.append(_attack_cell(config))
    return tuple(cells)


def _attack_cell(config: ExperimentConfig) -> Cell:
    a = config.attack
    smoothing = config.latent if a.space == "latent" else config.concept
    name = f"attack-{a.space}"
    scale = None
    if a.smoothed:
        symbol, scale = ("sigma", a.sigma) if a.space == "latent" else ("rho", a.rho)
        name += f"-smoothed-{symbol}{value_name(scale)}"
    job = attack_runner.AttackJob(
        space=a.space, eps=a.eps, norm=a.norm, iters=a.iters, restarts=a.restarts,
        smoothed=a.smoothed, scale=scale, eot=a.eot, n=smoothing.n, alpha=smoothing.alpha,
        models=EMPIRICAL_MODELS, seed=config.world.seed, num_inputs=a.inputs)
    return Cell(name, "attack", job)


def check_cells(cells: Sequence[Cell], world) -> None:
    """Raise ValueError naming the config key if a cell cannot run on ``world``.

    Checked before any cell runs, so a bad model name or τ > K fails in a second, not after
    an hour of earlier cells.
    """
    for cell in cells:
        section = cell.name.split("-")[0]
        try:
            world.check_models(cell.job.models)
        except ValueError as error:
            where = "key 'models'" if cell.kind == "certify" else f"models {cell.job.models}"
            raise ConfigError(f"section '{section}', {where}: {error}") from None
        if cell.kind == "perturb":
            try:
                perturb_runner.check_budgets(cell.job, world.generator.num_concepts)
            except ValueError as error:
                raise ConfigError(f"section 'perturb', key 'tau': {error}") from None


def git_revision() -> str | None:
    """``git rev-parse HEAD`` of the checkout holding this package, or None outside git."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
            text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def manifest(config: ExperimentConfig, cells: Sequence[Cell], world) -> dict[str, Any]:
    """The run manifest: resolved config, cells, seed, world, versions, devices, git revision."""
    import flax
    import jax
    import numpy as np

    import cbcert

    return {
        "config": config.to_dict(),
        "cells": [{"name": c.name, "kind": c.kind} for c in cells],
        "seed": config.world.seed,
        "world": world.name,
        "versions": {"cbcert": cbcert.__version__, "jax": jax.__version__,
                     "flax": flax.__version__, "numpy": np.__version__},
        "devices": [str(d) for d in jax.devices()],
        "git_revision": git_revision(),
    }


def _write_manifest(out: Path, meta: dict[str, Any]) -> None:
    """Write ``manifest.json``, or refuse if the one there describes another sweep."""
    path = out / MANIFEST
    pinned = ("config", "cells", "world")
    if path.exists():
        previous = read_json(path)
        if not isinstance(previous, dict):
            raise RecordsError(f"{path}: damaged, expected a JSON object")
        if {k: previous.get(k) for k in pinned} != {k: meta[k] for k in pinned}:
            raise RunMismatchError(
                f"--out {out} holds a sweep of another config or world "
                f"({previous.get('config', {}).get('name')}); use another --out or delete it")
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, meta)


def run_sweep(
    config: ExperimentConfig,
    out: str | Path,
    *,
    sections: Sequence[str] = SECTIONS,
    load_world: Callable[[str], Any],
    progress: Callable[[str], Callable[[int, int], None] | None] | None = None,
    on_cell: Callable[[Cell, Any], None] | None = None,
) -> dict[str, Any]:
    """Run every cell of ``config`` into ``<out>/<cell>/``; rerunning resumes.

    Args:
      config: the experiment.
      out: sweep directory (gets ``manifest.json`` and one directory per cell).
      sections: which sections to sweep (`sections_in_file` for a YAML file).
      load_world: ``preset -> World``, e.g. `cbcert.builtin.load_builtin`; injected so that
        tests can pass ``untrained_world``.
      progress: ``cell name -> callback(done, total)`` (or None) for each cell's runner.
      on_cell: called with ``(cell, summary)`` after each cell finishes.

    Returns:
      ``{cell name: summary dict}`` (for perturb cells, the summary of its `PerturbResult`).

    Raises:
      ConfigError: a cell cannot run on the world (unknown model, τ > K).
      RunMismatchError: ``out`` holds another sweep or a cell directory other settings.
      RunLockedError: another process is running a sweep or cell in ``out``.
    """
    out = Path(out)
    world = load_world(config.world.preset)
    cells = plan_cells(config, sections)
    check_cells(cells, world)
    check_writable(out)
    with hold(out):
        _write_manifest(out, manifest(config, cells, world))
        summaries = {}
        for cell in cells:
            callback = progress(cell.name) if progress else None
            run_cell = {"certify": certify_runner.run, "perturb": perturb_runner.run,
                        "attack": attack_runner.run}[cell.kind]
            summary = run_cell(world, cell.job, out / cell.name, progress=callback)
            if cell.kind == "perturb":
                summary = summary.summary
            summaries[cell.name] = summary
            if on_cell:
                on_cell(cell, summary)
        return summaries


__all__ = [
    "MANIFEST", "SECTIONS", "Cell", "check_cells", "git_revision", "manifest", "plan_cells",
    "run_sweep", "sections_in_file",
]
