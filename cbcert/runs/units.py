"""Units of a run at once: independent pieces of work in threads, their results in order.

A certification run's batches of inputs and an attack run's (batch, model, ε) units are
independent: each has its own keys and runs the same compiled programs whatever else runs, so
their results are the same bits whether they run one after the other or side by side. On CPU
one of them at a time leaves part of a small machine idle — an APGD step is a small program
called from a host loop, and a certification batch interleaves sampling, counting and host-side
bounds — so runs take them two at a time, each in its own thread (`units_at_once`, `Units`),
and write their records in the units' order.

Measured on the 2-core Intel Xeon VM (AVX-512), 2026-12-06, built-in default world, the runs'
other processes stopped:

* certification (σ = 0.1, std/cbm/cbmh/proto, n0 = 100, n = 1,000, batches of 10 inputs, 40
  inputs): 23.0 s one batch at a time, 14.6 s two at once (1.58×);
* attack (16 inputs, std/cbm/proto × ε {0.01, 0.03}, `benchmarks/attack_units.py`): vanilla
  (100 iterations) 16.6 s against 8.7 s (1.9×); smoothed (σ = 0.1, EOT 8, PREDICT n = 1,000,
  20 iterations) 77 s against 46 s (1.7×).

Each running unit sizes its chunks by the memory budget, so two at once may hold twice the
bytes of one; runs split an explicit ``max_memory`` between them (`split_budget`), which may
shrink the chunks: then the float32 fields are equal only up to rounding
(docs/reproducibility.md). Accelerators run one at a time (not measured there), and so does a
multi-process job, whose units enter collective programs that every process must reach in the
same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from cbcert.schema import validate


def units_at_once(requested: int | None = None) -> int:
    """How many units a run runs at once (module docstring).

    ``requested`` (an integer >= 1; `cbcert.schema.ConfigError` with key ``units`` otherwise)
    if given, else 2 on CPU and 1 on accelerators; always 1 in a multi-process job.
    """
    if isinstance(requested, np.integer):
        requested = int(requested)
    if requested is not None:
        validate("count", requested, key="units", label="units")
    if jax.process_count() > 1:
        return 1
    if requested is not None:
        return int(requested)
    return 2 if jax.default_backend() == "cpu" else 1


def split_budget(max_memory: int | None, count: int) -> int | None:
    """Each of ``count`` units' share of an explicit memory budget (None: the default budget,
    a per-unit heuristic, is kept, so the units' chunks and bits are those of one at a time)."""
    return None if max_memory is None else max(max_memory // count, 1)


class Units:
    """``with Units(count) as run: run(fn, units)`` yields ``fn(unit)`` for each unit in order,
    computing ``count`` at a time in threads (``count`` = 1: one after the other, in the
    caller's thread, as it iterates). Leaving the context with an error (Ctrl-C included)
    cancels the units not started and does not wait for the running ones."""

    def __init__(self, count: int):
        self.count = count
        self.executor: ThreadPoolExecutor | None = None

    def __enter__(self) -> Callable[[Callable, Iterable], Iterator]:
        if self.count > 1:
            self.executor = ThreadPoolExecutor(self.count, thread_name_prefix="cbcert-unit")
        return self.run

    def __exit__(self, kind, error, trace) -> bool:
        if self.executor is not None:
            self.executor.shutdown(wait=kind is None, cancel_futures=True)
        return False

    def run(self, fn: Callable, units: Iterable) -> Iterator:
        if self.executor is None:
            return map(fn, units)
        futures = [self.executor.submit(fn, unit) for unit in units]
        return (future.result() for future in futures)


__all__ = ["Units", "split_budget", "units_at_once"]
