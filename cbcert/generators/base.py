"""The generator protocol shared by the built-in world and the ported generators.

A generator ``g = g2 ∘ D ∘ E ∘ g1`` (SPEC §1) reaches the rest of cbcert as a frozen
bundle of pure functions and one parameter pytree, so the engine can compose it with a
classifier inside ``jax.jit`` without knowing what it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

Params = Any
Array = jax.Array


@dataclass(frozen=True)
class Generator:
    """A generator split as ``g = g2 ∘ D ∘ E ∘ g1``.

    Attributes:
      name: human-readable name.
      latent_dim: d, the latent ``z ∈ R^d`` has a standard normal prior.
      concept_names: the K binary concepts, in the order of the logit pairs.
      num_unsup: U, unsupervised dims appended to the concept representation.
      image_shape: (H, W, 3) of rendered images, values in [0, 1].
      params: parameter pytree passed to every function below.
      g1: ``(params, z[B, d]) -> w[B, dw]``.
      encode: E, ``(params, w[B, dw]) -> c[B, 2K + U]`` (interleaved logit pairs, then u).
      decode: D, ``(params, c[B, 2K + U]) -> w[B, dw]``.
      g2: ``(params, w[B, dw]) -> x[B, H, W, 3]``.
    """

    name: str
    latent_dim: int
    concept_names: tuple[str, ...]
    num_unsup: int
    image_shape: tuple[int, int, int]
    params: Params
    g1: Callable[[Params, Array], Array]
    encode: Callable[[Params, Array], Array]
    decode: Callable[[Params, Array], Array]
    g2: Callable[[Params, Array], Array]

    @property
    def num_concepts(self) -> int:
        """K, the number of binary concepts."""
        return len(self.concept_names)

    @property
    def concept_dim(self) -> int:
        """2K + U, the size of the concept representation ``c``."""
        return 2 * self.num_concepts + self.num_unsup

    def image(self, params: Params, z: Array) -> Array:
        """``g(z) = g2(D(E(g1(z))))``: ``z[B, d] -> x[B, H, W, 3]``.

        The full chain goes through the bottleneck, so the latent image is the autoencoded one.
        For the built-in world ``D(E(w)) = w`` exactly.
        """
        return self.g2(params, self.decode(params, self.encode(params, self.g1(params, z))))

    def concepts(self, params: Params, z: Array) -> Array:
        """``c = E(g1(z))``: ``z[B, d] -> c[B, 2K + U]``."""
        return self.encode(params, self.g1(params, z))

    def image_from_concepts(self, params: Params, c: Array) -> Array:
        """``g2(D(c))``: ``c[B, 2K + U] -> x[B, H, W, 3]`` (semantic perturbations act on c)."""
        return self.g2(params, self.decode(params, c))

