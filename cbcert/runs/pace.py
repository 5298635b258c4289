"""How long a sweep's unfinished cells will take, priced from what its finished cells took.

A finished cell's wall time (`measured_seconds`):

* certification and attack cells: the sum of their records' ``seconds`` (a certification
  record's is its input's share of the chunk, the same on each model's record, so the sum over
  records is divided by the number of models; an attack record's is its unit's share of the
  run's wall time). The records hold every session's work, whatever revision wrote them.
* perturbation, class-distance and explain cells, whose records carry no time: the ``"cell"``
  lines of ``sessions.jsonl`` (`cbcert.runs.sessions`), which `cbcert.runs.sweep.run_sweep`
  appends when it finishes (``state: done``) or leaves (``state: stopped``) a cell, summed; a
  cell finished before the sweep logged them (or by a runner outside the sweep) is unmeasured.

`time_left` prices each unfinished cell with `cell_cost` at the pace (seconds per unit of cost)
that cells of its kind took, the median over the finished ones (over every measured finished
cell while none of its kind has finished), less the share of an interrupted certification or
attack cell its records already cover. It is one process's work: two selections or shards at
once share the machine (docs/commands.md measures what that gains).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cbcert.runs import sessions
from cbcert.runs.directory import RECORDS, RUN, SUMMARY
from cbcert.runs.shards import cell_cost

_SECONDS = re.compile(rb'"seconds": ([-+0-9.eE]+)')
# Kinds whose records time themselves (one ``seconds`` field per record).
TIMED_RECORDS = ("certify", "attack")


def cell_lines(out: str | Path) -> dict[str, list[dict]]:
    """The ``"cell"`` lines of ``out/sessions.jsonl`` (`cbcert.runs.sessions.entries`) by cell
    name, in order ({} without a log)."""
    found: dict[str, list[dict]] = {}
    for entry in sessions.entries(Path(out), "cell"):
        if "cell" in entry:
            found.setdefault(str(entry["cell"]), []).append(entry)
    return found


def _record_seconds(kind: str, models: int, where: Path) -> tuple[float, int]:
    """(seconds of work, work units done) from a certify/attack cell's records: units are
    inputs for certification (records / models) and records for attacks."""
    path = where / RECORDS
    if not path.is_file():
        return 0.0, 0
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # a torn last line is not a record
    seconds = sum(float(m) for m in _SECONDS.findall(complete))
    lines = complete.count(b"\n")
    if kind == "certify":
        return seconds / models, lines // models
    return seconds, lines


def cell_seconds(where: Path, kind: str, models: int, lines: Sequence[dict]) -> float | None:
    """Wall time of the finished cell in directory ``where`` (module docstring), or None where
    it was not measured: ``kind`` is the cell's runner, ``models`` its number of models and
    ``lines`` its ``"cell"`` lines (`cell_lines`)."""
    if kind in TIMED_RECORDS:
        seconds, units = _record_seconds(kind, max(1, models), Path(where))
        return seconds if units else None
    if not any(entry.get("state") == "done" for entry in lines):
        return None
    return float(sum(entry.get("seconds", 0.0) for entry in lines))


def _units(cell) -> int:
    """Work units of a whole certify (inputs) or attack (inputs × models × ε) cell."""
    job = cell.job
    if cell.kind == "certify":
        return job.num_inputs
    return job.num_inputs * len(job.models) * len(job.eps)


def measured_seconds(out: str | Path, cell, lines: dict[str, list[dict]] | None = None
                     ) -> float | None:
    """Wall time a finished cell took (module docstring), or None where it was not measured.

    Args:
      out: the sweep directory; the cell's directory is ``out/<cell.name>``.
      cell: a `cbcert.runs.sweep.Cell`.
      lines: `cell_lines` of ``out`` (read here if None).
    """
    lines = cell_lines(out) if lines is None else lines
    return cell_seconds(Path(out) / cell.name, cell.kind, len(getattr(cell.job, "models", ())),
                        lines.get(cell.name, []))


def done_fraction(out: str | Path, cell) -> float:
    """Share of an unfinished cell's work its records hold: certify and attack cells (records
    over the whole cell's units, at most 1); 0 for the other kinds (priced whole)."""
    if cell.kind not in TIMED_RECORDS:
        return 0.0
    _, units = _record_seconds(cell.kind, len(cell.job.models), Path(out) / cell.name)
    return min(1.0, units / max(1, _units(cell)))


@dataclass(frozen=True)
class TimeLeft:
    """`time_left`'s estimate.

    Attributes:
      seconds: estimated seconds of one process's work for the unfinished cells (0 when none
        is left), or None when no finished cell has a measured time yet.
      unfinished: cells priced.
      measured: finished cells whose times set the pace.
      pace: seconds per unit of `cell_cost` by kind (each kind's median over its measured
        finished cells; kinds without one are absent).
    """

    seconds: float | None
    unfinished: int
    measured: int
    pace: dict[str, float]


def time_left(out: str | Path, cells: Sequence, finished: Iterable[str],
              priced: Iterable[str] | None = None) -> TimeLeft:
    """Estimated work left in ``cells`` of the sweep in ``out`` (module docstring).

    ``seconds = Σ_unfinished cell_cost(c) · pace[kind(c)] · (1 − done_fraction(c))`` with
    ``pace[k] = median_{finished measured c of kind k} measured_seconds(c) / cell_cost(c)``,
    or the median over every measured finished cell for a kind with none.

    Args:
      out: the sweep directory.
      cells: the sweep's cells (`cbcert.runs.sweep.Cell`); its finished ones set the pace.
      finished: the names of those already done (``summary.json`` exists), e.g. from
        `cbcert.runs.shards.sweep_status`.
      priced: the names of the cells to price (e.g. one shard's or a ``--cells`` selection);
        None: all of ``cells``. Finished ones among them cost nothing.
    """
    out = Path(out)
    finished = set(finished)
    lines = cell_lines(out)
    ratios: dict[str, list[float]] = {}
    for cell in cells:
        if cell.name in finished:
            seconds = measured_seconds(out, cell, lines)
            if seconds is not None and cell_cost(cell) > 0:
                ratios.setdefault(cell.kind, []).append(seconds / cell_cost(cell))
    pace = {kind: statistics.median(values) for kind, values in ratios.items()}
    measured = sum(len(v) for v in ratios.values())
    priced = None if priced is None else set(priced)
    unfinished = [c for c in cells
                  if c.name not in finished and (priced is None or c.name in priced)]
    if not unfinished:
        return TimeLeft(0.0, 0, measured, pace)
    if not measured:
        return TimeLeft(None, len(unfinished), 0, pace)
    overall = statistics.median([r for values in ratios.values() for r in values])
    seconds = sum(cell_cost(c) * pace.get(c.kind, overall) * (1.0 - done_fraction(out, c))
                  for c in unfinished)
    return TimeLeft(seconds, len(unfinished), measured, pace)


def finished_wall_time(out: str | Path, cells: Iterable[tuple[str, str]]
                       ) -> tuple[float, int, int]:
    """``(seconds, measured, unmeasured)``: the summed wall time of the finished cells among
    ``cells`` (``(name, kind)`` pairs, e.g. a sweep manifest's; finished = ``summary.json``
    exists), how many of them were measured and how many were not (`cell_seconds`; a cell's
    number of models is read from its ``run.json``)."""
    out = Path(out)
    lines = cell_lines(out)
    total, measured, unmeasured = 0.0, 0, 0
    for name, kind in cells:
        where = out / name
        if not (where / SUMMARY).is_file():
            continue
        try:
            models = len(json.loads((where / RUN).read_text())["job"]["models"])
        except (OSError, ValueError, KeyError, TypeError):
            models = 0
        seconds = cell_seconds(where, kind, models, lines.get(name, [])) if (
            models or kind not in TIMED_RECORDS) else None
        if seconds is None:
            unmeasured += 1
        else:
            total, measured = total + seconds, measured + 1
    return total, measured, unmeasured


def duration(seconds: float) -> str:
    """A duration for people: ``'23 h 10 min'``, ``'7 min'``, ``'40 s'``."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration of {seconds!r} seconds")
    if seconds < 60:
        return f"{round(seconds)} s"
    minutes = round(seconds / 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min"


__all__ = ["TIMED_RECORDS", "TimeLeft", "cell_lines", "cell_seconds", "done_fraction",
           "duration", "finished_wall_time", "measured_seconds", "time_left"]
