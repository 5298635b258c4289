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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cbcert.engine import compiler, memory, sharding
from cbcert.engine.keys import sample_key
from cbcert.engine.noise import NoiseModel
from cbcert.engine.validity import (
    NO_VOTE,
    check_dtype,
    check_finite_inputs,
    check_votes,
)

_MAX_INDEX = 2**31
# ``callback(done, total)``: (input, sample) pairs finished so far, and in all.
ProgressCallback = Callable[[int, int], None]
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
      chunk_size: pairs per chunk B, capped at the run's pairs and rounded up to a multiple of
        the device count; default from ``max_memory``.
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
    if not (isinstance(num_classes, int | np.integer) and num_classes >= 1):
        raise ValueError(f"num_classes={num_classes!r} must be an integer >= 1")
    body = _argmax_body(apply_fn, int(num_classes))
    run = _Run.create(body, params, inputs, noise, scale, key, num_samples, indices, chunk_size,
                      max_memory, mesh, dtype)
    check_finite_inputs(run.inputs, run.indices)
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
    if not (isinstance(num_classes, int | np.integer) and num_classes >= 1):
        raise ValueError(f"num_classes={num_classes!r} must be an integer >= 1")
    run = _Run.create(_argmax_body(apply_fn, int(num_classes)), params, inputs, noise, scale,
                      key, num_samples, indices, chunk_size, max_memory, mesh, dtype)
    check_finite_inputs(run.inputs, run.indices)
    return _collect(run, progress)


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
    run = _Run.create(fn, params, inputs, noise, scale, key, num_samples, indices, chunk_size,
                      max_memory, mesh, dtype)
    return _collect(run, progress)


def _collect(run: "_Run", progress: ProgressCallback | None):
    """Executes ``run`` and returns its per-pair outputs as numpy ``[N, num_samples, ...]``."""
    flat_out = None

    def consume(out, start: int, valid: int) -> None:
        nonlocal flat_out
        if flat_out is None:
            flat_out = jax.tree.map(
                lambda leaf: np.empty((run.num_pairs, *leaf.shape[1:]), leaf.dtype), out
            )
        for dst, src in zip(jax.tree.leaves(flat_out), jax.tree.leaves(out), strict=True):
            dst[start : start + valid] = src[:valid]

    run.execute(consume, progress)
    return jax.tree.map(
        lambda leaf: leaf.reshape(run.num_inputs, run.num_samples, *leaf.shape[1:]), flat_out
    )


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


@functools.lru_cache(maxsize=64)
def _argmax_body(apply_fn: Callable, num_classes: int) -> Callable:
    """Per-chunk body of ``count_classes``: labels ``[B, H]`` int32 of the noisy samples.

    ``labels[b, h] = argmax_c logits[b, h, c]``, or `NO_VOTE` where a logit of that head is
    NaN or inf (one ``isfinite`` reduction per chunk). Cached so that repeated runs reuse one
    jitted step (and its compilation).
    """

    def body(params, x_clean, x_noisy):
        del x_clean
        logits = apply_fn(params, x_noisy)
        if logits.ndim != 3 or logits.shape[0] != x_noisy.shape[0] or (
            logits.shape[2] != num_classes
        ):
            raise ValueError(
                f"apply_fn must return logits [B, H, num_classes={num_classes}] for "
                f"x[B={x_noisy.shape[0]}, ...]; got shape {tuple(logits.shape)}"
            )
        votes = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, H]
        return jnp.where(jnp.isfinite(logits).all(axis=-1), votes, NO_VOTE)

    return body


@functools.lru_cache(maxsize=64)
def _step(body: Callable, noise: NoiseModel, mesh: Mesh, key_impl: str | None, dtype) -> Callable:
    """Jitted chunk step ``(params, x[B,*event], i[B], j[B], key_data, scale) -> body outputs``.

    Each device draws the noise of its own pairs and runs ``body`` on them (``shard_map``: the
    partitioning is explicit, the compiler does not get to choose); the per-pair results are
    then replicated (one all-gather of small outputs) so every process can read all of them.
    """
    def local(params, x, i, j, key_data, scale):
        key = key_data if key_impl is None else jax.random.wrap_key_data(key_data, impl=key_impl)
        keys = jax.vmap(sample_key, in_axes=(None, 0, 0))(key, i, j)  # [b]
        x_noisy = jax.vmap(noise.perturb, in_axes=(0, 0, None))(keys, x, scale)  # [b, *event]
        if dtype is not None:
            x, x_noisy = x.astype(dtype), x_noisy.astype(dtype)
        out = body(params, x, x_noisy)
        for leaf in jax.tree.leaves(out):
            if leaf.ndim < 1 or leaf.shape[0] != x.shape[0]:
                raise ValueError(
                    f"fn must return arrays with a leading batch axis of size {x.shape[0]}; "
                    f"got shape {tuple(leaf.shape)}"
                )
        return out

    spec = sharding.batch_spec(mesh)
    return compiler.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), spec, spec, spec, P(), P()), out_specs=spec),
        out_shardings=NamedSharding(mesh, P()),
    )


@dataclasses.dataclass(frozen=True)
class _Run:
    """A validated sampling run: inputs on the host, the step, and the chunk plan."""

    step: Callable
    mesh: Mesh
    params: object  # pytree replicated on ``mesh``
    inputs: np.ndarray  # [N, *event]
    indices: np.ndarray  # [N] int32, global input indices
    num_inputs: int
    num_samples: int
    num_pairs: int
    chunk: int  # pairs per chunk, a multiple of the device count
    key_data: jax.Array
    scale: jax.Array

    @classmethod
    def create(cls, body, params, inputs, noise, scale, key, num_samples, indices, chunk_size,
               max_memory, mesh, dtype) -> "_Run":
        check_dtype(dtype)
        inputs = np.asarray(inputs)
        inputs = inputs.astype(jax.dtypes.canonicalize_dtype(inputs.dtype), copy=False)
        if inputs.ndim < 1 or inputs.shape[0] < 1:
            raise ValueError(f"inputs has shape {inputs.shape}; expected [N >= 1, *event]")
        num_inputs, event_shape = inputs.shape[0], inputs.shape[1:]
        if not (isinstance(num_samples, int | np.integer) and 1 <= num_samples < _MAX_INDEX):
            raise ValueError(f"num_samples={num_samples!r} must be an integer in [1, 2**31)")
        noise.check_event(event_shape)
        scale = noise.check_scale(scale)
        indices = _check_indices(indices, num_inputs)
        key_data, key_impl = _split_key(key)
        mesh = sharding.default_mesh() if mesh is None else mesh
        shards = sharding.num_shards(mesh)
        step = _step(body, noise, mesh, key_impl, dtype)
        params = sharding.put_replicated(mesh, params)
        num_pairs = num_inputs * int(num_samples)
        if chunk_size is None:
            probe = memory.probe_pairs(num_pairs, shards)
            cost, compiled = memory.probe_step(step, mesh, params, event_shape, inputs.dtype,
                                               key_data, scale, probe)
            compute_bound = (memory.default_cpu_budget(max_memory, mesh)
                             and cost.intensity >= memory.COMPUTE_BOUND_FLOPS_PER_BYTE)
            if compute_bound and not memory.repays_second_compilation(cost.flops, num_pairs,
                                                                      shards):
                chunk_size = probe * shards  # a short run: the program compiled already
            else:
                chunk_size = memory.auto_chunk_size(
                    cost.bytes, memory.check_max_memory(max_memory, mesh), num_pairs, shards,
                    compute_bound=compute_bound)
            if chunk_size == probe * shards:  # the probe compiled this very program
                step = compiled
        elif not (isinstance(chunk_size, int | np.integer) and chunk_size >= 1):
            raise ValueError(f"chunk_size={chunk_size!r} must be an integer >= 1")
        else:
            # A chunk larger than the run would only allocate padding.
            chunk_size = min(int(chunk_size), num_pairs)
        return cls(
            step=step, mesh=mesh, params=params, inputs=inputs, indices=indices,
            num_inputs=num_inputs, num_samples=int(num_samples), num_pairs=num_pairs,
            chunk=-(-int(chunk_size) // shards) * shards,
            key_data=sharding.put_replicated(mesh, key_data),
            scale=sharding.put_replicated(mesh, scale),
        )

    def execute(self, consume: Callable, progress: ProgressCallback | None) -> None:
        """Runs every chunk, calling ``consume(host_outputs, start, valid)`` in order."""
        self._loop(consume, progress or None)

    def _loop(self, consume: Callable, callback: ProgressCallback | None) -> None:
        pending = None
        for start in range(0, self.num_pairs, self.chunk):
            out = self._dispatch(start)
            if pending is not None:
                self._finish(consume, callback, *pending)
            pending = (out, start, min(self.chunk, self.num_pairs - start))
        self._finish(consume, callback, *pending)

    def _dispatch(self, start: int):
        pairs = np.minimum(start + np.arange(self.chunk), self.num_pairs - 1)  # [B], padded
        rows = pairs // self.num_samples
        put = functools.partial(sharding.put_batch, self.mesh)
        return self.step(
            self.params,
            put(self.inputs[rows]),
            put(self.indices[rows]),
            put((pairs % self.num_samples).astype(np.int32)),
            self.key_data,
            self.scale,
        )

    def _finish(self, consume, callback, out, start: int, valid: int) -> None:
        consume(sharding.fetch_replicated(out), start, valid)
        if callback is not None:
            callback(start + valid, self.num_pairs)


def _check_indices(indices, num_inputs: int) -> np.ndarray:
    if indices is None:
        return np.arange(num_inputs, dtype=np.int32)
    indices = np.asarray(indices)
    if indices.shape != (num_inputs,) or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(
            f"indices has shape {indices.shape} and dtype {indices.dtype}; expected integers "
            f"[N={num_inputs}]"
        )
    if indices.min() < 0 or indices.max() >= _MAX_INDEX:
        raise ValueError(
            f"indices range over [{indices.min()}, {indices.max()}]; allowed range [0, 2**31)"
        )
    return indices.astype(np.int32)


def _split_key(key) -> tuple[np.ndarray | jax.Array, str | None]:
    """Raw key data and the PRNG implementation name (None for a raw ``uint32`` key)."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"key has shape {key.shape}; expected one scalar key")
        return jax.random.key_data(key), jax.random.key_impl(key)
    if key.dtype != jnp.uint32 or key.ndim != 1:
        raise ValueError(
            f"key has shape {key.shape} and dtype {key.dtype}; expected a jax.random.key or a "
            "raw uint32 key"
        )
    return key, None
