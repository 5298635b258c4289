"""Layers shared by the Flax models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def conv_patches(x: jax.Array, kernel: jax.Array, stride: int, pad: int) -> jax.Array:
    """NHWC convolution as one matmul over k×k patches (im2col).

    ``x[B, H, W, I] * kernel[kh, kw, I, O] -> [B, H', W', O]`` with symmetric zero padding
    ``pad`` and stride ``stride``; identical to ``lax.conv_general_dilated`` up to float
    rounding. Why: XLA:CPU's native convolution runs at a few GFLOP/s on small feature maps
    (measured with jax 0.10.2), while the patch matmul runs at matmul speed.
    """
    kh, kw, cin, cout = kernel.shape
    xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0))) if pad else x
    ho = (x.shape[1] + 2 * pad - kh) // stride + 1
    wo = (x.shape[2] + 2 * pad - kw) // stride + 1
    patches = jnp.concatenate(
        [xp[:, i : i + stride * (ho - 1) + 1 : stride, j : j + stride * (wo - 1) + 1 : stride]
         for i in range(kh) for j in range(kw)],
        axis=-1,
    )  # [B, ho, wo, kh*kw*I], (i, j, c) order as in the HWIO kernel
    return patches @ kernel.reshape(kh * kw * cin, cout)


class PatchConv(nnx.Module):
    """Convolution with ``nnx.Conv``'s ``kernel``/``bias`` layout, computed by ``conv_patches``."""

    def __init__(self, cin: int, cout: int, size: int, *, stride: int = 1, padding: int = 0,
                 rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (size, size, cin, cout)))
        self.bias = nnx.Param(jnp.zeros((cout,)))
        self.stride, self.padding = stride, padding

    def __call__(self, x):  # [B, H, W, cin] -> [B, H', W', cout]
        return conv_patches(x, self.kernel[...], self.stride, self.padding) + self.bias[...]
