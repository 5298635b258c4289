"""BigGAN-deep generator (Brock et al., ICLR 2019, "Large scale GAN training for high fidelity
natural image synthesis") in Flax NNX, laid out like the ``pytorch-pretrained-biggan`` port of
the TF-Hub modules (``biggan-deep-128/256/512``).

Channel-last (NHWC). Spectral normalisation is folded into the weights by the converter
(``W / σ`` with the stored power-iteration vectors, what the PyTorch module computes in
``eval()``), so here every layer is a plain dense / conv layer.

Structure: the condition ``h = [z ; E y]`` (z and a class embedding of equal width) feeds a
linear layer to a 4×4×16ch tensor, then a stack of bottleneck residual blocks
``BN-ReLU-1×1 → BN-ReLU-(2× nearest up)-3×3 → BN-ReLU-3×3 → BN-ReLU-1×1`` (skip: keep the first
half of the channels when the width halves, nearest up-sampling), with one self-attention layer
(SAGAN) before the block at ``attention_layer_position``, and a final BN-ReLU-3×3 conv whose
first three channels go through tanh. Every block BN is class-conditional,
``(x − μ_t) / sqrt(σ²_t + eps) · (1 + h W_s) + h W_o``, with statistics μ_t, σ²_t read off a
table of ``n_stats`` truncation levels (``t = truncation / step``; between levels the two
neighbours are mixed with the *upstream* weights ``frac · μ[⌊t⌋] + (1 − frac) · μ[⌊t⌋ + 1]``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from cbcert.generators.base import Generator, condition_labels, resolve_class_index
from cbcert.generators.cbae import CBAE
from cbcert.nn.layers import PatchConv, conv2d

Layer = tuple[bool, int, int]  # (up-sample, input width, output width) in units of channel_width


@dataclasses.dataclass(frozen=True)
class BigGANConfig:
    """Static structure of a BigGAN-deep generator (the fields of upstream ``config.json``).

    Attributes:
      output_dim: image side (128, 256 or 512 for the released models).
      z_dim: latent width (also the class-embedding width; the condition is ``2 z_dim`` wide).
      channel_width: ch; block widths are multiples of it.
      num_classes: classes of the one-hot label (1000 for ImageNet).
      layers: per block ``(up_sample, in_mult, out_mult)``.
      attention_layer_position: self-attention sits before the block with this index.
      eps: batch-norm epsilon (1e-4 upstream).
      n_stats: truncation levels of the stored batch-norm statistics (51 upstream).
    """

    output_dim: int
    z_dim: int
    channel_width: int
    num_classes: int
    layers: tuple[Layer, ...]
    attention_layer_position: int
    eps: float = 1e-4
    n_stats: int = 51

    def __post_init__(self):
        for name in ("z_dim", "channel_width", "num_classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; must be >= 1")
        if self.n_stats < 2:
            raise ValueError(f"n_stats={self.n_stats}; must be >= 2")
        if not self.layers:
            raise ValueError("layers=(); need at least one block")
        ups = sum(bool(up) for up, _, _ in self.layers)
        if 4 * 2**ups != self.output_dim:
            raise ValueError(f"output_dim={self.output_dim}; the layers up-sample 4x4 "
                             f"{ups} times, i.e. to {4 * 2**ups}")
        widths = [16] + [out for _, _, out in self.layers]
        for i, (_, cin, cout) in enumerate(self.layers):
            if cin != widths[i] or cout not in (cin, cin // 2):
                raise ValueError(f"layers[{i}]={self.layers[i]}; input width must be the "
                                 f"previous output ({widths[i]}) and the output equal or half")
        if widths[-1] != 1:
            raise ValueError(f"layers[-1]={self.layers[-1]}; the last block must end at width 1 "
                             "(channel_width channels)")
        if not 0 <= self.attention_layer_position < len(self.layers):
            raise ValueError(f"attention_layer_position={self.attention_layer_position}; "
                             f"allowed: 0..{len(self.layers) - 1}")

    @property
    def condition_dim(self) -> int:
        return 2 * self.z_dim


def stats_index(truncation: float, n_stats: int) -> tuple[int, float]:
    """``(⌊t⌋, frac)`` with ``t = truncation · (n_stats − 1)`` computed as upstream does.

    Raises:
      ValueError: truncation outside (0, 1].
    """
    if not 0 < truncation <= 1:
        raise ValueError(f"truncation={truncation}; allowed: 0 < truncation <= 1")
    frac, start = math.modf(truncation / (1.0 / (n_stats - 1)))
    return int(start), frac


def _table_stats(table: jax.Array, truncation: float) -> jax.Array:
    """Row of the statistics table ``[n_stats, C] -> [C]`` for a truncation level."""
    start, frac = stats_index(truncation, table.shape[0])
    if frac == 0.0:
        return table[start]
    return table[start] * frac + table[start + 1] * (1 - frac)


class ConditionalBatchNorm(nnx.Module):
    """Class-conditional BN with truncation-indexed statistics (see module docstring)."""

    def __init__(self, channels: int, condition_dim: int, config: BigGANConfig,
                 rngs: nnx.Rngs):
        self.running_means = nnx.BatchStat(jnp.zeros((config.n_stats, channels)))
        self.running_vars = nnx.BatchStat(jnp.ones((config.n_stats, channels)))
        self.scale = nnx.Linear(condition_dim, channels, use_bias=False, rngs=rngs)
        self.offset = nnx.Linear(condition_dim, channels, use_bias=False, rngs=rngs)
        self.eps = config.eps

    def __call__(self, x: jax.Array, h: jax.Array, truncation: float) -> jax.Array:
        """``x[B, H, W, C], h[B, 2 z_dim] -> [B, H, W, C]``."""
        mean = _table_stats(self.running_means[...], truncation)
        var = _table_stats(self.running_vars[...], truncation)
        gain = (1 + self.scale(h))[:, None, None, :]
        bias = self.offset(h)[:, None, None, :]
        return (x - mean) / jnp.sqrt(var + self.eps) * gain + bias


class OutputBatchNorm(nnx.Module):
    """Unconditional BN before the RGB conv, same statistics table."""

    def __init__(self, channels: int, config: BigGANConfig):
        self.running_means = nnx.BatchStat(jnp.zeros((config.n_stats, channels)))
        self.running_vars = nnx.BatchStat(jnp.ones((config.n_stats, channels)))
        self.weight = nnx.Param(jnp.ones((channels,)))
        self.bias = nnx.Param(jnp.zeros((channels,)))
        self.eps = config.eps

    def __call__(self, x: jax.Array, truncation: float) -> jax.Array:
        mean = _table_stats(self.running_means[...], truncation)
        var = _table_stats(self.running_vars[...], truncation)
        return (x - mean) / jnp.sqrt(var + self.eps) * self.weight[...] + self.bias[...]


def _conv(cin: int, cout: int, kernel: int, bias: bool, rngs: nnx.Rngs) -> PatchConv:
    """``Conv2d(cin, cout, kernel, padding=kernel // 2)`` in NHWC (``cbcert.nn.layers.conv``)."""
    return conv2d(cin, cout, kernel, padding=kernel // 2, use_bias=bias, rngs=rngs)


def upsample_nearest(x: jax.Array) -> jax.Array:
    """2× nearest-neighbour up-sampling ``[B, H, W, C] -> [B, 2H, 2W, C]``."""
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """``[B, H, W, C] -> [B, H/2, W/2, C]`` (stride 2, no padding)."""
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


class SelfAttention(nnx.Module):
    """SAGAN self-attention (Zhang et al. 2019): ``x + γ · o(softmax(θ φᵀ) g)``.

    θ, φ: 1×1 convs to C/8; g: 1×1 conv to C/2; φ and g are 2×2 max-pooled, o maps C/2 → C.
    """

    def __init__(self, channels: int, rngs: nnx.Rngs):
        self.snconv1x1_theta = _conv(channels, channels // 8, 1, False, rngs)
        self.snconv1x1_phi = _conv(channels, channels // 8, 1, False, rngs)
        self.snconv1x1_g = _conv(channels, channels // 2, 1, False, rngs)
        self.snconv1x1_o_conv = _conv(channels // 2, channels, 1, False, rngs)
        self.gamma = nnx.Param(jnp.zeros((1,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        theta = self.snconv1x1_theta(x).reshape(b, h * w, c // 8)
        phi = max_pool_2x2(self.snconv1x1_phi(x)).reshape(b, h * w // 4, c // 8)
        g = max_pool_2x2(self.snconv1x1_g(x)).reshape(b, h * w // 4, c // 2)
        attention = jax.nn.softmax(theta @ jnp.swapaxes(phi, 1, 2), axis=-1)  # [B, HW, HW/4]
        out = self.snconv1x1_o_conv((attention @ g).reshape(b, h, w, c // 2))
        return x + self.gamma[...] * out


class GenBlock(nnx.Module):
    """Bottleneck residual block of BigGAN-deep (reduction factor 4)."""

    def __init__(self, cin: int, cout: int, up: bool, config: BigGANConfig, rngs: nnx.Rngs):
        mid = cin // 4
        cond = config.condition_dim
        self.bn_0 = ConditionalBatchNorm(cin, cond, config, rngs)
        self.conv_0 = _conv(cin, mid, 1, True, rngs)
        self.bn_1 = ConditionalBatchNorm(mid, cond, config, rngs)
        self.conv_1 = _conv(mid, mid, 3, True, rngs)
        self.bn_2 = ConditionalBatchNorm(mid, cond, config, rngs)
        self.conv_2 = _conv(mid, mid, 3, True, rngs)
        self.bn_3 = ConditionalBatchNorm(mid, cond, config, rngs)
        self.conv_3 = _conv(mid, cout, 1, True, rngs)
        self.up = up
        self.cout = cout

    def __call__(self, x: jax.Array, h: jax.Array, truncation: float) -> jax.Array:
        y = self.conv_0(jax.nn.relu(self.bn_0(x, h, truncation)))
        y = jax.nn.relu(self.bn_1(y, h, truncation))
        if self.up:
            y = upsample_nearest(y)
        y = self.conv_1(y)
        y = self.conv_2(jax.nn.relu(self.bn_2(y, h, truncation)))
        y = self.conv_3(jax.nn.relu(self.bn_3(y, h, truncation)))
        skip = x[..., : self.cout]  # width halves: keep the first half of the channels
        if self.up:
            skip = upsample_nearest(skip)
        return y + skip


class BigGAN(nnx.Module):
    """BigGAN-deep: ``model(z[B, z_dim], y[B, num_classes], truncation) -> img[B, H, W, 3]``.

    ``model.condition(z, y) = [z ; y E]`` and ``model.synthesize(h, truncation)`` split the
    forward pass; the image is tanh-valued in [-1, 1].
    """

    def __init__(self, config: BigGANConfig, *, rngs: nnx.Rngs):
        self.config = config
        ch = config.channel_width
        self.embeddings = nnx.Linear(config.num_classes, config.z_dim, use_bias=False, rngs=rngs)
        self.gen_z = nnx.Linear(config.condition_dim, 4 * 4 * 16 * ch, rngs=rngs)
        layers = []
        for i, (up, cin, cout) in enumerate(config.layers):
            if i == config.attention_layer_position:
                layers.append(SelfAttention(ch * cin, rngs))
            layers.append(GenBlock(ch * cin, ch * cout, bool(up), config, rngs))
        self.layers = nnx.List(layers)
        self.bn = OutputBatchNorm(ch, config)
        self.conv_to_rgb = _conv(ch, ch, 3, True, rngs)

    def condition(self, z: jax.Array, y: jax.Array) -> jax.Array:
        """``h = [z ; y E]``: ``z[B, z_dim], y[B, num_classes] (one-hot) -> h[B, 2 z_dim]``."""
        return jnp.concatenate([z, self.embeddings(y)], axis=1)

    def synthesize(self, h: jax.Array, truncation: float) -> jax.Array:
        """``h[B, 2 z_dim] -> img[B, output_dim, output_dim, 3]`` in [-1, 1].

        ``truncation`` (a Python float in (0, 1]) selects the batch-norm statistics; the caller
        scales/truncates z itself (upstream samples ``truncation · truncnorm(−2, 2)``).
        """
        ch = self.config.channel_width
        x = self.gen_z(h).reshape(h.shape[0], 4, 4, 16 * ch)  # upstream's view is already NHWC
        for layer in self.layers:
            x = layer(x, h, truncation) if isinstance(layer, GenBlock) else layer(x)
        x = self.conv_to_rgb(jax.nn.relu(self.bn(x, truncation)))
        return jnp.tanh(x[..., :3])

    def __call__(self, z: jax.Array, y: jax.Array, truncation: float) -> jax.Array:
        return self.synthesize(self.condition(z, y), truncation)


def biggan_generator(model: BigGAN, class_index: int | Sequence[int], truncation: float,
                     name: str = "biggan-deep", cbae: CBAE | None = None) -> Generator:
    """BigGAN-deep for one ImageNet class, or for a list of them, as cbcert's ``Generator``.

    * ``g1(z) = [truncation · z ; E e_class]`` (the condition vector, ``dw = 2 z_dim``); z has a
      standard normal prior here -- upstream's truncated-normal sampling is not applied.
      ``class_index`` an int: every input renders that class. A list: the generator's
      ``classes``; each input ``[z ; k]`` renders ``class_index[k]`` (`Generator`).
    * ``E``/``D``: a CB-AE trained on that vector (``certify train cbae``; ``num_ws = 1``,
      ``latent_dim = 2 z_dim``), or without one ``E = D = identity`` (K = 0, U = 2 z_dim).
    * ``g2(h) = (synthesize(h, truncation) + 1) / 2`` in [0, 1], NHWC.
    """
    config = model.config
    classes = resolve_class_index(class_index, config.num_classes)
    stats_index(truncation, config.n_stats)  # validates truncation early
    if cbae is not None and (cbae.config.num_ws, cbae.config.latent_dim) != (
            1, config.condition_dim):
        raise ValueError(f"CB-AE latent (num_ws={cbae.config.num_ws}, latent_dim="
                         f"{cbae.config.latent_dim}) does not match the generator's condition "
                         f"(num_ws=1, latent_dim={config.condition_dim})")
    graphdef, params = nnx.split(model)
    cb_graphdef, cb_params = nnx.split(cbae) if cbae is not None else (None, None)
    labels = condition_labels(classes, class_index, config.num_classes, config.z_dim)

    def g1(p, z):
        m = nnx.merge(graphdef, p["biggan"])
        return m.condition(truncation * z[:, :config.z_dim], labels(z))

    def g2(p, h):
        return (nnx.merge(graphdef, p["biggan"]).synthesize(h, truncation) + 1) / 2

    def encode(p, h):
        return h if cbae is None else nnx.merge(cb_graphdef, p["cbae"]).encode(h)

    def decode(p, c):
        return c if cbae is None else nnx.merge(cb_graphdef, p["cbae"]).decode(c)

    return Generator(name=name, latent_dim=config.z_dim,
                     concept_names=() if cbae is None else cbae.config.concept_names,
                     num_unsup=config.condition_dim if cbae is None else cbae.config.num_unsup,
                     image_shape=(config.output_dim, config.output_dim, 3),
                     params={"biggan": params, "cbae": cb_params}, g1=g1, encode=encode,
                     decode=decode, g2=g2, classes=classes)
