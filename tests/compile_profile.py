"""Where the suite's time goes: XLA compilation vs the rest, per test module (a pytest plugin).

    PYTHONPATH=tests pytest -n 0 -p compile_profile [tests/test_x.py ...]

Listens to JAX's monitoring events in this process and, at the end of the run, prints one row
per module: tests, wall seconds (setup + call + teardown), seconds in XLA's backend compiler,
in tracing and lowering to MLIR, and how many programs were compiled (a persistent-cache hit
compiles nothing and is not counted). ``COMPILE_PROFILE_JSONL=path`` also writes one JSON line
per test; ``COMPILE_PROFILE_PROGRAMS=path`` one JSON line per compiled program (the test, the
jitted function's name, XLA's seconds and the last argument shapes), from JAX's compile log: the
census of docs/DEVELOPMENT.md, which works under xdist too (each worker appends). The table
needs ``-n 0`` (xdist workers are other processes). Compilations inside subprocesses
(``certify`` runs, multi-process jobs) are not seen. Not a test module: nothing is collected
from it.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
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


_current = {"test": None, "shapes": ""}


class _ProgramLog(logging.Handler):
    """Appends one JSON line per "Finished XLA compilation" record of JAX's compile log."""

    def __init__(self, path: str):
        super().__init__(logging.DEBUG)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling ") and len(record.args or ()) > 1:
            avals = list(record.args[1])
            _current["shapes"] = f"{len(avals)} args, last: " + ", ".join(
                str(a) for a in avals[-5:])
            return
        done = re.search(r"Finished XLA compilation of (.*?) in ([0-9.e-]+) sec", message)
        if done:
            with open(self.path, "a") as sink:
                sink.write(json.dumps({"test": _current["test"], "program": done.group(1),
                                       "seconds": float(done.group(2)),
                                       "arguments": _current["shapes"]}) + "\n")


def pytest_configure(config):
    del config
    import jax
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listen)
    path = os.environ.get("COMPILE_PROFILE_PROGRAMS")
    if path:
        jax.config.update("jax_log_compiles", True)
        for name in ("jax._src.interpreters.pxla", "jax._src.dispatch"):
            logger = logging.getLogger(name)
            logger.addHandler(_ProgramLog(path))
            logger.setLevel(logging.DEBUG)
            logger.propagate = False  # the census only: no compile warnings in the test output


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    del nextitem
    _current["test"] = item.nodeid
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
