"""The log of the processes that worked on a sweep directory: ``<out>/sessions.jsonl``.

A sweep that takes days is resumed by many processes, perhaps on machines whose arithmetic
differs in the last bits (AVX2 and AVX-512) and at several revisions of cbcert. Each
`cbcert.runs.sweep.run_sweep` call appends (process 0 of a multi-host job; every shard its own
lines) a ``"start"`` line — UTC time, git revision, versions and machine
(`cbcert.runs.machine.provenance`, which each runner also appends to the ``run.json`` of the
cells it writes records into: `cbcert.runs.provenance`), the shard, how many cells it will
visit — and, when it returns
or raises, an ``"end"`` or ``"stopped"`` line with the cells complete when it left. In between,
each cell it worked on (not one finished before) gets a ``"cell"`` line when the call finishes or
leaves it (`timed`): its name, ``state`` (``done`` or ``stopped``) and wall ``seconds``; a cell's
lines sum to its wall time over sessions (`cbcert.runs.pace`). A process killed outright
(SIGKILL) leaves no line after its last. `starts` reads the start lines back (the report's header
counts them).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cbcert.runs.directory import append_records, json_line

SESSIONS = "sessions.jsonl"


def log(out: Path, event: str, **fields: Any) -> None:
    """Append one ``{"event", "time" (UTC, ISO 8601), **fields}`` line to ``out/SESSIONS``."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with append_records(Path(out) / SESSIONS) as sink:
        sink.write(json_line({"event": event, "time": now, **fields}))


@contextlib.contextmanager
def timed(out: Path, cell: str, logged: bool = True) -> Iterator[None]:
    """Time the block (a cell's run) and, if ``logged``, append ``{"event": "cell", "cell",
    "state", "seconds"}`` when it ends: ``state`` is ``done`` if the block returned, ``stopped``
    if it raised (Ctrl-C and SIGTERM included); ``seconds`` is its wall time (0.1 s)."""
    tic, state = time.monotonic(), "stopped"
    try:
        yield
        state = "done"
    finally:
        if logged:
            log(out, "cell", cell=cell, state=state, seconds=round(time.monotonic() - tic, 1))


def entries(out: Path, event: str | None) -> list[dict[str, Any]]:
    """The ``event`` entries (``"start"``, ``"cell"``, …; None: every entry) of
    ``out/SESSIONS`` in order ([] without a log); lines that are not JSON objects (a torn last
    line) are left out."""
    path = Path(out) / SESSIONS
    if not path.is_file():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and event in (None, entry.get("event")):
            found.append(entry)
    return found


def starts(out: Path) -> list[dict[str, Any]]:
    """The ``"start"`` entries of ``out/SESSIONS`` in order (`entries`)."""
    return entries(out, "start")


__all__ = ["SESSIONS", "entries", "log", "starts", "timed"]
