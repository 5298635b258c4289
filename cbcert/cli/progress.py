"""Progress bars of the CLI: one rich bar per unit of work, on stderr, on process 0 only.

The library reports progress through plain callbacks ``callback(done, total)``; the engine and
runners never draw anything. `bar` gives one such callback for a command, `bars` one per cell
of a sweep. Both are silent with ``--quiet``, off a terminal (logs, CI, pipes) and on every
process but the first of a multi-host job.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import jax
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

Callback = Callable[[int, int], None]


class _Rate(ProgressColumn):
    """Units per second, e.g. ``12.3 inputs/s``."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed or 0.0:,.1f} {self.unit}/s")


def shown(quiet: bool) -> bool:
    """Whether bars are drawn: not quiet, stderr is a terminal, process 0 of the job."""
    return not quiet and sys.stderr.isatty() and jax.process_index() == 0


def _progress(unit: str, transient: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    _Rate(unit), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=transient)


@contextlib.contextmanager
def bar(description: str, quiet: bool, unit: str = "inputs") -> Iterator[Callback | None]:
    """A ``callback(done, total)`` driving one bar, or None when bars are not `shown`."""
    if not shown(quiet):
        yield None
        return
    with _progress(unit, transient=True) as progress:
        task = progress.add_task(description, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


@contextlib.contextmanager
def bars(quiet: bool, unit: str = "units") -> Iterator[Callable[[str], Callback] | None]:
    """``name -> callback``: a new bar per call (one per sweep cell); None when not `shown`."""
    if not shown(quiet):
        yield None
        return
    with _progress(unit, transient=False) as progress:
        def for_cell(name: str) -> Callback:
            task = progress.add_task(name, total=None)
            return lambda done, total: progress.update(task, completed=done, total=total)

        yield for_cell
