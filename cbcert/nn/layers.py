"""Layers shared by the Flax models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def conv_patches(x: jax.Array, kernel: jax.Array, stride: int, pad: int,
                 preferred_element_type=None) -> jax.Array:
    """NHWC convolution as one matmul over k×k patches (im2col).

    ``x[B, H, W, I] * kernel[kh, kw, I, O] -> [B, H', W', O]`` (cross-correlation, like
    ``lax.conv_general_dilated``) with symmetric zero padding ``pad`` and stride ``stride``,
    ``H' = (H + 2·pad − kh) // stride + 1``; identical to ``lax.conv_general_dilated`` up to
    float rounding. Why: XLA:CPU's native convolution runs at a few GFLOP/s on small feature
    maps (3–6 GFLOP/s for a 3×3 convolution on 2×2 maps, measured with jax 0.10.2), while the
    patch matmul runs at matmul speed; on larger maps the two are about as fast in a whole
    network (ResNet-50 at 224 px, StyleGAN2 at 64 px).

    The patches ``[B, H', W', kh·kw·I]`` (channel order ``(i, j, c)``, as in the HWIO kernel)
    are gathered in two concatenations, the ``kw`` column shifts then the ``kh`` row shifts of
    those: the same tensor as one concatenation of the ``kh·kw`` shifts, at about half the XLA
    compile time. A 1×1 kernel without padding traces to strided slices (none at stride 1) and
    one ``dot_general``. ``preferred_element_type`` is the matmul's accumulation/output dtype
    (e.g. float32 for bfloat16 inputs; None: the inputs' dtype).
    """
    kh, kw, cin, cout = kernel.shape
    xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0))) if pad else x
    ho = (x.shape[1] + 2 * pad - kh) // stride + 1
    wo = (x.shape[2] + 2 * pad - kw) // stride + 1
    cols = jnp.concatenate([xp[:, :, j : j + stride * (wo - 1) + 1 : stride] for j in range(kw)],
                           axis=-1)  # [B, H + 2·pad, wo, kw*I], (j, c) order
    patches = jnp.concatenate([cols[:, i : i + stride * (ho - 1) + 1 : stride] for i in range(kh)],
                              axis=-1)  # [B, ho, wo, kh*kw*I], (i, j, c) order
    return jnp.dot(patches, kernel.reshape(kh * kw * cin, cout),
                   preferred_element_type=preferred_element_type)


class PatchConv(nnx.Module):
    """Convolution with ``nnx.Conv``'s ``kernel``/``bias`` layout, computed by ``conv`` (the
    backend's fast path: XLA's native convolution on GPU/TPU and on large CPU maps, the patch
    matmul ``conv_patches`` on small CPU maps and for 1×1 kernels).

    ``PatchConv(cin, cout, k, stride=s, padding=p, use_bias=b)`` computes ``nnx.Conv(cin, cout,
    (k, k), strides=(s, s), padding=((p, p), (p, p)), use_bias=b)``: parameters ``kernel[k, k,
    cin, cout]`` (HWIO, lecun-normal init) and, if ``use_bias``, ``bias[cout]`` (zeros; else
    the attribute is ``None`` and the state has no ``bias``, as in ``nnx.Conv``), so key tables
    that target ``.../kernel`` and ``.../bias`` fit both. No dilation or groups.

    ``draw_bias_key``: draw (and discard) a ``params`` key for the bias as ``nnx.Conv`` does,
    so a randomly initialised model that replaced ``nnx.Conv`` by ``PatchConv`` gets the same
    weights from the same seed. The world nets leave it off (their trained checkpoints and
    seeds were made that way).

    Until 2026-12-02 the world nets took the patch matmul on CPU at every map size; they now
    take ``conv`` like the ported models (the built-in world's throughput 1.08× at chunk 8,
    2.0× at chunk 32, logits within 7.5e-4), which changed ``results/reference`` in the last
    digits of its float estimates (DFS distances, attack losses), not in its certificates.
    """

    def __init__(self, cin: int, cout: int, size: int, *, stride: int = 1, padding: int = 0,
                 use_bias: bool = True, draw_bias_key: bool = False, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (size, size, cin, cout)))
        if use_bias and draw_bias_key:
            rngs.params()
        self.bias = nnx.Param(jnp.zeros((cout,))) if use_bias else nnx.data(None)
        self.stride, self.padding = stride, padding

    def __call__(self, x):  # [B, H, W, cin] -> [B, H', W', cout]
        y = conv(x, self.kernel[...], self.stride, self.padding)
        return y if self.bias is None else y + self.bias[...]


# Smallest output side at which XLA:CPU's native convolution takes over from the patch matmul.
NATIVE_MIN_SIDE = 8
# Outputs that an RGB stem (3×3 kernel on 3 channels) with 17-32 outputs is computed at on CPU
# (`native_outputs`).
RGB_STEM_OUTPUTS = 48


def native_is_faster(x_shape: tuple[int, ...], kernel_shape: tuple[int, ...], stride: int,
                     pad: int) -> bool:
    """Whether ``conv`` takes ``lax.conv_general_dilated`` rather than ``conv_patches``.

    Always on GPU/TPU (cuDNN & co.: the tuned path; patch matrices would cost ``kh·kw`` times
    the activation memory). On CPU for kernels larger than 1×1 whose output is at least
    ``NATIVE_MIN_SIDE`` pixels on each side: XLA:CPU's convolution (Eigen) packs the patches
    block by block inside its matmul instead of writing the ``kh·kw``-times larger patch matrix
    to memory (57.8 MB for a 3×3, 256-channel convolution on 28×28 maps at batch 8, which lands
    in freshly mapped pages), so on large maps it runs 1.5-5× faster, and it gives the same
    float32 sums (bit-identical on ResNet-50). On maps of 2×2 it collapses to 0.4-5 GFLOP/s
    (measured with jax 0.10.2 on 2 cores), where the patch matmul stays at matmul speed; 1×1
    kernels are plain matmuls either way. ``benchmarks/conv_layers.py`` times both paths on
    every ResNet-50 convolution shape (``--size 32`` for small maps) against PyTorch.
    """
    if jax.default_backend() != "cpu":
        return True
    kh, kw = kernel_shape[:2]
    if kh * kw == 1:
        return False
    ho = (x_shape[1] + 2 * pad - kh) // stride + 1
    wo = (x_shape[2] + 2 * pad - kw) // stride + 1
    return min(ho, wo) >= NATIVE_MIN_SIDE


def native_outputs(kernel_shape: tuple[int, ...]) -> int:
    """How many output channels ``conv``'s native path computes for ``kernel[kh, kw, I, O]``.

    ``O`` except for an RGB stem on CPU: a 3×3 kernel on 3 channels with 17-32 outputs is
    computed with its kernel zero-padded to ``RGB_STEM_OUTPUTS`` outputs, the extra channels
    dropped (exact: each output channel is its own sum). XLA:CPU's (Eigen's) convolution falls
    off a cliff at those widths: on 32×32 maps (jax 0.10.2, 2-core Intel Xeon with AVX-512,
    2026-12-05) 48 outputs took 1/1.75-1/4.3 of the time of 17-32 at batch 32 and 1/3.4-1/9.3
    at batch 64; 3 → 24 ran at 7 GFLOP/s, 3 → 48 or 64 at ~140. Not the patch matmul, which is
    as fast here: its input padding fuses with the image's producer (the built-in world's
    renderer) into a loop that LLVM vectorises differently at different optimisation levels,
    so the test suite's level would stop giving the users' bits
    (``tests/test_reproducibility.py``). Padding the kernel touches no activation.
    """
    kh, kw, cin, cout = kernel_shape
    if jax.default_backend() == "cpu" and (kh, kw, cin) == (3, 3, 3) and 16 < cout <= 32:
        return RGB_STEM_OUTPUTS
    return cout


def conv(x: jax.Array, kernel: jax.Array, stride: int, pad: int,
         preferred_element_type=None) -> jax.Array:
    """The backend's fast convolution: ``lax.conv_general_dilated`` on GPU/TPU and on CPU for
    large maps (an RGB stem with its outputs padded, ``native_outputs``), ``conv_patches`` on
    CPU for small maps and 1×1 kernels (``native_is_faster``).

    ``x[B, H, W, I] * kernel[kh, kw, I, O] -> [B, H', W', O]`` (cross-correlation, symmetric
    zero padding ``pad``); the two paths agree up to float32 rounding.
    ``preferred_element_type``: accumulation/output dtype (e.g. float32 for bfloat16 inputs);
    None: the inputs' dtype, and for bfloat16/float16 inputs on the patch path the matmul
    still accumulates in float32 (then rounds to the inputs' dtype).
    """
    dtype = jnp.result_type(x, kernel)  # mixed inputs promote as the patch matmul's dot does
    if not native_is_faster(x.shape, kernel.shape, stride, pad):
        if preferred_element_type is None and jnp.issubdtype(dtype, jnp.floating) \
                and jnp.finfo(dtype).bits < 32:
            # bf16/f16 inputs: accumulate in float32, return the inputs' dtype. XLA:CPU's
            # narrow matmul runs at the bf16 units' rate only with a float32 output (AMX:
            # ResNet-50's bf16 forward 55 -> 83 images/s at 112 px, fp32 80; 2026-12-05).
            return conv_patches(x, kernel, stride, pad, jnp.float32).astype(dtype)
        return conv_patches(x, kernel, stride, pad, preferred_element_type)
    cout, computed = kernel.shape[3], native_outputs(kernel.shape)
    if computed != cout:
        kernel = jnp.pad(kernel, ((0, 0), (0, 0), (0, 0), (0, computed - cout)))
    y = jax.lax.conv_general_dilated(x.astype(dtype), kernel.astype(dtype), (stride, stride),
                                     [(pad, pad), (pad, pad)],
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                     preferred_element_type=preferred_element_type)
    return y if computed == cout else y[..., :cout]


def conv2d(cin: int, cout: int, size: int, *, stride: int = 1, padding: int = 0,
           use_bias: bool = True, rngs: nnx.Rngs) -> PatchConv:
    """Drop-in for ``nnx.Conv(cin, cout, (size, size), strides=(stride, stride),
    padding=((padding, padding),) * 2, use_bias=use_bias, rngs=rngs)`` in the ported models:
    same parameter paths, shapes, initialisation and random draws; computed by ``conv``
    (patch matmul on CPU for small maps, the native convolution on large maps and on
    accelerators)."""
    return PatchConv(cin, cout, size, stride=stride, padding=padding, use_bias=use_bias,
                     draw_bias_key=True, rngs=rngs)


class TorchBatchNorm(nnx.BatchNorm):
    """``nnx.BatchNorm`` whose training mode is ``torch.nn.BatchNorm2d``'s: what the trainers
    of converted torchvision models need for their one-step PyTorch parity.

    Inference (``use_running_average=True``, how every ported model is built and run) is
    ``nnx.BatchNorm``'s, unchanged. Training, on ``x[..., C]`` with n values per channel:
    normalise by the batch mean μ and the biased variance v (two-pass, ``mean((x − μ)²)``),
    ``y = (x − μ) / sqrt(v + ε) · scale + bias``, and update the running statistics as
    PyTorch does with its momentum 0.1: ``mean ← 0.9 mean + 0.1 μ`` and
    ``var ← 0.9 var + 0.1 · v · n / (n − 1)`` (the unbiased variance; flax's own BatchNorm
    keeps the biased one with momentum 0.99).
    """

    TORCH_MOMENTUM = 0.1

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        running = self.use_running_average if use_running_average is None \
            else use_running_average
        if running or mask is not None:
            return super().__call__(x, use_running_average, mask=mask)
        axes = tuple(range(x.ndim - 1))
        mean = jnp.mean(x, axis=axes)  # [C]
        var = jnp.mean(jnp.square(x - mean), axis=axes)  # [C], biased
        n = x.size // x.shape[-1]
        m = self.TORCH_MOMENTUM
        self.mean[...] = jax.lax.stop_gradient((1 - m) * self.mean[...] + m * mean)
        self.var[...] = jax.lax.stop_gradient((1 - m) * self.var[...]
                                              + m * var * (n / max(n - 1, 1)))
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        return y * self.scale[...] + self.bias[...]
