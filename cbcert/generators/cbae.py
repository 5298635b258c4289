"""Concept-bottleneck autoencoder (CB-AE) over a generator's latent, in Flax NNX.

Port of the CB-AE of Kulkarni et al., CVPR 2025, "Interpretable generative models through
post-hoc concept bottlenecks" (public structure of Trustworthy-ML-Lab/posthoc-generative-cbm),
which gives a frozen StyleGAN2 the split ``g = g2 ∘ D ∘ E ∘ g1`` of SPEC §1:

* ``E``: the per-layer latents ``ws[B, num_ws, dw]`` are averaged over layers (they are copies
  of one ``w`` before truncation, the mean keeps E differentiable in every copy), then
  ``3 × [Linear, LeakyReLU(0.1), BatchNorm] → Linear`` maps them to the upstream concept logits.
* ``D``: the mirror MLP ``3 × [Linear, LeakyReLU(0.1), BatchNorm] → Linear`` back to ``dw``,
  tiled to the ``num_ws`` layers.

Upstream logits are grouped by the config's concept bins; a binary concept's bin holds
``[absent, present]`` (index 1 = concept on, as in upstream's class lists), and the groups after
the named (supervised) ones -- upstream's trailing ``"cat"`` group -- are the unsupervised part
(``CBAEConfig.from_upstream`` says how names pair with bins). cbcert's layout (docs/DESIGN.md) is
``[c0+, c0−, c1+, c1−, ..., u]``, so the two differ by swapping inside every pair -- an
involution, applied on the way out of E and on the way into D.

Batch norm runs on its running statistics (the upstream model in ``eval()`` mode);
``cbcert.training.cbae`` trains it in batch-statistics mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from cbcert.concepts import set_concept, swap_pairs

BN_EPS = 1e-5  # torch.nn.BatchNorm1d default
BN_MOMENTUM = 0.9  # torch's momentum 0.1 (weight of the new batch) in flax's convention
LEAKY_SLOPE = 0.1  # upstream nn.LeakyReLU(0.1)
NUM_HIDDEN = 3  # [Linear, LeakyReLU, BatchNorm] blocks in each of E and D


@dataclasses.dataclass(frozen=True)
class CBAEConfig:
    """Static structure of a CB-AE.

    Attributes:
      latent_dim: dw, width of one style vector (upstream ``latent_noise_dim``, 512 for StyleGAN2).
      num_ws: per-layer copies of ``w`` the generator's synthesis network reads (14 at 256 px).
      concept_names: the K binary concepts, in upstream bin order.
      num_unsup: U, size of the trailing unsupervised ("unknown") group (0 if there is none).
    """

    latent_dim: int
    num_ws: int
    concept_names: tuple[str, ...]
    num_unsup: int

    def __post_init__(self):
        if self.latent_dim < 1:
            raise ValueError(f"latent_dim={self.latent_dim}; must be >= 1")
        if self.num_ws < 1:
            raise ValueError(f"num_ws={self.num_ws}; must be >= 1")
        if self.num_unsup < 0:
            raise ValueError(f"num_unsup={self.num_unsup}; must be >= 0")
        if not self.concept_names and not self.num_unsup:
            raise ValueError("concept_names=() and num_unsup=0; the bottleneck would be empty")

    @property
    def num_concepts(self) -> int:
        """K, the number of binary concepts."""
        return len(self.concept_names)

    @property
    def concept_dim(self) -> int:
        """2K + U, width of the bottleneck (upstream ``sum(concept_bins)``)."""
        return 2 * self.num_concepts + self.num_unsup

    @classmethod
    def from_upstream(cls, latent_dim: int, num_ws: int, concept_bins: Sequence[int],
                      concept_names: Sequence[str], types: Sequence[str]) -> CBAEConfig:
        """Config from upstream's ``model`` section (``latent_noise_dim``, ``num_ws``, concepts).

        How upstream pairs the lists (posthoc-generative-cbm ``models/basic.py``): it supervises
        the first ``K = len(concept_names)`` groups of ``concept_bins``, one fewer when the names
        contain ``"unknown"`` (which must then be the last name); ``concept_names[i]`` and
        ``types[i]`` describe group ``i < K`` and later entries of ``types`` are never read.
        The groups after the K-th are never supervised: together they are the unsupervised part
        ``u``, ``U = sum(concept_bins[K:])``. Upstream's configs come in three shapes:

        * names end with ``"unknown"``, all three lists equally long (CelebA-HQ: 9, 9, 9):
          K = 8 concepts, U = the last group;
        * names without ``"unknown"``, one name fewer than groups (CUB: 10 names, 11 bins and
          types): K = 10, U = the trailing ``"cat"`` group of 40;
        * names without ``"unknown"``, as many as groups (the ``cc_*`` concept classifier
          configs: 8, 8, 8): K = 8, U = 0.

        cbcert certifies binary concepts only: each supervised group must be of type ``"bin"``
        with 2 bins (``[absent, present]``); a supervised ``"cat"`` or ``"cont"`` group (none of
        upstream's configs has one) is refused, naming it.

        Raises:
          ValueError: more supervised names than groups, too few types, ``"unknown"`` before the
            last name, a bin count < 1, or a supervised group that is not binary.
        """
        bins, names, kinds = list(concept_bins), list(concept_names), list(types)
        if "unknown" in names[:-1]:
            raise ValueError(f"concept_names has 'unknown' at position {names.index('unknown')}; "
                             "upstream treats it as the unsupervised group only as the last name")
        num_concepts = len(names) - (names[-1:] == ["unknown"])
        if num_concepts > len(bins):
            raise ValueError(f"concept_names names {num_concepts} supervised concepts but "
                             f"concept_bins has only {len(bins)} groups")
        if len(kinds) < num_concepts:
            raise ValueError(f"types has {len(kinds)} entries; the {num_concepts} supervised "
                             "concepts need one each")
        for i, size in enumerate(bins):
            if size < 1:
                raise ValueError(f"concept_bins[{i}]={size}; allowed: integers >= 1")
        supervised = zip(bins[:num_concepts], names[:num_concepts], kinds[:num_concepts],
                         strict=True)
        for i, (size, name, kind) in enumerate(supervised):
            if kind != "bin" or size != 2:
                raise ValueError(f"concept group {i} ({name!r}): type={kind!r}, bins={size}; "
                                 "cbcert certifies binary concepts: every supervised group must "
                                 "be type 'bin' with 2 bins")
        return cls(latent_dim=latent_dim, num_ws=num_ws,
                   concept_names=tuple(names[:num_concepts]),
                   num_unsup=sum(bins[num_concepts:]))


class _Block(nnx.Module):
    """Upstream ``Linear → LeakyReLU(0.1) → BatchNorm1d`` (that order: the norm comes last)."""

    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.norm = nnx.BatchNorm(dout, use_running_average=True, epsilon=BN_EPS,
                                  momentum=BN_MOMENTUM, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(jax.nn.leaky_relu(self.linear(x), LEAKY_SLOPE))


class CBAE(nnx.Module):
    """CB-AE encoder/decoder on flat latents ``w[B, num_ws · dw]`` (cbcert's ``Generator`` layout).

    ``model.encode(w) -> c[B, 2K + U]`` and ``model.decode(c) -> w[B, num_ws · dw]``.
    """

    def __init__(self, config: CBAEConfig, *, rngs: nnx.Rngs):
        self.config = config
        h, k = config.latent_dim, config.concept_dim
        self.encoder = nnx.List([_Block(h, h, rngs) for _ in range(NUM_HIDDEN)])
        self.encoder_out = nnx.Linear(h, k, rngs=rngs)
        self.decoder = nnx.List([_Block(k if i == 0 else h, h, rngs) for i in range(NUM_HIDDEN)])
        self.decoder_out = nnx.Linear(h, h, rngs=rngs)

    def encode_upstream(self, ws: jax.Array) -> jax.Array:
        """Upstream ``CB_AE.enc``: ``ws[B, num_ws, dw] -> logits[B, sum(bins)]`` in bin order."""
        x = jnp.mean(ws, axis=1)  # [B, dw]
        for block in self.encoder:
            x = block(x)
        return self.encoder_out(x)

    def decode_upstream(self, logits: jax.Array) -> jax.Array:
        """Upstream ``CB_AE.dec``: ``logits[B, sum(bins)] -> ws[B, num_ws, dw]`` (one w, tiled)."""
        x = logits
        for block in self.decoder:
            x = block(x)
        x = self.decoder_out(x)  # [B, dw]
        return jnp.broadcast_to(x[:, None, :], (x.shape[0], self.config.num_ws, x.shape[1]))

    def encode(self, w: jax.Array) -> jax.Array:
        """E: ``w[B, num_ws · dw] -> c[B, 2K + U]`` (interleaved ``[c+, c−]`` pairs, then u)."""
        ws = w.reshape(w.shape[0], self.config.num_ws, self.config.latent_dim)
        return swap_pairs(self.encode_upstream(ws), self.config.num_concepts)

    def decode(self, c: jax.Array) -> jax.Array:
        """D: ``c[B, 2K + U] -> w[B, num_ws · dw]``."""
        ws = self.decode_upstream(swap_pairs(c, self.config.num_concepts))
        return ws.reshape(c.shape[0], -1)

    def intervene(self, w: jax.Array, concept: int, value: bool, alpha: float | jax.Array
                  ) -> jax.Array:
        """Upstream's swap intervention, blended: ``(1 − α) w + α D(swap(E(w)))``.

        Args:
          w: ``[B, num_ws · dw]`` latents.
          concept: index i of the binary concept to set, ``0 <= i < K``.
          value: the state to give it.
          alpha: 1 uses the decoded latent only, 0 returns ``w``.

        Returns:
          ``w'[B, num_ws · dw]``.
        """
        if not 0 <= concept < self.config.num_concepts:
            raise ValueError(f"concept={concept}; allowed: 0..{self.config.num_concepts - 1}")
        c = set_concept(self.encode(w), concept, value)
        return blend(w, self.decode(c), alpha)


def blend(w: jax.Array, w_decoded: jax.Array, alpha: float | jax.Array) -> jax.Array:
    """Upstream's interpolation ``(1 − α) w + α w_decoded`` (α = 1: pure CB-AE latent)."""
    return (1 - alpha) * w + alpha * w_decoded
