"""The budget kinds of empirical robustness runs (`cbcert.runs.perturb`) and what an image
record observes.

Four kinds: geometric ε (latent shift ``z + ε u``), semantic τ (τ concept flips), and the
smoothing noises σ (latent Gaussian) and ρ (Bernoulli concept flips). Each has its space, its
engine noise, its key stream (`cbcert.engine.keys.Stream`) and its range rule
(`cbcert.schema.RULES`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp

from cbcert.concepts import concept_state
from cbcert.engine.keys import Stream
from cbcert.engine.noise import BernoulliFlips, FixedFlips, Gaussian, SphereShift
from cbcert.schema import value_name


@dataclass(frozen=True)
class BudgetKind:
    """One kind of budget: where its noise acts, which noise, which key stream, which range."""

    space: str  # "latent" (noise on z) or "concept" (noise on c = E(g1(z)))
    stream: int
    rule: str  # the budget's range in `cbcert.schema.RULES`

    def noise(self, kind: str, num_concepts: int, ball: bool):
        """The engine noise model whose scale is the budget value."""
        if kind == "eps":
            return SphereShift(ball=ball)
        if kind == "tau":
            return FixedFlips(num_concepts)
        return Gaussian() if kind == "sigma" else BernoulliFlips(num_concepts)


BUDGET_KINDS = {
    "eps": BudgetKind("latent", Stream.GEOMETRIC, "eps"),
    "tau": BudgetKind("concept", Stream.SEMANTIC, "count"),
    "sigma": BudgetKind("latent", Stream.ESTIMATE, "sigma"),
    "rho": BudgetKind("concept", Stream.ESTIMATE, "rho"),
}


def budget_name(kind: str, value: float) -> str:
    """File stem of a budget's records: ``eps0.3``, ``tau5`` (exact: `value_name`)."""
    return f"{kind}{value_name(value)}"


def observer(world, space: str, models: tuple[str, ...], scores: bool, *,
             prototypes: bool = False, logits: bool = False) -> Callable:
    """Pure ``observe(params, x[B, *event]) -> dict`` of what a record needs about an image.

    ``x`` is a latent ``z[B, d]`` (space ``latent``: image ``g(z)``, concepts ``c = E(g1(z))``)
    or a concept representation ``c[B, 2K + U]`` (space ``concept``: image ``g2(D(c))``).

    Returns ``{"pred": int32[B, H] argmax of every model, "state": bool[B, K] = C(c)}`` plus
    ``"scores": [B, K]`` the CBM's concept scores r (for DFS) when ``scores``, and
    ``"prototypes": [B, P]`` the prototype similarities (`World.prototypes`) when ``prototypes``,
    and ``"logits": [B, H, C]`` every model's logits when ``logits``.
    """
    gen = world.generator
    k = gen.num_concepts

    def observe(params, x):
        c = x if space == "concept" else gen.concepts(params["gen"], x)  # [B, 2K + U]
        image = gen.image_from_concepts(params["gen"], c)  # [B, H, W, 3]
        out_logits = world.classify(params["clf"], image, models)  # [B, H, C]
        out = {"pred": jnp.argmax(out_logits, axis=-1).astype(jnp.int32),
               "state": concept_state(c, k)}
        if scores:
            out["scores"] = world.concept_scores(params["clf"], image)  # [B, K]
        if prototypes:
            out["prototypes"] = world.prototypes(params["clf"], image)  # [B, P]
        if logits:
            out["logits"] = out_logits
        return out

    return observe


__all__ = ["BUDGET_KINDS", "BudgetKind", "budget_name", "observer"]
