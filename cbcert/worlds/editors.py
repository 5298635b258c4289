"""Concept editors: how a world turns "flip these concepts" into an edited concept
representation, perfectly or with designed defects (SPEC §8, counterfactuals).

An editor is a pure function of one edit, ``edit(key, c[2K + U], targets bool[K]) ->
c'[2K + U]`` (`World.edit` maps it over a batch, one key per edit).
The perfect editor swaps the targets' logit pairs (`cbcert.concepts.flip_pairs`) and ignores
its key: on the built-in worlds the generator's read-out ``C(E(D(c')))`` then shows exactly the
asked edit, so edit verification can never reject anything. The **imperfect editor** fails in
a controlled way, independently per target concept i of each edit:

* with probability ``fail`` the flip of i does not happen (i keeps its state);
* otherwise, with probability ``leak``, the edit leaks: i's correlated partner ``i ⊕ 1`` (the
  concepts are paired 0↔1, 2↔3, …: blue↔stripes, large↔outline, …) flips too — when the
  partner is not a target itself (a leak onto a target has no effect).

A leak lands only on a non-target, and a partner is unique, so leaks never cancel and never
undo a failure: an edit comes out exactly as asked iff no target failed and none leaked,
``P(valid) = (1 − fail)^m (1 − leak)^f`` for m targets of which f have a partner outside the
targets (`designed_validity`; ``((1 − fail)(1 − leak))^m`` when no two targets are partners).
The draws come from the edit's key: two ``[K]`` uniforms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from cbcert.concepts import flip_pairs

Editor = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def perfect_editor(num_concepts: int) -> Editor:
    """``edit(key, c, targets) = F(c, targets)``: the targets' pairs swapped, nothing else."""
    def edit(key, c, targets):
        del key  # exact: no randomness
        return flip_pairs(c, targets, num_concepts)

    return edit


def partners(num_concepts: int) -> jax.Array:
    """``[K]`` int32: each concept's correlated partner ``i ⊕ 1`` (K even)."""
    if num_concepts % 2:
        raise ValueError(f"num_concepts={num_concepts} must be even to pair the concepts")
    return jnp.arange(num_concepts) ^ 1


@dataclass(frozen=True)
class EditorDefects:
    """The designed defects of an imperfect editor: per target concept, ``fail`` (the flip
    does not happen) and, given it happens, ``leak`` (its partner flips too); each in [0, 1)."""

    fail: float
    leak: float

    def __post_init__(self):
        for name in ("fail", "leak"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r} must be in [0, 1)")


def designed_validity(defects: EditorDefects, targets) -> np.ndarray:
    """``(1 − fail)^m (1 − leak)^f``: the probability that an edit of the ``targets bool[...,
    K]`` comes out exactly as asked (m targets, f of them with their partner outside the
    targets); ``[...]`` float64."""
    targets = np.asarray(targets, bool)
    free = targets & ~targets[..., np.asarray(partners(targets.shape[-1]))]
    return ((1.0 - defects.fail) ** targets.sum(axis=-1)
            * (1.0 - defects.leak) ** free.sum(axis=-1))


def imperfect_editor(num_concepts: int, defects: EditorDefects) -> Editor:
    """The editor with ``defects`` (module docstring): ``edit(key, c[2K + U], targets
    bool[K]) -> c'``, the flips actually applied being ``(targets ∧ ¬failed) ⊕
    partner-of(targets ∧ ¬failed ∧ leaked ∧ partner not a target)``."""
    mate = partners(num_concepts)

    def edit(key, c, targets):
        targets = jnp.asarray(targets, bool)
        draw_fail, draw_leak = jax.random.uniform(key, (2, *targets.shape))
        done = targets & (draw_fail >= defects.fail)  # [B, K]
        leaked = done & (draw_leak < defects.leak) & ~targets[..., mate]
        spill = jnp.zeros_like(done).at[..., mate].set(leaked)  # partner of each leaked i
        return flip_pairs(c, done ^ spill, num_concepts)

    return edit


__all__ = ["Editor", "EditorDefects", "designed_validity", "imperfect_editor", "partners",
           "perfect_editor"]
