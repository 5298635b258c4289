"""Run directories: one run per directory, held under a lock, with checked records.

Every runner (certification, perturb, attack) and every sweep writes into an output directory
the same way:

* ``check_writable(out)`` before any work: a read-only directory, or a path under a file, is
  refused in a second instead of after an hour of sampling;
* ``hold(out)`` (`cbcert.runs.lock`) takes an exclusive lock for the whole run;
* ``open_run(out, kind, meta)`` pins the run's settings in ``run.json``, led by ``"kind"`` (which
  runner wrote it: one of `KINDS`; `run_kind` reads it, and tells the kind of a directory
  written before ``run.json`` named it from its layout); a rerun with other settings
  is refused naming the first setting that differs (settings that never change results, such
  as ``batch``, are recorded but left free), a damaged ``run.json`` is reported with its path;
* ``read_records(path, key, check)`` reads the JSONL records appended as work finishes: a torn
  last line (a crash mid-write) is dropped, a malformed complete line is an error naming the
  file and line (records are strict JSON: a bare ``NaN`` or ``Infinity`` makes a line
  malformed), a record failing ``check`` (an input that is not part of the run, an unknown
  model or budget) is refused, and records are keyed so that a duplicated line cannot be
  counted twice: exact duplicates (ignoring wall-clock ``seconds``) collapse to one, two
  different records for one key are refused;
* ``write_json(path, data)`` writes strict JSON (no ``NaN``/``Infinity``) atomically;
* every runner returns a `RunSummary`: the summary it wrote to ``summary.json`` (readable as
  that mapping), its kind and what it hands its caller besides files (``extras``).

The files of a directory are named here once: `RUN`, `RECORDS` (`EXPLANATIONS` for an explain
run), `SUMMARY`, `LOCK`, and a sweep's `MANIFEST`. `cbcert.runs.session` is the loop every
runner shares on top of this contract (check, lock, pin, append, summarise).

In a multi-host job (``cbcert.engine.distributed``) only process 0 touches the directory: it
checks, locks, pins and reads, and every other process receives the same outcome (the same
bytes of a records file, the same error) through `on_coordinator` and `read_shared`, so all
processes continue in lock step; `write_json`, `append_records` and the lock do nothing
anywhere else. The directory therefore needs to exist only on process 0's host.

Size: the whole run-directory contract in one place (every runner and the sweep follow it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import jax

from cbcert.engine import distributed
from cbcert.runs import peers
from cbcert.schema import ConfigError, short_repr, shorten

RUN = "run.json"
RECORDS = "records.jsonl"
EXPLANATIONS = "explanations.jsonl"  # an explain run's records (written whole, not appended)
SUMMARY = "summary.json"
LOCK = ".lock"
MANIFEST = "manifest.json"  # a sweep directory's (its cells are run directories)
Kind = Literal["certify", "perturb", "attack", "classes", "explain"]
KINDS: tuple[Kind, ...] = ("certify", "perturb", "attack", "classes", "explain")
# Fields that legitimately differ between two computations of the same record.
WALL_CLOCK_FIELDS = frozenset({"seconds"})
_T = TypeVar("_T")


class RunDirError(ConfigError):
    """An output directory that cannot hold this run (the setting ``out``)."""

    def __init__(self, message: str):
        super().__init__(message, key="out")


class RunMismatchError(RunDirError):
    """The output directory holds a run with different settings."""


class RunLockedError(RunDirError):
    """Another process holds the output directory."""


class RecordsError(RunDirError):
    """A records file (or ``run.json``) that cannot be trusted: malformed, conflicting, foreign."""


def is_writer() -> bool:
    """Whether this process writes files: always, except off process 0 of a multi-host job."""
    return distributed.is_coordinator()


# Errors process 0 hands to the others by name (anything else arrives as a RuntimeError).
def _shared_errors() -> dict[str, type]:
    return {cls.__name__: cls for cls in (RunDirError, RunMismatchError, RunLockedError,
                                          RecordsError)}


def on_coordinator(fn: Callable[[], _T]) -> _T:
    """``fn()`` on process 0 only; its JSON-able result, or its error, on every process.

    Outside a multi-host job this is ``fn()``. In one, process 0 runs ``fn`` and broadcasts
    the outcome; the others raise the same error (`RunDirError` family by class, another
    `ConfigError` with its key, anything else as RuntimeError) or return the same result.
    """
    if not distributed.is_initialized():
        return fn()
    if not is_writer():
        outcome = json.loads(distributed.broadcast_bytes(None).decode("utf-8"))
        if "result" in outcome:
            return outcome["result"]
        cls = _shared_errors().get(outcome["error"])
        if cls is not None:
            raise cls(outcome["message"])
        if outcome["error"] == "ConfigError":
            raise ConfigError(outcome["message"], key=outcome["key"], detail=outcome["detail"])
        raise RuntimeError(f"process 0: {outcome['message']}")
    try:
        result = fn()
    except Exception as err:
        kind = type(err).__name__ if type(err).__name__ in _shared_errors() else (
            "ConfigError" if isinstance(err, ConfigError) else type(err).__name__)
        outcome = {"error": kind, "message": str(err), "key": getattr(err, "key", None),
                   "detail": getattr(err, "detail", None)}
        distributed.broadcast_bytes(json.dumps(outcome).encode("utf-8"))
        raise
    distributed.broadcast_bytes(json.dumps({"result": result}).encode("utf-8"))
    return result


def check_writable(out: Path) -> None:
    """Raise `RunDirError` unless ``out`` is (or can be created as) a writable directory.

    Checked before any work: ``out`` under a file, a read-only parent or a read-only ``out``.
    In a multi-host job process 0 checks (its host holds the files); all raise alike.
    """
    on_coordinator(lambda: _check_writable(Path(out)))


def _check_writable(out: Path) -> None:
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


def read_json(path: Path, advice: str = "delete the directory or use another --out") -> Any:
    """A JSON file; `RecordsError` naming the file if it cannot be read or parsed (nesting
    deeper than Python's recursion limit included), ending with ``advice`` if damaged."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as err:
        raise RecordsError(f"{path}: cannot read it ({err.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecordsError(f"{path}: damaged, not valid JSON ({shorten(str(err))}); "
                           f"{advice}") from None
    except RecursionError:
        raise RecordsError(f"{path}: damaged, arrays or objects nested too deeply to read; "
                           f"{advice}") from None


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as strict, indented JSON (NaN/inf refused), atomically via a rename.

    Does nothing off process 0 of a multi-host job.
    """
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    if not is_writer():
        return
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_json_once(path: Path, data: Any) -> bool:
    """Write ``data`` as strict JSON unless ``path`` exists; True if this call wrote it.

    Exclusive: the text goes to a file of this process's own and is hard-linked into place
    (atomic, and refused when the name exists, on NFS too), so of several processes racing —
    sweep shards starting together — exactly one writes and the others read its file.
    Does nothing (False) off process 0 of a multi-host job.
    """
    path = Path(path)
    if not is_writer() or path.exists():
        return False
    partial = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    try:
        os.link(partial, path)
        return True
    except FileExistsError:
        return False
    finally:
        partial.unlink(missing_ok=True)


class _NoSink:
    """The records sink of every process but process 0 of a multi-host job: writes nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def append_records(path: Path) -> Iterator[Any]:
    """A text sink appending to ``path`` (process 0), or one that writes nothing (the others)."""
    if not is_writer():
        yield _NoSink()
        return
    with Path(path).open("a") as sink:
        yield sink


def json_line(record: dict) -> str:
    """One strict-JSON line for a records file (NaN/inf refused; use None)."""
    return json.dumps(record, allow_nan=False) + "\n"


def _no_constant(token: str) -> None:
    raise ValueError(f"{token} is not strict JSON")


def _strict_loads(text: str) -> Any:
    """``json.loads`` refusing the ``NaN``, ``Infinity`` and ``-Infinity`` tokens (ValueError),
    which `json_line` never writes."""
    return json.loads(text, parse_constant=_no_constant)


def finite_or_none(value: float) -> float | None:
    """``float(value)``, or None where it is NaN or infinite (strict JSON has neither)."""
    value = float(value)
    return value if math.isfinite(value) else None


def open_run(out: Path, meta: dict[str, Any], extra: dict[str, Any] | None = None, *,
             free: Collection[str] = (), kind: Kind | None = None) -> None:
    """Write ``out/run.json`` (``"kind"``, then ``meta``, then ``extra``), or check the one there.

    A run directory holds one run: if ``run.json`` exists, its ``meta`` keys must equal
    ``meta`` (compared after a JSON round trip, so tuples equal the lists read back), else
    `RunMismatchError` naming the first setting that differs (``job.n = 200 there, 100
    now``). ``free`` lists dotted paths into ``meta`` (``"job.batch"``) of settings that never
    change results: written, not compared, so a rerun may change them (``run.json`` keeps the
    first run's). ``extra`` (versions, devices) is written but not compared. ``kind`` (one of
    `KINDS`) is compared with the one there, if there is one: a directory written before
    ``run.json`` named its kind resumes as it is (its settings still decide). In a multi-host
    job process 0 does this and the others share its outcome.
    """
    on_coordinator(lambda: _open_run(Path(out), meta, extra, free, kind))


_ABSENT = object()


def _shown(value: Any) -> str:
    return "absent" if value is _ABSENT else short_repr(value)


def _difference(old: Any, new: Any, path: str, free: Collection[str]) -> str | None:
    """``"path = old there, new now"`` for the first setting where ``old`` and ``new`` differ
    (depth first, in ``new``'s order, then keys only ``old`` has), None if they agree."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*new, *(k for k in old if k not in new)]:
            where = f"{path}.{key}"
            if where not in free:
                found = _difference(old.get(key, _ABSENT), new.get(key, _ABSENT), where, free)
                if found:
                    return found
        return None
    return None if old == new else f"{path} = {_shown(old)} there, {_shown(new)} now"


def _open_run(out: Path, meta: dict[str, Any], extra: dict[str, Any] | None,
              free: Collection[str], kind: Kind | None) -> None:
    meta = json.loads(json.dumps(meta))
    run_file = Path(out) / RUN
    if run_file.exists():
        previous = read_json(run_file)
        if not isinstance(previous, dict):
            raise RecordsError(f"{run_file}: damaged, expected a JSON object")
        there = previous.get("kind", kind)
        if kind is not None and there != kind:
            raise RunMismatchError(f"{out} holds a {short_repr(there)} run, not a {kind} run; "
                                   "use another --out or delete it")
        for key in (k for k in meta if k not in free):
            found = _difference(previous.get(key, _ABSENT), meta[key], key, free)
            if found:
                raise RunMismatchError(f"{out} holds a run with different settings ({found}); "
                                       "use another --out or delete it")
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    write_json(run_file, {**({"kind": kind} if kind is not None else {}), **meta,
                          **(extra or {})})


def open_run_dir(out: Path, kind: Kind, meta: dict[str, Any], world, *,
                 free: Collection[str] = ()) -> None:
    """``runs.directory.open_run`` of a ``kind`` run pinning ``world_pin(meta, world)``, with
    the versions and devices (see `run_info`); ``free`` as in `open_run` (recorded, not
    compared on a rerun).

    In a multi-host job every process first checks those settings and the world's parameters
    against process 0's (`cbcert.runs.peers`): before any sampling, all processes raise
    `SettingsMismatchError` naming the first difference.
    """
    meta = world_pin(meta, world)
    if peers.in_job():
        peers.check({"run": meta, "world": peers.world_identity(world)})
    open_run(out, meta, run_info(), free=free, kind=kind)


def world_pin(meta: dict[str, Any], world) -> dict[str, Any]:
    """``meta`` plus ``world_identity`` when the world declares one (``metadata["identity"]``:
    e.g. a pixels world's images and classifier hashes), so a run never resumes on other data.
    Worlds without one pin their name only, as before."""
    identity = (world.metadata or {}).get("identity")
    return meta if identity is None else {**meta, "world_identity": identity}


def run_info() -> dict[str, Any]:
    """What ``run.json`` records besides the settings: versions and devices."""
    import cbcert

    return {"versions": {"cbcert": cbcert.__version__, "jax": jax.__version__},
            "devices": [str(d) for d in jax.devices()]}


def run_kind(run: dict[str, Any]) -> Kind:
    """Which runner wrote a parsed ``run.json``: its ``"kind"``.

    A ``run.json`` written before it named its kind is told by its layout: perturb pins
    ``settings``, classes and explain their own key, certify and attack a ``job`` (certify's
    with ``noise``, attack's with ``eps`` and ``space``). Raises ValueError for an unknown kind
    or layout.
    """
    if "kind" in run:
        if run["kind"] not in KINDS:
            raise ValueError(f"unknown kind {short_repr(run['kind'])} (known: "
                             f"{', '.join(KINDS)})")
        return run["kind"]
    if "explain" in run:
        return "explain"
    if "settings" in run:
        return "perturb"
    if "classes" in run:
        return "classes"
    job = run.get("job", {})
    if isinstance(job, dict) and "noise" in job:
        return "certify"
    if isinstance(job, dict) and "eps" in job and "space" in job:
        return "attack"
    raise ValueError(f"run.json with unknown layout (keys {short_repr(sorted(run))})")


@dataclass(frozen=True, eq=False)
class RunSummary(Mapping[str, Any]):
    """What every runner returns: the summary it wrote to ``summary.json``, read as that
    mapping (``result["models"]``), with the runner's kind and its extras.

    Attributes:
      kind: the runner (one of `KINDS`, as written in ``run.json``).
      summary: the dict written to ``summary.json``.
      extras: what the runner hands its caller besides files, by name: perturb's ``rows``
        (the table rows, `cbcert.robustness.protocol.BudgetRow`), explain's ``figure`` (the
        arrays of ``explain.png``, or None); empty for the others.
    """

    kind: Kind
    summary: dict[str, Any]
    extras: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.summary)

    def __len__(self) -> int:
        return len(self.summary)


def check_types(record: dict, types: dict[str, tuple]) -> None:
    """Raise ValueError naming the first field of ``record`` whose JSON type is not allowed."""
    for name, allowed in types.items():
        value = record[name]
        ok = (value is None and None in allowed) or (
            value is not None and not (isinstance(value, bool) and bool not in allowed)
            and isinstance(value, tuple(t for t in allowed if t is not None)))
        if not ok:
            raise ValueError(f"field {name!r} = {value!r} has the wrong type")


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

    In a multi-host job process 0 reads the file and every process parses the same bytes
    (`read_shared`), so all agree on the records or all raise the same error.

    Raises:
      RecordsError: naming the file and line of a malformed, foreign or conflicting record.
    """
    path = Path(path)
    complete = read_shared(path, repair=repair)
    if complete is None:
        return []
    records: dict[Hashable, tuple[int, dict]] = {}
    for number, line in enumerate(complete.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = _strict_loads(line.decode("utf-8"))
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, a NaN/Infinity token
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


def read_shared(path: Path, *, repair: bool = False) -> bytes | None:
    """The complete lines of a JSONL file as process 0 reads them, on every process.

    None if the file does not exist. A torn last line (a crash mid-write) is left out, and
    with ``repair`` cut from the file too (process 0, holding the run's lock).
    """
    path = Path(path)

    def read() -> bytes | None:
        if not path.exists():
            return None
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise RecordsError(f"{path}: cannot read it ({err.strerror})") from None
        complete = raw[: raw.rfind(b"\n") + 1]
        if repair and len(complete) != len(raw):
            path.write_bytes(complete)
        return complete

    if not distributed.is_initialized():
        return read()
    data = None

    def probe() -> bool:
        nonlocal data
        data = read()
        return data is not None

    if not on_coordinator(probe):
        return None
    return distributed.broadcast_bytes(data)


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
    "EXPLANATIONS", "KINDS", "LOCK", "MANIFEST", "RECORDS", "RUN", "SUMMARY", "Kind",
    "RecordsError", "RunDirError", "RunLockedError", "RunMismatchError", "RunSummary",
    "append_records", "check_field", "check_writable", "finite_or_none", "is_writer",
    "json_line", "on_coordinator", "open_run", "open_run_dir", "read_json", "read_records",
    "read_shared", "run_kind", "world_pin", "write_json", "write_json_once",
]
