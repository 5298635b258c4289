"""What machine a run ran on: the CPU model and the instruction sets that change its float bits
or its speed (AVX-512 rounds some float32 sums differently from AVX2; AMX and AVX512-BF16 are
what bf16 needs), the logical CPUs and the platform; and which revision of cbcert ran
(`git_revision`).

A run that spans sessions may span machines (a sweep resumed elsewhere); `provenance` is what a
session records about itself, once: `cbcert.runs.sweep` logs it in ``sessions.jsonl`` and every
runner appends it to the ``run.json`` of each directory it writes records into
(`cbcert.runs.provenance`), so every record can be traced to the machine and revision that made
it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

# The ISA flags that matter to cbcert's numbers and speed, in the order they are reported.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")


def cpu_description() -> tuple[str, list[str]]:
    """``(CPU model, [ISA_FLAGS this CPU has])`` from ``lscpu`` (Linux); elsewhere the
    platform's processor name and no flags."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or platform.machine(), []
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    model = fields.get("Model name", platform.machine()).strip()
    flags = fields.get("Flags", "").split()
    return model, [f for f in ISA_FLAGS if f in flags]


def describe() -> dict:
    """``{"cpu": model, "isa": [flags], "logical_cpus": n, "platform": platform string}``."""
    model, flags = cpu_description()
    return {"cpu": model, "isa": flags, "logical_cpus": os.cpu_count(),
            "platform": platform.platform()}


def git_revision() -> str | None:
    """``git rev-parse HEAD`` of the checkout holding this package, or None outside git."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
            text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def versions() -> dict[str, str]:
    """The versions a run's numbers depend on: ``{"cbcert", "jax", "flax", "numpy"}``."""
    import flax
    import jax
    import numpy as np

    import cbcert

    return {"cbcert": cbcert.__version__, "jax": jax.__version__, "flax": flax.__version__,
            "numpy": np.__version__}


def provenance() -> dict:
    """What a session records about itself: ``{"git_revision", "versions", "machine"}``
    (`git_revision`, `versions`, `describe`)."""
    return {"git_revision": git_revision(), "versions": versions(), "machine": describe()}


__all__ = ["ISA_FLAGS", "cpu_description", "describe", "git_revision", "provenance", "versions"]
