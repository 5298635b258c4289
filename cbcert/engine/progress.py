"""Progress reporting for long Monte Carlo runs.

The sampler reports through a plain callback ``callback(done, total)`` (pairs of input and
sample finished so far, and in all); ``rich_callback`` turns that into a rich progress bar with
samples/s. The bar is silent when disabled, when stdout is not a terminal (logs, CI, pipes) and
on every process but the first of a multi-host job.
"""

import contextlib
import sys
from collections.abc import Callable, Iterator

import jax
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

ProgressCallback = Callable[[int, int], None]


def _silent(done: int, total: int) -> None:
    del done, total


class _SamplesPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(f"{task.speed or 0.0:,.0f} samples/s")


@contextlib.contextmanager
def rich_callback(description: str, enabled: bool = True) -> Iterator[ProgressCallback]:
    """Context manager yielding a ``callback(done, total)`` that drives a rich progress bar.

    Args:
      description: text shown left of the bar, e.g. ``"certify σ=0.25"``.
      enabled: False gives a callback that does nothing (``--quiet``).
    """
    if not (enabled and sys.stdout.isatty() and jax.process_index() == 0):
        yield _silent
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _SamplesPerSecond(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
