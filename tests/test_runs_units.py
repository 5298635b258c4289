"""Units at once: the default and its checks, results in order, an error stops the rest."""

import threading
import time

import jax
import numpy as np
import pytest

from cbcert.runs.units import Units, split_budget, units_at_once
from cbcert.schema import ConfigError


def test_two_on_cpu_a_request_as_given_and_one_in_a_multi_process_job(monkeypatch):
    assert jax.default_backend() == "cpu" and units_at_once() == 2
    assert units_at_once(5) == 5 and units_at_once(np.int64(1)) == 1
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert units_at_once() == 1 and units_at_once(3) == 3
    # A multi-process job enters each unit's collective programs in order: one at a time.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert units_at_once() == units_at_once(4) == 1


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_a_bad_request_names_units_and_the_range(bad):
    with pytest.raises(ConfigError, match=r"units: .*\[1, inf\)") as error:
        units_at_once(bad)
    assert error.value.key == "units"


def test_an_explicit_budget_is_split_and_the_default_kept():
    assert split_budget(None, 2) is None
    assert split_budget(1000, 2) == 500 and split_budget(1001, 3) == 333
    assert split_budget(1, 4) == 1


@pytest.mark.parametrize("count", [1, 2, 3])
def test_results_come_in_the_units_order_whatever_finishes_first(count):
    def fn(i):  # later units finish first
        time.sleep(0.02 * (4 - i))
        return i, threading.current_thread() is threading.main_thread()

    with Units(count) as run:
        results = list(run(fn, range(5)))
    assert [i for i, _ in results] == list(range(5))
    # One at a time runs in the caller's thread; more at once in worker threads.
    assert all(main == (count == 1) for _, main in results)


def test_an_error_reaches_the_caller_and_cancels_the_units_not_started():
    """Unit 1 raises while units 2 and 3 may be running (held at a gate): the caller gets the
    error at unit 1, the context does not wait for the running ones, and units 4-9 never
    start."""
    gate, started = threading.Event(), []

    def fn(i):
        started.append(i)
        if i == 1:
            raise ValueError("unit 1 failed")
        if i >= 2:
            assert gate.wait(10)
        return i

    seen = []
    with pytest.raises(ValueError, match="unit 1 failed"), Units(2) as run:
        for result in run(fn, range(10)):
            seen.append(result)
    assert seen == [0]
    assert set(started) <= {0, 1, 2, 3} and {0, 1} <= set(started)
    gate.set()
    time.sleep(0.2)  # the workers finish what they had and take nothing new
    assert set(started) <= {0, 1, 2, 3}
