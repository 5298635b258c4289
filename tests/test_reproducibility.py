"""The reproducibility guarantee (docs/reproducibility.md) on another CPU's kernels.

XLA and oneDNN pick vector kernels by the CPU's instruction set and by the array shapes, so a
float32 result may change in its last bits from an AVX-512 CPU to an AVX2 one. Tests that compare
floats with values stored on another machine, or across batch and chunk shapes, carry the
``float_bits`` marker; here they run again in a child pytest with both libraries capped at
another instruction set -- AVX2 where this CPU has AVX-512 (the emulation of the most common CI
and laptop CPU on a recent server), SSE4 otherwise -- so a test that holds only by one CPU's
rounding fails on whichever machine runs the suite.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_REPO_ROOT = Path(__file__).resolve().parents[1]


def cpu_flags() -> set[str]:
    """Instruction-set flags of this machine's first CPU (``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def other_isa(flags: set[str]) -> dict[str, str]:
    """Environment that caps XLA and oneDNN below this CPU's instruction set."""
    xla, onednn = ("AVX2", "AVX2") if "avx512f" in flags else ("SSE4_2", "SSE41")
    flags_now = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags_now} --xla_cpu_max_isa={xla}".strip(),
            "ONEDNN_MAX_CPU_ISA": onednn}


def test_other_isa_is_below_this_cpu():
    assert other_isa({"avx2", "avx512f"})["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert other_isa({"avx2"})["ONEDNN_MAX_CPU_ISA"] == "SSE41"
    assert "--xla_cpu_max_isa=AVX2" in other_isa({"avx512f"})["XLA_FLAGS"]


def marked_modules() -> list[str]:
    """The test modules that name the ``float_bits`` marker (relative to the repository root).

    The child collects these only: collecting every module (each imports its libraries and builds
    its module-level models) costs the child tens of seconds and selects nothing more, since a
    test can carry the marker only where its module names it.
    """
    tests = _REPO_ROOT / "tests"
    return sorted(str(path.relative_to(_REPO_ROOT)) for path in tests.glob("test_*.py")
                  if path.name != Path(__file__).name and "float_bits" in path.read_text())


def test_marked_modules_are_the_modules_with_float_bits_tests():
    modules = marked_modules()
    assert "tests/test_engine_sampler.py" in modules and "tests/test_runs_attack.py" in modules
    assert "tests/test_reproducibility.py" not in modules
    assert "tests/test_apgd.py" not in modules  # it names no marker


@pytest.mark.slow
def test_float_sensitive_tests_pass_on_another_instruction_set(tmp_path):
    env = {**os.environ, **other_isa(cpu_flags())}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "float_bits", "-p", "no:cacheprovider",
         "-o", "addopts=", "--basetemp", str(tmp_path / "child"), *marked_modules()],
        cwd=_REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, f"{env['XLA_FLAGS']}, {env['ONEDNN_MAX_CPU_ISA']}:\n{tail}"
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= 13, tail
    assert not re.search(r"\d+ (failed|skipped|error)", result.stdout), tail
