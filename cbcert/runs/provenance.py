"""Who wrote each cell: the sessions a cell's ``run.json`` lists, and what an older run's
``sessions.jsonl`` tells.

Each process that writes records into a run directory appends one entry to the ``"sessions"``
list of its ``run.json`` (`stamp`, called by `cbcert.runs.session.Session` before the first
record it writes): UTC ``time``, ``git_revision``, ``versions`` and ``machine`` (what a sweep's
``sessions.jsonl`` start line records: `cbcert.runs.machine.provenance`) and
``records_before``, the complete record lines the directory's JSONL files held when it began.
A resume keeps the list and appends; `cbcert.runs.directory.open_run` compares only the
settings, never this list. A rerun that writes no record (a finished cell) adds nothing.

`cell_provenance` reads a cell's writers back for the report: from the list when its first entry
found no record (source ``run.json``); otherwise — a run written before the list existed, or
whose first records came from such a run — from its sweep's ``sessions.jsonl`` where the log
allows (`derive`, source ``sessions.jsonl``), else unknown, saying why.

Size: the run.json list and the whole derivation from an older run's log in one place, each
rule of `derive` one small function.
"""

from __future__ import annotations

import datetime
import fnmatch
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbcert.runs import machine, sessions
from cbcert.runs.directory import MANIFEST, RUN, RecordsError, is_writer, read_json, write_json

SESSIONS_KEY = "sessions"  # run.json's list of the sessions that wrote records
# The log's times are whole seconds and a cell line's seconds tenths: times this close agree.
SLACK = 2.0


def record_lines(out: Path) -> int:
    """Complete record lines (a torn last line is not one) in the ``*.jsonl`` files of ``out``."""
    return sum(path.read_bytes().count(b"\n") for path in Path(out).glob("*.jsonl"))


def stamp(out: Path) -> None:
    """Append this process's entry (module docstring) to ``out/run.json``'s ``"sessions"``.

    Called once per session, under the run's lock, before its first record: the entry is there
    even if the process is killed after writing. Atomic like every ``run.json`` write
    (`cbcert.runs.directory.write_json`); nothing off process 0 of a multi-host job.

    Raises:
      RecordsError: ``run.json`` is damaged or its ``"sessions"`` is not a list.
    """
    if not is_writer():
        return
    run_file = Path(out) / RUN
    run = read_json(run_file)
    listed = run.get(SESSIONS_KEY, []) if isinstance(run, dict) else None
    if not isinstance(listed, list):
        raise RecordsError(f"{run_file}: damaged, expected an object whose {SESSIONS_KEY!r} is "
                           "a list; delete the directory or use another --out")
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    entry = {"time": now, **machine.provenance(), "records_before": record_lines(out)}
    write_json(run_file, {**run, SESSIONS_KEY: [*listed, entry]})


def machine_label(description: Any) -> str:
    """``"CPU model (ISA flags)"`` of a `cbcert.runs.machine.describe` mapping (``?`` where
    absent): two sessions ran on the same kind of machine when their labels are equal."""
    m = description if isinstance(description, dict) else {}
    isa = m.get("isa") if isinstance(m.get("isa"), list) else []
    return f"{m.get('cpu', '?')} ({' '.join(map(str, isa)) or 'no ISA flags read'})"


Writer = tuple[str | None, str]  # (git revision, `machine_label`)


@dataclass(frozen=True)
class CellProvenance:
    """Who wrote a cell's records.

    Attributes:
      sessions: how many sessions are known to have written into it (None: none known).
      writers: each known session's ``(git revision, machine label)``, in order.
      complete: whether every session that wrote into it is known.
      source: ``run.json``, ``sessions.jsonl``, ``run.json + sessions.jsonl`` or ``unknown``.
      note: why the writers are not all known ("" when they are).
    """

    sessions: int | None
    writers: tuple[Writer, ...]
    complete: bool
    source: str
    note: str = ""

    @property
    def revisions(self) -> tuple[str | None, ...]:
        """The known writers' revisions, each once, in order."""
        return tuple(dict.fromkeys(r for r, _ in self.writers))

    @property
    def machines(self) -> tuple[str, ...]:
        """The known writers' machine labels, each once, in order."""
        return tuple(dict.fromkeys(m for _, m in self.writers))

    @property
    def mixed(self) -> str:
        """``yes``: written by more than one revision or machine; ``no``: by one, every writer
        known; ``unknown``: the known writers agree but others may have written."""
        if len(self.revisions) > 1 or len(self.machines) > 1:
            return "yes"
        return "no" if self.complete and self.writers else "unknown"


def _writer(entry: dict) -> Writer:
    revision = entry.get("git_revision")
    return (None if revision is None else str(revision), machine_label(entry.get("machine")))


def listed_sessions(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``"sessions"`` entries of a parsed ``run.json`` ([] if it has none).

    Raises ValueError if it is not a list of objects."""
    listed = run.get(SESSIONS_KEY, [])
    if not (isinstance(listed, list) and all(isinstance(e, dict) for e in listed)):
        raise ValueError(f"run.json's {SESSIONS_KEY!r} must be a list of objects")
    return listed


def _when(text: Any) -> float | None:
    """Seconds since the epoch of an ISO 8601 time, None if it is not one."""
    try:
        moment = datetime.datetime.fromisoformat(str(text))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def cell_provenance(path: Path | None, run: dict[str, Any]) -> CellProvenance:
    """The writers of the cell in directory ``path`` whose parsed ``run.json`` is ``run``.

    From ``run.json``'s list when its first session found no record. Otherwise the sessions
    that wrote before the list's first come from the ``sessions.jsonl`` of the cell's sweep
    (the directory above ``path``, or the one above that for a world's cell; `derive`).
    Raises ValueError for a malformed list.
    """
    listed = listed_sessions(run)
    writers = tuple(_writer(e) for e in listed)
    if listed and listed[0].get("records_before") == 0:
        return CellProvenance(len(listed), writers, True, "run.json")
    derived = _derived(Path(path)) if path is not None else None
    if derived is None:
        note = (f"{listed[0].get('records_before')} record lines predate the first session it "
                "lists" if listed else "run.json lists no session")
        return CellProvenance(len(listed) or None, writers, False,
                              "run.json" if listed else "unknown",
                              f"{note}, and no sessions.jsonl has a cell line for it")
    first = (_when(listed[0].get("time")) if listed else None) or math.inf
    earlier = tuple(w for w, end in zip(derived.writers, derived.ends, strict=True)
                    if end < first)
    known = earlier + writers
    note = derived.note
    if listed and not earlier:
        note = "; ".join(filter(None, [note, "no cell line before the first session it lists"]))
    return CellProvenance(len(known) or None, known, not note,
                          "run.json + sessions.jsonl" if listed else "sessions.jsonl", note)


def _derived(path: Path) -> Derived | None:
    """The derivation for the cell in ``path`` from the nearest sweep log above it that has a
    line for it (its name there: ``cell``, or ``world/cell`` for a world's cell), None if none
    has."""
    for log_dir, name in ((path.parent, path.name),
                          (path.parent.parent, f"{path.parent.name}/{path.name}")):
        if (log_dir / sessions.SESSIONS).is_file():
            found = derive(log_dir).get(name)
            if found is not None:
                return found
    return None


def _stat(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
    except OSError:
        return -1, -1
    return stat.st_mtime_ns, stat.st_size


@dataclass(frozen=True)
class Derived:
    """What ``sessions.jsonl`` tells of one cell (`derive`).

    Attributes:
      writers: the writer of each of its cell lines that one revision and machine explain.
      ends: when each of those lines was logged (seconds since the epoch).
      complete: every session that wrote into it is among ``writers``.
      note: why not ("" when complete).
    """

    writers: tuple[Writer, ...]
    ends: tuple[float, ...]
    complete: bool
    note: str


@dataclass
class _Session:
    """A start line of the log and what the log tells of its life."""

    line: int
    start: float
    writer: Writer
    selection: tuple[str, ...] | None  # its cells in plan order; None where unknown (a shard)
    closing: int | None = None  # the line of its end or stopped line
    finished: tuple[str, ...] = ()
    stopped: bool = False
    end: float = math.inf
    superseded: float = math.inf
    position: dict[str, int] = field(default_factory=dict)

    def selects(self, cell: str) -> bool:
        """Whether it may have worked on ``cell``: one of its cells, and no further than the
        cell it stopped in."""
        if self.selection is None:
            return True
        where = self.position.get(cell)
        return where is not None and not (self.stopped and where > len(self.finished))

    def before(self, cell: str) -> Sequence[str]:
        """The cells it visits before ``cell`` (none where its order is unknown)."""
        return () if self.selection is None else self.selection[: self.position[cell]]


@dataclass(frozen=True)
class _Stint:
    """One cell line: a session's work on ``cell``, logged at ``end``."""

    cell: str
    end: float
    done: bool
    writer: Writer | None  # None: no single revision and machine explains it


def derive(log_dir: Path) -> dict[str, Derived]:
    """Each cell's writers as far as ``log_dir/sessions.jsonl`` (`cbcert.runs.sessions`) and
    ``log_dir/manifest.json`` tell, by cell name: for runs whose ``run.json`` lists no session.

    A ``"cell"`` line is one session's work on a cell (its ``seconds`` up to its time), but
    the line does not name the session; it is given to the start lines that can have written
    it, and read as one writer where they share one revision and machine. Rules:

    * a start line's cells are the manifest's cells its ``only`` patterns match, in plan order
      (every cell for a shard, whose cells the log does not give); a start line whose cell
      count is not that number belongs to a sweep of another directory (a sweep directory
      refuses another config), whose lines were copied in: it is left out;
    * an ``end`` or ``stopped`` line closes the session whose cells begin with its
      ``finished`` cells (``end``: all of them; ``stopped``: it was in the next one); if
      several such sessions differ in revision or machine, those a later session has
      superseded (next rule) are left out, and if they still differ none is closed;
    * a session with no closing line (killed outright) is taken to have ended when a later
      session at another revision started on any of its cells: every session of the paper run
      that did log its end obeys this;
    * a cell line's candidates started before its work began, had not closed or ended, select
      its cell, and could reach it: every cell they visit first had a ``summary.json`` by then
      (a cell line shows that its cell had none when its work began, a ``stopped`` one until
      it ended);
    * a revision is known to log cell lines once one of its sessions is the only explanation
      of a line. A session at another revision (older cbcert logged none) that selects a cell,
      started before the cell's ``done`` line and could reach it may have written into it
      unseen: the cell's writers are then incomplete, and so are those of a cell with no
      ``done`` line or with a line no one revision and machine explains.

    A cell with no line is absent. A session killed outright leaves no line for the cell it
    was in; that work is not seen.
    """
    log_dir = Path(log_dir)
    return _derive_cached(str(log_dir), *_stat(log_dir / sessions.SESSIONS),
                          *_stat(log_dir / MANIFEST))


# Keyed by the log's and the manifest's modification time and size: a report reads one log
# once per cell table (every world's cells, each cell alone when checked), not once per cell.
@functools.lru_cache(maxsize=8)
def _derive_cached(log_dir: str, *stamps: int) -> dict[str, Derived]:
    log = sessions.entries(Path(log_dir), None)
    order = _plan(Path(log_dir))
    runs = _sessions(log, order)
    _close(runs, log)
    return _cells(runs, *_stints(runs, log))


def _plan(log_dir: Path) -> list[str] | None:
    """The manifest's cell names in plan order, None without a readable manifest."""
    path = log_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = read_json(path)
    except RecordsError:
        return None
    cells = manifest.get("cells") if isinstance(manifest, dict) else None
    if not isinstance(cells, list):
        return None
    return [str(c["name"]) for c in cells if isinstance(c, dict) and "name" in c]


def _sessions(log: list[dict], order: list[str] | None) -> list[_Session]:
    runs = []
    for line, entry in enumerate(log):
        start = _when(entry.get("time"))
        if entry.get("event") != "start" or start is None:
            continue
        selection = None
        if order is not None and not entry.get("shard"):
            patterns = entry.get("only") or []
            selection = tuple(c for c in order if not patterns or any(
                fnmatch.fnmatchcase(c, str(p)) for p in patterns))
            if len(selection) != entry.get("cells"):
                continue  # another directory's sweep (module docstring)
        run = _Session(line, start, _writer(entry), selection)
        run.position = {c: i for i, c in enumerate(selection or ())}
        runs.append(run)
    for run in runs:
        run.superseded = min((o.start for o in runs if o.start > run.start
                              and o.writer[0] != run.writer[0] and _overlap(run, o)),
                             default=math.inf)
    return runs


def _overlap(a: _Session, b: _Session) -> bool:
    """Whether two sessions share a cell (unknown, so not assumed, where either is a shard)."""
    return a.selection is not None and b.selection is not None and not set(
        a.selection).isdisjoint(b.selection)


def _close(runs: list[_Session], log: list[dict]) -> None:
    """Give each ``end`` or ``stopped`` line to the session it closes (`derive`'s rules)."""
    for line, entry in enumerate(log):
        when = _when(entry.get("time"))
        if entry.get("event") not in ("end", "stopped") or when is None:
            continue
        finished = tuple(map(str, entry.get("finished") or ()))
        stopped = entry["event"] == "stopped"
        candidates = [r for r in runs if r.closing is None and r.line < line
                      and _closes(r, finished, stopped)]
        if len({r.writer for r in candidates}) > 1:
            candidates = [r for r in candidates if when <= r.superseded + SLACK]
        if not candidates or len({r.writer for r in candidates}) > 1:
            continue
        run = candidates[0]
        run.closing, run.finished, run.stopped, run.end = line, finished, stopped, when
    for run in runs:
        if run.closing is None:
            run.end = run.superseded


def _closes(run: _Session, finished: tuple[str, ...], stopped: bool) -> bool:
    """Whether a closing line with these ``finished`` cells can be ``run``'s: they are the
    first of its cells (all of them for an ``end`` line)."""
    if run.selection is None:
        return True
    if finished != run.selection[: len(finished)]:
        return False
    return len(finished) < len(run.selection) if stopped else len(finished) == len(
        run.selection)


def _stints(runs: list[_Session], log: list[dict]) -> tuple[list[_Stint], dict[str, float]]:
    """Every cell line with the one writer that explains it, if one does; and until when each
    cell is known to have had no ``summary.json``."""
    lines = []
    for line, entry in enumerate(log):
        end = _when(entry.get("time"))
        seconds = entry.get("seconds")
        if entry.get("event") != "cell" or end is None or not isinstance(seconds, (int, float)):
            continue
        lines.append((line, str(entry.get("cell")), end - seconds, end,
                      entry.get("state") == "done"))
    absent: dict[str, float] = {}
    for _, cell, begin, end, done in lines:
        absent[cell] = max(absent.get(cell, -math.inf), begin if done else end)
    stints = []
    for line, cell, begin, end, done in lines:
        candidates = [r for r in runs if r.line < line and r.start <= begin + SLACK
                      and r.selects(cell)
                      and (r.closing > line if r.closing is not None else r.end >= end - SLACK)
                      and _reaches(r, cell, begin + SLACK, absent)]
        writers = {r.writer for r in candidates}
        stints.append(_Stint(cell, end, done, writers.pop() if len(writers) == 1 else None))
    return stints, absent


def _reaches(run: _Session, cell: str, by: float, absent: dict[str, float]) -> bool:
    """Whether ``run`` can have been at ``cell`` before ``by``: every cell it visits first had
    its summary by then."""
    return all(absent.get(c, -math.inf) < by for c in run.before(cell))


def _cells(runs: list[_Session], stints: list[_Stint],
           absent: dict[str, float]) -> dict[str, Derived]:
    """Each cell's `Derived` from its stints (`derive`'s last rule)."""
    logging = {s.writer[0] for s in stints if s.writer is not None}
    found: dict[str, Derived] = {}
    for cell in dict.fromkeys(s.cell for s in stints):
        own = [s for s in stints if s.cell == cell]
        known = [s for s in own if s.writer is not None]
        notes = []
        if len(own) > len(known):
            notes.append(f"{len(own) - len(known)} of its {len(own)} cell lines fit sessions of "
                         "several revisions or machines, or none")
        done = [s.end for s in own if s.done]
        if not done:
            notes.append("no cell line says it finished")
        else:
            unseen = [r for r in runs if r.writer[0] not in logging and r.selects(cell)
                      and r.start < done[0] and _reaches(r, cell, min(done[0], r.end), absent)]
            if unseen:
                shown = ", ".join(dict.fromkeys(str(r.writer[0])[:7] for r in unseen))
                notes.append(f"sessions that logged no cell line (revisions {shown}) may have "
                             "written into it")
        found[cell] = Derived(tuple(s.writer for s in known), tuple(s.end for s in known),
                              not notes, "; ".join(notes))
    return found


__all__ = ["SESSIONS_KEY", "CellProvenance", "Derived", "cell_provenance", "derive",
           "listed_sessions", "machine_label", "record_lines", "stamp"]
