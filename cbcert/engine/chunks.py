"""A sampling run cut into fixed-size chunks, and the jitted step that maps a chunk.

`Run.create` validates a run (inputs, sample count, indices, key, scale, chunk size) and picks
its chunk (``cbcert.engine.memory``: XLA's estimate of the probe's memory against a budget, the
compute-bound floor); `jitted_step` is the one jitted program per (body, noise, mesh, key
implementation, dtype) that draws the noise of a chunk's pairs on every device and applies the
body. The public samplers (``cbcert.engine.sampler``) and the per-input stopping of
``cbcert.engine.continuous`` are built on these.
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
from cbcert.engine.validity import NO_VOTE, check_dtype, check_finite_inputs

MAX_INDEX = 2**31
# ``callback(done, total)``: (input, sample) pairs finished so far, and in all.
ProgressCallback = Callable[[int, int], None]


@functools.lru_cache(maxsize=64)
def argmax_body(apply_fn: Callable, num_classes: int) -> Callable:
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


def voting_run(apply_fn: Callable, num_classes, params, inputs, noise: NoiseModel, scale, key,
               num_samples: int, indices, chunk_size, max_memory, mesh, dtype) -> "Run":
    """The `Run` of the counting samplers (``count_classes``, ``sample_labels``,
    ``count_classes_sequential``): `argmax_body` votes of ``apply_fn``'s heads over
    ``num_samples`` samples per input. Raises ValueError unless ``num_classes`` is an integer
    ``>= 1``, and `NonFiniteError` naming every input holding a NaN or inf (before sampling).
    """
    if not (isinstance(num_classes, int | np.integer) and num_classes >= 1):
        raise ValueError(f"num_classes={num_classes!r} must be an integer >= 1")
    run = Run.create(argmax_body(apply_fn, int(num_classes)), params, inputs, noise, scale, key,
                     num_samples, indices, chunk_size, max_memory, mesh, dtype)
    check_finite_inputs(run.inputs, run.indices)
    return run


@functools.lru_cache(maxsize=64)
def jitted_step(body: Callable, noise: NoiseModel, mesh: Mesh, key_impl: str | None,
                dtype) -> Callable:
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
class Run:
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
               max_memory, mesh, dtype) -> "Run":
        check_dtype(dtype)
        inputs = np.asarray(inputs)
        inputs = inputs.astype(jax.dtypes.canonicalize_dtype(inputs.dtype), copy=False)
        if inputs.ndim < 1 or inputs.shape[0] < 1:
            raise ValueError(f"inputs has shape {inputs.shape}; expected [N >= 1, *event]")
        num_inputs, event_shape = inputs.shape[0], inputs.shape[1:]
        if not (isinstance(num_samples, int | np.integer) and 1 <= num_samples < MAX_INDEX):
            raise ValueError(f"num_samples={num_samples!r} must be an integer in [1, 2**31)")
        noise.check_event(event_shape)
        scale = noise.check_scale(scale)
        indices = check_indices(indices, num_inputs)
        key_data, key_impl = split_key(key)
        mesh = sharding.default_mesh() if mesh is None else mesh
        shards = sharding.num_shards(mesh)
        step = jitted_step(body, noise, mesh, key_impl, dtype)
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
            chunk_size = memory.capped_chunk_size(chunk_size, num_pairs, shards)
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


def check_indices(indices, num_inputs: int) -> np.ndarray:
    """``indices[N]`` as int32 global input indices in ``[0, 2**31)`` (``arange(N)`` for None);
    ValueError naming the shape, dtype or range otherwise."""
    if indices is None:
        return np.arange(num_inputs, dtype=np.int32)
    indices = np.asarray(indices)
    if indices.shape != (num_inputs,) or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(
            f"indices has shape {indices.shape} and dtype {indices.dtype}; expected integers "
            f"[N={num_inputs}]"
        )
    if indices.min() < 0 or indices.max() >= MAX_INDEX:
        raise ValueError(
            f"indices range over [{indices.min()}, {indices.max()}]; allowed range [0, 2**31)"
        )
    return indices.astype(np.int32)


def split_key(key) -> tuple[np.ndarray | jax.Array, str | None]:
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


def collect(run: "Run", progress: ProgressCallback | None):
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
