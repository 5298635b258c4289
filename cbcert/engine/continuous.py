"""Continuous batching for sequential Monte Carlo: inputs stop at checkpoints and free slots.

`count_classes_sequential` counts argmax labels like ``sampler.count_classes``, but an input
is sampled only up to its next checkpoint ``n_k``; when its first ``n_k`` labels are back, a
``decide`` callback (the sequential statistics, ``cbcert.certify.sequential``) says whether it
stops. A stopped input frees its place in the chunks for the next input, so the devices stay
busy with samples that are still needed and wall time falls with the samples saved.

Chunks are filled from a queue of (input, first sample, end) segments: continuations of
running inputs first, then new inputs in order; a chunk that cannot be filled (every running
input waits for its checkpoint's labels and no new input is left) is padded and masked, as in
the sampler. Sample ``j`` of global input ``i`` always has the noise of ``sample_key(key, i,
j)`` and an input never receives samples beyond ``n_k`` before its decision at ``n_k``, so the
counts seen at every checkpoint -- hence every decision, count and sample number -- are
bit-identical whatever the chunk size, the order inputs are admitted in, the inputs run
together, the devices or a resume; and the first ``n_k`` samples are those of
``count_classes(…, num_samples=n_k)``. One chunk is dispatched before the previous one is read
back, as in the sampler; the jitted step is the sampler's (one compilation per configuration).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from cbcert.engine import chunks, sampler, sharding
from cbcert.engine.noise import NoiseModel

# ``decide(rows[m], k, counts[m, H, C]) -> stop[m]``: inputs ``rows`` (positions in ``inputs``)
# have their first ``checkpoints[k]`` labels counted in ``counts``.
Decide = Callable[[np.ndarray, int, np.ndarray], np.ndarray]
# ``finished(rows[m], counts[m, H, C], samples[m], seconds[m])`` once inputs have stopped.
Finished = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]


@dataclasses.dataclass(frozen=True)
class SequentialCounts:
    """What `count_classes_sequential` returns; every field indexed like ``inputs``.

    Attributes:
      counts: ``[N, H, C]`` int64 label counts over the samples each input drew.
      samples: ``[N]`` samples drawn per input: the checkpoint at which it stopped.
      seconds: ``[N]`` wall time attributed to each input: the time between consecutive chunk
        read-backs, shared among the chunk's valid samples.
    """

    counts: np.ndarray
    samples: np.ndarray
    seconds: np.ndarray


def count_classes_sequential(
    apply_fn: Callable,
    params,
    inputs,
    noise: NoiseModel,
    key: jax.Array,
    checkpoints: Sequence[int],
    decide: Decide,
    *,
    scale,
    num_classes: int,
    indices=None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
    mesh: Mesh | None = None,
    finished: Finished | None = None,
    dtype=None,
) -> SequentialCounts:
    """Label counts of every head with per-input stopping at checkpoints (continuous batching).

    Input ``n`` draws samples ``j = 0, 1, …`` with ``x̃_nj = noise.perturb(sample_key(key,
    indices[n], j), inputs[n], scale)`` as in ``count_classes``. When its first
    ``checkpoints[k]`` labels are counted, ``decide([n], k, counts)`` is called (inputs reaching
    a checkpoint together come in one call); if it returns True, or ``k`` is the last
    checkpoint, the input stops with ``samples[n] = checkpoints[k]`` and ``finished`` is called
    for it, else it continues to ``checkpoints[k + 1]``.

    Args:
      apply_fn, params, inputs, noise, key, scale, num_classes, indices, chunk_size,
      max_memory, mesh, dtype: as in ``cbcert.engine.sampler.count_classes`` (the chunk size is
        sized and capped for ``N · checkpoints[-1]`` pairs).
      checkpoints: strictly increasing sample counts ``n_1 < … < n_K`` (``n_K`` the maximum).
      decide: ``decide(rows[m], k, counts[m, H, C]) -> bool[m]``, a deterministic function of
        its arguments (every process of a multi-host job must decide alike).
      finished: ``finished(rows, counts, samples, seconds)`` for inputs as they stop (write
        their records there), or None.

    Returns:
      `SequentialCounts`. With the single checkpoint ``n``, ``counts`` equals
      ``count_classes(…, num_samples=n)``.

    Raises:
      NonFiniteError: as ``count_classes`` (non-finite inputs, or a NaN/inf logit in a chunk
        read back; inputs that stopped before were already passed to ``finished``).
    """
    checkpoints = _check_checkpoints(checkpoints)
    run = chunks.voting_run(apply_fn, num_classes, params, inputs, noise, scale, key,
                            checkpoints[-1], indices, chunk_size, max_memory, mesh, dtype)
    return _Scheduler(run, checkpoints, int(num_classes), decide, finished).execute()


def _check_checkpoints(checkpoints) -> tuple[int, ...]:
    values = tuple(checkpoints)
    ok = bool(values) and all(isinstance(c, int | np.integer) and not isinstance(c, bool)
                              and 1 <= c < 2**31 for c in values)
    if not ok or any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"checkpoints={list(values)!r} must be strictly increasing integers "
                         "in [1, 2**31)")
    return tuple(int(c) for c in values)


class _Scheduler:
    """The segment queue, the running inputs' counts and the two-deep dispatch pipeline."""

    def __init__(self, run, checkpoints, num_classes, decide, finished):
        self.run, self.checkpoints = run, checkpoints
        self.num_classes, self.decide, self.finished = num_classes, decide, finished
        num = run.num_inputs
        self.queue: collections.deque = collections.deque()  # [row, next sample, end]
        self.admitted = 0
        self.level = np.zeros(num, np.int64)  # checkpoint index each input is heading to
        self.returned = np.zeros(num, np.int64)  # labels counted per input
        self.samples = np.zeros(num, np.int64)
        self.seconds = np.zeros(num, np.float64)
        self.counts: np.ndarray | None = None
        self.clock = time.perf_counter()

    def execute(self) -> SequentialCounts:
        pending: collections.deque = collections.deque()
        while True:
            chunk = self._fill()
            if chunk is not None:
                pending.append((self._dispatch(*chunk), *chunk))
            if not pending:
                break
            if chunk is None or len(pending) > 1:
                self._finish(*pending.popleft())
        return SequentialCounts(self.counts, self.samples, self.seconds)

    def _fill(self):
        """The next chunk's ``(rows[B], samples[B], valid)``, padded; None if nothing to run."""
        size, rows, samples = self.run.chunk, [], []
        taken = 0
        while taken < size:
            if not self.queue:
                if self.admitted == self.run.num_inputs:
                    break
                self.queue.append([self.admitted, 0, self.checkpoints[0]])
                self.admitted += 1
            segment = self.queue[0]
            take = min(size - taken, segment[2] - segment[1])
            rows.append(np.full(take, segment[0], np.int64))
            samples.append(np.arange(segment[1], segment[1] + take, dtype=np.int64))
            segment[1] += take
            taken += take
            if segment[1] == segment[2]:
                self.queue.popleft()
        if taken == 0:
            return None
        pad = size - taken  # copies of the last pair; their labels are dropped
        rows = np.concatenate(rows + [np.full(pad, rows[-1][-1], np.int64)])
        samples = np.concatenate(samples + [np.full(pad, samples[-1][-1], np.int64)])
        return rows, samples, taken

    def _dispatch(self, rows: np.ndarray, samples: np.ndarray, valid: int):
        run = self.run
        put = functools.partial(sharding.put_batch, run.mesh)
        return run.step(run.params, put(run.inputs[rows]), put(run.indices[rows]),
                        put(samples.astype(np.int32)), run.key_data, run.scale)

    def _finish(self, out, rows: np.ndarray, samples: np.ndarray, valid: int) -> None:
        labels = sharding.fetch_replicated(out)[:valid]  # [v, H]
        sampler.check_votes(labels, self.run.indices[rows[:valid]])
        now = time.perf_counter()
        elapsed, self.clock = now - self.clock, now
        heads = labels.shape[1]
        if self.counts is None:
            self.counts = np.zeros((self.run.num_inputs, heads, self.num_classes), np.int64)
        uniq, local = np.unique(rows[:valid], return_inverse=True)  # [u], [v]
        flat = (local[:, None] * heads + np.arange(heads)) * self.num_classes + labels  # [v, H]
        size = uniq.size * heads * self.num_classes
        self.counts[uniq] += np.bincount(flat.ravel(), minlength=size).reshape(
            uniq.size, heads, self.num_classes)
        per_row = np.bincount(local, minlength=uniq.size)
        self.returned[uniq] += per_row
        self.seconds[uniq] += elapsed * per_row / valid
        target = np.asarray(self.checkpoints)[self.level[uniq]]
        reached = uniq[self.returned[uniq] == target]
        # Levels as they were at read-back: an input that continues past checkpoint k in this
        # loop is headed to k + 1 and must not be decided there before its samples are back.
        levels = self.level[reached]
        for k in np.unique(levels):
            self._decide(reached[levels == k], int(k))

    def _decide(self, rows: np.ndarray, k: int) -> None:
        stop = np.asarray(self.decide(rows, k, self.counts[rows].copy()), bool)
        if stop.shape != rows.shape:
            raise ValueError(f"decide returned shape {stop.shape}; expected {rows.shape}")
        if k == len(self.checkpoints) - 1:
            stop = np.ones_like(stop)
        for row in rows[~stop]:
            self.level[row] = k + 1
            self.queue.append([int(row), self.checkpoints[k], self.checkpoints[k + 1]])
        done = rows[stop]
        self.samples[done] = self.checkpoints[k]
        if self.finished is not None and done.size:
            self.finished(done, self.counts[done].copy(), self.samples[done].copy(),
                          self.seconds[done].copy())
