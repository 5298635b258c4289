"""How many (input, sample) pairs a chunk holds: XLA's memory estimate against a budget.

A chunk's size is the largest power of two whose per-device memory -- temporaries, outputs and
per-pair arguments from XLA's memory analysis of the compiled step on a small probe -- fits the
budget (``max_memory``; a quarter of the device memory on GPU/TPU, 8 MiB on CPU, where small
chunks stay in cache). `batch_within_memory` does the same for work the sampler does not run
itself (APGD's gradient steps).
"""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cbcert.engine import sharding

# Per-device memory a chunk may use when the device does not report its capacity (CPU). Small
# on purpose: on CPU, chunks whose activations outgrow the caches are slower (default world on
# 2 cores: ~1200 samples/s at 8 pairs per chunk, ~700 at 32-64, ~880 at 512).
DEFAULT_MAX_MEMORY = 8 * 2**20
# Fraction of a reporting device's memory (GPU/TPU) a chunk may use by default.
DEFAULT_MEMORY_FRACTION = 0.25
# Larger chunks than this gain nothing measurable and delay the first progress update.
MAX_CHUNK_PER_DEVICE = 2**14
# Smaller chunks leave matmul units idle whatever the memory estimate says.
MIN_CHUNK_PER_DEVICE = 8
_PROBE_PAIRS_PER_DEVICE = 8


def batch_within_memory(fn: Callable, params, event_shape: tuple[int, ...], dtype, *,
                        max_memory: int | None = None, factor: int = 1, minimum: int = 1,
                        maximum: int | None = None, mesh: Mesh | None = None) -> int:
    """Largest power-of-two batch B with ``factor · B`` inputs of ``fn`` within ``max_memory``.

    For work the sampler does not run itself, e.g. APGD's gradient steps: the bytes one input
    costs come from XLA's memory analysis of ``jax.jit(fn)(params, x[8, *event])``
    (temporaries, outputs and the per-input arguments), as for `count_classes`' chunks.
    ``factor`` multiplies the cost of one input (e.g. the EOT samples behind each attacked
    point); the result is clipped to ``[minimum, maximum]``.

    Args:
      fn: ``fn(params, x[B, *event]) -> pytree``, pure and jittable.
      params: its parameters (their bytes are not charged to the inputs).
      event_shape, dtype: shape and dtype of one input.
      max_memory: bytes per device (default: as `count_classes`).
    """
    mesh = sharding.default_mesh() if mesh is None else mesh
    budget = check_max_memory(max_memory, mesh)
    probe = _PROBE_PAIRS_PER_DEVICE
    x = jax.ShapeDtypeStruct((probe, *event_shape), np.dtype(dtype))
    analysis = jax.jit(fn).lower(params, x).compile().memory_analysis()
    event_bytes = math.prod(event_shape) * np.dtype(dtype).itemsize
    if analysis is None:
        per_input = 4.0 * event_bytes
    else:
        params_bytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(params))
        args = max(analysis.argument_size_in_bytes - params_bytes, 0.0)
        used = analysis.temp_size_in_bytes + analysis.output_size_in_bytes + args
        per_input = max(used / probe, float(event_bytes))
    fits = max(int(budget // (per_input * max(factor, 1))), 1)
    batch = 1 << (fits.bit_length() - 1)
    if maximum is not None:
        batch = min(batch, maximum)
    return max(batch, minimum)


def check_max_memory(max_memory: int | None, mesh: Mesh) -> int:
    if max_memory is not None:
        if not (isinstance(max_memory, int | np.integer) and max_memory >= 1):
            raise ValueError(f"max_memory={max_memory!r} must be a positive number of bytes")
        return int(max_memory)
    # A device of this process: another host's devices report nothing here (multi-host).
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    stats = (local or list(mesh.devices.flat))[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] * DEFAULT_MEMORY_FRACTION)
    return DEFAULT_MAX_MEMORY


def bytes_per_pair(step, mesh, params, event_shape, input_dtype, key_data, param) -> float:
    """Per-device bytes one (input, sample) pair costs, from XLA's memory analysis.

    Compiles the step for a small probe chunk and divides its temporaries, outputs and
    per-pair arguments by the pairs each device holds. Where the backend gives no analysis,
    falls back to four copies of the event (clean, key bits, noise, noisy). Cached per
    configuration, so only the first run of a configuration pays for the probe.
    """
    leaves, treedef = jax.tree.flatten((params, key_data, param))
    signature = (treedef, tuple((tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves))
    return _bytes_per_pair_cached(step, mesh, signature, tuple(event_shape),
                                  np.dtype(input_dtype))


@functools.lru_cache(maxsize=64)
def _bytes_per_pair_cached(step, mesh, signature, event_shape, input_dtype) -> float:
    treedef, avals = signature
    replicated = NamedSharding(mesh, P())
    params, key_data, param = jax.tree.unflatten(
        treedef, [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in avals]
    )
    shards = sharding.num_shards(mesh)
    probe = _PROBE_PAIRS_PER_DEVICE * shards
    batch = NamedSharding(mesh, sharding.batch_spec(mesh))
    args = (
        params,
        jax.ShapeDtypeStruct((probe, *event_shape), input_dtype, sharding=batch),
        jax.ShapeDtypeStruct((probe,), jnp.int32, sharding=batch),
        jax.ShapeDtypeStruct((probe,), jnp.int32, sharding=batch),
        key_data,
        param,
    )
    event_bytes = math.prod(event_shape) * input_dtype.itemsize
    analysis = step.lower(*args).compile().memory_analysis()
    if analysis is None:
        return 4.0 * event_bytes
    params_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in avals)
    per_pair_args = max(analysis.argument_size_in_bytes - params_bytes, 0.0)
    used = analysis.temp_size_in_bytes + analysis.output_size_in_bytes + per_pair_args
    return max(used / _PROBE_PAIRS_PER_DEVICE, float(event_bytes))


def auto_chunk_size(per_pair: float, max_memory: int, num_pairs: int, shards: int) -> int:
    """Largest power-of-two chunk per device within ``max_memory``, capped by the run's size.

    At least ``MIN_CHUNK_PER_DEVICE`` pairs per device (the budget is a target, not a limit);
    powers of two keep the batch friendly to matmul tiling and let runs of similar size share
    one compilation.
    """
    fits = int(min(max(max_memory // per_pair, MIN_CHUNK_PER_DEVICE), MAX_CHUNK_PER_DEVICE))
    per_device = 1 << (fits.bit_length() - 1)
    needed = 1 << max(0, math.ceil(math.log2(-(-num_pairs // shards))))
    return min(per_device, needed) * shards
