"""The built-in procedural concept world: a differentiable generator with exact concepts.

Structure (SPEC §1, ``g = g2 ∘ D ∘ E ∘ g1``), all maps pure and differentiable:

* ``g1(z) = M [sin(ω t_c) ; t_u]`` with ``t = A z``: ``A`` (d×d) and ``M`` (dw×dw) are fixed
  random orthogonal matrices, ``t_c`` the first K coordinates (one per concept), ``t_u`` the
  remaining ``U = d − K`` nuisance coordinates. The sinusoid makes concept boundaries recur in
  latent space, so latent noise crosses them at a calibrated rate (see
  ``ConceptWorldConfig.frequency``).
* ``E(w)``: ``v = Mᵀ w``; concept i gets the logit pair ``(γ v_i / 2, −γ v_i / 2)``, the
  unsupervised dims are ``u = v[K:]``. ``D(c) = M [(c⁺ − c⁻)/γ ; u]`` so ``D(E(w)) = w`` exactly.
  Swapping a pair negates ``v_i``, which flips concept i and touches nothing else.
* ``g2(w)`` renders an RGB image with soft masks; concept i is drawn with strength
  ``a_i = sigmoid(κ v_i)`` (κ large: the attribute is visibly on or off except within a thin
  band around its boundary), nuisance (position, rotation, scale, hue, background brightness
  and texture) comes from ``u``.

Every concept has an exact visual meaning (``VOCABULARY``). Classes are concept patterns; the
label of a concept vector ``b ∈ {0,1}^K`` is its nearest pattern in Hamming distance, which is
linear in ``b``: ``argmax_k Σ_i (2b_i − 1)(2p_ki − 1) − 10⁻³ k`` (ties to the lower index).

Size: one module for the world's whole definition (config and presets, class patterns, the
renderer, the generator and its priors) — they share its private structure constants.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from cbcert import concepts
from cbcert.generators.base import Generator

# Each entry: (name, what the concept draws when on). Presets use the first 8 / 12 / 16.
VOCABULARY: tuple[tuple[str, str], ...] = (
    ("blue", "object is blue (off: red)"),
    ("stripes", "object has dark stripes"),
    ("large", "object is large"),
    ("outline", "object has a black outline"),
    ("dark_background", "background is dark (off: light)"),
    ("second_object", "a small green diamond is present"),
    ("hole", "object has a hole in its centre"),
    ("frame", "image has a magenta frame"),
    ("dots", "background is dotted"),
    ("cross", "object carries a white cross"),
    ("tint", "background has a purple tint"),
    ("corner_marker", "a cyan square sits in the top-left corner"),
    ("horizon", "a yellow horizontal line crosses the background"),
    ("underline", "an orange bar lies under the object"),
    ("square", "object is a square (off: a disc)"),
    ("elongated", "object is stretched along its axis (same area)"),
)

_NUISANCE_NAMED = 7  # position x, y, rotation, scale, hue, background brightness, diamond angle


@dataclass(frozen=True)
class ConceptWorldConfig:
    """Typed configuration of a concept world.

    Attributes:
      num_concepts: K, 8, 12 or 16 (first K entries of ``VOCABULARY``).
      latent_dim: d ≥ K + 8.
      image_size: H = W of rendered images (32 or 64).
      num_anchor_classes: classes with mutually far patterns.
      num_near_classes: classes at Hamming distance 1–2 from an anchor ("semantically close").
      extra_similar: additional classes close (distance 1–2) to existing ones.
      extra_dissimilar: additional classes far (distance ≥ 4) from all others.
      frequency: ω; concept boundaries in latent space recur every π/ω along each concept axis.
      sharpness: κ in ``a_i = sigmoid(κ v_i)``.
      logit_scale: γ, scale of the concept logit pairs.
      structure_seed: seed of the fixed matrices and class patterns (part of the world's identity).
      label_concepts: the class rule reads only the first ``label_concepts`` concepts (0: all
        K). With it fixed, K grows the vocabulary a concept model sees while the task stays the
        same: the patterns are drawn over the core only, concept i is ``sin(ω (A z)_i)`` for
        every K, so a latent has the same class in every world of the study (``vocab12``,
        ``vocab16`` over the core of ``k8``: 8 → 12 → 16 concepts, as the method's 18 → 27 → 36).
      class_separation: least Hamming distance between anchor patterns (0: ``max(3, Kc // 3)``).
      prior_flip: None: the standard normal prior ``z ~ N(0, I)``, under which every concept is
        an independent fair coin, so a typical state sits next to a class boundary (the
        *fragile* family). A number q in [0, 0.5): the *class-conditional* prior of the
        *saturated* family: class y uniform, target bits ``patterns[y] xor Bernoulli(q)`` on the
        core concepts, and z the standard normal conditioned on those bits
        (`ConceptWorld.condition`): inputs sit at or next to their class pattern, as images
        of one real class share most of its attributes.
    """

    num_concepts: int = 12
    latent_dim: int = 32
    image_size: int = 32
    num_anchor_classes: int = 5
    num_near_classes: int = 5
    extra_similar: int = 0
    extra_dissimilar: int = 0
    frequency: float = 1.5 * math.pi
    sharpness: float = 225.0
    logit_scale: float = 2.0
    structure_seed: int = 0
    label_concepts: int = 0
    class_separation: int = 0
    prior_flip: float | None = None

    @classmethod
    def from_preset(cls, name: str) -> ConceptWorldConfig:
        """Named presets: ``default``, ``k8``, ``k16``, ``px64``, ``similar5``, ``similar10``,
        ``dissimilar5``, ``dissimilar10``, ``vocab12``, ``vocab16`` (the fragile family) and
        ``saturated`` (the saturated family).

        ``k8``/``k16`` change the task with K (their patterns span all K concepts);
        ``vocab12``/``vocab16`` keep ``k8``'s task and add 4 / 8 concepts outside the class rule.
        ``saturated``: 10 classes whose patterns over the 12 concepts are pairwise at Hamming
        distance ≥ 6, and the class-conditional prior with q = 0.03 (``prior_flip``): a state
        at its pattern changes class only after 3 flips, so one or two concept flips rarely
        matter, as in the method's RIVAL-10.
        """
        presets = {
            "default": {},
            "k8": {"num_concepts": 8},
            "k16": {"num_concepts": 16},
            "px64": {"image_size": 64},
            "similar5": {"extra_similar": 5},
            "similar10": {"extra_similar": 10},
            "dissimilar5": {"extra_dissimilar": 5},
            "dissimilar10": {"extra_dissimilar": 10},
            "vocab12": {"num_concepts": 12, "label_concepts": 8},
            "vocab16": {"num_concepts": 16, "label_concepts": 8},
            "saturated": {"num_anchor_classes": 10, "num_near_classes": 0,
                          "class_separation": 6, "prior_flip": 0.03},
        }
        if name not in presets:
            raise ValueError(f"unknown world preset {name!r} (allowed: {', '.join(presets)})")
        return replace(cls(), **presets[name])

    def __post_init__(self) -> None:
        if self.num_concepts not in (8, 12, 16):
            raise ValueError(f"num_concepts={self.num_concepts} not in (8, 12, 16)")
        if self.latent_dim < self.num_concepts + _NUISANCE_NAMED + 1:
            raise ValueError(
                f"latent_dim={self.latent_dim} must be ≥ num_concepts + {_NUISANCE_NAMED + 1}"
            )
        if self.image_size not in (32, 64):
            raise ValueError(f"image_size={self.image_size} not in (32, 64)")
        if not 0 <= self.label_concepts <= self.num_concepts:
            raise ValueError(f"label_concepts={self.label_concepts} not in [0, num_concepts="
                             f"{self.num_concepts}]")
        if not 0 <= self.class_separation <= self.core_concepts:
            raise ValueError(f"class_separation={self.class_separation} not in [0, "
                             f"{self.core_concepts}] (the concepts the class rule reads)")
        if self.prior_flip is not None and not 0.0 <= self.prior_flip < 0.5:
            raise ValueError(f"prior_flip={self.prior_flip} not in [0, 0.5) (or None: the "
                             f"standard normal prior)")

    def identity(self) -> dict:
        """The fields as a dict, without those added after weights were shipped while they sit
        at their defaults (``label_concepts = 0``): what a checkpoint's ``world_config`` pins,
        so the weights trained before a field existed still match their preset."""
        later = {"label_concepts": 0, "class_separation": 0, "prior_flip": None}
        return {k: v for k, v in asdict(self).items() if k not in later or v != later[k]}

    @property
    def core_concepts(self) -> int:
        """How many leading concepts the class rule reads (``label_concepts``, 0 = all K)."""
        return self.label_concepts or self.num_concepts

    @property
    def num_classes(self) -> int:
        return (
            self.num_anchor_classes
            + self.num_near_classes
            + self.extra_similar
            + self.extra_dissimilar
        )


def _orthogonal(rng: np.random.Generator, n: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def class_patterns(config: ConceptWorldConfig) -> np.ndarray:
    """Deterministic class patterns ``P[C, Kc]`` (0/1) over the ``Kc = core_concepts`` concepts
    the class rule reads, with a designed similarity structure.

    Anchors are drawn with pairwise Hamming distance ≥ ``class_separation`` (default
    ``max(3, Kc // 3)``; a draw that finds no room after 2,000 tries starts the anchors
    afresh, and after 20 such restarts the separation is refused; the shipped presets' most
    misses in a row is 188); near class j copies anchor
    ``j mod A`` and flips 1 or 2 concepts (alternating); extra similar classes do the same to
    random existing classes; extra dissimilar classes are at distance ≥ 4 from every class.
    All patterns are distinct. They depend on Kc, never on the concepts beyond it.
    """
    k = config.core_concepts
    rng = np.random.default_rng([config.structure_seed, 7])
    patterns: list[np.ndarray] = []

    def distinct(p: np.ndarray) -> bool:
        return all(np.any(p != q) for q in patterns)

    min_anchor = config.class_separation or max(3, k // 3)
    misses = restarts = 0
    while len(patterns) < config.num_anchor_classes:
        p = rng.integers(0, 2, k)
        if all(np.sum(p != q) >= min_anchor for q in patterns):
            patterns.append(p)
            misses = 0
            continue
        misses += 1
        if misses == 2_000:  # stuck: start the anchors afresh (no shipped preset gets here)
            patterns.clear()
            misses, restarts = 0, restarts + 1
            if restarts == 20:
                raise ValueError(f"found no {config.num_anchor_classes} patterns over {k} "
                                 f"concepts at pairwise Hamming distance ≥ {min_anchor}")
    anchors = list(patterns)

    def near(base: np.ndarray, flips: int) -> np.ndarray:
        while True:
            p = base.copy()
            p[rng.choice(k, flips, replace=False)] ^= 1
            if distinct(p):
                return p

    for j in range(config.num_near_classes):
        patterns.append(near(anchors[j % len(anchors)], 1 + j % 2))
    for j in range(config.extra_similar):
        patterns.append(near(patterns[rng.integers(len(patterns))], 1 + j % 2))
    for _ in range(config.extra_dissimilar):
        while True:
            p = rng.integers(0, 2, k)
            if all(np.sum(p != q) >= 4 for q in patterns):
                patterns.append(p)
                break
    return np.stack(patterns).astype(np.int32)


def label_of(concepts: jax.Array, patterns: jax.Array) -> jax.Array:
    """Nearest class pattern in Hamming distance: ``bool[..., K], P[C, Kc] -> int32[...]``.

    ``argmax_k Σ_{i<Kc} (2b_i − 1)(2p_ki − 1) − 10⁻³ k`` equals ``argmin_k d_H(b_{:Kc}, p_k)``
    with ties going to the lower class index; concepts ``i ≥ Kc`` do not matter.
    """
    signs = 2.0 * concepts[..., : patterns.shape[-1]].astype(jnp.float32) - 1.0
    score = signs @ (2.0 * patterns.astype(jnp.float32) - 1.0).T
    score = score - 1e-3 * jnp.arange(patterns.shape[0], dtype=jnp.float32)
    return jnp.argmax(score, axis=-1).astype(jnp.int32)


def world_params(config: ConceptWorldConfig) -> dict[str, np.ndarray]:
    """The fixed parameter pytree of a world (float32 numpy arrays)."""
    rng = np.random.default_rng([config.structure_seed, 1])
    d, k = config.latent_dim, config.num_concepts
    u = d - k
    n_tex = u - _NUISANCE_NAMED
    return {
        "A": _orthogonal(rng, d).astype(np.float32),
        "M": _orthogonal(rng, d).astype(np.float32),
        "tex_freq": rng.uniform(0.5, 2.5, (n_tex, 2)).astype(np.float32),
        "tex_phase": rng.uniform(0, 2 * np.pi, (n_tex,)).astype(np.float32),
        "patterns": class_patterns(config),
    }


def _lerp(a: jax.Array, b: jax.Array, t: jax.Array) -> jax.Array:
    return a + (b - a) * t


def _logsumexp4(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array) -> jax.Array:
    """``log(eᵃ + eᵇ + eᶜ + eᵈ)`` elementwise, by ``jax.nn.logsumexp``'s formula
    (``log Σ exp(x − m) + m`` with ``m`` the maximum, held constant under differentiation).

    The same value as ``jax.nn.logsumexp(jnp.stack([a, b, c, d]), axis=0)`` for finite inputs,
    without its reductions over a stacked axis: XLA:CPU cannot fuse those into the renderer's
    per-pixel loop, and they cost the built-in world's renderer 120 µs of its 135 µs per
    32×32 image (batch 64, 2-core Intel Xeon, jax 0.10.2, 2026-12-05); elementwise, it takes
    15 µs. Rendered images were bit-identical on the probe batch.
    """
    m = jax.lax.stop_gradient(jnp.maximum(jnp.maximum(a, b), jnp.maximum(c, d)))
    return jnp.log(jnp.exp(a - m) + jnp.exp(b - m) + jnp.exp(c - m) + jnp.exp(d - m)) + m


def _over(base: jax.Array, colour: jax.Array, alpha: jax.Array) -> jax.Array:
    """Alpha-composite ``colour`` over ``base``: ``[B,H,W,3], [B|1,H|1,W|1,3], [B,H,W,1]``."""
    return base * (1.0 - alpha) + colour * alpha


def render(config: ConceptWorldConfig, params, a: jax.Array, u: jax.Array) -> jax.Array:
    """Render images from concept strengths and nuisance.

    Args:
      a: ``[B, K]`` concept strengths in [0, 1] (1 = attribute on).
      u: ``[B, U]`` nuisance coordinates (standard normal under the prior).
    Returns:
      ``[B, H, W, 3]`` float32 images in [0, 1].
    """
    names = [n for n, _ in VOCABULARY[: config.num_concepts]]
    zeros = jnp.zeros(a.shape[:1], a.dtype)

    def on(name: str) -> jax.Array:  # [B, 1, 1, 1]
        s = a[:, names.index(name)] if name in names else zeros
        return s[:, None, None, None]

    h = config.image_size
    grid = (jnp.arange(h, dtype=jnp.float32) + 0.5) / h
    yy, xx = jnp.meshgrid(grid, grid, indexing="ij")
    X, Y = xx[None, :, :, None], yy[None, :, :, None]  # [1, H, W, 1]
    edge = float(h) * 2.0  # soft-mask slope: a transition about one pixel wide

    def nz(i: int) -> jax.Array:  # [B, 1, 1, 1]
        return u[:, i][:, None, None, None]

    cx, cy = 0.5 + 0.07 * jnp.tanh(nz(0)), 0.5 + 0.07 * jnp.tanh(nz(1))
    theta = 0.6 * nz(2)
    scale = 1.0 + 0.08 * jnp.tanh(nz(3))
    hue = 0.08 * jnp.tanh(nz(4))
    brightness = 0.06 * jnp.tanh(nz(5))
    diamond_angle = 2.0 * nz(6)

    # Background: grey level, tint, low-frequency texture from the remaining nuisance dims.
    grey = _lerp(0.82, 0.18, on("dark_background")) + brightness
    tint = on("tint") * jnp.array([0.14, -0.1, 0.16])
    tex_u = u[:, _NUISANCE_NAMED:]  # [B, T]
    waves = jnp.cos(
        2 * jnp.pi * (X * params["tex_freq"][:, 0] + Y * params["tex_freq"][:, 1])
        + params["tex_phase"]
    )  # [1, H, W, T]
    texture = 0.035 * jnp.einsum("bt,xhwt->bhw", jnp.tanh(tex_u), waves)[..., None]
    img = jnp.broadcast_to(grey + tint + texture, (a.shape[0], h, h, 3))

    dots = jax.nn.sigmoid((jnp.sin(2 * jnp.pi * 5 * X) * jnp.sin(2 * jnp.pi * 5 * Y) - 0.75) * 12)
    img = _over(img, 1.0 - grey, on("dots") * dots)
    horizon = jax.nn.sigmoid((0.035 - jnp.abs(Y - 0.86)) * edge)
    img = _over(img, jnp.array([0.95, 0.9, 0.15]), on("horizon") * horizon)
    border_dist = jnp.minimum(jnp.minimum(X, 1 - X), jnp.minimum(Y, 1 - Y))
    frame = jax.nn.sigmoid((0.07 - border_dist) * edge)
    img = _over(img, jnp.array([0.85, 0.1, 0.85]), on("frame") * frame)
    corner = jax.nn.sigmoid((0.16 - jnp.maximum(X, Y)) * edge)
    img = _over(img, jnp.array([0.1, 0.85, 0.9]), on("corner_marker") * corner)

    # Object in its own rotated, scaled frame; p, q in units of its radius.
    radius = (0.2 + 0.1 * on("large")) * scale
    dx, dy = X - cx, Y - cy
    xr = jnp.cos(theta) * dx + jnp.sin(theta) * dy
    yr = -jnp.sin(theta) * dx + jnp.cos(theta) * dy
    # Elongation keeps the area (aspect ratio 2.56), so it is independent of "large".
    stretch = 1.0 + 0.6 * on("elongated")
    p = xr / (radius * stretch)
    q = yr * stretch / radius
    rho = jnp.sqrt(p * p + q * q + 1e-12)
    box = _logsumexp4(12.0 * p, -12.0 * p, 12.0 * q, -12.0 * q) / 12.0 - math.log(2) / 12
    sdf = _lerp(rho - 1.0, box - 1.0, on("square"))  # < 0 inside
    px = radius * edge  # pixels per unit of p, q
    body = jax.nn.sigmoid(-sdf * px)

    under = jax.nn.sigmoid((0.12 - jnp.abs(q - 1.35)) * px)
    under = under * jax.nn.sigmoid((0.9 - jnp.abs(p)) * px)
    img = _over(img, jnp.array([1.0, 0.55, 0.05]), on("underline") * under)

    red, blue = jnp.array([0.9, 0.15, 0.1]), jnp.array([0.12, 0.28, 0.92])
    colour = _lerp(red, blue, on("blue")) + hue * jnp.array([1.0, 0.5, -1.0])
    stripes = jax.nn.sigmoid(4.0 * jnp.sin(2 * jnp.pi * 1.25 * q))
    colour = colour * (1.0 - 0.8 * on("stripes") * stripes)
    hole = jax.nn.sigmoid((0.55 - rho) * px)
    alpha = body * (1.0 - on("hole") * hole)
    img = _over(img, colour, alpha)
    cross = jnp.maximum(
        jax.nn.sigmoid((0.18 - jnp.abs(p)) * px), jax.nn.sigmoid((0.18 - jnp.abs(q)) * px)
    )
    img = _over(img, jnp.array([1.0, 1.0, 1.0]), on("cross") * cross * alpha)
    outline = jax.nn.sigmoid((0.16 - jnp.abs(sdf)) * px)
    img = _over(img, jnp.array([0.0, 0.0, 0.0]), on("outline") * outline)

    dcx = 0.5 + 0.36 * jnp.cos(diamond_angle)
    dcy = 0.5 + 0.36 * jnp.sin(diamond_angle)
    diamond = jax.nn.sigmoid((0.085 - jnp.abs(X - dcx) - jnp.abs(Y - dcy)) * edge)
    img = _over(img, jnp.array([0.1, 0.8, 0.2]), on("second_object") * diamond)
    return jnp.clip(img, 0.0, 1.0)


@dataclass(frozen=True)
class ConceptWorld:
    """A concept world: its config, the ``Generator`` view, and ground-truth read-outs."""

    config: ConceptWorldConfig
    generator: Generator

    @property
    def params(self):
        return self.generator.params

    @property
    def num_classes(self) -> int:
        return self.config.num_classes

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(f"class{c}" for c in range(self.num_classes))

    def concept_signal(self, params, z: jax.Array) -> jax.Array:
        """``v_c = sin(ω (A z)_{:K})``: ``z[B, d] -> [B, K]``, concept i is on iff ``v_i > 0``."""
        t = z @ params["A"].T
        return jnp.sin(self.config.frequency * t[:, : self.config.num_concepts])

    def concepts_of(self, params, z: jax.Array) -> jax.Array:
        """Ground-truth concept vector of ``g(z)``: ``z[B, d] -> bool[B, K]``."""
        return self.concept_signal(params, z) > 0

    def label_of_concepts(self, params, concepts: jax.Array) -> jax.Array:
        """Ground-truth class of a concept vector: ``bool[B, K] -> int32[B]``."""
        return label_of(concepts, params["patterns"])

    def label_of(self, params, z: jax.Array) -> jax.Array:
        """Ground-truth class of ``g(z)``: ``z[B, d] -> int32[B]``."""
        return self.label_of_concepts(params, self.concepts_of(params, z))

    @property
    def conditional(self) -> bool:
        """Whether the world's prior is class-conditional (``config.prior_flip`` set)."""
        return self.config.prior_flip is not None

    def condition(self, params, z: jax.Array, keys: jax.Array) -> jax.Array:
        """Standard normal latents conditioned on class-pattern concepts (the saturated prior).

        For input b, ``keys[b]`` draws the class ``y ~ U{0..C−1}`` (``fold_in(key, 0)``) and
        flips ``f ~ Bernoulli(q)^{Kc}`` (``fold_in(key, 1)``, q = ``prior_flip``); the target
        bits are ``patterns[y] xor f`` on the core concepts. With ``t = A z`` (A orthogonal),
        every core coordinate whose concept bit ``[sin(ω t_i) > 0]`` is not its target is
        reflected, ``t_i → −t_i`` (``sin`` is odd, so the bit flips), and ``z' = Aᵀ t``. A
        standard normal coordinate reflected whenever it falls on the wrong side is exactly a
        standard normal conditioned on the right side (the density at an allowed s is
        ``φ(s) + φ(−s) = 2φ(s)``), so ``z'`` is ``N(0, I)`` conditioned on the target bits:
        the distance from z' to every concept boundary is distributed as under the standard
        prior, only the states are concentrated on the patterns.

        Args:
          z: ``[B, d]`` standard normal draws; keys: ``[B]`` typed PRNG keys.
        Returns:
          ``[B, d]`` float32 latents (z itself, unchanged, if the world is not conditional).
        """
        if not self.conditional:
            return z
        patterns = params["patterns"]  # [C, Kc]
        c, kc = patterns.shape
        q = self.config.prior_flip

        def target(key):  # -> bool[Kc]
            y = jax.random.randint(jax.random.fold_in(key, 0), (), 0, c)
            flips = jax.random.bernoulli(jax.random.fold_in(key, 1), q, (kc,))
            return (patterns[y] > 0) ^ flips

        want = jax.vmap(target)(keys)  # [B, Kc]
        t = z @ params["A"].T
        have = jnp.sin(self.config.frequency * t[:, :kc]) > 0
        sign = jnp.where(have == want, 1.0, -1.0).astype(t.dtype)
        t = jnp.concatenate([t[:, :kc] * sign, t[:, kc:]], axis=-1)
        return t @ params["A"]

    def sample_latents(self, key: jax.Array, n: int) -> jax.Array:
        """``n`` latents from the world's prior: ``[n, d]`` float32 (the standard normal, or
        its class-conditional form `condition` when ``config.prior_flip`` is set)."""
        z = jax.random.normal(key, (n, self.config.latent_dim), jnp.float32)
        if not self.conditional:
            return z
        return self.condition(self.params, z, jax.random.split(jax.random.fold_in(key, 1), n))


def make_world(config: ConceptWorldConfig) -> ConceptWorld:
    """Build the world's generator from its config (deterministic in ``structure_seed``)."""
    k = config.num_concepts
    gamma, omega, kappa = config.logit_scale, config.frequency, config.sharpness

    def g1(params, z):  # [B, d] -> [B, d]
        t = z @ params["A"].T
        v = jnp.concatenate([jnp.sin(omega * t[:, :k]), t[:, k:]], axis=-1)
        return v @ params["M"].T

    def encode(params, w):  # [B, d] -> [B, 2K + U]
        v = w @ params["M"]
        return concepts.join(jnp.stack([0.5 * gamma * v[:, :k], -0.5 * gamma * v[:, :k]], -1),
                             v[:, k:])

    def decode(params, c):  # [B, 2K + U] -> [B, d]
        s = concepts.margins(c, k) / gamma
        return jnp.concatenate([s, concepts.unsupervised(c, k)], axis=-1) @ params["M"].T

    def g2(params, w):  # [B, d] -> [B, H, W, 3]
        v = w @ params["M"]
        return render(config, params, jax.nn.sigmoid(kappa * v[:, :k]), v[:, k:])

    generator = Generator(
        name=f"concept-world-k{k}-c{config.num_classes}-{config.image_size}px",
        latent_dim=config.latent_dim,
        concept_names=tuple(n for n, _ in VOCABULARY[:k]),
        num_unsup=config.latent_dim - k,
        image_shape=(config.image_size, config.image_size, 3),
        params=jax.tree.map(jnp.asarray, world_params(config)),
        g1=g1,
        encode=encode,
        decode=decode,
        g2=g2,
    )
    return ConceptWorld(config=config, generator=generator)
