"""Monte Carlo sampling of a model under noise, in fixed-size chunks on all devices.

The (input, sample) pairs of a run are flattened (sample index fastest) and cut into chunks of
B pairs, the last one padded with copies of a valid pair whose results are dropped on the host.
One jitted step maps a chunk to per-pair results; it depends only on B, the event shape/dtype
and the static structure of the model and noise, so a run — or a sweep over σ/ρ/ε/m, inputs and
sample counts — compiles once. The noise of sample j of global input i comes from
``sample_key(key, i, j)`` (``cbcert.engine.keys``), hence results are bit-identical for any
chunk size, batch of inputs, padding or device count. The step for chunk k+1 is dispatched
before the results of chunk k are read back, so the devices never wait for the host.

A NaN or inf logit is no vote (``argmax`` would count an all-NaN row as class 0): the step marks
such samples, and the counting samplers refuse them -- and non-finite inputs -- with a
`NonFiniteError` instead of returning counts.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from cbcert.engine.chunks import ProgressCallback, Run, collect, voting_run
from cbcert.engine.noise import NoiseModel
from cbcert.engine.validity import check_votes


def count_classes(
    apply_fn: Callable,
    params,
    inputs,
    noise: NoiseModel,
    key: jax.Array,
    num_samples: int,
    *,
    scale,
    num_classes: int,
    indices=None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
    mesh: Mesh | None = None,
    progress: ProgressCallback | None = None,
    dtype=None,
) -> np.ndarray:
    """Counts of argmax labels of every head over noisy samples of every input.

    ``counts[n, h, y] = #{j < num_samples : argmax_c apply_fn(params, x̃_nj)[h, c] = y}`` with
    ``x̃_nj = noise.perturb(sample_key(key, indices[n], j), inputs[n], scale)`` — the Monte Carlo
    estimate behind ``PREDICT``/``CERTIFY`` of Cohen et al. (2019) and Lee et al. (2019). All H
    heads see the same noisy sample.

    Args:
      apply_fn: ``apply_fn(params, x[B, *event]) -> logits[B, H, num_classes]``, pure and jittable.
      params: pytree of arrays passed to ``apply_fn`` (replicated on every device).
      inputs: ``[N, *event]`` clean inputs in the perturbation space (latents ``z`` or concept
        representations ``c``).
      noise: noise model (``cbcert.engine.noise``).
      key: stream key (e.g. ``stream_key(root, STREAM_ESTIMATE)``), typed or raw ``uint32[2]``.
      num_samples: noisy samples per input, ``>= 1``.
      scale: the noise's scale (σ, ρ, m, ε), keyword-only, traced (one step for all scales).
      num_classes: C, the size of the logits' last axis.
      indices: ``[N]`` global input indices (default ``arange(N)``); pass them when ``inputs``
        is a subset or a batch of a larger run so the noise stays the same.
      chunk_size: pairs per chunk B, capped at the run's pairs rounded up to a power of two
        (at least 8 per device; `cbcert.engine.memory.capped_chunk_size`) and rounded up to a
        multiple of the device count; default from ``max_memory``.
      max_memory: bytes per device a chunk may use when ``chunk_size`` is None (default: a
        quarter of the device memory, or 8 MiB where the device does not report it, with at
        least 32 pairs per device for compute-bound steps of runs long enough to repay a second
        compilation; see ``cbcert.engine.memory``).
      mesh: device mesh to split chunks over (default: all devices, one ``"data"`` axis).
      progress: ``callback(done, total)`` called after every chunk, or None (the engine draws
        no progress bars; front ends such as the CLI do).
      dtype: optional floating compute dtype (e.g. ``jnp.bfloat16``) the noisy samples are
        cast to before ``apply_fn``; noise is always drawn in the inputs' dtype. A
        non-floating dtype is refused (TypeError): it would round the noise away.

    Returns:
      ``[N, H, num_classes]`` int64 counts; every ``counts[n, h].sum() == num_samples``.

    Raises:
      NonFiniteError: an input holds a NaN or inf (before sampling), or ``apply_fn`` returned
        a NaN or inf logit for a noisy sample (when its chunk is read back).
    """
    run = voting_run(apply_fn, num_classes, params, inputs, noise, scale, key, num_samples,
                     indices, chunk_size, max_memory, mesh, dtype)
    counts = None

    def consume(labels: np.ndarray, start: int, valid: int) -> None:
        nonlocal counts
        labels = labels[:valid]  # [v, H]
        pairs = start + np.arange(valid)  # [v]
        check_votes(labels, run.indices[pairs // run.num_samples])
        if counts is None:
            counts = np.zeros((run.num_inputs, labels.shape[1], num_classes), np.int64)
        first = start // run.num_samples
        rows = pairs // run.num_samples - first  # [v]
        heads = labels.shape[1]
        flat = (rows[:, None] * heads + np.arange(heads)) * num_classes + labels  # [v, H]
        window = counts[first : first + rows[-1] + 1]
        window += np.bincount(flat.ravel(), minlength=window.size).reshape(window.shape)

    run.execute(consume, progress)
    return counts


def sample_labels(
    apply_fn: Callable,
    params,
    inputs,
    noise: NoiseModel,
    key: jax.Array,
    num_samples: int,
    *,
    scale,
    num_classes: int,
    indices=None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
    mesh: Mesh | None = None,
    progress: ProgressCallback | None = None,
    dtype=None,
) -> np.ndarray:
    """The votes behind `count_classes`, one per sample: ``labels[n, j, h] = argmax_c
    apply_fn(params, x̃_nj)[h, c]`` (`NO_VOTE` where a logit of head h is NaN or inf).

    Runs `count_classes`' own chunk step (same body, noise, key and dtype), so for the same
    arguments it reuses that compilation, and ``labels`` rebuilds its counts exactly:
    ``counts[n, h, y] = #{j : labels[n, j, h] = y}``. For per-sample comparisons of two models
    or dtypes on the same noisy samples (e.g. bf16 vs fp32 agreement).

    Args: as `count_classes`.

    Returns:
      ``[N, num_samples, H]`` int32 labels.
    """
    run = voting_run(apply_fn, num_classes, params, inputs, noise, scale, key, num_samples,
                     indices, chunk_size, max_memory, mesh, dtype)
    return collect(run, progress)


def map_samples(
    fn: Callable,
    params,
    inputs,
    noise: NoiseModel,
    key: jax.Array,
    num_samples: int,
    *,
    scale,
    indices=None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
    mesh: Mesh | None = None,
    progress: ProgressCallback | None = None,
    dtype=None,
):
    """Per-sample results of ``fn`` on clean/noisy pairs (empirical PFR, CFR, DFS; SPEC §3).

    Sample j of input n is ``x̃_nj = noise.perturb(sample_key(key, indices[n], j), inputs[n],
    scale)`` exactly as in ``count_classes``, so both see the same noise for the same key.

    Args:
      fn: ``fn(params, x_clean[B, *event], x_noisy[B, *event]) -> pytree of [B, ...]`` arrays,
        pure and jittable (e.g. predictions and concept states of clean and noisy images).
      params, inputs, noise, key, num_samples, scale, indices, chunk_size, max_memory, mesh,
      progress, dtype: as in ``count_classes`` (``dtype`` casts both clean and noisy inputs).

    Returns:
      The pytree of ``fn``'s outputs as numpy arrays ``[N, num_samples, ...]``.
    """
    run = Run.create(fn, params, inputs, noise, scale, key, num_samples, indices, chunk_size,
                      max_memory, mesh, dtype)
    return collect(run, progress)


def map_inputs(
    fn: Callable,
    params,
    inputs,
    *,
    chunk_size: int | None = None,
    max_memory: int | None = None,
    mesh: Mesh | None = None,
    progress: ProgressCallback | None = None,
    dtype=None,
):
    """``fn`` over every input in memory-bounded chunks on all devices (no noise).

    ``out[n] = fn(params, inputs[n:n+1])[0]`` for every n, computed in fixed-size chunks whose
    size comes from ``max_memory`` (XLA's memory estimate of one input, as in `count_classes`)
    or ``chunk_size``; the last chunk is padded and its padding dropped. This is how clean
    images are classified (agreement pool, clean references, attack starts), so no generator
    or classifier call ever holds more than one chunk, whatever the number of inputs.

    Args:
      fn: ``fn(params, x[B, *event]) -> pytree of [B, ...]`` arrays, pure and jittable. Pass the
        same function object across calls to reuse its compilation.
      params, inputs, chunk_size, max_memory, mesh, progress, dtype: as in `count_classes`
        (``progress`` counts inputs).

    Returns:
      The pytree of ``fn``'s outputs as numpy arrays ``[N, ...]``.
    """
    out = map_samples(_clean_body(fn), params, inputs, Unperturbed(), _UNUSED_KEY, 1,
                      scale=0.0, chunk_size=chunk_size, max_memory=max_memory, mesh=mesh,
                      progress=progress, dtype=dtype)
    return jax.tree.map(lambda leaf: leaf[:, 0], out)


@dataclasses.dataclass(frozen=True)
class Unperturbed:
    """The identity "noise" of `map_inputs`: every sample is the clean input."""

    def check_scale(self, scale) -> np.ndarray:
        return np.float32(0.0)

    def check_event(self, event_shape: tuple[int, ...]) -> None:
        del event_shape

    def perturb(self, key: jax.Array, x: jax.Array, scale: jax.Array) -> jax.Array:
        del key, scale
        return x


# `map_inputs` draws no noise; the sampler still threads a key through its step.
_UNUSED_KEY = np.zeros(2, np.uint32)


def cast_floating(tree, dtype):
    """``tree`` with every floating-point leaf cast to ``dtype``; other leaves unchanged.

    The parameters of a reduced-precision run: ``--dtype bfloat16`` casts the generator's and
    the classifiers' parameters with it and the noisy samples with ``count_classes(...,
    dtype=)``; counts stay integers. ``cast_floating({"w": f32[2], "n": i32[]}, jnp.bfloat16)
    -> {"w": bf16[2], "n": i32[]}``.
    """
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


@functools.lru_cache(maxsize=64)
def _clean_body(fn: Callable) -> Callable:
    """``map_samples`` body applying ``fn`` to the clean inputs (cached: one jitted step)."""

    def body(params, x_clean, x_noisy):
        del x_noisy
        return fn(params, x_clean)

    return body
