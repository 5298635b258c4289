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
  shared-weight ``conv`` by ``cbcert.nn.layers.conv`` (patch matmul on small CPU maps, the
  native convolution on large ones and on accelerators).
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

import math

import jax
import jax.numpy as jnp
from flax import nnx

from cbcert.generators.stylegan2.config import (
    KERNEL_SIZE,
    LRELU_GAIN,
    NoiseMode,
    StyleGAN2Config,
)
from cbcert.generators.stylegan2.ops import (
    bias_act,
    modulated_conv2d,
    normalize_2nd_moment,
    upsample2d,
)


class Buffer(nnx.Variable):
    """Non-trained state read from the checkpoint (w_avg, FIR filters, constant noise)."""


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
