"""The smoothing noises and their certificates: THE table pairing each noise with its radius.

Randomized smoothing (SPEC §4) comes in three kinds, each a noise the engine samples and the
certificate that turns probability bounds into radii under that noise:

========== ========= ======= ============================================ ====================
kind       space     scale   engine noise                                 certificate
========== ========= ======= ============================================ ====================
gaussian   latent    σ       ``z + σ N(0, I)``                            L2, Cohen et al.
bernoulli  concept   ρ       flip each concept with probability ρ          Hamming, Lee et al.
fixed      concept   m       flip exactly m uniformly chosen concepts     Hamming (radius 0)
========== ========= ======= ============================================ ====================

Everything that depends on the kind -- which noise to sample, the scale's name and allowed
range (checked here against `cbcert.schema.RULES`), the radius rule, the certified scale, the
radius grid of the reports, file names -- is a field or method of its `Smoothing` entry, so no
other module dispatches on the kind's name.

The scale is a user's value: `Smoothing.check` is THE rule, run once at the edge -- a
`cbcert.runs.certify.CertifyJob` or `cbcert.runs.attack.AttackJob` (CLI, sweeps, runners)
and the API's `cbcert.api.Noise` -- and every layer below trusts it (the engine keeps a free
invariant guard, `cbcert.engine.noise.NoiseModel.check_scale`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cbcert.certify.cohen import RadiusRule
from cbcert.certify.hamming import BernoulliHammingRadius, FixedFlipHammingRadius
from cbcert.certify.l2 import L2Radius
from cbcert.engine.noise import BernoulliFlips, FixedFlips, Gaussian
from cbcert.schema import ConfigError, validate, value_name


@dataclass(frozen=True)
class Smoothing:
    """One kind of smoothing noise and its certificate.

    Attributes:
      kind: ``gaussian``, ``bernoulli`` or ``fixed``.
      space: ``latent`` (noise on z) or ``concept`` (noise on c = E(g1(z))).
      key: the scale's setting (``sigma``, ``rho``, ``flips``); also its range rule.
      symbol: σ, ρ or m (tables, titles).
      hamming: radii are Hamming distances between concept states (else L2 in latent space).
      prefix: run-directory name before the scale, e.g. ``latent-sigma``.
    """

    kind: str
    space: str
    key: str
    symbol: str
    hamming: bool
    prefix: str
    _noise: Callable[[int], Any]
    _rule: str
    _radius: Callable[[float, int], RadiusRule]

    def check(self, scale: Any, num_concepts: int | None = None) -> None:
        """Raise `ConfigError` (key = `key`) unless ``scale`` is allowed; ``m ≤ K`` when known.

        The user rule (`cbcert.schema.RULES`), run once where a value enters: the jobs and the
        API's `Noise`. Below them the scale is trusted.
        """
        validate(self._rule, scale, key=self.key)
        if num_concepts is not None:
            self.check_concepts(scale, num_concepts)

    def check_concepts(self, scale: Any, num_concepts: int) -> None:
        """The part of `check` that needs the world: ``m ≤ K`` for fixed flips (σ and ρ have
        none). For a scale `check` passed before K was known (a job, then its world)."""
        if self.kind == "fixed" and scale > num_concepts:
            detail = f"got {scale}, allowed range [1, K={num_concepts}] (the world's concepts)"
            raise ConfigError(f"key '{self.key}': {detail}", key=self.key, value=scale,
                              allowed=f"[1, {num_concepts}]", detail=detail)

    def noise(self, num_concepts: int):
        """The engine noise model (``cbcert.engine.noise``) of this kind."""
        return self._noise(num_concepts)

    def certified_scale(self, scale: float, num_concepts: int, dtype=None) -> float:
        """The scale a certificate may use: ``min(typed, drawn)`` (SPEC §4).

        The engine samples with the float32 scale (``noise.drawn``): σ rounded to float32 --
        and further to the inputs' ``dtype`` when it is narrower (bfloat16 inputs draw
        ``bfloat16(σ)``) -- and ρ to the 2⁻²³ grid of float32 uniforms. The Gaussian radius
        grows with σ and the Bernoulli Hamming radius with ρ ∈ (0, ½), so certifying with the
        smaller of the typed and the drawn value never claims more than holds for the noise
        drawn, nor for the one typed. ``dtype`` None: float32 inputs.
        """
        return min(float(scale), self.noise(num_concepts).drawn(scale, dtype))

    def radius_rule(self, scale: float, num_concepts: int, dtype=None) -> RadiusRule:
        """The radius rule (``rule.radius(p_lower, p_upper)``) at the certified scale for
        inputs of ``dtype`` (None: float32): `L2Radius` (σ), `BernoulliHammingRadius` (ρ) or
        `FixedFlipHammingRadius` (m, drawn exactly). Build it once per run and pass it on."""
        return self._radius(self.certified_scale(scale, num_concepts, dtype), num_concepts)

    def radius_grid(self, scale: float, num_concepts: int) -> np.ndarray:
        """Radii at which certified accuracy is reported: σ/4 steps to 4σ, or 0…K (Hamming)."""
        if self.hamming:
            return np.arange(num_concepts + 1, dtype=np.float64)
        return np.round(np.arange(0, 17) * scale / 4, 10)

    def name(self, scale: float) -> str:
        """Run-directory name at ``scale``: ``latent-sigma0.1``, ``concept-flips2``."""
        return f"{self.prefix}{value_name(scale)}"


SMOOTHINGS: dict[str, Smoothing] = {
    s.kind: s
    for s in (
        Smoothing("gaussian", "latent", "sigma", "σ", False, "latent-sigma",
                  lambda k: Gaussian(), "sigma", lambda sigma, k: L2Radius(sigma)),
        Smoothing("bernoulli", "concept", "rho", "ρ", True, "concept-rho",
                  BernoulliFlips, "rho", BernoulliHammingRadius),
        Smoothing("fixed", "concept", "flips", "m", True, "concept-flips",
                  FixedFlips, "count", lambda m, k: FixedFlipHammingRadius(int(m), k)),
    )
}
KINDS = tuple(SMOOTHINGS)
# The noise a smoothed classifier of each space uses in attacks (and the API's default).
SPACE_NOISE = {"latent": "gaussian", "concept": "bernoulli"}


def smoothing(kind: str) -> Smoothing:
    """The `Smoothing` of ``kind``; `ConfigError` (key ``noise``) naming the kinds otherwise."""
    try:
        return SMOOTHINGS[kind]
    except (KeyError, TypeError):
        raise ConfigError(f"key 'noise': got {kind!r}, allowed: {', '.join(KINDS)}",
                          key="noise", value=kind, allowed=", ".join(KINDS)) from None


def attack_name(space: str, scale: float | None = None) -> str:
    """Run-directory name of an attack in ``space``: ``attack-latent`` on the base classifier,
    ``attack-latent-smoothed-sigma0.25`` (``attack-concept-smoothed-rho0.2``) on the smoothed
    one at ``scale`` -- the space's smoothing names the scale (`of_space`)."""
    name = f"attack-{space}"
    if scale is None:
        return name
    kind = of_space(space)
    return f"{name}-smoothed-{kind.key}{value_name(scale)}"


def of_space(space: str) -> Smoothing:
    """The smoothing used for a space's smoothed classifier: Gaussian (latent), Bernoulli."""
    try:
        return SMOOTHINGS[SPACE_NOISE[space]]
    except (KeyError, TypeError):
        raise ConfigError(f"key 'space': got {space!r}, allowed: latent, concept", key="space",
                          value=space, allowed="latent, concept") from None
