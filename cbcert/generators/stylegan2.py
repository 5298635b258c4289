"""StyleGAN2 generator (Karras et al., CVPR 2020, "Analyzing and improving the image quality of
StyleGAN") in Flax NNX, laid out like NVlabs' stylegan2-ada-pytorch ``G_ema``, with the three
synthesis architectures of the paper's Figure 7 ("skip", the default, "orig" and "resnet").

Written from the paper's equations and the public parameter layout (see
``cbcert.convert.stylegan2``); channel-last (NHWC) and float32 throughout, which is what the
reference computes with ``force_fp32`` (its fp16 pre-normalisation cancels under demodulation).

Maths, per part:

* mapping ``z → w``: ``z / sqrt(mean(z²) + 1e-8)`` (2nd-moment normalisation), then ``L`` fully
  connected layers with equalised learning rate -- weights scaled at run time by
  ``lr_mult / sqrt(fan_in)``, biases by ``lr_mult`` -- and ``lrelu_0.2(·)·√2``. The result is
  broadcast to ``num_ws`` per-layer copies; truncation moves the first ``cutoff`` copies to
  ``w_avg + ψ (w − w_avg)``.
* modulated convolution (paper eq. 1-3): styles ``s = A(w)`` (affine, bias initialised to 1),
  ``w'_ijk = s_i w_ijk``, demodulated by ``1 / sqrt(Σ_ik w'_ijk² + 1e-8)``; computed as
  ``conv(x ⊙ s, w) ⊙ d`` (the same linear map as the per-sample grouped convolution), the
  shared-weight ``conv`` as a patch matmul on CPU, the native convolution on accelerators
  (``cbcert.models.layers.conv``).
* up-sampling (2×): zero insertion, the stored FIR filter ``f`` (gain 4), then the 3×3 kernel used
  as a true convolution (spatially flipped), as NVlabs' transposed-convolution fast path does;
  computed in that path's order (the two filters commute): the transposed convolution by output
  phase at the input resolution (``transposed_conv3_up2``), then the FIR on its output.
  The FIR filter is applied per channel as ``fh·fw`` shifted multiply-adds, not as a depthwise
  convolution (which XLA:CPU runs at < 1 GFLOP/s).
* each conv layer adds ``noise · noise_strength`` (per-pixel noise broadcast over channels),
  the bias, ``lrelu_0.2 · √2`` and clamps to ``±conv_clamp``.
* ToRGB: a 1×1 modulated conv without demodulation (styles scaled by ``1/sqrt(fan_in)``),
  linear, clamped to ``±conv_clamp``.
* synthesis architecture (one for the whole network, as NVlabs builds it):

  - "skip": every block renders RGB; the running image is up-sampled with the block's FIR
    filter and the block's RGB added to it.
  - "orig": plain stack of blocks; only the last block has a ToRGB, whose output is the image.
  - "resnet": as "orig", and every block but the first (the constant input) is residual:
    ``x' = (skip(x) + conv1(conv0(x))) / √2``, where ``skip`` is a 1×1 linear conv without bias
    (equalised lr, weights scaled by ``1/sqrt(fan_in)``) followed by the same 2× FIR
    up-sampling, and ``conv1``'s activation gain and clamp are both multiplied by ``1/√2``
    (``lrelu(·)·√2/√2``, clamped to ``±conv_clamp/√2``).

  Every architecture consumes ``num_ws = 2·blocks`` styles: the convs of block b >= 1 read
  ``ws[:, 2b − 1]`` and ``ws[:, 2b]`` (block 0's single conv ``ws[:, 0]``); a ToRGB (every
  block's in "skip", the last block's otherwise) reads the next one, ``ws[:, 2b + 1]``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from cbcert.generators.base import Generator
from cbcert.generators.cbae import CBAE
from cbcert.models.layers import conv

NoiseMode = Literal["const", "random", "none"]
ARCHITECTURES = ("orig", "skip", "resnet")
LRELU_SLOPE = 0.2
LRELU_GAIN = math.sqrt(2.0)
KERNEL_SIZE = 3


class Buffer(nnx.Variable):
    """Non-trained state read from the checkpoint (w_avg, FIR filters, constant noise)."""


@dataclasses.dataclass(frozen=True)
class StyleGAN2Config:
    """Static structure of a stylegan2-ada-pytorch generator.

    Attributes:
      z_dim: latent width d.
      w_dim: style width.
      img_resolution: output side (a power of two >= 4).
      img_channels: output channels (3 for RGB).
      channels: feature channels of the blocks at 4, 8, ..., img_resolution
        (NVlabs: ``min(channel_base // res, channel_max)``, see ``channels_from_base``).
      c_dim: conditioning label width (0: unconditional).
      mapping_layers: fully connected layers of the mapping network.
      mapping_features: width of the hidden mapping layers.
      embed_features: width of the label embedding (only used when ``c_dim > 0``).
      lr_multiplier: equalised-lr multiplier of the mapping layers (0.01 in StyleGAN2).
      conv_clamp: clamp of every conv and ToRGB output, or None.
      filter_size: side of the stored 2-D FIR up-sampling filter (4 for ``[1, 3, 3, 1]``).
      use_noise: whether the conv layers have noise inputs.
      has_w_avg: whether the mapping network tracks ``w_avg`` (needed for truncation).
      architecture: synthesis architecture, one of ``ARCHITECTURES`` (module docstring).
    """

    z_dim: int
    w_dim: int
    img_resolution: int
    img_channels: int
    channels: tuple[int, ...]
    c_dim: int = 0
    mapping_layers: int = 8
    mapping_features: int | None = None
    embed_features: int | None = None
    lr_multiplier: float = 0.01
    conv_clamp: float | None = None
    filter_size: int = 4
    use_noise: bool = True
    has_w_avg: bool = True
    architecture: str = "skip"

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}; allowed: "
                             f"{', '.join(map(repr, ARCHITECTURES))}")
        res = self.img_resolution
        if res < 4 or res & (res - 1):
            raise ValueError(f"img_resolution={res}; must be a power of two >= 4")
        if len(self.channels) != len(self.block_resolutions) or min(self.channels) < 1:
            raise ValueError(f"channels={self.channels}; need {len(self.block_resolutions)} "
                             f"positive widths (one per block resolution {self.block_resolutions})")
        for name in ("z_dim", "w_dim", "img_channels", "mapping_layers", "filter_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; must be >= 1")
        if self.c_dim < 0:
            raise ValueError(f"c_dim={self.c_dim}; must be >= 0")

    @property
    def block_resolutions(self) -> tuple[int, ...]:
        """4, 8, ..., img_resolution."""
        return tuple(2**i for i in range(2, int(math.log2(self.img_resolution)) + 1))

    @property
    def num_ws(self) -> int:
        """Per-layer styles: 2 per block (1 in the 4×4 block) plus the last ToRGB."""
        return 2 * len(self.block_resolutions)

    @property
    def hidden_features(self) -> int:
        return self.w_dim if self.mapping_features is None else self.mapping_features

    @property
    def embed_width(self) -> int:
        if self.c_dim == 0:
            return 0
        return self.w_dim if self.embed_features is None else self.embed_features


def channels_from_base(channel_base: int, channel_max: int, img_resolution: int
                       ) -> tuple[int, ...]:
    """NVlabs' widths ``min(channel_base // res, channel_max)`` for res = 4 ... img_resolution."""
    log2 = int(math.log2(img_resolution))
    return tuple(min(channel_base // 2**i, channel_max) for i in range(2, log2 + 1))


# ----------------------------------------------------------------------------- pure ops


def normalize_2nd_moment(x: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``x / sqrt(mean_j x_j² + eps)`` over the last axis: ``x[B, D] -> [B, D]``."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def bias_act(x: jax.Array, bias: jax.Array, lrelu: bool, gain: float,
             clamp: float | None) -> jax.Array:
    """``clamp(act(x + b) · gain, ±clamp)``, ``act`` = leaky ReLU (slope 0.2) or identity.

    ``x[..., C]``, ``bias[C]``; the clamp is applied after the gain, as in NVlabs ``bias_act``.
    """
    x = x + bias
    if lrelu:
        x = jnp.where(x >= 0, x, x * LRELU_SLOPE)
    x = x * gain
    if clamp is not None:
        x = jnp.clip(x, -clamp, clamp)
    return x


def upfirdn2d(x: jax.Array, f: jax.Array, up: int, padding: tuple[int, int, int, int],
              gain: float) -> jax.Array:
    """Up-sample, pad, FIR-filter: ``x[B, H, W, C] -> [B, H·up + py0 + py1 − fh + 1,
    W·up + px0 + px1 − fw + 1, C]``.

    Zero insertion (``x[i]`` lands at ``i·up``, ``up − 1`` zeros follow), padding
    ``(px0, px1, py0, py1)`` (negative values crop), then true 2-D convolution with
    ``gain · f[fh, fw]`` keeping only fully overlapping outputs (NVlabs ``upfirdn2d`` with
    ``down=1, flip_filter=False``). Row n of the result is row ``n + fh − 1 − py0`` of the full
    convolution of the zero-inserted input (``scipy.signal.upfirdn``).

    Computed per channel as ``y[n, m] = Σ_{i<fh, j<fw} g[i, j] · p[n + i, m + j]`` with
    ``g = gain · f`` flipped in both axes and ``p`` the up-sampled, padded map: ``fh·fw`` shifted
    multiply-adds (XLA:CPU runs the equivalent depthwise convolution at < 1 GFLOP/s).
    """
    b, h, w, c = x.shape
    px0, px1, py0, py1 = padding
    if up > 1:
        x = x.reshape(b, h, 1, w, 1, c)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, up - 1), (0, 0), (0, up - 1), (0, 0)))
        x = x.reshape(b, h * up, w * up, c)
    x = jnp.pad(x, ((0, 0), (max(py0, 0), max(py1, 0)), (max(px0, 0), max(px1, 0)), (0, 0)))
    x = x[:, max(-py0, 0): x.shape[1] - max(-py1, 0), max(-px0, 0): x.shape[2] - max(-px1, 0)]
    fh, fw = f.shape
    taps = (f[::-1, ::-1] * gain).astype(x.dtype)  # flipped: convolution, not correlation
    ho, wo = x.shape[1] - fh + 1, x.shape[2] - fw + 1
    y = None
    for i in range(fh):
        for j in range(fw):
            term = x[:, i: i + ho, j: j + wo] * taps[i, j]
            y = term if y is None else y + term
    return y


def upsample2d(x: jax.Array, f: jax.Array) -> jax.Array:
    """2× FIR up-sampling ``x[B, H, W, C] -> [B, 2H, 2W, C]`` (DC gain preserved)."""
    fh, fw = f.shape
    padding = ((fw + 1) // 2, (fw - 2) // 2, (fh + 1) // 2, (fh - 2) // 2)
    return upfirdn2d(x, f, up=2, padding=padding, gain=4.0)


# (tap t of a 2-wide input window, output phase p) -> index of the 3-tap kernel (module docstring)
_POLYPHASE_TAP = {(0, 0): 1, (0, 1): 2, (1, 1): 0}


def transposed_conv3_up2(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """Zero insertion then true convolution with a 3×3 kernel, by output phase (polyphase).

    ``x[B, H, W, I], kernel[3, 3, I, O] -> v[B, 2H + 4, 2W + 4, O]`` with (per axis)
    ``v[m] = Σ_s kernel[2 − s] · U[m + s − 3]``, ``U`` the zero-inserted input (``U[2p] = x[p]``,
    zeros between). Only every other ``U`` is non-zero, so ``v[2a] = k[1] x[a − 1]`` and
    ``v[2a + 1] = k[2] x[a − 1] + k[0] x[a]``: one convolution of the input, padded (1, 2), with
    a ``2×2`` kernel holding the four phases' taps side by side (``[2, 2, I, 4O]``, zeros where a
    phase has no tap), then depth-to-space. ``32·H·W·I·O`` FLOPs instead of the ``72·H·W·I·O``
    of the dense 3×3 convolution at twice the resolution; the result is the same linear map.
    """
    zeros = jnp.zeros_like(kernel[0, 0])
    rows = []
    for ty in (0, 1):
        cols = []
        for tx in (0, 1):
            phases = []
            for py in (0, 1):
                for px in (0, 1):
                    iy, ix = _POLYPHASE_TAP.get((ty, py)), _POLYPHASE_TAP.get((tx, px))
                    phases.append(zeros if iy is None or ix is None else kernel[iy, ix])
            cols.append(jnp.concatenate(phases, axis=-1))  # [I, 4O], (py, px, o) order
        rows.append(jnp.stack(cols))
    taps = jnp.stack(rows)  # [2, 2, I, 4O]
    v = conv(jnp.pad(x, ((0, 0), (1, 2), (1, 2), (0, 0))), taps, 1, 0)  # [B, H + 2, W + 2, 4O]
    b, hp, wp, _ = v.shape
    o = kernel.shape[-1]
    v = v.reshape(b, hp, wp, 2, 2, o).transpose(0, 1, 3, 2, 4, 5)
    return v.reshape(b, 2 * hp, 2 * wp, o)


def modulated_conv2d(x: jax.Array, kernel: jax.Array, styles: jax.Array, demodulate: bool,
                     up: int = 1, f: jax.Array | None = None) -> jax.Array:
    """Modulated (and demodulated) convolution, paper eq. 1-3.

    Args:
      x: ``[B, H, W, I]``.
      kernel: ``[k, k, I, O]`` (HWIO), used unscaled (demodulation normalises it).
      styles: ``s[B, I]``.
      demodulate: divide output channel j by ``sqrt(Σ_{i,k} (s_i w_ijk)² + 1e-8)``.
      up: 1 (same-size, cross-correlation with padding k // 2) or 2 (FIR up-sampling with ``f``,
        then the kernel as a true convolution).
      f: ``[fh, fw]`` FIR filter, needed when ``up == 2``.

    Returns:
      ``[B, H·up, W·up, O]``.
    """
    k = kernel.shape[0]
    y = x * styles[:, None, None, :]
    if up == 1:
        y = conv(y, kernel, 1, k // 2)
    elif up == 2:
        if f is None:
            raise ValueError("f=None; the 2x up-sampling convolution needs its FIR filter")
        fh, fw = f.shape
        pad = k // 2
        padding = (pad + (fw + 1) // 2, pad + (fw - 2) // 2,
                   pad + (fh + 1) // 2, pad + (fh - 2) // 2)
        if k == 3:  # the synthesis layers: polyphase transposed conv, then the FIR
            y = upfirdn2d(transposed_conv3_up2(y, kernel), f, up=1,
                          padding=tuple(p - 3 for p in padding), gain=4.0)
        else:
            y = upfirdn2d(y, f, up=2, padding=padding, gain=4.0)
            y = conv(y, kernel[::-1, ::-1], 1, 0)
    else:
        raise ValueError(f"up={up}; allowed: 1, 2")
    if demodulate:
        energy = jnp.sum(jnp.square(kernel), axis=(0, 1))  # [I, O]
        d = jax.lax.rsqrt(jnp.square(styles) @ energy + 1e-8)  # [B, O]
        y = y * d[:, None, None, :]
    return y


# ----------------------------------------------------------------------------- modules


class FullyConnected(nnx.Module):
    """Equalised-lr dense layer: ``act(x W·lr/√fan_in + b·lr)`` (``kernel[in, out]``)."""

    def __init__(self, din: int, dout: int, lr_multiplier: float, lrelu: bool,
                 bias_init: float, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) / lr_multiplier)
        self.bias = nnx.Param(jnp.full((dout,), bias_init / lr_multiplier))
        self.weight_gain = lr_multiplier / math.sqrt(din)
        self.bias_gain = lr_multiplier
        self.lrelu = lrelu

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x[B, in] -> [B, out]``."""
        y = x @ (self.kernel[...] * self.weight_gain)
        return bias_act(y, self.bias[...] * self.bias_gain, self.lrelu,
                        LRELU_GAIN if self.lrelu else 1.0, None)


class MappingNetwork(nnx.Module):
    """``z[B, z_dim] (+ c[B, c_dim]) -> ws[B, num_ws, w_dim]``."""

    def __init__(self, config: StyleGAN2Config, rngs: nnx.Rngs):
        self.config = config
        self.embed = (FullyConnected(config.c_dim, config.embed_width, 1.0, False, 0.0, rngs)
                      if config.c_dim else None)
        widths = ([config.z_dim + config.embed_width]
                  + [config.hidden_features] * (config.mapping_layers - 1) + [config.w_dim])
        self.fc = nnx.List([FullyConnected(widths[i], widths[i + 1], config.lr_multiplier, True,
                                           0.0, rngs) for i in range(config.mapping_layers)])
        self.w_avg = Buffer(jnp.zeros((config.w_dim,))) if config.has_w_avg else None

    def __call__(self, z: jax.Array, c: jax.Array | None, truncation_psi: float,
                 truncation_cutoff: int | None) -> jax.Array:
        parts = [normalize_2nd_moment(z)] if self.config.z_dim else []
        if self.config.c_dim:
            if c is None:
                raise ValueError(f"c=None; this generator is conditional (c_dim="
                                 f"{self.config.c_dim})")
            parts.append(normalize_2nd_moment(self.embed(c)))
        x = jnp.concatenate(parts, axis=1)
        for layer in self.fc:
            x = layer(x)
        ws = jnp.broadcast_to(x[:, None, :], (x.shape[0], self.config.num_ws, x.shape[1]))
        if truncation_psi == 1:
            return ws
        if self.w_avg is None:
            raise ValueError(f"truncation_psi={truncation_psi}; this generator has no w_avg, "
                             "only truncation_psi=1 is possible")
        cutoff = self.config.num_ws if truncation_cutoff is None else truncation_cutoff
        layer_ids = jnp.arange(self.config.num_ws)[None, :, None]
        w_avg = self.w_avg[...]
        truncated = w_avg + truncation_psi * (ws - w_avg)
        return jnp.where(layer_ids < cutoff, truncated, ws)


class SynthesisLayer(nnx.Module):
    """Modulated 3×3 conv (optionally 2× up-sampling) + noise + bias + lrelu·√2 + clamp."""

    def __init__(self, cin: int, cout: int, resolution: int, up: int,
                 config: StyleGAN2Config, rngs: nnx.Rngs):
        self.affine = FullyConnected(config.w_dim, cin, 1.0, False, 1.0, rngs)
        self.kernel = nnx.Param(jax.random.normal(rngs.params(),
                                                  (KERNEL_SIZE, KERNEL_SIZE, cin, cout)))
        self.bias = nnx.Param(jnp.zeros((cout,)))
        self.up = up
        self.resolution = resolution
        self.conv_clamp = config.conv_clamp
        self.resample_filter = (Buffer(jnp.ones((config.filter_size,) * 2)) if up > 1 else None)
        if config.use_noise:
            self.noise_const = Buffer(jnp.zeros((resolution, resolution)))
            self.noise_strength = nnx.Param(jnp.zeros(()))
        else:
            self.noise_const = self.noise_strength = None

    def __call__(self, x: jax.Array, w: jax.Array, noise_mode: NoiseMode,
                 key: jax.Array | None, gain: float = 1.0) -> jax.Array:
        """``x[B, H, W, I], w[B, w_dim] -> [B, H·up, W·up, O]``.

        ``gain`` multiplies the activation gain and the clamp (NVlabs' ``gain`` argument; the
        "resnet" architecture passes ``1/√2`` to the second conv of a block).
        """
        styles = self.affine(w)
        f = None if self.resample_filter is None else self.resample_filter[...]
        y = modulated_conv2d(x, self.kernel[...], styles, True, self.up, f)
        if self.noise_strength is not None and noise_mode != "none":
            if noise_mode == "const":
                noise = self.noise_const[...][None, :, :, None]
            else:
                noise = jax.random.normal(key, (y.shape[0], self.resolution, self.resolution, 1))
            y = y + noise * self.noise_strength[...]
        clamp = None if self.conv_clamp is None else self.conv_clamp * gain
        return bias_act(y, self.bias[...], True, LRELU_GAIN * gain, clamp)


class SkipConv(nnx.Module):
    """Residual branch of a "resnet" block: 1×1 linear conv without bias, then 2× FIR up.

    ``y = gain · up_f(x W / √fan_in)`` with ``kernel[1, 1, I, O]`` and the layer's own stored
    FIR filter ``f`` (NVlabs ``Conv2dLayer(kernel_size=1, bias=False, up=2)``: convolve first,
    then ``upfirdn2d`` with the up-sampling padding and gain 4, i.e. ``upsample2d``).
    """

    def __init__(self, cin: int, cout: int, config: StyleGAN2Config, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (1, 1, cin, cout)))
        self.resample_filter = Buffer(jnp.ones((config.filter_size,) * 2))
        self.weight_gain = 1.0 / math.sqrt(cin)

    def __call__(self, x: jax.Array, gain: float) -> jax.Array:
        """``x[B, H, W, I] -> [B, 2H, 2W, O]``."""
        y = x @ (self.kernel[...][0, 0] * self.weight_gain)
        return upsample2d(y, self.resample_filter[...]) * gain


class ToRGB(nnx.Module):
    """1×1 modulated conv without demodulation, styles scaled by ``1/√fan_in``; linear + clamp."""

    def __init__(self, cin: int, config: StyleGAN2Config, rngs: nnx.Rngs):
        self.affine = FullyConnected(config.w_dim, cin, 1.0, False, 1.0, rngs)
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (1, 1, cin, config.img_channels)))
        self.bias = nnx.Param(jnp.zeros((config.img_channels,)))
        self.weight_gain = 1.0 / math.sqrt(cin)
        self.conv_clamp = config.conv_clamp

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        styles = self.affine(w) * self.weight_gain
        y = modulated_conv2d(x, self.kernel[...], styles, False)
        return bias_act(y, self.bias[...], False, 1.0, self.conv_clamp)


class SynthesisBlock(nnx.Module):
    """One resolution: [const | conv0 (2× up)], conv1, then per architecture (module docstring)
    a ToRGB ("skip": every block; "orig"/"resnet": the last) and a residual ``skip`` branch
    ("resnet", every block but the first)."""

    def __init__(self, index: int, config: StyleGAN2Config, rngs: nnx.Rngs):
        self.resolution = config.block_resolutions[index]
        arch = config.architecture
        cout = config.channels[index]
        is_last = index == len(config.block_resolutions) - 1
        if index == 0:
            self.const = nnx.Param(jax.random.normal(rngs.params(), (cout, 4, 4)))  # CHW
            self.conv0 = None
        else:
            cin = config.channels[index - 1]
            self.const = None
            self.conv0 = SynthesisLayer(cin, cout, self.resolution, 2, config, rngs)
        # Only "skip" has a running image to up-sample (NVlabs registers the filter everywhere).
        self.resample_filter = (Buffer(jnp.ones((config.filter_size,) * 2))
                                if index > 0 and arch == "skip" else None)
        self.conv1 = SynthesisLayer(cout, cout, self.resolution, 1, config, rngs)
        self.torgb = ToRGB(cout, config, rngs) if is_last or arch == "skip" else None
        self.skip = (SkipConv(config.channels[index - 1], cout, config, rngs)
                     if index > 0 and arch == "resnet" else None)

    @property
    def num_conv(self) -> int:
        return 1 if self.conv0 is None else 2

    @property
    def num_torgb(self) -> int:
        return 0 if self.torgb is None else 1

    def __call__(self, x: jax.Array | None, img: jax.Array | None, ws: jax.Array,
                 noise_mode: NoiseMode, key: jax.Array | None
                 ) -> tuple[jax.Array, jax.Array | None]:
        """``ws[B, num_conv + num_torgb, w_dim]``; returns features and the running image (NHWC;
        None after a block without ToRGB)."""
        keys = [None, None] if key is None else list(jax.random.split(key, 2))
        if self.conv0 is None:
            const = jnp.transpose(self.const[...], (1, 2, 0))  # [4, 4, C]
            x = jnp.broadcast_to(const[None], (ws.shape[0], *const.shape))
            x = self.conv1(x, ws[:, 0], noise_mode, keys[1])
        elif self.skip is not None:
            gain = math.sqrt(0.5)
            y = self.skip(x, gain)
            x = self.conv0(x, ws[:, 0], noise_mode, keys[0])
            x = y + self.conv1(x, ws[:, 1], noise_mode, keys[1], gain)
        else:
            x = self.conv0(x, ws[:, 0], noise_mode, keys[0])
            x = self.conv1(x, ws[:, 1], noise_mode, keys[1])
        if img is not None:  # "skip" only: the other architectures render RGB once, at the end
            img = upsample2d(img, self.resample_filter[...])
        if self.torgb is not None:
            y = self.torgb(x, ws[:, self.num_conv])
            img = y if img is None else img + y
        return x, img


class StyleGAN2(nnx.Module):
    """Mapping + synthesis networks of a StyleGAN2 ``G_ema``.

    ``model.map(z, c, truncation_psi, truncation_cutoff) -> ws[B, num_ws, w_dim]`` and
    ``model.synthesize(ws, noise_mode, key) -> img[B, H, W, C]`` (about [-1, 1]).
    """

    def __init__(self, config: StyleGAN2Config, *, rngs: nnx.Rngs):
        self.config = config
        self.mapping = MappingNetwork(config, rngs)
        self.blocks = nnx.List([SynthesisBlock(i, config, rngs)
                                for i in range(len(config.block_resolutions))])

    def map(self, z: jax.Array, c: jax.Array | None = None, truncation_psi: float = 1.0,
            truncation_cutoff: int | None = None) -> jax.Array:
        """``z[B, z_dim] -> ws[B, num_ws, w_dim]`` (truncated towards ``w_avg`` if ψ != 1).

        ``truncation_cutoff`` = number of leading layers truncated (None: all).
        """
        return self.mapping(z, c, truncation_psi, truncation_cutoff)

    def synthesize(self, ws: jax.Array, noise_mode: NoiseMode = "const",
                   key: jax.Array | None = None) -> jax.Array:
        """``ws[B, num_ws, w_dim] -> img[B, H, W, C]`` in the generator's range (about [-1, 1]).

        Args:
          ws: per-layer styles; block b reads ``ws[:, 2b − 1 : 2b + 2]`` (its ToRGB, when it has
            one, shares the style of the next block's first conv).
          noise_mode: ``"const"`` (the stored noise buffers: deterministic), ``"random"`` (fresh
            N(0, 1) noise drawn from ``key``) or ``"none"``.
          key: PRNG key, required for ``"random"`` and refused otherwise.
        """
        if noise_mode not in ("const", "random", "none"):
            raise ValueError(f"noise_mode={noise_mode!r}; allowed: 'const', 'random', 'none'")
        if (key is None) != (noise_mode != "random"):
            given = "None" if key is None else "a key"
            raise ValueError(f"noise_mode={noise_mode!r} with key={given}; a key is needed "
                             "for (and only for) noise_mode='random'")
        if ws.shape[1:] != (self.config.num_ws, self.config.w_dim):
            raise ValueError(f"ws.shape={ws.shape}; expected [B, {self.config.num_ws}, "
                             f"{self.config.w_dim}]")
        x = img = None
        start = 0
        for i, block in enumerate(self.blocks):
            block_key = None if key is None else jax.random.fold_in(key, i)
            x, img = block(x, img, ws[:, start: start + block.num_conv + block.num_torgb],
                           noise_mode, block_key)
            start += block.num_conv
        return img


def stylegan2_generator(model: StyleGAN2, cbae: CBAE | None = None,
                        truncation_psi: float = 1.0, truncation_cutoff: int | None = None,
                        name: str = "stylegan2", class_index: int | None = None) -> Generator:
    """StyleGAN2 (+ optional CB-AE) as cbcert's ``Generator`` (``g = g2 ∘ D ∘ E ∘ g1``).

    * ``g1(z) = map(z, c, ψ, cutoff)`` flattened to ``w[B, num_ws · w_dim]``; for a
      conditional generator (``c_dim > 0``) ``c`` is the one-hot label of ``class_index``
      (required, in ``[0, c_dim)``; fixed for the whole world, as BigGAN's class), for an
      unconditional one there is no label and ``class_index`` must be None.
    * ``E``/``D``: the CB-AE's (``cbcert.generators.cbae.CBAE``); without one, K = 0 and
      ``E = D = identity`` (``U = num_ws · w_dim``).
    * ``g2(w) = clip((synthesize(w, noise_mode="const") + 1) / 2, 0, 1)`` as ``[B, H, W, C]``:
      the stored constant noise makes ``g2`` a deterministic function of ``w``.

    Raises:
      ValueError: a conditional generator without ``class_index`` or with one outside
        ``[0, c_dim)``, an unconditional one with a ``class_index``, or a CB-AE whose latent
        shape differs from the generator's.
    """
    config = model.config
    if config.c_dim and class_index is None:
        raise ValueError(f"class_index=None; this StyleGAN2 is conditional (c_dim="
                         f"{config.c_dim}): pick a class in 0..{config.c_dim - 1}")
    if not config.c_dim and class_index is not None:
        raise ValueError(f"class_index={class_index!r}; this StyleGAN2 is unconditional "
                         "(c_dim=0) and takes no class")
    if class_index is not None and (not isinstance(class_index, int) or isinstance(
            class_index, bool) or not 0 <= class_index < config.c_dim):
        raise ValueError(f"class_index={class_index!r}; allowed: 0..{config.c_dim - 1} "
                         f"(c_dim={config.c_dim})")
    if cbae is not None and (cbae.config.latent_dim, cbae.config.num_ws) != (config.w_dim,
                                                                             config.num_ws):
        raise ValueError(f"CB-AE latent (num_ws={cbae.config.num_ws}, latent_dim="
                         f"{cbae.config.latent_dim}) does not match the generator's (num_ws="
                         f"{config.num_ws}, w_dim={config.w_dim})")
    graphdef, params = nnx.split(model)
    cb_graphdef, cb_params = nnx.split(cbae) if cbae is not None else (None, None)
    onehot = (None if class_index is None
              else jax.nn.one_hot(jnp.asarray([class_index]), config.c_dim))

    def g1(p, z):
        c = None if onehot is None else jnp.broadcast_to(onehot, (z.shape[0], config.c_dim))
        ws = nnx.merge(graphdef, p["stylegan2"]).map(z, c, truncation_psi, truncation_cutoff)
        return ws.reshape(z.shape[0], -1)

    def g2(p, w):
        ws = w.reshape(w.shape[0], config.num_ws, config.w_dim)
        img = nnx.merge(graphdef, p["stylegan2"]).synthesize(ws, "const")
        return jnp.clip((img + 1) / 2, 0, 1)

    def encode(p, w):
        return w if cbae is None else nnx.merge(cb_graphdef, p["cbae"]).encode(w)

    def decode(p, c):
        return c if cbae is None else nnx.merge(cb_graphdef, p["cbae"]).decode(c)

    return Generator(
        name=name, latent_dim=config.z_dim,
        concept_names=() if cbae is None else cbae.config.concept_names,
        num_unsup=config.num_ws * config.w_dim if cbae is None else cbae.config.num_unsup,
        image_shape=(config.img_resolution, config.img_resolution, config.img_channels),
        params={"stylegan2": params, "cbae": cb_params}, g1=g1, encode=encode, decode=decode,
        g2=g2)
