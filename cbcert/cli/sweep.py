"""``certify sweep`` (a whole experiment from one config) and ``certify report``."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

import click

from cbcert.cli import common
from cbcert.cli.distributed import distributed_options
from cbcert.cli.progress import bars
from cbcert.runs.directory import MANIFEST, RunDirError
from cbcert.schema import ConfigError

# Exit status after SIGTERM: 128 + the signal's number, as a shell reports a process it killed.
TERMINATED_EXIT_CODE = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM arrived (``kill``, a scheduler's preemption or time limit). Raised in the main
    thread and not an `Exception`, so it unwinds like Ctrl-C: each cell's runner closes its
    records and lock, and the sweep logs ``stopped`` in ``sessions.jsonl``."""


@contextlib.contextmanager
def _sigterm_unwinds():
    """While inside: SIGTERM raises `Terminated` in the main thread (the previous handler is
    restored after). Outside the main thread (where Python cannot set handlers) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sweep_world(preset: str):
    from cbcert.worlds.builtin import load_builtin

    try:
        return load_builtin(preset)
    except ValueError as err:
        raise click.BadParameter(f"section 'world', key 'preset': {err}",
                                 param_hint="CONFIG") from None


def _any_world(name: str):
    """A world of a multi-world config: a built-in preset or a world directory."""
    try:
        return common.load_world(name)
    except click.BadParameter as err:
        raise click.BadParameter(f"key 'worlds': {err.message}", param_hint="CONFIG") from None


@click.command("sweep")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Sweep directory (default results/<config file name>); rerunning resumes.")
@click.option("--world", "world_name", default=None,
              help="Run the config on this world instead of its world.preset: a built-in preset "
                   "or a world directory with a world.json.")
@click.option("--shard", metavar="I/N", default=None,
              help="Run only shard I of N (0 <= I < N): cells dealt evenly by estimated cost, "
                   "the same on every machine; shards may run at once into one --out.")
@click.option("--cells", "patterns", multiple=True, metavar="PATTERN",
              help="Run only the cells whose name matches PATTERN (shell-style: 'saturated/*' "
                   "is one world, '*/attack-*' every world's attacks; repeatable); the others "
                   "stay as they are and a later run without --cells resumes them.")
@click.option("--status", is_flag=True,
              help="Run nothing: list every cell as done, running (and where) or missing, "
                   "and estimate the work left from the finished cells' times.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars and no per-cell lines.")
@distributed_options
def sweep_cmd(config_path: Path, out: Path | None, world_name: str | None, shard: str | None,
              patterns: tuple[str, ...], status: bool, quiet: bool) -> None:
    """Run every cell of an experiment config into OUT/<cell>/ and write OUT/manifest.json.

    Cells: one certification per σ (latent) and per ρ and fixed flip count m (concept), one
    perturb run with all budgets, one attack run per attack section, one class-distance
    measurement (classes). Only the sections the file names are swept (latent, concept,
    perturb and attack if it names none). A config with a `worlds:` list runs every world's
    cells into OUT/<world>/<cell>/. Interrupted sweeps resume when rerun with the same --out.

    Example: certify sweep configs/reference.yaml --out results/reference
    (add --world <dir> to run the same cells on a world from real parts; --shard I/N on each
    of N machines sharing the directory; --cells 'saturated/*' to run one world's cells first;
    --status to see where a sweep stands).
    """
    from cbcert.engine.validity import NonFiniteError
    from cbcert.runs import sweep
    from cbcert.runs.config import load_config
    from cbcert.runs.pool import PoolTooSmallError

    try:
        config = load_config(config_path)
        sections = sweep.sections_in_file(config_path)
        cells = sweep.plan_cells(config, sections)
    except ConfigError as err:
        raise click.BadParameter(str(err), param_hint="CONFIG") from None
    part = _shard(shard, sweep)
    try:
        selected = sweep.select_cells(cells, patterns)
    except ConfigError as err:
        raise click.BadParameter(f"{err.value!r} {err.detail}", param_hint="--cells") from None
    if world_name is not None and config.worlds:
        raise click.BadParameter(f"{config_path} lists {len(config.worlds)} worlds (key "
                                 "'worlds'); --world replaces the world of a single-world "
                                 "config only", param_hint="--world")
    out = out or Path("results") / config_path.stem
    if status:
        _print_status(sweep, out, cells, part, {c.name for c in selected})
        return
    out = common.writable_out(out)

    def done(cell, result) -> None:
        if cell.kind == "explain":
            from cbcert.cli.explain import draw_figure

            draw_figure(result, out / cell.name)
        if not quiet:
            common.console.print(f"{cell.name}: done, records and summary in {out / cell.name}/")

    try:
        with _sigterm_unwinds(), bars(quiet, unit="units") as progress:
            if config.worlds:
                load = _any_world
            elif world_name is None:
                load = _sweep_world
            else:
                load = lambda _: common.load_world(world_name)  # noqa: E731
            visited = sweep.run_sweep(config, out, sections=sections, load_world=load,
                                      progress=progress, on_cell=done, shard=part,
                                      only=patterns)
    except Terminated:
        click.echo(f"Stopped by SIGTERM: the finished cells and every record written are kept "
                   f"in {out}; rerun the same command to resume.", err=True)
        sys.exit(TERMINATED_EXIT_CODE)
    except RunDirError as err:
        raise click.BadParameter(str(err), param_hint="--out") from None
    except PoolTooSmallError as err:
        raise click.BadParameter(f"section 'world', key 'num_inputs': {err}",
                                 param_hint="CONFIG") from None
    except ConfigError as err:
        raise click.BadParameter(f"{config_path}: {err}", param_hint="CONFIG") from None
    except NonFiniteError as err:  # the world's models or inputs gave NaN or inf
        where = "--world" if world_name is not None else "CONFIG (its world)"
        raise click.BadParameter(f"{err}; the cells finished before are kept in {out}",
                                 param_hint=where) from None
    if not quiet and (part is not None or patterns):
        what = " and ".join(([f"shard {part[0]}/{part[1]}"] if part is not None else [])
                            + ([f"--cells {' '.join(patterns)}"] if patterns else []))
        common.console.print(f"{what} finished ({len(visited)} of {len(cells)} cells); certify "
                             f"sweep {config_path} --out {out} --status shows the others")
    elif not quiet:
        common.console.print(f"sweep finished; manifest in {out / MANIFEST}; "
                             f"tables and figures: certify report {out}")


def _shard(value: str | None, sweep) -> tuple[int, int] | None:
    """``--shard I/N`` as ``(I, N)``; exit 2 naming --shard unless 0 <= I < N."""
    if value is None:
        return None
    index, _, count = value.partition("/")
    try:
        part = (int(index), int(count))
    except ValueError:
        raise click.BadParameter(f"got {value!r}; expected I/N, e.g. 0/4",
                                 param_hint="--shard") from None
    with common.bad_input():
        sweep.check_shard(*part)
    return part


def _print_status(sweep, out: Path, cells, part: tuple[int, int] | None,
                  selected: set[str]) -> None:
    """The table of `sweep.sweep_status` (one shard's cells with --shard, the ``selected``
    names only with --cells)."""
    from rich.table import Table

    from cbcert.runs import pace

    states = sweep.sweep_status(out, cells, part[1] if part else None)
    finished = {s.name for s in states if s.state == "done"}  # every cell's, for the pace
    if part is not None:
        states = [s for s in states if s.shard == part[0]]
    states = [s for s in states if s.name in selected]
    table = Table(title=f"sweep {out}" + (f", shard {part[0]}/{part[1]}" if part else ""))
    for column in ("cell", "state", *(("shard",) if part else ()), "detail"):
        table.add_column(column)
    for s in states:
        table.add_row(s.name, s.state, *((f"{s.shard}/{part[1]}",) if part else ()), s.detail)
    common.console.print(table)
    counts = {state: sum(s.state == state for s in states) for state in ("done", "running",
                                                                        "missing")}
    common.console.print(", ".join(f"{n} {state}" for state, n in counts.items()))
    left = pace.time_left(out, cells, finished, priced={s.name for s in states})
    if left.unfinished and left.seconds is None:
        common.console.print("work left: not known until a cell finishes (its time sets the "
                             "pace)")
    elif left.unfinished:
        common.console.print(f"work left: about {pace.duration(left.seconds)} for one process, "
                             f"at the pace of the {left.measured} measured finished cells "
                             f"(cell_cost; docs/commands.md)")


@click.command("report")
@click.argument("run_dir", metavar="RUN_DIR",
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--quiet", "-q", is_flag=True, help="No notes and no list of written files.")
def report_cmd(run_dir: Path, quiet: bool) -> None:
    """Markdown + CSV tables and PNG figures of a sweep (or one runner's) directory.

    Written to RUN_DIR/report/; figures whose data are absent are skipped with a note. For a
    multi-world sweep every world gets its own report (RUN_DIR/<world>/report/) and
    RUN_DIR/report/ holds the cross-world tables and figures.

    Example: certify report results/reference
    """
    from cbcert.report import write as report

    try:
        written = report.write_report(run_dir,
                                      log=(lambda _: None) if quiet else common.console.print)
    except report.ReportError as err:
        raise click.BadParameter(str(err), param_hint="RUN_DIR") from None
    if not quiet:
        common.console.print(f"wrote {len(written)} files to {run_dir / report.REPORT_DIR}/")


COMMANDS = (sweep_cmd, report_cmd)
