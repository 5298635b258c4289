"""How many (input, sample) pairs a chunk holds: XLA's memory estimate against a budget.

A chunk's size is the largest power of two whose per-device memory -- temporaries, outputs and
per-pair arguments from XLA's memory analysis of the compiled step on a small probe -- fits the
budget (``max_memory``; a quarter of the device memory on GPU/TPU, 8 MiB on CPU, where small
chunks stay in cache). On CPU with the default budget, a compute-bound step (at least
``COMPUTE_BOUND_FLOPS_PER_BYTE`` FLOPs per byte of per-pair memory, from XLA's cost analysis of
the same probe) gets at least ``COMPUTE_BOUND_CHUNK_PER_DEVICE`` pairs: its deep layers' small
feature maps give matmuls of few rows at small chunks; a run too short to repay compiling that
larger chunk (`repays_second_compilation`) keeps the probe's. `batch_within_memory` does the same
for work the sampler does not run itself (APGD's gradient steps).
"""

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cbcert.engine import compiler, sharding

# Per-device memory a chunk may use when the device does not report its capacity (CPU). Small
# on purpose: on CPU, chunks whose activations outgrow the caches are slower (default world on
# 2 cores with patch-matmul convolutions: ~1200 samples/s at 8 pairs per chunk, ~700 at 32-64,
# ~880 at 512; with native convolutions on large maps, 2026-12-02: chunk 16, 0.30 MiB per pair).
DEFAULT_MAX_MEMORY = 8 * 2**20
# Fraction of a reporting device's memory (GPU/TPU) a chunk may use by default.
DEFAULT_MEMORY_FRACTION = 0.25
# Larger chunks than this gain nothing measurable and delay the first progress update.
MAX_CHUNK_PER_DEVICE = 2**14
# Smaller chunks leave matmul units idle whatever the memory estimate says.
MIN_CHUNK_PER_DEVICE = 8
# Largest probe chunk (pairs per device) of `probe_pairs`: the built-in world's automatic chunk on
# CPU (0.30 MiB per pair under the 8 MiB rule), so its runs compile the step once.
PROBE_PAIRS_PER_DEVICE = 16
# Inputs of `batch_within_memory`'s probe.
_GRADIENT_PROBE_INPUTS = 8
# CPU, default budget: steps this compute-bound (FLOPs per byte of per-pair memory) take at
# least COMPUTE_BOUND_CHUNK_PER_DEVICE pairs, if those fit COMPUTE_BOUND_MAX_MEMORY. Measured
# with jax 0.10.2 on 2 cores (interleaved rounds, benchmarks/timing.py), chunk 32 vs chunk 8:
# ResNet-18 on 64 px images (724 FLOP/B, 0.28 GFLOP/pair) 1.51x, BigGAN-deep-32 -> ResNet-50 at
# 56 px (600 FLOP/B) 1.28x, StyleGAN2-64 + CB-AE -> ResNet-50 (805 FLOP/B) 1.08x; the built-in
# world, then 31 FLOP/B (every convolution a patch matmul, memory-bound), ran 0.55-0.66x at
# 32-64 and kept the 8 MiB rule. Since its convolutions take the native path on large maps
# (2026-12-02) it is 166-170 FLOP/B at 0.30 MiB per pair: chunk 16 under the 8 MiB rule.
COMPUTE_BOUND_FLOPS_PER_BYTE = 200.0
COMPUTE_BOUND_CHUNK_PER_DEVICE = 32
COMPUTE_BOUND_MAX_MEMORY = 256 * 2**20
# The compute-bound chunk is a second program to compile after the probe's (measured on 2 cores:
# ResNet-18 steps ~3 s, BigGAN/StyleGAN2 -> ResNet-50 ~5-10 s) for a 1.08-1.51x faster run. A run
# of fewer FLOPs per device than this (~15-20 s of such a CPU at chunk 16, where a 1.3x gain
# saves about one compilation) keeps the probe's chunk and runs the probe's compiled program.
COMPUTE_BOUND_MIN_RUN_FLOPS = 1e12


def batch_within_memory(fn: Callable, params, event_shape: tuple[int, ...], dtype, *,
                        max_memory: int | None = None, factor: int = 1, minimum: int = 1,
                        maximum: int | None = None, mesh: Mesh | None = None) -> int:
    """Largest power-of-two batch B with ``factor · B`` inputs of ``fn`` within ``max_memory``.

    For work the sampler does not run itself, e.g. APGD's gradient steps: the bytes one input
    costs come from XLA's memory analysis of ``jax.jit(fn)(params, x[8, *event])``
    (temporaries, outputs and the per-input arguments), as for `count_classes`' chunks.
    ``factor`` multiplies the cost of one input (e.g. the EOT samples behind each attacked
    point); the result is clipped to ``[minimum, maximum]`` (``minimum`` without compiling
    anything when ``maximum <= minimum``).

    Args:
      fn: ``fn(params, x[B, *event]) -> pytree``, pure and jittable.
      params: its parameters (their bytes are not charged to the inputs).
      event_shape, dtype: shape and dtype of one input.
      max_memory: bytes per device (default: as `count_classes`).
    """
    mesh = sharding.default_mesh() if mesh is None else mesh
    budget = check_max_memory(max_memory, mesh)
    if maximum is not None and maximum <= minimum:
        return minimum  # the clip decides whatever the memory: no probe to compile
    probe = _GRADIENT_PROBE_INPUTS
    x = jax.ShapeDtypeStruct((probe, *event_shape), np.dtype(dtype))
    analysis = compiler.jit(fn).lower(params, x).compile().memory_analysis()
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
    limit = _device_bytes_limit(mesh)
    if limit is not None:
        return int(limit * DEFAULT_MEMORY_FRACTION)
    return DEFAULT_MAX_MEMORY


def default_cpu_budget(max_memory: int | None, mesh: Mesh) -> bool:
    """Whether ``check_max_memory`` falls back to ``DEFAULT_MAX_MEMORY`` (no budget given, and
    the devices report no capacity: CPU)."""
    return max_memory is None and _device_bytes_limit(mesh) is None


def _device_bytes_limit(mesh: Mesh) -> int | None:
    # A device of this process: another host's devices report nothing here (multi-host).
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    stats = (local or list(mesh.devices.flat))[0].memory_stats() or {}
    return stats.get("bytes_limit")


class PairCost(NamedTuple):
    """Per-device bytes and FLOPs one (input, sample) pair costs in a compiled step."""

    bytes: float
    flops: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte of per-pair memory (0 where either is unknown)."""
        return self.flops / self.bytes if self.bytes > 0 else 0.0


def run_chunk_pairs(num_pairs: int, shards: int) -> int:
    """Pairs per device of a chunk that holds the whole run: its size rounded up to a power of
    two, at least ``MIN_CHUNK_PER_DEVICE``.

    The largest chunk a run needs. Small runs (an agreement pool of 2 inputs, PREDICT's ``n0``
    samples of 1 input) pad up to ``MIN_CHUNK_PER_DEVICE`` rather than compile a program of
    their own size: the runs of 1 to 8 pairs per device share one program, as those of 9 to 16
    share another. ``run_chunk_pairs(3, 1) = 8``, ``run_chunk_pairs(10, 1) = 16``.
    """
    needed = 1 << max(0, math.ceil(math.log2(-(-num_pairs // shards))))
    return max(needed, MIN_CHUNK_PER_DEVICE)


def capped_chunk_size(chunk_size: int, num_pairs: int, shards: int) -> int:
    """A requested chunk (``--chunk-size``, pairs over all devices) capped at the run's own
    `run_chunk_pairs`: a chunk larger than the run would only allocate padding
    (``--chunk-size 10**9`` once tried to allocate 12 GiB), and a run smaller than the request
    still pads up to it within that cap, so its stages share the requested chunk's program."""
    return min(int(chunk_size), run_chunk_pairs(num_pairs, shards) * shards)


def probe_pairs(num_pairs: int, shards: int) -> int:
    """Pairs per device of the memory probe: the run's `run_chunk_pairs` (what
    `auto_chunk_size` picks for a run that fits), at most ``PROBE_PAIRS_PER_DEVICE``
    (the built-in world's automatic chunk on CPU). When the run then takes that chunk, it
    runs on the probe's compiled program: one compilation, not two."""
    return min(run_chunk_pairs(num_pairs, shards), PROBE_PAIRS_PER_DEVICE)


def probe_step(step, mesh, params, event_shape, input_dtype, key_data, scale,
               pairs: int = PROBE_PAIRS_PER_DEVICE) -> tuple[PairCost, Any]:
    """Per-device bytes and FLOPs of one (input, sample) pair, from XLA's analyses, and the
    probe's compiled step.

    Compiles the step for a probe chunk of ``pairs`` pairs per device and divides its
    temporaries, outputs and per-pair arguments, and its cost analysis' FLOPs, by ``pairs``.
    Where the backend gives no memory analysis, falls back to four copies of the event (clean,
    key bits, noise, noisy); no cost analysis gives 0 FLOPs. The compiled step
    (``jax.stages.Compiled``, called like ``step`` on a chunk of ``pairs * shards`` pairs with
    the arguments' shardings) serves a run whose chunk is the probe's size instead of
    compiling the same program again. Cached per configuration, so only the first run of a
    configuration pays for the probe.
    """
    leaves, treedef = jax.tree.flatten((params, key_data, scale))
    signature = (treedef, tuple((tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves))
    return _probe_cached(step, mesh, signature, tuple(event_shape), np.dtype(input_dtype),
                         int(pairs))


@functools.lru_cache(maxsize=64)
def _probe_cached(step, mesh, signature, event_shape, input_dtype, pairs):
    treedef, avals = signature
    replicated = NamedSharding(mesh, P())
    params, key_data, scale = jax.tree.unflatten(
        treedef, [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in avals]
    )
    shards = sharding.num_shards(mesh)
    probe = pairs * shards
    batch = NamedSharding(mesh, sharding.batch_spec(mesh))
    args = (
        params,
        jax.ShapeDtypeStruct((probe, *event_shape), input_dtype, sharding=batch),
        jax.ShapeDtypeStruct((probe,), jnp.int32, sharding=batch),
        jax.ShapeDtypeStruct((probe,), jnp.int32, sharding=batch),
        key_data,
        scale,
    )
    event_bytes = math.prod(event_shape) * input_dtype.itemsize
    compiled = step.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) and cost else cost) or {}
    flops = float(cost.get("flops", 0.0)) / pairs  # per-device program
    analysis = compiled.memory_analysis()
    if analysis is None:
        return PairCost(4.0 * event_bytes, flops), compiled
    params_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in avals)
    per_pair_args = max(analysis.argument_size_in_bytes - params_bytes, 0.0)
    used = analysis.temp_size_in_bytes + analysis.output_size_in_bytes + per_pair_args
    return PairCost(max(used / pairs, float(event_bytes)), flops), compiled


def repays_second_compilation(flops_per_pair: float, num_pairs: int, shards: int) -> bool:
    """Whether a compute-bound run is long enough to compile a larger chunk than its probe's.

    ``flops_per_pair · ⌈num_pairs / shards⌉ >= COMPUTE_BOUND_MIN_RUN_FLOPS`` (per device; 0
    FLOPs where the backend has no cost analysis, so never). Deterministic: the chunk, and so
    the order of floating-point work, never depends on a timing.
    """
    return flops_per_pair * -(-num_pairs // shards) >= COMPUTE_BOUND_MIN_RUN_FLOPS


def auto_chunk_size(per_pair: float, max_memory: int, num_pairs: int, shards: int, *,
                    compute_bound: bool = False) -> int:
    """Largest power-of-two chunk per device within ``max_memory``, capped by the run's
    `run_chunk_pairs` (its size rounded up, at least ``MIN_CHUNK_PER_DEVICE``).

    At least ``MIN_CHUNK_PER_DEVICE`` pairs per device (the budget is a target, not a limit);
    ``compute_bound`` (a CPU step doing many FLOPs per byte, with the default budget) raises
    that floor to ``COMPUTE_BOUND_CHUNK_PER_DEVICE`` pairs, or as many as fit
    ``COMPUTE_BOUND_MAX_MEMORY``. Powers of two keep the batch friendly to matmul tiling and
    let runs of similar size share one compilation.
    """
    floor = MIN_CHUNK_PER_DEVICE
    if compute_bound:
        floor = max(floor, min(COMPUTE_BOUND_CHUNK_PER_DEVICE,
                               int(COMPUTE_BOUND_MAX_MEMORY // per_pair)))
    fits = int(min(max(max_memory // per_pair, floor), MAX_CHUNK_PER_DEVICE))
    per_device = 1 << (fits.bit_length() - 1)
    return min(per_device, run_chunk_pairs(num_pairs, shards)) * shards
