"""Helpers for tests that need a fresh JAX process: fake CPU devices, multi-process jobs.

JAX reads ``XLA_FLAGS`` once, when its backend starts, so a test that needs 8 devices on a
CPU-only machine must run its code in a new interpreter.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]


def start_python(code: str, *, num_devices: int = 1, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None):
    """Starts ``python -c code`` with ``num_devices`` fake CPU devices; returns the ``Popen``.

    The child sees this repository on ``PYTHONPATH`` and only the CPU platform, and runs in
    ``cwd`` (default: this process's working directory).
    """
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1")
    child_env = dict(os.environ)
    child_env.update(
        XLA_FLAGS=" ".join([*os.environ.get("XLA_FLAGS", "").split(),
                            f"--xla_force_host_platform_device_count={num_devices}"]),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    child_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )


def wait_python(process: subprocess.Popen, timeout: float = 300.0) -> str:
    """Waits for a process from ``start_python``; returns its stdout, raises on failure."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        raise RuntimeError(f"child timed out after {timeout} s:\n{stderr}") from None
    if process.returncode != 0:
        raise RuntimeError(f"child exited with {process.returncode}:\n{stderr}")
    return stdout


def run_python(code: str, *, num_devices: int = 1, timeout: float = 300.0) -> str:
    """Runs ``python -c code`` with ``num_devices`` fake CPU devices; returns its stdout."""
    return wait_python(start_python(code, num_devices=num_devices), timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a coordinator address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
