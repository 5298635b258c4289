"""The loop every runner shares on its output directory: check, lock, pin, append, summarise.

``with session(out, kind, meta, world) as run:`` checks that ``out`` is writable (before any
work), holds its lock (`cbcert.runs.lock.hold`) for the whole block and pins ``meta`` with
``"kind"`` in ``run.json`` (`cbcert.runs.directory.open_run_dir`: a rerun with other settings is
refused). Inside, ``run.path(name)`` is a file of the run, ``run.append(name)`` the sink for its
records, and ``run.finish(summary, pool)`` writes ``summary.json`` (with the pool's size) and
returns the `RunSummary` every runner returns. How a runner reads and checks its records (their
key, their fields) and what it measures stays its own.

Before the first record a session writes, ``run.json``'s ``"sessions"`` gets its entry (revision,
machine, versions, records already there: `cbcert.runs.provenance.stamp`): the sinks of
``run.append`` see to it, and a runner that writes its records otherwise calls
``run.writing()`` first. A session that writes nothing (a finished run re-summarised) adds none.

Separate from `cbcert.runs.directory`, which holds the contract itself (file names, kinds, the
summary type), because the lock module builds on that one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbcert.runs.directory import (
    RECORDS,
    SUMMARY,
    Kind,
    RunSummary,
    append_records,
    check_writable,
    open_run_dir,
    write_json,
)
from cbcert.runs.lock import hold
from cbcert.runs.provenance import stamp


@dataclass
class Session:
    """A runner's open, locked and pinned directory ``out`` (see `session`)."""

    out: Path
    kind: Kind
    _stamped: bool = field(default=False, init=False, repr=False)

    def path(self, name: str = RECORDS) -> Path:
        """A file of the run (the records file by default)."""
        return self.out / name

    @contextlib.contextmanager
    def append(self, name: str = RECORDS) -> Iterator[Any]:
        """The text sink appending records to ``name`` (nothing off process 0 of a multi-host
        job: `cbcert.runs.directory.append_records`); `writing` before its first text."""
        with append_records(self.path(name)) as sink:
            yield _Stamping(sink, self)

    def writing(self) -> None:
        """Append this session to ``run.json``'s ``"sessions"`` (`cbcert.runs.provenance.stamp`)
        unless done already: called before each write of a record."""
        if not self._stamped:
            stamp(self.out)
            self._stamped = True

    def finish(self, summary: dict[str, Any], pool=None, **extras: Any) -> RunSummary:
        """Write ``summary`` (plus ``"pool"``: agreement inputs and pool size, given the
        run's `cbcert.runs.pool.Pool`) as ``summary.json``; the runner's `RunSummary` with
        ``extras`` (what it hands its caller besides files)."""
        if pool is not None:
            summary["pool"] = {"agreement_inputs": len(pool.indices),
                               "pool_size": pool.pool_size}
        write_json(self.out / SUMMARY, summary)
        return RunSummary(self.kind, summary, extras)


class _Stamping:
    """A records sink that has its session stamped (`Session.writing`) before any text."""

    def __init__(self, sink: Any, owner: Session):
        self._sink, self._owner = sink, owner

    def write(self, text: str) -> int:
        """Write ``text`` to the sink, the session's entry in ``run.json`` first."""
        self._owner.writing()
        return self._sink.write(text)

    def flush(self) -> None:
        """Flush the sink."""
        self._sink.flush()


@contextlib.contextmanager
def session(out: str | Path, kind: Kind, meta: dict[str, Any], world, *,
            free: Collection[str] = ()) -> Iterator[Session]:
    """Check ``out`` is writable, hold its lock and pin ``{"kind": kind, **meta}`` (plus the
    world's identity, versions and devices) in ``run.json``; the `Session` on it.

    ``free``: dotted settings of ``meta`` recorded but not compared on a rerun
    (``"job.batch"``). Raises the `cbcert.runs.directory.RunDirError` family (unwritable,
    locked, other settings or another kind there).
    """
    out = Path(out)
    check_writable(out)
    with hold(out):
        open_run_dir(out, kind, meta, world, free=free)
        yield Session(out, kind)


__all__ = ["Session", "session"]
