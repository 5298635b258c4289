"""Interleaved timing for the benchmarks: contenders alternate within rounds, ratios per round.

On a shared machine the load changes within seconds, so timing one contender after another
compares machine states, not programs. Here every contender runs once per round (the order
rotated each round), each ratio is taken within a round and the median over rounds is reported
with its range, so a target is judged on several paired measurements, not one run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed_rate(work: Callable[[], int], min_seconds: float) -> float:
    """Units per second of ``work()`` (which returns the units it did, e.g. samples), calling
    it until at least ``min_seconds`` have passed (at least once)."""
    units, start = 0, time.perf_counter()
    while True:
        units += work()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return units / elapsed


def interleaved(contenders: dict[str, Callable[[], int]], rounds: int, min_seconds: float,
                warm_up: bool = True) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Rates of every contender in every round, and each one's first (warm-up) call in seconds.

    ``contenders[name]()`` does a unit of work and returns how many units (samples, images) it
    did. Each is called once first (compilation, autotuning; timed and returned as
    ``first_call[name]``), then in each of ``rounds`` rounds every contender is timed by
    ``timed_rate(fn, min_seconds)``, round r starting at contender ``r mod len``.
    """
    first_call = {}
    if warm_up:
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            first_call[name] = time.perf_counter() - start
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            rates[name].append(timed_rate(contenders[name], min_seconds))
    return rates, first_call


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio_summary(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` of the per-round ratios ``numerator[r] / denominator[r]``."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def format_ratio(numerator: list[float], denominator: list[float]) -> str:
    """``"x1.23 (0.98-1.40 over 3 rounds)"``."""
    mid, low, high = ratio_summary(numerator, denominator)
    return f"x{mid:.2f} ({low:.2f}-{high:.2f} over {len(numerator)} rounds)"
