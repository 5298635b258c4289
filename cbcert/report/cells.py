"""The finished cells of a run directory: what the report reads (``run.json``, ``summary.json``).

A sweep directory holds one cell per runner invocation (its manifest gives their order); a
runner's own output directory is a single cell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cbcert.runs.directory import RUN, SUMMARY, read_json

MANIFEST = "manifest.json"


class ReportError(ValueError):
    """The directory holds no finished runner cell."""


@dataclass(frozen=True)
class CellResult:
    """A finished runner directory.

    Attributes:
      name: directory name (the sweep's cell name).
      kind: ``certify``, ``perturb``, ``attack``, ``classes`` or ``explain`` (read from
        ``run.json``).
      run: the parsed ``run.json``; summary: the parsed ``summary.json``.
    """

    name: str
    kind: Literal["certify", "perturb", "attack", "classes", "explain"]
    run: dict[str, Any]
    summary: dict[str, Any]


def cell_kind(run: dict[str, Any]) -> str:
    """Which runner wrote a ``run.json``: perturb pins ``settings``, classes and explain their
    own key, the others a ``job``."""
    if "explain" in run:
        return "explain"
    if "settings" in run:
        return "perturb"
    if "classes" in run:
        return "classes"
    job = run.get("job", {})
    if "noise" in job:
        return "certify"
    if "eps" in job and "space" in job:
        return "attack"
    raise ReportError(f"run.json with unknown layout (keys {sorted(run)})")


def find_cells(run_dir: str | Path, log: Callable[[str], None] = print) -> tuple[CellResult, ...]:
    """The finished cells of a sweep directory, or the one cell of a runner's output directory.

    Cells without ``summary.json`` (still running or interrupted) are skipped with a note, and
    so are cells the manifest lists that have no directory yet (a sweep split into shards
    reports on whatever the shards have finished). Raises ReportError if none is found.
    """
    run_dir = Path(run_dir)
    dirs = [run_dir] if (run_dir / RUN).is_file() else sorted(
        (d for d in run_dir.iterdir() if (d / RUN).is_file()), key=_cell_order(run_dir))
    if dirs != [run_dir] and (run_dir / MANIFEST).is_file():
        present = {d.name for d in dirs}
        for cell in read_json(run_dir / MANIFEST).get("cells", []):
            if cell["name"] not in present:
                log(f"note: cell {cell['name']} of the manifest has not run yet (missing); "
                    "certify sweep CONFIG --status lists where each cell stands")
    cells = []
    for d in dirs:
        if not (d / SUMMARY).is_file():
            log(f"note: {d} has no {SUMMARY} (unfinished); rerun it to include it")
            continue
        run = read_json(d / RUN)
        cells.append(CellResult(d.name, cell_kind(run), run, read_json(d / SUMMARY)))
    if not cells:
        raise ReportError(f"{run_dir}: no finished runner directory (run.json + summary.json)")
    return tuple(cells)


def _cell_order(run_dir: Path) -> Callable[[Path], tuple[int, str]]:
    """Sort key: a sweep's manifest order (latent, concept, perturb, attack), then by name."""
    path = run_dir / MANIFEST
    names = [c["name"] for c in read_json(path)["cells"]] if path.is_file() else []
    return lambda d: (names.index(d.name) if d.name in names else len(names), d.name)
