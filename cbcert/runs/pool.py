"""The input pool of a run and its agreement set (SPEC §3), shared by every runner.

``z_i ~ N(0, I)`` is drawn from ``fold_in(fold_in(root, Stream.POOL), i)``; the agreement set is
the pool inputs on which ``f_std`` and ``f_cbm`` predict the same class on the clean image, that
class being the reference label. Certification, perturbation and attack runs with the same seed
use the same inputs. Every generator and classifier call here goes through the engine's
memory-bounded `map_inputs`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from cbcert.engine.keys import Stream, stream_key
from cbcert.engine.sampler import map_inputs
from cbcert.schema import ConfigError
from cbcert.worlds.world import clean_predictor


class PoolTooSmallError(ConfigError):
    """Too few generated inputs have std and cbm agreeing for the number of inputs asked."""

    def __init__(self, message: str):
        super().__init__(message, key="num_inputs")


@dataclass(frozen=True)
class Pool:
    """The agreement set of a generated input pool (SPEC §3).

    Attributes:
      indices: ``[M]`` pool indices where ``f_std`` and ``f_cbm`` agree on the clean image.
      labels: ``[M]`` the shared clean prediction, the reference label.
      true_labels: ``[M]`` ground-truth classes when the world knows them, else None.
      latents: ``[M, d]`` their latents (``[M, d + 1]`` inputs ``[z ; k]`` in a multi-class
        conditional world).
      pool_size: how many latents were generated to find them.
      asked: ``[M]`` the class each input asked a multi-class conditional generator for
        (``classes[k]``), else None.
    """

    indices: np.ndarray
    labels: np.ndarray
    true_labels: np.ndarray | None
    latents: np.ndarray
    pool_size: int
    asked: np.ndarray | None = None

    def input_fields(self, row: int) -> dict:
        """Record fields of input ``row`` beyond the common ones: ``{"generator_class": c}``
        in a multi-class conditional world (the class the input asked for), else ``{}``."""
        return {} if self.asked is None else {"generator_class": int(self.asked[row])}


# Indices conditioned together by a world's latent prior (a divisor of agreement_pool's block).
PRIOR_BLOCK = 64


def pool_latents(world, seed: int, start: int, count: int) -> np.ndarray:
    """Latents ``z_i ~ N(0, I)``, i in ``[start, start + count)``: ``[count, d]``.

    ``z_i`` is drawn from ``fold_in(fold_in(root, Stream.POOL), i)``, so the pool is the same
    whatever its size or the block in which an index is generated. In a world with a
    ``latent_prior`` (the saturated worlds' class-conditional prior) that draw is then
    conditioned with the key ``fold_in(fold_in(root, Stream.PRIOR), i)``, always within the
    aligned block of `PRIOR_BLOCK` indices that holds i: the prior's matmuls round a row
    differently with the batch's row count on some CPUs (AVX-512), and a pool input must not
    depend on the block it is drawn in. A multi-class conditional
    generator's inputs are ``[z_i ; k_i]`` (``[count, d + 1]``): the class position ``k_i`` is
    uniform over its ``classes``, drawn from ``fold_in(fold_in(root, Stream.CLASSES), i)``, so
    ``z_i`` is the same as in a one-class world with the same seed.
    """
    root = jax.random.key(seed)
    gen = world.generator
    key = stream_key(root, Stream.POOL)
    d = gen.latent_dim
    index = np.arange(start, start + count)
    draw = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(key, i), (d,)))
    if world.latent_prior is None:
        z = np.asarray(draw(index))
    else:  # z_i conditioned as the world's prior says, in blocks of PRIOR_BLOCK indices
        prior_key = stream_key(root, Stream.PRIOR)
        first = start // PRIOR_BLOCK * PRIOR_BLOCK
        blocks = []
        for lo in range(first, start + count, PRIOR_BLOCK):
            block = np.arange(lo, lo + PRIOR_BLOCK)
            keys = jax.vmap(lambda i: jax.random.fold_in(prior_key, i))(block)
            blocks.append(np.asarray(world.latent_prior(gen.params, draw(block), keys)))
        z = np.concatenate(blocks)[start - first:start - first + count]
    if not gen.classes:
        return z
    class_key = stream_key(root, Stream.CLASSES)
    pick = jax.vmap(lambda i: jax.random.randint(jax.random.fold_in(class_key, i), (), 0,
                                                 len(gen.classes)))
    return gen.with_classes(z, np.asarray(pick(index)))


def agreement_pool(
    world,
    seed: int,
    num_inputs: int,
    *,
    space: str = "latent",
    block: int = 256,
    max_pool: int | None = None,
    chunk_size: int | None = None,
    max_memory: int | None = None,
) -> Pool:
    """First ``num_inputs`` pool inputs on which ``std`` and ``cbm`` agree on the clean image.

    For concept-space runs the clean image is the autoencoded ``g2(D(E(g1(z))))`` (SPEC §1).
    Latents are searched in blocks of ``block``; each block is classified by the engine in
    chunks within ``max_memory`` (or of ``chunk_size``), so a large generator never renders a
    whole block at once. Raises ValueError if fewer are found among ``max_pool`` (default
    ``20 · num_inputs``) latents. A world with fixed inputs (``world.dataset``, e.g. pixel
    space) has no agreement set: see `dataset_pool`.
    """
    if world.dataset is not None:
        return dataset_pool(world, num_inputs)
    max_pool = max_pool or max(20 * num_inputs, block)
    params = world.params
    predict = clean_predictor(world, space, ("std", "cbm"))

    found_idx, found_lab, found_z = [], [], []
    start = 0
    while sum(map(len, found_idx)) < num_inputs and start < max_pool:
        z = pool_latents(world, seed, start, block)
        pred = map_inputs(predict, params, z, chunk_size=chunk_size,
                          max_memory=max_memory)  # [B, 2]
        agree = np.flatnonzero(pred[:, 0] == pred[:, 1])
        found_idx.append(start + agree)
        found_lab.append(pred[agree, 0])
        found_z.append(z[agree])
        start += block
    indices = np.concatenate(found_idx)[:num_inputs]
    if len(indices) < num_inputs:
        raise PoolTooSmallError(
            f"only {len(indices)} of {start} generated inputs have std and cbm agreeing, "
            f"fewer than the {num_inputs} inputs asked for"
        )
    latents = np.concatenate(found_z)[:num_inputs]
    true = None
    if world.true_label is not None:
        true = map_inputs(_true_labels(world), params, latents, chunk_size=chunk_size,
                          max_memory=max_memory)
    gen = world.generator
    asked = (np.asarray(gen.classes)[latents[:, gen.latent_dim].astype(np.int64)]
             if gen.classes else None)
    return Pool(
        indices=indices,
        labels=np.concatenate(found_lab)[:num_inputs],
        true_labels=true,
        latents=latents,
        pool_size=start,
        asked=asked,
    )


def dataset_pool(world, num_inputs: int) -> Pool:
    """The first ``num_inputs`` fixed inputs of ``world.dataset`` in file order, each labelled
    with its own label (reference label = true label); no agreement filter, no noise drawn."""
    data = world.dataset
    total = len(data.labels)
    if num_inputs > total:
        raise PoolTooSmallError(f"{world.name} holds {total} inputs, fewer than the "
                                f"{num_inputs} inputs asked for")
    labels = data.labels[:num_inputs]
    return Pool(indices=np.arange(num_inputs), labels=labels, true_labels=labels,
                latents=data.latents[:num_inputs], pool_size=total)


@functools.lru_cache(maxsize=32)
def _true_labels(world) -> Callable:
    """``(params, z[B, d]) -> int32[B]`` ground-truth classes (one object per world: one jit)."""
    return lambda params, z: world.true_label(params["gen"], z)


def space_inputs(world, latents: np.ndarray, space: str, *, chunk_size: int | None = None,
                 max_memory: int | None = None) -> np.ndarray:
    """The inputs a space's noise perturbs: the latents ``z`` (``latent``) or ``c = E(g1(z))``."""
    if space == "latent":
        return latents
    return encode_inputs(world, latents, chunk_size=chunk_size, max_memory=max_memory)


def encode_inputs(world, latents: np.ndarray, *, chunk_size: int | None = None,
                  max_memory: int | None = None) -> np.ndarray:
    """``c = E(g1(z))`` of every latent, in memory-bounded chunks: ``[N, d] -> [N, 2K + U]``."""
    return map_inputs(_encoder(world), world.params, latents, chunk_size=chunk_size,
                      max_memory=max_memory)


@functools.lru_cache(maxsize=32)
def _encoder(world) -> Callable:
    return world.encode_latents
