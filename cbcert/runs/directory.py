"""Run directories: one run per directory, held under a lock, with checked records.

Every runner (certification, perturb, attack) and every sweep writes into an output directory
the same way:

* ``check_writable(out)`` before any work: a read-only directory, or a path under a file, is
  refused in a second instead of after an hour of sampling;
* ``hold(out)`` takes an exclusive ``flock`` on ``out/.lock`` for the whole run; a second
  process on the same directory is refused, naming the holder (pid, host, command, start).
  The file is removed when the run ends; the kernel drops the lock when its process dies
  (even ``kill -9``), so the stale file such a death leaves never blocks a resume;
* ``open_run(out, meta)`` pins the run's settings in ``run.json``; a rerun with other settings
  is refused, a damaged ``run.json`` is reported with its path;
* ``read_records(path, key, check)`` reads the JSONL records appended as work finishes: a torn
  last line (a crash mid-write) is dropped, a malformed complete line is an error naming the
  file and line, a record failing ``check`` (an input that is not part of the run, an unknown
  model or budget) is refused, and records are keyed so that a duplicated line cannot be
  counted twice: exact duplicates (ignoring wall-clock ``seconds``) collapse to one, two
  different records for one key are refused;
* ``write_json(path, data)`` writes strict JSON (no ``NaN``/``Infinity``) atomically.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

RUN = "run.json"
RECORDS = "records.jsonl"
SUMMARY = "summary.json"
LOCK = ".lock"
# Fields that legitimately differ between two computations of the same record.
WALL_CLOCK_FIELDS = frozenset({"seconds"})
_SHOWN = 200  # characters of a file line or value quoted in an error message


class RunDirError(ValueError):
    """An output directory that cannot hold this run (``key`` names the setting, ``out``)."""

    key = "out"


class RunMismatchError(RunDirError):
    """The output directory holds a run with different settings."""


class RunLockedError(RunDirError):
    """Another process holds the output directory."""


class RecordsError(RunDirError):
    """A records file (or ``run.json``) that cannot be trusted: malformed, conflicting, foreign."""


def shorten(text: Any, limit: int = _SHOWN) -> str:
    """``repr``-free, bounded rendering of a value for error messages (never unbounded)."""
    text = text if isinstance(text, str) else repr(text)
    return text if len(text) <= limit else f"{text[: limit - 20]}… ({len(text)} characters)"


def value_name(value: float) -> str:
    """The exact text of a budget or scale in a file or directory name.

    ``format(value, "g")`` (6 significant digits: ``0.1``, ``1e-05``, ``2``) where that reads
    back as the same number, else ``repr`` (``0.1000001``), so two different values never share
    a name (σ = 0.1 and 0.1000001 once shared ``latent-sigma0.1``).
    """
    short = format(value, "g")
    return short if float(short) == value else repr(float(value))


def check_writable(out: Path) -> None:
    """Raise `RunDirError` unless ``out`` is (or can be created as) a writable directory.

    Checked before any work: ``out`` under a file, a read-only parent or a read-only ``out``.
    """
    out = Path(out)
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == out else f"is under the file {probe}"
        raise RunDirError(f"{out} {where}; give a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "directory" if probe == out else f"parent directory {probe}"
        raise RunDirError(f"{out}: the {what} is not writable")


def _holder() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "command": shorten(" ".join(sys.argv)), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


@contextlib.contextmanager
def hold(out: Path, name: str = LOCK) -> Iterator[Path]:
    """Exclusive lock on ``out/name`` for the duration of the block (creates ``out``).

    Raises:
      RunLockedError: another process holds it; the message names that process.
      RunDirError: ``out`` cannot be created or written.
    """
    out = Path(out)
    check_writable(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    handle = open(path, "a+")  # noqa: SIM115 - held open for the whole block
    locked = False
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise RunDirError(f"{path}: cannot lock ({err.strerror})") from None
            handle.seek(0)
            holder = shorten(handle.read().strip() or "an unknown process")
            raise RunLockedError(f"{out} is in use by another run ({holder}); wait for it to "
                                 "finish or use another --out") from None
        # The holder removes the file when it is done; a lock taken on a file removed in
        # between would guard nothing, so the path must still name the locked file.
        if not path.exists() or os.stat(path).st_ino != os.fstat(handle.fileno()).st_ino:
            raise RunLockedError(f"{out} was in use by another run that just finished; retry")
        locked = True
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder()) + "\n")
        handle.flush()
        yield out
    finally:
        if locked:
            path.unlink(missing_ok=True)
        handle.close()  # releases the lock


def read_json(path: Path) -> Any:
    """A JSON file; `RecordsError` naming the file if it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as err:
        raise RecordsError(f"{path}: cannot read it ({err.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecordsError(f"{path}: damaged, not valid JSON ({shorten(str(err))}); delete the "
                           "directory or use another --out") from None


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as strict, indented JSON (NaN/inf refused), atomically via a rename."""
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def json_line(record: dict) -> str:
    """One strict-JSON line for a records file (NaN/inf refused; use None)."""
    return json.dumps(record, allow_nan=False) + "\n"


def finite_or_none(value: float) -> float | None:
    """``float(value)``, or None where it is NaN or infinite (strict JSON has neither)."""
    value = float(value)
    return value if math.isfinite(value) else None


def open_run(out: Path, meta: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    """Write ``out/run.json`` (``meta`` plus ``extra``), or check the one there.

    A run directory holds one run: if ``run.json`` exists, its ``meta`` keys must equal
    ``meta`` (compared after a JSON round trip, so tuples equal the lists read back), else
    `RunMismatchError`. ``extra`` (versions, devices) is written but not compared.
    """
    meta = json.loads(json.dumps(meta))
    run_file = Path(out) / RUN
    if run_file.exists():
        previous = read_json(run_file)
        if not isinstance(previous, dict):
            raise RecordsError(f"{run_file}: damaged, expected a JSON object")
        if {k: previous.get(k) for k in meta} != meta:
            shown = shorten({k: previous.get(k) for k in meta}, 400)
            raise RunMismatchError(f"{out} holds a run with different settings ({shown}); use "
                                   "another --out or delete it")
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    write_json(run_file, {**meta, **(extra or {})})


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in WALL_CLOCK_FIELDS}


def read_records(path: Path, key: Callable[[dict], Hashable],
                 check: Callable[[dict], None] | None = None, *,
                 repair: bool = True) -> list[dict]:
    """The complete records of a JSONL file, one per key, in file order.

    Args:
      path: the records file (missing: no records).
      key: ``record -> hashable`` identity of a record, e.g. ``(index, model)``.
      check: raises ValueError (or KeyError) for a record that does not belong to this run.
      repair: drop a torn last line from the file itself (only while holding the run's lock).

    Raises:
      RecordsError: naming the file and line of a malformed, foreign or conflicting record.
    """
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    if repair and len(complete) != len(raw):
        path.write_bytes(complete)
    records: dict[Hashable, tuple[int, dict]] = {}
    for number, line in enumerate(complete.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RecordsError(f"{where}: not a JSON record ({shorten(str(err))}): "
                               f"{shorten(line.decode('utf-8', 'replace'))}") from None
        if not isinstance(record, dict):
            raise RecordsError(f"{where}: expected a JSON object, got {shorten(record)}")
        try:
            identity = key(record)
            if check is not None:
                check(record)
        except KeyError as err:
            raise RecordsError(f"{where}: record lacks the field {err}") from None
        except (TypeError, ValueError) as err:
            raise RecordsError(f"{where}: {shorten(str(err), 400)}; this record does not belong "
                               "to this run (delete the directory or use another --out)") from None
        if identity in records:
            first, previous = records[identity]
            if _untimed(previous) != _untimed(record):
                raise RecordsError(f"{where}: conflicts with line {first} for the same "
                                   f"{shorten(identity)}; the records cannot both be right "
                                   "(delete the directory or use another --out)")
            continue
        records[identity] = (number, record)
    return [record for _, record in records.values()]


def check_field(record: dict, field: str, allowed, what: str) -> None:
    """Raise ValueError unless ``record[field]`` is in ``allowed`` (a set or other container)."""
    value = record[field]
    try:
        ok = value in allowed
    except TypeError:  # unhashable value
        ok = False
    if not ok:
        raise ValueError(f"{field}={shorten(repr(value))} is not {what}")


__all__ = [
    "LOCK", "RECORDS", "RUN", "SUMMARY", "RecordsError", "RunDirError", "RunLockedError",
    "RunMismatchError", "check_field", "check_writable", "finite_or_none", "hold", "json_line",
    "open_run", "read_json", "read_records", "shorten", "value_name", "write_json",
]
