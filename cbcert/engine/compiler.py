"""XLA options for every program cbcert compiles, and the ``jit`` that applies them.

On CPU, cbcert compiles with XLA's classic elemental emitters instead of its newer MLIR
"fusion emitters" (``xla_cpu_use_fusion_emitters=false``). Measured with jax 0.10.2 on the
2-core CI machine (``benchmarks/compiler_options.py``): the built-in world's programs compile
about twice as fast (its forward pass 1.33 → 0.71 s, its input gradient 3.34 → 1.49 s) and run
as fast; a ported ResNet-50 compiles slower (1.37 → 1.95 s) and runs the same, bit for bit.
float32 results differ from the fusion emitters' in the last bits only (a different, equally
valid order of float operations). Most of a short run, and of the test suite, is compilation;
a long run's time is execution, which does not change.

The choice applies to the programs cbcert jits itself (the sampler's chunk step, APGD, the
trainers, the memory probes); functions users jit themselves keep XLA's defaults. Opting out:
name the flag in ``XLA_FLAGS`` (``XLA_FLAGS=--xla_cpu_use_fusion_emitters=true``) and cbcert
leaves it to XLA; on GPU/TPU, and with a jaxlib that no longer knows the option, no option is
passed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

# XLA:CPU debug option -> value cbcert compiles with, and XLA's own default of each.
CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
XLA_DEFAULTS = {"xla_cpu_use_fusion_emitters": True}


@functools.cache
def compiler_options() -> dict[str, Any] | None:
    """``compiler_options`` for ``jax.jit``: `CPU_OPTIONS` on the CPU backend, else None.

    None as well when ``XLA_FLAGS`` names an option of `CPU_OPTIONS` (the user's choice wins)
    or when this jaxlib refuses the option (checked once on a one-element program). Called at
    the first compilation, never at import, so that ``jax.distributed.initialize`` can still
    run before the backend starts.
    """
    if jax.default_backend() != "cpu":
        return None
    flags = os.environ.get("XLA_FLAGS", "")
    if any(name in flags for name in CPU_OPTIONS):
        return None
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_OPTIONS).lower(np.float32(0)).compile()
    except Exception:  # noqa: BLE001 - an unknown option is reported as several error types
        return None
    return dict(CPU_OPTIONS)


class _Jit:
    """``jax.jit(fun, compiler_options=compiler_options(), **kwargs)``, built at first use.

    Calls, ``lower``, ``trace``, ``eval_shape`` and the jitted function's other attributes go
    to that ``jax.jit`` object. Called with traced arguments (inside another program, e.g. a
    predictor mapped by the sampler's step) it is a plain nested ``jax.jit``: XLA compiles only
    top-level programs, with the options of the outer one.
    """

    def __init__(self, fun: Callable, kwargs: dict):
        functools.update_wrapper(self, fun)
        self._fun, self._kwargs = fun, kwargs

    @functools.cached_property
    def jitted(self):
        return jax.jit(self._fun, compiler_options=compiler_options(), **self._kwargs)

    @functools.cached_property
    def nested(self):
        return jax.jit(self._fun, **self._kwargs)

    def __call__(self, *args, **kwargs):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
            return self.nested(*args, **kwargs)
        return self.jitted(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_fun", "_kwargs", "jitted", "nested"):
            raise AttributeError(name)
        return getattr(self.jitted, name)


def jit(fun: Callable | None = None, **kwargs) -> Callable:
    """``jax.jit`` with cbcert's `compiler_options` (same arguments; usable as a decorator,
    bare or with keyword arguments). The options are resolved at the first call or lowering,
    so jitting at import time does not start the backend."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    return _Jit(fun, kwargs)
