"""Shards and status of a sweep: cell costs, the deterministic shard assignment, cell states.

Shards (``certify sweep --shard I/N``, for machines that share a filesystem but no JAX job):
`assign_shards` deals the cells to N shards by their `cell_cost` (largest first, each to the
least loaded shard), the same way on every machine. `sweep_status` lists every cell as done
(``summary.json``), running (its lock is held) or missing. Cell names may hold a world
directory (``similar5/latent-sigma0.1``) in a multi-world sweep; costs and states do not care.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cbcert.runs.directory import LOCK, SUMMARY
from cbcert.runs.lock import lock_holder
from cbcert.schema import ConfigError

# What one APGD step costs in batched forward passes: a forward and a backward pass (≈ 3
# passes) on the attack's small batches, through a host loop, run at about a third of the
# per-sample speed of the certification's large batches. Measured on the committed paper run
# (`results/paper/default`, 2-core Intel VM): a certification cell took a median 660 s, a
# vanilla attack cell 250 s and the smoothed latent attack 2.8 s per record
# (`tests/test_runs_sweep.py` checks the costs against those times).
APGD_STEP_PASSES = 9


def cell_cost(cell) -> float:
    """Estimated work of a cell in network passes (generator + one classifier per model).

    Certification: inputs × (n0 + n) noisy samples, each through the generator and the H
    models (``(1 + H)`` passes). Perturbation: inputs × samples × budgets perturbed images plus
    the clean ones, ``(1 + H)`` passes each. Explain: inputs × (n0 + n sign samples, three
    views, k + 1 edits per model), ``(1 + H)`` passes. Attack: per input, model and ε,
    restarts × iters APGD steps through generator and model (`APGD_STEP_PASSES` each), times
    ``eot`` when smoothed, plus PREDICT's n samples at the clean and adversarial points. Only
    the ratios between cells matter (`assign_shards`).
    """
    job = cell.job
    if cell.kind == "classes":
        return float(job.samples * 2)  # generator and backbone once per sample
    if cell.kind == "explain":  # sign samples, 3 clean/perturbed views, (k + 1) edits per model
        return float(job.num_inputs * (job.n0 + job.n + 3 + len(job.models) * (job.top_k + 1))
                     * (1 + len(job.models)))
    heads = len(job.models)
    if cell.kind == "certify":
        samples = job.n + (job.n0 if job.mode == "certify" else 0)
        return float(job.num_inputs * samples * (1 + heads))
    if cell.kind == "perturb":
        images = job.num_inputs * (job.samples * len(job.budgets) + 2)
        return float(images * (1 + heads))
    steps = job.restarts * job.iters * APGD_STEP_PASSES * 2 * (job.eot if job.smoothed else 1)
    predict = 2 * job.n * 2 if job.smoothed else 2
    return float(job.num_inputs * len(job.eps) * heads * (steps + predict))


def check_shard(index: int, count: int) -> None:
    """Raise `ConfigError` (key ``shard``) unless ``0 <= index < count``."""
    if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count):
        detail = f"got {index}/{count}; give I/N with N >= 1 and 0 <= I < N"
        raise ConfigError(f"shard={index}/{count}: {detail}", key="shard",
                          value=(index, count), detail=detail)


def assign_shards(cells: Sequence, count: int) -> tuple[int, ...]:
    """The shard of every cell: largest `cell_cost` first, each to the least loaded shard.

    Deterministic (ties go to the earlier cell and the lower shard), so every machine computes
    the same assignment from the same config; every cell gets exactly one shard, and no shard
    exceeds the average load by more than the largest cell's cost (greedy LPT scheduling).
    """
    check_shard(0, count)
    costs = [cell_cost(cell) for cell in cells]
    loads = [0.0] * count
    shards = [0] * len(cells)
    for i in sorted(range(len(cells)), key=lambda i: (-costs[i], i)):
        shards[i] = min(range(count), key=lambda s: (loads[s], s))
        loads[shards[i]] += costs[i]
    return tuple(shards)


def shard_cells(cells: Sequence, index: int, count: int) -> tuple:
    """The cells of shard ``index`` of ``count``, in plan order."""
    check_shard(index, count)
    return tuple(c for c, s in zip(cells, assign_shards(cells, count), strict=True) if s == index)


def select_cells(cells: Sequence, patterns: Sequence[str]) -> tuple:
    """The cells whose name matches any of the shell-style ``patterns`` (``*``, ``?``, ``[…]``,
    case-sensitive, `fnmatch.fnmatchcase`), in plan order: ``saturated/*`` is one world of a
    multi-world sweep, ``*/attack-*`` every world's attacks. No pattern: every cell.

    Raises `ConfigError` (key ``cells``) naming a pattern that matches no cell, with some of
    the names it could have matched.
    """
    if not patterns:
        return tuple(cells)
    names = [c.name for c in cells]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            shown = ", ".join(names[:6]) + (f", … ({len(names)} cells)" if len(names) > 6 else "")
            detail = f"matches no cell of this sweep; its cells are {shown}"
            raise ConfigError(f"cells={pattern!r}: {detail}", key="cells", value=pattern,
                              detail=detail)
    return tuple(c for c in cells if any(fnmatch.fnmatchcase(c.name, p) for p in patterns))


@dataclass(frozen=True)
class CellStatus:
    """Where a cell of a sweep stands (`sweep_status`).

    Attributes:
      name: the cell's directory name.
      state: ``done`` (its ``summary.json`` exists), ``running`` (a process holds its lock)
        or ``missing`` (neither: not started, or interrupted).
      detail: who runs it (host, pid, since), or how many records an interrupted cell has.
      shard: its shard when the status was asked for N shards, else None.
    """

    name: str
    state: Literal["done", "running", "missing"]
    detail: str
    shard: int | None = None


def sweep_status(out: str | Path, cells: Sequence,
                 shards: int | None = None) -> tuple[CellStatus, ...]:
    """The state of every cell of a sweep in ``out``, read from its cell directories.

    Reads only: ``summary.json``, the cell's lock (probed with `lock_holder`, so a lock file
    left by a killed run counts as not held) and the number of JSONL record lines.
    """
    out = Path(out)
    assigned = assign_shards(cells, shards) if shards else (None,) * len(cells)
    result = []
    for cell, shard in zip(cells, assigned, strict=True):
        where = out / cell.name
        holder = lock_holder(where, LOCK)
        if holder is not None:
            detail = ", ".join(f"{k} {holder[k]}" for k in ("host", "pid", "started")
                               if k in holder) or str(holder.get("holder", "unknown holder"))
            result.append(CellStatus(cell.name, "running", detail, shard))
        elif (where / SUMMARY).is_file():
            result.append(CellStatus(cell.name, "done", "", shard))
        else:
            lines = sum(path.read_bytes().count(b"\n") for path in where.glob("*.jsonl"))
            detail = f"interrupted, {lines} records" if lines else (
                "started, no records yet" if where.is_dir() else "not started")
            result.append(CellStatus(cell.name, "missing", detail, shard))
    return tuple(result)


__all__ = ["APGD_STEP_PASSES", "CellStatus", "assign_shards", "cell_cost", "check_shard",
           "select_cells", "shard_cells", "sweep_status"]
