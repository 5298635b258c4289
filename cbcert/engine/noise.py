"""Noise models for randomized smoothing and empirical perturbations.

Every model is a frozen dataclass holding only static structure (e.g. the number of concepts);
its scale (σ, ρ, m, ε) is passed to ``perturb`` as a traced value, so a sweep over scales reuses
one compilation. ``perturb(key, x[*event], scale)`` draws one noisy sample; the sampler vmaps it
over (input, sample) pairs with keys from ``cbcert.engine.keys.sample_key`` (``scale`` stays
positional there: it is the one unmapped argument of that ``vmap``, ``in_axes=(0, 0, None)``).

Concept representations follow `cbcert.concepts` (flips are `cbcert.concepts.flip_pairs`).
"""

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from cbcert.concepts import check_concept_dim, flip_pairs


def _scalar(scale, name: str) -> float:
    value = np.asarray(scale)
    if value.shape != () or not np.issubdtype(value.dtype, np.number):
        raise ValueError(f"{name}={scale!r} must be a real scalar")
    return float(value)


class NoiseModel(Protocol):
    """What the sampler needs from a noise model."""

    def check_scale(self, scale) -> np.ndarray:
        """The scale as a numpy scalar of the traced dtype; ValueError outside the noise's domain.

        The engine's invariant guard (one host comparison per sampling call), not the user
        rule: σ, ρ and m as typed are checked once, at the edge (``cbcert.certify.smoothing.
        Smoothing.check`` from a job or the API's noise constructors), and trusted below it.
        """

    def check_event(self, event_shape: tuple[int, ...]) -> None:
        """Raises ValueError if one input of this shape cannot be perturbed."""

    def perturb(self, key: jax.Array, x: jax.Array, scale: jax.Array) -> jax.Array:
        """One noisy sample ``x_noisy[*event]`` of ``x[*event]``."""


@dataclasses.dataclass(frozen=True)
class Gaussian:
    """Isotropic Gaussian noise ``x + σ ε``, ``ε ~ N(0, I)`` (Cohen et al. 2019); scale σ ≥ 0."""

    def check_scale(self, scale) -> np.ndarray:
        sigma = _scalar(scale, "sigma")
        if not (math.isfinite(sigma) and sigma >= 0.0):
            raise ValueError(f"sigma={sigma} must be finite and in [0, inf)")
        return np.float32(sigma)

    def check_event(self, event_shape: tuple[int, ...]) -> None:
        del event_shape  # any shape

    def drawn(self, scale, dtype=None) -> float:
        """The σ actually sampled for inputs of ``dtype``, exactly, as a float.

        The traced scale is ``float32(σ)``; `perturb` casts it to the inputs' dtype, so
        bfloat16 inputs draw ``bfloat16(float32(σ))`` (0.7 -> 0.69921875). None: float32.
        ``scale`` is a checked σ (the edge's rule; not checked again here).
        """
        sigma = np.float32(scale)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            sigma = sigma.astype(jax.dtypes.canonicalize_dtype(dtype))
        return float(sigma)

    def perturb(self, key: jax.Array, x: jax.Array, scale: jax.Array) -> jax.Array:
        """``x[*event] + σ · N(0, I)``, noise drawn in ``x.dtype``."""
        return x + jnp.asarray(scale, x.dtype) * jax.random.normal(key, x.shape, x.dtype)


@dataclasses.dataclass(frozen=True)
class BernoulliFlips:
    """Independent concept flips ``F(c, η)``, ``η_i ~ Bern(ρ)`` (Lee et al. 2019); ρ ∈ [0, 1]."""

    num_concepts: int

    def __post_init__(self):
        if self.num_concepts < 1:
            raise ValueError(f"num_concepts={self.num_concepts} must be >= 1")

    def check_scale(self, scale) -> np.ndarray:
        rho = _scalar(scale, "rho")
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"rho={rho} must be in [0, 1]")
        return np.float32(rho)

    def check_event(self, event_shape: tuple[int, ...]) -> None:
        _check_event_vector(event_shape, self.num_concepts)

    def drawn(self, scale, dtype=None) -> float:
        """The flip probability actually sampled, exactly: ``⌈float32(ρ) · 2²³⌉ / 2²³``.

        ``jax.random.bernoulli(key, p)`` is ``uniform(key) < p`` with float32 uniforms on the
        grid ``k / 2²³``, ``k = 0 … 2²³ − 1``, so ``P[η = 1] = #{k : k / 2²³ < p} / 2²³``. This
        can be below ρ (e.g. ρ = 0.39); a certificate must not assume more noise than drawn.
        The inputs' ``dtype`` plays no part: the flips are drawn from float32 uniforms.
        ``scale`` is a checked ρ (the edge's rule; not checked again here).
        """
        del dtype
        p = float(np.float32(scale))
        return math.ceil(p * 2**23) / 2**23

    def perturb(self, key: jax.Array, x: jax.Array, scale: jax.Array) -> jax.Array:
        """``F(c, η)`` for one ``c[2K + U]`` with ``η ~ Bern(ρ)^K``."""
        self.check_event(x.shape)
        eta = jax.random.bernoulli(key, scale, (self.num_concepts,))  # [K]
        return flip_pairs(x, eta, self.num_concepts)


@dataclasses.dataclass(frozen=True)
class FixedFlips:
    """Flips exactly m uniformly chosen concepts (the τ-subset flips of SPEC §1); m ∈ [0, K].

    A uniform random permutation ranks the concepts; those ranked below m are flipped, so every
    subset of size m has probability ``1 / C(K, m)`` and m can be traced.
    """

    num_concepts: int

    def __post_init__(self):
        if self.num_concepts < 1:
            raise ValueError(f"num_concepts={self.num_concepts} must be >= 1")

    def check_scale(self, scale) -> np.ndarray:
        m = _scalar(scale, "m")
        if not (m == int(m) and 0 <= m <= self.num_concepts):
            raise ValueError(f"m={scale!r} must be an integer in [0, {self.num_concepts}]")
        return np.int32(m)

    def check_event(self, event_shape: tuple[int, ...]) -> None:
        _check_event_vector(event_shape, self.num_concepts)

    def drawn(self, scale, dtype=None) -> float:
        """The flip count actually sampled: exactly m (a checked integer), whatever ``dtype``."""
        del dtype
        return float(np.int32(scale))

    def perturb(self, key: jax.Array, x: jax.Array, scale: jax.Array) -> jax.Array:
        """``F(c, 1_S)`` for one ``c[2K + U]``, ``S`` uniform among subsets of size m."""
        self.check_event(x.shape)
        order = jax.random.permutation(key, self.num_concepts)  # [K]: concept at each rank
        ranks = jnp.zeros(self.num_concepts, jnp.int32).at[order].set(
            jnp.arange(self.num_concepts, dtype=jnp.int32)
        )
        return flip_pairs(x, ranks < scale, self.num_concepts)


@dataclasses.dataclass(frozen=True)
class SphereShift:
    """Shift ``x + ε u`` with u uniform on the unit L2 sphere, or in the unit ball; scale ε ≥ 0.

    ``u = g / ‖g‖₂`` with ``g ~ N(0, I)`` is uniform on the sphere (Muller 1959); scaling by
    ``r = U^(1/d)``, ``U ~ U(0, 1)``, d = ``x.size``, makes it uniform in the ball.
    """

    ball: bool = False

    def check_scale(self, scale) -> np.ndarray:
        eps = _scalar(scale, "eps")
        if not (math.isfinite(eps) and eps >= 0.0):
            raise ValueError(f"eps={eps} must be finite and in [0, inf)")
        return np.float32(eps)

    def check_event(self, event_shape: tuple[int, ...]) -> None:
        if math.prod(event_shape) < 1:
            raise ValueError(f"event shape {tuple(event_shape)} must have at least one element")

    def perturb(self, key: jax.Array, x: jax.Array, scale: jax.Array) -> jax.Array:
        """``x[*event] + ε u``, ``‖u‖₂ = 1`` (sphere) or ``≤ 1`` (ball), drawn in ``x.dtype``."""
        direction_key, radius_key = jax.random.split(key)
        g = jax.random.normal(direction_key, x.shape, x.dtype)
        u = g / jnp.sqrt(jnp.sum(jnp.square(g)))
        if self.ball:
            u = u * jax.random.uniform(radius_key, (), x.dtype) ** (1.0 / x.size)
        return x + jnp.asarray(scale, x.dtype) * u


@dataclasses.dataclass(frozen=True)
class Leading:
    """``inner`` noise on the first ``size`` coordinates of a flat input; the rest carried as is.

    A multi-class conditional generator's input is ``[z ; k]`` (`cbcert.generators.base`): the
    class position k rides after the latent and must not move. ``perturb(key, x[size + t])
    = [inner.perturb(key, x[:size]) ; x[size:]]`` with the same key, so the noise on z is
    bit-identical to ``inner`` on a width-``size`` input (σ, the sphere's dimension, the
    ball's radius law all see ``size`` coordinates).
    """

    inner: NoiseModel
    size: int

    def check_scale(self, scale) -> np.ndarray:
        return self.inner.check_scale(scale)

    def check_event(self, event_shape: tuple[int, ...]) -> None:
        if len(event_shape) != 1 or event_shape[0] <= self.size:
            raise ValueError(f"event shape {tuple(event_shape)}: expected one flat vector "
                             f"longer than the {self.size} perturbed coordinates")
        self.inner.check_event((self.size,))

    def drawn(self, scale, dtype=None) -> float:
        return self.inner.drawn(scale, dtype)

    def perturb(self, key: jax.Array, x: jax.Array, scale: jax.Array) -> jax.Array:
        """``[inner.perturb(key, x[:size], scale) ; x[size:]]`` for one input."""
        moved = self.inner.perturb(key, x[: self.size], scale)
        return jnp.concatenate([moved, x[self.size :]])


def restrict(noise: NoiseModel, size: int | None) -> NoiseModel:
    """``noise`` on the first ``size`` coordinates only (`Leading`), or ``noise`` for None."""
    return noise if size is None else Leading(noise, int(size))


def _check_event_vector(event_shape: tuple[int, ...], num_concepts: int) -> None:
    if len(event_shape) != 1:
        raise ValueError(
            f"concept noise needs one flat vector c[2K + U] per input, got event shape "
            f"{tuple(event_shape)}"
        )
    check_concept_dim(event_shape, num_concepts, "concept representation")
