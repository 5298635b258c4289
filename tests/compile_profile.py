"""Where the suite's time goes: XLA compilation vs the rest, per test module (a pytest plugin).

    PYTHONPATH=tests pytest -n 0 -p compile_profile [tests/test_x.py ...]

Listens to JAX's monitoring events in this process and, at the end of the run, prints one row
per module: tests, wall seconds (setup + call + teardown), seconds in XLA's backend compiler,
in tracing and lowering to MLIR, and how many programs were compiled (a persistent-cache hit
compiles nothing and is not counted). ``COMPILE_PROFILE_JSONL=path`` also writes one JSON line
per test. Compilations inside subprocesses (``certify`` runs, multi-process jobs) are not seen;
run with ``-n 0`` (xdist workers are other processes). Not a test module: nothing is collected
from it.
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = ("/jax/core/compile/jaxpr_trace_duration",
         "/jax/core/compile/jaxpr_to_mlir_module_duration")

_seconds: collections.Counter = collections.Counter()
_counts: collections.Counter = collections.Counter()
_modules: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])


def _listen(event: str, duration: float, **_) -> None:
    _seconds[event] += duration
    _counts[event] += 1


def pytest_configure(config):
    del config
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    del nextitem
    _seconds.clear()
    _counts.clear()
    start = time.perf_counter()
    yield
    wall = time.perf_counter() - start
    row = _modules[item.path.stem]
    row[0] += 1
    row[1] += wall
    row[2] += _seconds[COMPILE]
    row[3] += sum(_seconds[name] for name in TRACE)
    row[4] += _counts[COMPILE]
    path = os.environ.get("COMPILE_PROFILE_JSONL")
    if path:
        with open(path, "a") as sink:
            sink.write(json.dumps({"test": item.nodeid, "wall": wall, "compile": _seconds[COMPILE],
                                   "programs": _counts[COMPILE]}) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _modules:
        return
    write = terminalreporter.write_line
    write("")
    write(f"{'module':34} {'tests':>5} {'wall s':>8} {'compile s':>9} {'trace s':>8} "
          f"{'programs':>8}")
    rows = sorted(_modules.items(), key=lambda kv: -kv[1][1])
    for name, (tests, wall, compile_s, trace_s, programs) in rows:
        write(f"{name:34} {tests:5d} {wall:8.1f} {compile_s:9.1f} {trace_s:8.1f} {programs:8d}")
    total = [sum(row[i] for row in _modules.values()) for i in range(5)]
    write(f"{'all':34} {total[0]:5d} {total[1]:8.1f} {total[2]:9.1f} {total[3]:8.1f} "
          f"{total[4]:8d}  (compile {total[2] / max(total[1], 1e-9):.0%} of wall)")
