"""The finished cells of a run directory: what the report reads (``run.json``, ``summary.json``).

A sweep directory holds one cell per runner invocation (its manifest gives their order); a
runner's own output directory is a single cell.

Every file read is checked for its outer layout (a JSON object; the manifest's ``cells`` and
``worlds`` lists of named entries), and a damaged one raises `DamagedFileError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbcert.runs.directory import MANIFEST, RUN, SUMMARY, Kind, RecordsError, read_json, run_kind
from cbcert.schema import short_repr


class ReportError(ValueError):
    """No report can be written: no finished runner cell, a damaged file, an unwritable place."""


class DamagedFileError(ReportError):
    """A file of the run (``run.json``, ``summary.json``, the manifest) that cannot be read."""


def read_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; `DamagedFileError` naming it if unreadable or not an object."""
    try:
        data = read_json(path, advice="rerun what wrote it")
    except RecordsError as err:
        raise DamagedFileError(str(err)) from None
    if not isinstance(data, dict):
        raise DamagedFileError(f"{path}: expected a JSON object, found a "
                               f"{type(data).__name__}; rerun what wrote it")
    return data


def _is_entry(entry: Any, directory: bool) -> bool:
    """A manifest entry: an object with a string ``name``; ``directory``: one plain directory
    name (the report reads and writes under it)."""
    if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and entry["name"]):
        return False
    return not directory or (entry["name"] not in (".", "..") and "/" not in entry["name"])


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    """A sweep directory's manifest (``cells``: a list of ``{"name": …}``; ``worlds``: the same
    with directory names), or None if there is none; `DamagedFileError` naming it if damaged."""
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        return None
    manifest = read_object(path)
    for key, rule in (("cells", "a 'name'"), ("worlds", "a 'name' (a directory name)")):
        entries = manifest.get(key, [])
        if not (isinstance(entries, list)
                and all(_is_entry(e, directory=key == "worlds") for e in entries)):
            raise DamagedFileError(f"{path}: {key!r} must be a list of objects with {rule}; "
                                   f"found {short_repr(entries)}")
    return manifest


@dataclass(frozen=True)
class CellResult:
    """A finished runner directory.

    Attributes:
      name: directory name (the sweep's cell name).
      kind: ``certify``, ``perturb``, ``attack``, ``classes`` or ``explain`` (``run.json``'s
        ``"kind"``, or its layout in a directory written before it named its kind:
        `cbcert.runs.directory.run_kind`).
      run: the parsed ``run.json``; summary: the parsed ``summary.json``.
      path: the cell's directory (where its ``records.jsonl`` is), None if not read from disk.
    """

    name: str
    kind: Kind
    run: dict[str, Any]
    summary: dict[str, Any]
    path: Path | None = None


def find_cells(run_dir: str | Path, log: Callable[[str], None] = print) -> tuple[CellResult, ...]:
    """The finished cells of a sweep directory, or the one cell of a runner's output directory.

    Cells without ``summary.json`` (still running or interrupted) are skipped with a note, and
    so are cells the manifest lists that have no directory yet (a sweep split into shards
    reports on whatever the shards have finished). Raises ReportError if none is found,
    `DamagedFileError` naming a damaged ``run.json``, ``summary.json`` or manifest.
    """
    run_dir = Path(run_dir)
    single = (run_dir / RUN).is_file()
    manifest = None if single else read_manifest(run_dir)
    names = [c["name"] for c in manifest.get("cells", [])] if manifest else []
    dirs = [run_dir] if single else sorted(
        (d for d in run_dir.iterdir() if (d / RUN).is_file()),
        key=lambda d: (names.index(d.name) if d.name in names else len(names), d.name))
    present = {d.name for d in dirs}
    for name in names:
        if name not in present:
            log(f"note: cell {name} of the manifest has not run yet (missing); "
                "certify sweep CONFIG --status lists where each cell stands")
    cells = []
    for d in dirs:
        if not (d / SUMMARY).is_file():
            log(f"note: {d} has no {SUMMARY} (unfinished); rerun it to include it")
            continue
        run = read_object(d / RUN)
        try:
            kind = run_kind(run)
        except ValueError as err:
            raise DamagedFileError(f"{d / RUN}: {err}") from None
        cells.append(CellResult(d.name, kind, run, read_object(d / SUMMARY), d))
    if not cells:
        raise ReportError(f"{run_dir}: no finished runner directory (run.json + summary.json)")
    return tuple(cells)

