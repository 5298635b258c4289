"""The generator protocol shared by the built-in world and the ported generators.

A generator ``g = g2 ∘ D ∘ E ∘ g1`` (SPEC §1) reaches the rest of cbcert as a frozen
bundle of pure functions and one parameter pytree, so the engine can compose it with a
classifier inside ``jax.jit`` without knowing what it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
      classes: the classes a multi-class conditional generator renders (BigGAN's ImageNet
        indices, a conditional StyleGAN2's labels), or ``()``. With classes, an input is
        ``[z ; k]`` of width ``d + 1``: ``k`` is the position in ``classes`` of the class
        this input asks for, stored as a float (exact: at most `MAX_CLASSES` positions, so
        also in bfloat16) and read by ``g1``. No noise, shift or attack touches ``k``
        (`cbcert.engine.noise.restrict`), so every perturbation acts on ``z`` exactly as in a
        one-class world; ``k`` has no gradient.
      num_ws: how many per-layer copies of one ``w`` make ``g1``'s output (StyleGAN2's
        ``w+``, ``dw = num_ws · w_dim``; 1 otherwise): a CB-AE trained for the generator
        (`cbcert.training.cbae`) reads them as ``[num_ws, dw / num_ws]``.
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
    classes: tuple[int, ...] = ()
    num_ws: int = 1

    @property
    def num_concepts(self) -> int:
        """K, the number of binary concepts."""
        return len(self.concept_names)

    @property
    def concept_dim(self) -> int:
        """2K + U, the size of the concept representation ``c``."""
        return 2 * self.num_concepts + self.num_unsup

    @property
    def input_dim(self) -> int:
        """Width of one input: d, or d + 1 when it carries its class position (``classes``)."""
        return self.latent_dim + (1 if self.classes else 0)

    def sample_inputs(self, key: Array, n: int) -> Array:
        """``n`` inputs from the prior, jittable: ``z ~ N(0, I)`` ``[n, d]`` drawn from ``key``;
        with ``classes``, ``[z ; k]`` ``[n, d + 1]``, k uniform, drawn from ``fold_in(key, 1)``."""
        z = jax.random.normal(key, (n, self.latent_dim))
        if not self.classes:
            return z
        k = jax.random.randint(jax.random.fold_in(key, 1), (n,), 0, len(self.classes))
        return jnp.concatenate([z, k[:, None].astype(z.dtype)], axis=1)

    def with_classes(self, z, positions) -> np.ndarray:
        """``[z ; k]``: latents ``z[B, d]`` and class positions ``k[B]`` as inputs ``[B, d + 1]``.

        ``z`` itself for a generator without ``classes`` (``positions`` must then be None).
        """
        z = np.asarray(z)
        if not self.classes:
            if positions is not None:
                raise ValueError(f"{self.name} renders one class; it takes no class positions")
            return z
        positions = np.asarray(positions)
        if positions.shape != z.shape[:1] or positions.min(initial=0) < 0 or positions.max(
                initial=0) >= len(self.classes):
            raise ValueError(f"class positions must be [B={z.shape[0]}] integers in "
                             f"0..{len(self.classes) - 1}; got shape {positions.shape}")
        return np.concatenate([z, positions[:, None].astype(z.dtype)], axis=1)

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


# Class positions are stored as floats in the input: every position up to 256 is exact in
# bfloat16 (8 significand bits), so a bf16 run reads the class it was asked for.
MAX_CLASSES = 256


def check_classes(classes: Sequence[int], num_classes: int, name: str) -> tuple[int, ...]:
    """A multi-class generator's class list: distinct integers in ``[0, num_classes)``, at
    most `MAX_CLASSES`; ValueError naming ``name`` otherwise."""
    values = tuple(classes)
    ok = (0 < len(values) <= MAX_CLASSES and len(set(values)) == len(values) and all(
        isinstance(c, int | np.integer) and not isinstance(c, bool) and 0 <= c < num_classes
        for c in values))
    if not ok:
        raise ValueError(f"{name}={list(values)!r}; allowed: 1 to {MAX_CLASSES} distinct "
                         f"integers in 0..{num_classes - 1}")
    return tuple(int(c) for c in values)


def resolve_class_index(class_index, num_classes: int, suffix: str = "") -> tuple[int, ...]:
    """``classes`` of a conditional generator's ``class_index``: ``()`` for one class (an integer
    in ``[0, num_classes)``), the checked list (`check_classes`) for several; ValueError
    ``class_index=…; allowed: 0..C-1 or a list of them<suffix>`` otherwise."""
    if isinstance(class_index, list | tuple):
        return check_classes(class_index, num_classes, "class_index")
    if (not isinstance(class_index, int | np.integer) or isinstance(class_index, bool)
            or not 0 <= class_index < num_classes):
        raise ValueError(f"class_index={class_index!r}; allowed: 0..{num_classes - 1} "
                         f"or a list of them{suffix}")
    return ()


def condition_labels(classes: tuple[int, ...], class_index: int | None, num_classes: int,
                     latent_dim: int) -> Callable[[Array], Array]:
    """The label function of a conditional ``g1``: ``x[B, ·] -> onehot[B, num_classes]``.

    One class (``classes == ()``): the one-hot of ``class_index`` on every row. Several: row
    b's label is ``classes[k_b]``, ``k_b`` read (rounded, no gradient) from column
    ``latent_dim`` of the input ``[z ; k]``.
    """
    if not classes:
        onehot = jax.nn.one_hot(jnp.asarray([class_index]), num_classes)
        return lambda x: jnp.broadcast_to(onehot, (x.shape[0], num_classes))
    table = jnp.asarray(classes, jnp.int32)

    def labels(x):
        k = jnp.round(jax.lax.stop_gradient(x[:, latent_dim])).astype(jnp.int32)
        return jax.nn.one_hot(table[jnp.clip(k, 0, len(classes) - 1)], num_classes)

    return labels
