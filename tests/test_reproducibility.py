"""The reproducibility guarantee (docs/reproducibility.md) on another CPU's kernels.

XLA and oneDNN pick vector kernels by the CPU's instruction set and by the array shapes, so a
float32 result may change in its last bits from an AVX-512 CPU to an AVX2 one. Tests that compare
floats with values stored on another machine, or across batch and chunk shapes, carry the
``float_bits`` marker; here they run again in a child pytest with both libraries capped at
another instruction set -- AVX2 where this CPU has AVX-512 (the emulation of the most common CI
and laptop CPU on a recent server), SSE4 otherwise -- so a test that holds only by one CPU's
rounding fails on whichever machine runs the suite.

The suite compiles every program with LLVM at optimisation level 1 (``tests/conftest.py``), users
at XLA's default 3; `test_the_suites_optimisation_level_gives_the_users_bits` checks that a
bit-sensitive command writes the same bytes at both.
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


def users_flags(flags: str) -> str:
    """``XLA_FLAGS`` without an optimisation level: what a user's run compiles with (XLA's
    default level 3) where the suite sets one (``tests/conftest.py``)."""
    return " ".join(flag for flag in flags.split()
                    if not flag.startswith("--xla_backend_optimization_level"))


def test_users_flags_drop_only_the_level():
    assert users_flags("--a=1 --xla_backend_optimization_level=1 --b") == "--a=1 --b"


@pytest.mark.slow
def test_the_suites_optimisation_level_gives_the_users_bits(tmp_path):
    """The suite compiles with LLVM at the level of ``tests/conftest.py`` (1), users at XLA's
    default (3): the same command gives byte-identical records at both levels.

    ``certify perturb --tau`` on the built-in world (concept edits through the generator, three
    classifiers, DFS distances from the concept classifier's float32 features) is among the
    most bit-sensitive outputs of the reference sweep: at level 0 (no FMA contraction) every one of
    its records changes in the last digits of ``dfs``, so this test fails if the suite's level
    ever changes the numerics (run it with ``XLA_FLAGS=--xla_backend_optimization_level=0`` to
    see it fail). Deterministic: no failure probability.
    """
    suite = os.environ.get("XLA_FLAGS", "")
    assert "--xla_backend_optimization_level" in suite
    args = ["perturb", "--eps", "", "--tau", "2", "--samples", "2", "--subsets", "2",
            "--subset-size", "4", "--pool", "8", "--quiet"]
    outputs = {}
    for name, flags, cache in (("suite", suite, "true"), ("user", users_flags(suite), "false")):
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_ENABLE_COMPILATION_CACHE": cache}
        outputs[name] = tmp_path / name
        result = subprocess.run([sys.executable, "-m", "cbcert", *args, "--out",
                                 str(outputs[name])], cwd=_REPO_ROOT, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{flags}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    files = sorted(path.name for path in outputs["suite"].glob("*.jsonl"))
    assert files == ["tau2.jsonl"]
    for name in files:
        suite_bytes = (outputs["suite"] / name).read_bytes()
        assert suite_bytes.count(b"\n") == 8 and b'"dfs"' in suite_bytes
        assert suite_bytes == (outputs["user"] / name).read_bytes(), name
