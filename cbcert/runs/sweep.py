"""Sweeps: expand an `ExperimentConfig` into runner cells, run them all, resumably.

A config becomes a list of *cells*, each one run of an existing runner in its own directory
``<out>/<cell>/``:

* ``latent``: one `CertifyJob` (Gaussian, Cohen ``CERTIFY``) per σ — ``latent-sigma0.25``;
* ``concept``: one per Bernoulli ρ — ``concept-rho0.2`` — and one per fixed flip count m —
  ``concept-flips2``;
* ``perturb``: one `PerturbJob` with every ε and τ budget — ``perturb``;
* ``attack``: one `AttackJob` per attack section (a config may list several) for its (space,
  smoothed) pair — ``attack-latent`` or ``attack-latent-smoothed-sigma0.25``
  (``attack-concept-smoothed-rho0.2``), or the section's ``name``;
* ``classes``: the class-centroid distances of f_std's features (`runs.classes`) — ``classes``;
* ``explain``: the concept models' explanations, their stability, certificates, known-answer
  quality and counterfactuals (`runs.explain`) — ``explain``.

A multi-world config (``worlds:``) runs every world's cells into ``<out>/<world>/<cell>/``: cell
names carry the world (``similar5/latent-sigma0.1``), each world directory gets the manifest
of its own single-world experiment (so ``certify report <out>/<world>`` and a single-world
rerun into it work), and ``<out>/manifest.json`` pins the whole experiment. Every world is
loaded and checked before the first cell runs.

Inputs: certification and perturbation cells use the first ``world.num_inputs`` inputs of the
std/cbm agreement set drawn from ``world.seed``; the attack cell the first ``attack.inputs`` of
the same set. Models: certification cells use their section's ``models``; perturbation and
attack cells ``std, cbm, proto`` (PFR differences are std − other). Smoothed attacks judge with
``PREDICT`` using the ``n`` and ``alpha`` of the latent (or concept) section.

Resumption is the runners': a rerun re-enters every cell, and each skips its finished inputs, so
a sweep killed at any point (even ``kill -9`` mid-write: torn JSONL lines are dropped) ends with
the summaries of an uninterrupted one. ``manifest.json`` (written before the first cell) pins
the resolved config; a rerun with another config into the same directory is refused.

Shards (``certify sweep --shard I/N``, for machines that share a filesystem but no JAX job):
`runs.shards.assign_shards` deals the cells (of every world) to N shards by cost, the same way
on every machine. A shard runs only its cells, each under its own cell lock, and takes no lock
on the sweep directory; the first shard to start writes ``manifest.json`` (`write_json_once`),
the others check theirs against it. So shards never write the same file, and the union of
their cell directories is the unsplit sweep's. `sweep_status` lists every cell as done, running
or missing.

Each call logs itself in ``<out>/sessions.jsonl`` (`cbcert.runs.sessions`): when, at which
revision, on which machine, the wall time of each cell it worked on (`cbcert.runs.pace` prices
the unfinished cells with them), and which cells were complete when it left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from cbcert.certify.schedule import SEQUENTIAL_KEYS
from cbcert.certify.smoothing import attack_name, of_space, smoothing
from cbcert.runs import attack as attack_runner
from cbcert.runs import certify as certify_runner
from cbcert.runs import classes as classes_runner
from cbcert.runs import explain as explain_runner
from cbcert.runs import explanations, peers, sessions
from cbcert.runs import perturb as perturb_runner
from cbcert.runs.config import ConfigError, ExperimentConfig
from cbcert.runs.directory import (
    MANIFEST,
    SUMMARY,
    RecordsError,
    RunMismatchError,
    check_writable,
    on_coordinator,
    read_json,
    write_json_once,
)
from cbcert.runs.lock import hold
from cbcert.runs.machine import git_revision, provenance, versions
from cbcert.runs.shards import (
    CellStatus,
    assign_shards,
    cell_cost,
    check_shard,
    select_cells,
    shard_cells,
    sweep_status,
)

SECTIONS = ("latent", "concept", "perturb", "attack", "classes", "explain")
# What a file naming no section sweeps (classes and explain came later: old sweeps keep their
# cells).
DEFAULT_SECTIONS = ("latent", "concept", "perturb", "attack")
# The runners' default models; the agreement set itself needs std and cbm.
EMPIRICAL_MODELS = ("std", "cbm", "proto")


@dataclass(frozen=True)
class Cell:
    """One runner invocation of a sweep.

    Attributes:
      name: directory under the sweep's output directory (``<world>/<cell>`` in a multi-world
        sweep).
      kind: which runner: ``certify``, ``perturb``, ``attack``, ``classes`` or ``explain``.
      job: the runner's settings (`CertifyJob`, `PerturbJob`, `AttackJob`, `ClassesJob`,
        `ExplainJob`).
      world: the world entry's name in a multi-world sweep, else None.
    """

    name: str
    kind: Literal["certify", "perturb", "attack", "classes", "explain"]
    job: Any
    world: str | None = None


def sections_in_file(path: str | Path) -> tuple[str, ...]:
    """Sections a YAML config asks to sweep: those it names, or `DEFAULT_SECTIONS` if it names
    none (a section named inside a ``worlds:`` entry counts too).

    A file with only a ``latent:`` section sweeps σ only, although the loaded config (filled
    from its preset) has every section.
    """
    data = yaml.safe_load(Path(path).read_bytes().decode("utf-8")) or {}
    if not isinstance(data, dict):
        return DEFAULT_SECTIONS
    entries = [w for w in data.get("worlds") or () if isinstance(w, dict)]
    named = tuple(s for s in SECTIONS if s in data or any(s in w for w in entries))
    return named or DEFAULT_SECTIONS


def plan_cells(config: ExperimentConfig,
               sections: Sequence[str] = DEFAULT_SECTIONS) -> tuple[Cell, ...]:
    """The cells of a sweep, in run order (latent, concept, perturb, attack, classes,
    explain); for a
    multi-world config, every world's cells in the order of ``worlds``, named
    ``<world>/<cell>``.

    Raises:
      ConfigError: ``sections`` names something other than `SECTIONS`, or a section of a
        world cannot run (named by world).
    """
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ConfigError(f"sections {unknown}: allowed {', '.join(SECTIONS)}")
    if config.worlds:
        cells = []
        for entry in config.worlds:
            try:
                own = plan_cells(config.for_world(entry), sections)
            except ConfigError as error:
                raise ConfigError(f"world {entry.name!r}: {error}") from None
            cells += [replace(c, name=f"{entry.name}/{c.name}", world=entry.name) for c in own]
        return tuple(cells)
    config.check_sections(tuple(sections))
    w = config.world
    cells: list[Cell] = []
    if "latent" in sections:
        c = config.latent
        for sigma in c.sigmas:
            job = certify_runner.CertifyJob(
                noise="gaussian", scale=sigma, n0=c.n0, n=c.n, alpha=c.alpha,
                two_class=c.two_class, models=c.models, seed=w.seed, num_inputs=w.num_inputs,
                **_schedule(c))
            cells.append(Cell(smoothing("gaussian").name(sigma), "certify", job))
    if "concept" in sections:
        c = config.concept
        common = dict(n0=c.n0, n=c.n, alpha=c.alpha, models=c.models, seed=w.seed,
                      num_inputs=w.num_inputs, two_class=c.two_class, **_schedule(c))
        for kind, scales in (("bernoulli", c.rhos), ("fixed", c.flips)):
            for scale in scales:
                job = certify_runner.CertifyJob(noise=kind, scale=scale, **common)
                cells.append(Cell(smoothing(kind).name(scale), "certify", job))
    if "perturb" in sections:
        p = config.perturb
        job = perturb_runner.PerturbJob(
            eps=p.eps, tau=p.tau, sigma=p.sigma, rho=p.rho, models=EMPIRICAL_MODELS,
            seed=w.seed, samples=p.samples,
            ball=p.ball, num_subsets=p.subsets, subset_size=p.subset_size,
            num_inputs=w.num_inputs, explain=p.explain)
        cells.append(Cell("perturb", "perturb", job))
    if "attack" in sections:
        taken = {cell.name for cell in cells}
        for i, attack in enumerate(config.attacks):
            cell = _attack_cell(config, attack)
            if cell.name in taken:
                raise ConfigError(f"section 'attack' (section {i}): cell {cell.name!r} is "
                                  "already taken by another cell; give this section a distinct "
                                  "'name'", key="name", value=cell.name)
            taken.add(cell.name)
            cells.append(cell)
    if "classes" in sections:
        job = classes_runner.ClassesJob(samples=config.classes.samples, seed=w.seed)
        cells.append(Cell("classes", "classes", job))
    if "explain" in sections:
        e = config.explain
        job = explain_runner.ExplainJob(
            models=e.models, num_inputs=e.inputs, eps=e.eps, tau=e.tau, sigma=e.sigma,
            radius=e.radius, n0=e.n0, n=e.n, alpha=e.alpha, top_k=e.top_k, seed=w.seed,
            figure_inputs=e.figure_inputs, rho=e.rho, flip_radius=e.flip_radius)
        cells.append(Cell("explain", "explain", job))
    return tuple(cells)


def _schedule(section) -> dict[str, Any]:
    """The certification schedule and subset settings of a latent or concept section."""
    return {**{key: getattr(section, key) for key in ("schedule", *SEQUENTIAL_KEYS)},
            "num_subsets": section.subsets, "subset_size": section.subset_size}


def _attack_cell(config: ExperimentConfig, a) -> Cell:
    """The cell of attack section ``a`` (an `AttackConfig` of ``config``)."""
    predict = getattr(config, a.space)  # the PREDICT n and α of the latent or concept section
    scale = getattr(a, of_space(a.space).key) if a.smoothed else None
    name = attack_name(a.space, scale) if a.name == "auto" else a.name
    job = attack_runner.AttackJob(
        space=a.space, eps=a.eps, norm=a.norm, iters=a.iters, restarts=a.restarts,
        smoothed=a.smoothed, scale=scale, eot=a.eot, n=predict.n, alpha=predict.alpha,
        models=EMPIRICAL_MODELS, seed=config.world.seed, num_inputs=a.inputs,
        explain=a.explain)
    return Cell(name, "attack", job)


def check_cells(cells: Sequence[Cell], world) -> None:
    """Raise ValueError naming the config key if a cell cannot run on ``world``.

    Checked before any cell runs, so a bad model name or τ > K fails in a second, not after
    an hour of earlier cells.
    """
    for cell in cells:
        if cell.kind == "classes":
            if world.embed is None:
                raise ConfigError(f"section 'classes': world {world.name} gives no classifier "
                                  "features (World.embed); drop the section for it")
            continue
        if cell.kind == "explain":
            try:
                world.check_models(cell.job.models)
                explain_runner.check(world, cell.job)
            except ValueError as error:
                raise ConfigError(f"section 'explain': {error}") from None
            continue
        section = "attack" if cell.kind == "attack" else cell.name.split("/")[-1].split("-")[0]
        try:
            world.check_models(cell.job.models)
        except ValueError as error:
            where = "key 'models'" if cell.kind == "certify" else f"models {cell.job.models}"
            raise ConfigError(f"section '{section}', {where}: {error}") from None
        if cell.kind == "perturb":
            try:
                perturb_runner.check_budgets(cell.job, world.generator.num_concepts)
            except ConfigError as error:
                raise ConfigError(f"section 'perturb', key '{error.key}': {error}") from None
        if cell.kind in ("perturb", "attack") and cell.job.explain:
            try:
                explanations.check(world, cell.job.models)
            except ConfigError as error:
                raise ConfigError(f"section '{section}', key 'explain': {error}") from None


def manifest(config: ExperimentConfig, cells: Sequence[Cell], world) -> dict[str, Any]:
    """The run manifest: resolved config, cells, seed, world, versions, devices, git revision.

    For a multi-world config ``world`` is ``{entry name: World}`` and the manifest's ``world``
    maps each entry to its world's name; ``worlds`` lists the entries in order.
    """
    import jax

    return {
        "config": config.to_dict(),
        "cells": [{"name": c.name, "kind": c.kind} for c in cells],
        "seed": config.world.seed,
        "world": ({name: w.name for name, w in world.items()} if isinstance(world, dict)
                  else world.name),
        **({"worlds": [{"name": e.name, "family": e.family} for e in config.worlds]}
           if config.worlds else {}),
        "versions": versions(),
        "devices": [str(d) for d in jax.devices()],
        "git_revision": git_revision(),
    }


# The manifest's keys a rerun (or another process of a multi-host job) must match.
PINNED = ("config", "cells", "world")


def _write_manifest(out: Path, meta: dict[str, Any]) -> None:
    """Write ``manifest.json``, or refuse if the one there describes another sweep.

    Written once (`write_json_once`): shards starting together never both write it. In a
    multi-host job process 0 does this and the others share its outcome.
    """
    on_coordinator(lambda: _pin_manifest(out, meta))


def _pin_manifest(out: Path, meta: dict[str, Any]) -> None:
    path = out / MANIFEST
    out.mkdir(parents=True, exist_ok=True)
    if write_json_once(path, meta):
        return
    previous = read_json(path)
    if not isinstance(previous, dict):
        raise RecordsError(f"{path}: damaged, expected a JSON object")
    if {k: previous.get(k) for k in PINNED} != {k: meta[k] for k in PINNED}:
        raise RunMismatchError(
            f"--out {out} holds a sweep of another config or world "
            f"({previous.get('config', {}).get('name')}); use another --out or delete it")


def run_sweep(
    config: ExperimentConfig,
    out: str | Path,
    *,
    sections: Sequence[str] = DEFAULT_SECTIONS,
    load_world: Callable[[str], Any],
    progress: Callable[[str], Callable[[int, int], None] | None] | None = None,
    on_cell: Callable[[Cell, Any], None] | None = None,
    shard: tuple[int, int] | None = None,
    only: Sequence[str] = (),
) -> dict[str, Any]:
    """Run every cell of ``config`` (or of one shard, or those ``only`` names) into
    ``<out>/<cell>/``; rerunning resumes.

    Args:
      config: the experiment.
      out: sweep directory (gets ``manifest.json`` and one directory per cell).
      sections: which sections to sweep (`sections_in_file` for a YAML file).
      load_world: ``preset -> World``, e.g. `cbcert.worlds.builtin.load_builtin`; injected so that
        tests can pass ``untrained_world`` (called once per world of a multi-world config,
        with its preset or directory).
      progress: ``cell name -> callback(done, total)`` (or None) for each cell's runner.
      on_cell: called with ``(cell, result)`` after each cell finishes, ``result`` the
        `RunSummary` the cell's runner returned (an explain cell's ``extras["figure"]`` is for
        the caller to draw).
      shard: ``(i, n)``: run only the cells `assign_shards` gives shard i of n, without
        locking ``out`` itself (each cell is locked by its runner), so that the other shards
        can run into the same ``out`` at the same time.
      only: shell-style patterns of cell names (`select_cells`): run only the matching cells
        (of the shard, with ``shard``), leaving the others as they are. The manifest is the
        whole sweep's, so a later run without ``only`` resumes into the same ``out``. Like a
        shard it does not lock ``out`` (each cell is locked by its runner): two selections
        may run into one ``out`` at once.

    Returns:
      ``{cell name: summary dict}`` of the cells run (each `RunSummary`'s ``summary``).

    Raises:
      ConfigError: a cell cannot run on the world (unknown model, τ > K).
      RunMismatchError: ``out`` holds another sweep or a cell directory other settings.
      RunLockedError: another process is running a sweep or cell in ``out``.
      SettingsMismatchError: in a multi-host job, processes disagree on the config, cells,
        worlds or shard (`cbcert.runs.peers`), or, at a cell, its settings or world.
    """
    out = Path(out)
    cells = plan_cells(config, sections)
    chosen = {c.name for c in select_cells(cells, only)}
    mine = [c for c in (cells if shard is None else shard_cells(cells, *shard))
            if c.name in chosen]
    entries = {e.name: config.for_world(e) for e in config.worlds}
    if entries:
        worlds = {name: load_world(c.world.preset) for name, c in entries.items()}
        for name, world in worlds.items():
            try:
                check_cells([c for c in cells if c.world == name], world)
            except ConfigError as error:
                raise ConfigError(f"world {name!r}: {error}") from None
    else:
        worlds = {None: load_world(config.world.preset)}
        check_cells(cells, worlds[None])
    check_writable(out)
    with hold(out) if shard is None and not only else contextlib.nullcontext():
        meta = manifest(config, cells, worlds if entries else worlds[None])
        # A multi-host job: every process sweeps the same cells (each cell's runner then
        # checks its own settings and world before sampling).
        peers.check({"sweep": {k: meta[k] for k in PINNED}, "shard": shard,
                     "only": list(only)})
        _write_manifest(out, meta)
        for name, own in entries.items():
            own_cells = [replace(c, name=c.name.split("/", 1)[1], world=None)
                         for c in cells if c.world == name]
            _write_manifest(out / name, manifest(own, own_cells, worlds[name]))
        summaries = {}
        sessions.log(out, "start", **provenance(),
                     shard=list(shard) if shard else None, cells=len(mine),
                     **({"only": list(only)} if only else {}))
        try:
            for cell in mine:
                callback = progress(cell.name) if progress else None
                run_cell = {"certify": certify_runner.run, "perturb": perturb_runner.run,
                            "attack": attack_runner.run, "classes": classes_runner.run,
                            "explain": explain_runner.run}[cell.kind]
                # A cell this call works on (not one finished before) logs its wall time.
                with sessions.timed(out, cell.name, not (out / cell.name / SUMMARY).is_file()):
                    result = run_cell(worlds[cell.world], cell.job, out / cell.name,
                                      progress=callback)
                summaries[cell.name] = result.summary
                if on_cell:
                    on_cell(cell, result)
        except BaseException as err:  # Ctrl-C too: log what this session finished, then raise
            sessions.log(out, "stopped", reason=type(err).__name__, finished=list(summaries))
            raise
        sessions.log(out, "end", finished=list(summaries))
        return summaries


__all__ = [
    "DEFAULT_SECTIONS", "PINNED", "SECTIONS", "Cell", "CellStatus", "assign_shards",
    "cell_cost", "check_cells",
    "check_shard", "git_revision", "manifest", "plan_cells", "run_sweep", "sections_in_file",
    "select_cells", "shard_cells", "sweep_status",
]
