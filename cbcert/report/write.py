"""Reports: Markdown + CSV tables and PNG figures from the cell directories of a run.

Reads only what the runners wrote (``run.json`` and ``summary.json`` of every cell; analysis is
separate from sampling) and writes into ``<run>/report/``:

* ``certification_latent.csv`` / ``certification_concept.csv``: per cell (σ, ρ or m) and model,
  smoothed accuracy (abstain = wrong), ACR (ACR-H), certified accuracy at σ/2, σ, 2σ (Hamming
  radii 1, 2, 3), abstain rate and seconds per input;
* ``perturb.csv``: per budget, mean and sd over subsets of CFR, flipped-concept count, PFR per
  model and DFS per concept model; ``perturb_tests.csv``: Δ = PFR_a − PFR_b with the paired
  permutation test's p over inputs, the Holm-corrected p and SPEC §3's t-test;
* ``attack.csv``: clean and robust accuracy per cell, model and ε; ``attack_tests.csv``: Δ =
  RobAcc_a − RobAcc_b per cell and ε over the same inputs, the exact McNemar p and its Holm
  correction over the cell, and the same over the inputs both models classify correctly
  unattacked (``*_clean``: the attack's effect without clean errors);
* ``report.md`` with every table, and the figures (matplotlib, Agg): PFR vs ε and vs τ, certified
  accuracy vs radius per certification cell, SmAcc and ACR vs σ and vs ρ, the std-vs-cbm
  robustness-gap heatmap (positive = CBM more robust), CFR / DFS vs PFR, PFR vs σ and ρ (perturb
  smoothing budgets), the attack bars (vanilla / smoothed × latent / concept) and the class-
  centroid distance heatmap (``classes.csv``, ``class_distances.png``). A figure whose data
  are absent is skipped with a note;
* ``provenance.csv``: who wrote each cell — sessions, git revisions, machines, ``mixed`` where
  more than one revision or machine did (`cbcert.runs.provenance`), counted in ``report.md``'s
  header; ``provenance.json``: the report's own git revision and versions, which the header
  states too. No time is written anywhere: the report of one run, rewritten by one tree, is the
  same bytes.

A multi-world sweep (its manifest lists ``worlds``) gets every world's own report in
``<run>/<world>/report/`` and the cross-world tables and figures (`cbcert.report.worlds`) in
``<run>/report/``, whose ``report.md`` links the per-world ones.

Nothing is read before the report directory is known to be writable (not a file, not in a
read-only run); a damaged ``run.json``, ``summary.json`` or manifest raises `ReportError` naming
the file (`cbcert.report.cells`), and so does a summary whose content the tables cannot use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cbcert.report.cells import (
    RUN,
    SUMMARY,
    CellResult,
    DamagedFileError,
    ReportError,
    find_cells,
    read_manifest,
)
from cbcert.report.figures import write_figures
from cbcert.report.method_outputs import write_method_outputs
from cbcert.report.tables import tables
from cbcert.report.worlds import (
    cross_world_figures,
    cross_world_tables,
    run_analysis,
    world_cells,
)
from cbcert.runs import pace, sessions
from cbcert.runs.config import AnalysisConfig
from cbcert.runs.directory import RunDirError, check_writable, write_json
from cbcert.runs.machine import git_revision
from cbcert.runs.provenance import machine_label
from cbcert.schema import ConfigError, shorten

REPORT_DIR = "report"
PROVENANCE = "provenance.json"  # the report's own revision and versions


def report_provenance() -> dict[str, Any]:
    """The report's own provenance: the git revision of the cbcert that wrote it (as a sweep's
    session log records its own: `cbcert.runs.machine.git_revision`) and the versions of
    cbcert, jax, numpy, scipy and matplotlib. No time: rewriting the report of one run with one
    tree gives the same bytes."""
    import jax
    import matplotlib
    import numpy as np
    import scipy

    import cbcert

    return {"git_revision": git_revision(),
            "versions": {"cbcert": cbcert.__version__, "jax": jax.__version__,
                         "numpy": np.__version__, "scipy": scipy.__version__,
                         "matplotlib": matplotlib.__version__}}


def _header(run_dir: Path, own: dict[str, Any]) -> str:
    """Title, the report's own revision and versions (``own``: `report_provenance`), the
    manifest's settings and the sweep's sessions."""
    versions = ", ".join(f"{k} {v}" for k, v in own["versions"].items())
    revision = own["git_revision"]
    where = f"git `{revision}`" if revision else "a tree outside git (no revision)"
    lines = [f"# Report: {run_dir.resolve().name}", "",
             f"Written by cbcert at {where} with {versions} ({PROVENANCE}).", ""]
    m = read_manifest(run_dir)
    if m is not None:
        versions = m.get("versions")
        versions = ", ".join(f"{k} {v}" for k, v in versions.items()) if isinstance(
            versions, dict) else versions
        world = m.get("world")
        if isinstance(world, dict):
            world = ", ".join(f"{k} = {v}" for k, v in world.items())
        config = m.get("config")
        name = config.get("name") if isinstance(config, dict) else None
        lines += [shorten(f"Config `{name}`, world `{world}`, seed {m.get('seed')}; the sweep "
                          f"began at git `{m.get('git_revision')}` with {versions}; devices "
                          f"{m.get('devices')}.", 1000), ""]
    sessions = _sessions_line(run_dir, m.get("cells", []) if m is not None else [])
    if sessions:
        lines += [sessions, ""]
    return "\n".join(lines)


def _sessions_line(run_dir: Path, cells: Sequence[dict]) -> str | None:
    """Who worked on a sweep, from its ``sessions.jsonl`` (`cbcert.runs.sessions`): how many
    sessions started, their git revisions and their machines (CPU model and ISA flags), each
    with its count, and the finished ``cells``' (the manifest's entries) summed wall time
    (`cbcert.runs.pace.finished_wall_time`). None without a log."""
    starts = sessions.starts(run_dir)
    if not starts:
        return None

    def counted(values) -> str:
        counts = Counter(values)
        return ", ".join(f"{v} ×{n}" if n > 1 else v for v, n in counts.items())

    revisions = counted(f"`{str(e.get('git_revision'))[:7]}`" for e in starts)
    machines = counted(machine_label(e.get("machine")) for e in starts)
    line = shorten(f"Sessions ({sessions.SESSIONS}): {len(starts)} started; revisions "
                   f"{revisions}; machines {machines}.", 1000)
    seconds, measured, unmeasured = pace.finished_wall_time(
        run_dir, [(str(c["name"]), str(c.get("kind"))) for c in cells])
    if measured or unmeasured:
        line += (f" Wall time of the finished cells: {pace.duration(seconds)} over {measured}"
                 f" cells" + (f" ({unmeasured} more without a recorded time)" if unmeasured
                               else "") + ".")
    return line


def _check_content(run_dir: Path, cells: Sequence[CellResult]) -> None:
    """Each cell's files hold what the tables read: `DamagedFileError` naming them if not."""
    for cell in cells:
        try:
            tables((cell,))
        except ReportError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            where = run_dir if (run_dir / RUN).is_file() else run_dir / cell.name
            raise DamagedFileError(
                f"{where / SUMMARY}: unexpected content ({type(err).__name__}: "
                f"{shorten(str(err), 200)}) for a {cell.kind} cell (with {where / RUN}); rerun "
                "the cell") from None


def write_report(run_dir: str | Path, log: Callable[[str], None] = print) -> list[Path]:
    """Write the tables (CSV + ``report.md``) and figures of a run into ``<run_dir>/report/``.

    Returns the written paths. Raises ReportError if ``run_dir`` holds no finished cell,
    naming a damaged file, or, before any cell is read, if a report folder it would write
    cannot be written (``report`` is a file, the run directory is read-only), naming it.
    """
    run_dir = Path(run_dir)
    _check_writable(run_dir, None)
    try:
        manifest = read_manifest(run_dir)
        entries = manifest.get("worlds") if manifest else None
        _check_writable(run_dir, entries)
        if entries:
            return _write_worlds_report(run_dir, manifest, log)
        cells = find_cells(run_dir, log)
        _check_content(run_dir, cells)
        all_tables = tables(cells)
        return _write(run_dir, all_tables, write_figures(cells, _out(run_dir), log), [])
    except OSError as err:
        raise ReportError(f"{err.filename or run_dir}: cannot write the report "
                          f"({err.strerror or err})") from None


def _check_writable(run_dir: Path, entries: list[dict] | None) -> None:
    """ReportError naming the first report folder (``run_dir``'s, each world's) that cannot be
    written: checked before the cells are read and the figures drawn."""
    folders = [run_dir / entry["name"] for entry in entries or ()
               if (run_dir / entry["name"]).is_dir()]
    for folder in [*folders, run_dir]:
        out = folder / REPORT_DIR
        if out.exists() and not out.is_dir():
            raise ReportError(f"{out} is a file; the report is written into a folder of that "
                              "name (move the file away)")
        try:
            check_writable(out)
        except RunDirError as err:
            raise ReportError(str(err)) from None


def _out(run_dir: Path) -> Path:
    out = run_dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    return out


def _mixed_line(all_tables) -> str | None:
    """How many cells the provenance table (per world or stacked) flags as mixed or not wholly
    known; None without it."""
    table = next((t for t in all_tables if t.name in ("provenance", "worlds_provenance")), None)
    if table is None:
        return None
    mixed = Counter(row[table.columns.index("mixed")] for row in table.rows)
    return (f"Provenance (table `{table.name}`): {mixed['yes']} of {len(table.rows)} cells "
            f"written by more than one git revision or machine, {mixed['unknown']} whose "
            "writers are not all known.")


def _write(run_dir: Path, all_tables, figures: list[Path], links: list[str]) -> list[Path]:
    """The tables as CSV, ``provenance.json`` (`report_provenance`), and ``report.md`` with
    ``links``, every table and the figures."""
    out = _out(run_dir)
    own = report_provenance()
    write_json(out / PROVENANCE, own)
    written = [out / PROVENANCE]
    for table in all_tables:
        path = out / f"{table.name}.csv"
        path.write_text(table.to_csv())
        written.append(path)
    mixed = _mixed_line(all_tables)
    markdown = [_header(run_dir, own), *([mixed, ""] if mixed else []), *links,
                *(t.to_markdown() for t in all_tables), "## Figures", ""]
    markdown += [f"![{f.stem}]({f.name})" for f in figures]
    path = out / "report.md"
    path.write_text("\n".join(markdown) + "\n")
    return [*written, *figures, path]


def _write_worlds_report(run_dir: Path, manifest: dict[str, Any],
                         log: Callable[[str], None]) -> list[Path]:
    """Per-world reports, then the cross-world tables and figures (`cbcert.report.worlds`) of
    the sweep whose ``manifest`` lists its worlds."""
    worlds = world_cells(run_dir, manifest["worlds"], log)
    written = []
    links = ["## Worlds", ""]
    for name, family, _ in worlds:
        written += write_report(run_dir / name, log=lambda _: None)
        links.append(f"- [{name}](../{name}/{REPORT_DIR}/report.md)"
                     + (f" — {family}" if family else ""))
    links.append("")
    analysis = run_analysis(worlds, _analysis(run_dir, manifest))
    all_tables = cross_world_tables(worlds, analysis)
    figures = cross_world_figures(worlds, _out(run_dir), all_tables, log, analysis)
    method = write_method_outputs(worlds, all_tables, _out(run_dir), log)
    figures += [p for p in method if p.suffix == ".png"]
    links += ["## The method's figures and tables by number", "",
              *(f"- [{p.name}]({p.name})" for p in method), ""]
    return (written + [p for p in method if p.suffix != ".png"]
            + _write(run_dir, all_tables, figures, links))


def _analysis(run_dir: Path, manifest: dict[str, Any]) -> AnalysisConfig:
    """The run's ``analysis`` settings as its manifest pinned them before the run (the
    defaults where it names none)."""
    config = manifest.get("config") or {}
    try:
        return AnalysisConfig.from_dict(config.get("analysis", {}), section="analysis")
    except ConfigError as err:
        raise DamagedFileError(f"{run_dir / 'manifest.json'}: {err}") from None


__all__ = ["REPORT_DIR", "ReportError", "write_report"]
