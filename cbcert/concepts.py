"""The concept representation: the one home of its layout (SPEC §1, docs/DESIGN.md).

A concept representation ``c`` is a flat vector ``[2K + U]``: interleaved logit pairs
``c[2i] = c_i+``, ``c[2i+1] = c_i−`` for the K binary concepts, then U unsupervised dims ``u``.
The state of concept i is ``C(c)_i = 1[c_i+ > c_i−]``; flipping it swaps its pair. Every module
that reads or writes pairs goes through this file (pure ``jax.numpy``, importable anywhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_concept_dim(shape: tuple[int, ...], num_concepts: int, name: str = "c") -> None:
    """Raise ValueError unless ``shape[-1]`` holds ``2 * num_concepts`` logits (plus any ``u``)."""
    if num_concepts < 1:
        raise ValueError(f"num_concepts={num_concepts} must be >= 1")
    if len(shape) < 1 or shape[-1] < 2 * num_concepts:
        raise ValueError(
            f"{name} has shape {tuple(shape)}; its last axis must hold 2*num_concepts="
            f"{2 * num_concepts} interleaved logits (plus optional unsupervised dims)"
        )


def pairs(c: jax.Array, num_concepts: int) -> jax.Array:
    """The logit pairs ``[c_i+, c_i−]``: ``c[..., 2K + U] -> [..., K, 2]``."""
    return c[..., : 2 * num_concepts].reshape(*c.shape[:-1], num_concepts, 2)


def join(pair_logits: jax.Array, rest: jax.Array) -> jax.Array:
    """Inverse of `pairs`: ``[..., K, 2]`` pairs and ``u[..., U]`` -> ``c[..., 2K + U]``."""
    flat = pair_logits.reshape(*pair_logits.shape[:-2], 2 * pair_logits.shape[-2])
    return jnp.concatenate([flat, rest], axis=-1)


def unsupervised(c: jax.Array, num_concepts: int) -> jax.Array:
    """The unsupervised dims ``u = c[..., 2K:]``."""
    return c[..., 2 * num_concepts :]


def margins(c: jax.Array, num_concepts: int) -> jax.Array:
    """``c_i+ − c_i−`` of every concept: ``[..., 2K + U] -> [..., K]`` (> 0 iff concept on)."""
    p = pairs(c, num_concepts)
    return p[..., 0] - p[..., 1]


def concept_state(c: jax.Array, num_concepts: int) -> jax.Array:
    """Concept state ``C(c)_i = 1[c_i+ > c_i−]`` (SPEC §1): ``[..., 2K + U] -> bool[..., K]``."""
    check_concept_dim(c.shape, num_concepts)
    p = pairs(c, num_concepts)
    return p[..., 0] > p[..., 1]


def flip_pairs(c: jax.Array, eta: jax.Array, num_concepts: int) -> jax.Array:
    """Concept flip ``F(c, η)`` (SPEC §1): swap the pair ``(c_i+, c_i−)`` wherever ``η_i = 1``.

    Args:
      c: concept representations ``[..., 2K + U]``.
      eta: flip indicators ``[..., K]`` (bool or 0/1), broadcastable against ``c[..., :1]``.
      num_concepts: K.

    Returns:
      ``[..., 2K + U]``, same dtype as ``c``; the unsupervised dims ``u`` are untouched.
    """
    check_concept_dim(c.shape, num_concepts)
    p = pairs(c, num_concepts)  # [..., K, 2]
    flipped = jnp.where(jnp.asarray(eta, bool)[..., None], p[..., ::-1], p)
    return join(flipped, unsupervised(c, num_concepts))


def swap_pairs(c: jax.Array, num_concepts: int) -> jax.Array:
    """Swap the two entries of each of the first ``num_concepts`` pairs: ``c[..., 2K + U]``.

    Converts upstream CB-AE bins ``[absent, present]`` to cbcert's ``[c+, c−]`` and back.
    """
    if num_concepts == 0:
        return c
    return join(pairs(c, num_concepts)[..., ::-1], unsupervised(c, num_concepts))


def absent_present(c: jax.Array, num_concepts: int) -> jax.Array:
    """Two-way logits ``[c_i−, c_i+]`` per concept (class 1 = on): ``[..., 2K+U] -> [..., K, 2]``.
    """
    return pairs(c, num_concepts)[..., ::-1]


def set_concept(c: jax.Array, concept: int | jax.Array, value: bool | jax.Array) -> jax.Array:
    """Set concept ``i`` to ``value`` by swapping logits: ``c[B, 2K + U] -> c'[B, 2K + U]``.

    The CB-AE intervention (Kulkarni et al.): the bin's largest logit moves to the wanted bin and
    the wanted bin's old logit to where the maximum was. For a pair this is ``c'_want =
    max(c+, c−)``, ``c'_other = min(c+, c−)``: a swap if the concept has the other state, a no-op
    if it already has the wanted one. ``concept`` and ``value`` may be traced.
    """
    pos, neg = c[..., 2 * concept], c[..., 2 * concept + 1]
    high, low = jnp.maximum(pos, neg), jnp.minimum(pos, neg)
    new_pos, new_neg = jnp.where(value, high, low), jnp.where(value, low, high)
    return c.at[..., 2 * concept].set(new_pos).at[..., 2 * concept + 1].set(new_neg)
