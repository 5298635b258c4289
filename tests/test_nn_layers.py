"""``cbcert.nn.layers``: the patch-matmul convolution as a drop-in for ``nnx.Conv``.

Convolutions run in float32 and are compared with the same convolution in float64 numpy
(``parity.assert_parity``; the other float32 implementation measures float32 error).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from parity import assert_parity

from cbcert.nn.layers import PatchConv, conv2d, conv_patches

# (cin, cout, kernel, stride, padding, use_bias, input side): every shape the ports build
# (ResNet/DenseNet stems, 3×3 and strided 1×1 convs, VGG and BigGAN convs with bias, add-ons).
CASES = [
    (3, 8, 7, 2, 3, False, 13),
    (4, 6, 3, 1, 1, False, 7),
    (4, 6, 3, 2, 1, False, 8),
    (4, 6, 1, 2, 0, False, 7),
    (5, 6, 1, 1, 0, True, 5),
    (3, 5, 3, 1, 1, True, 6),
]


def conv_float64(x, kernel, stride: int, padding: int, bias=None) -> np.ndarray:
    """PyTorch / ``nnx.Conv`` cross-correlation of ``x[B, H, W, I]`` with ``kernel[kh, kw, I, O]``
    (symmetric zero padding), in float64: ``[B, h, w, O]``."""
    x = np.pad(np.asarray(x, np.float64), ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    kernel = np.asarray(kernel, np.float64)
    kh, kw = kernel.shape[:2]
    oh, ow = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    out = sum(np.einsum("bhwi,io->bhwo", x[:, i:i + stride * (oh - 1) + 1:stride,
                                          j:j + stride * (ow - 1) + 1:stride], kernel[i, j])
              for i in range(kh) for j in range(kw))
    return out if bias is None else out + np.asarray(bias, np.float64)


@pytest.mark.parametrize("cin,cout,kernel,stride,padding,use_bias,side", CASES)
def test_conv2d_is_a_drop_in_for_nnx_conv(cin, cout, kernel, stride, padding, use_bias, side):
    def ours(rngs):
        return conv2d(cin, cout, kernel, stride=stride, padding=padding, use_bias=use_bias,
                      rngs=rngs)

    def flax_conv(rngs):
        return nnx.Conv(cin, cout, (kernel, kernel), strides=(stride, stride),
                        padding=((padding, padding),) * 2, use_bias=use_bias, rngs=rngs)

    def build_pair(build):  # the second module shows the random stream stayed in step
        rngs = nnx.Rngs(0)
        return build(rngs), build(rngs)

    mine, theirs = build_pair(ours), build_pair(flax_conv)
    for a, b in zip(mine, theirs, strict=True):
        state_a, state_b = nnx.to_pure_dict(nnx.state(a)), nnx.to_pure_dict(nnx.state(b))
        assert set(state_a) == set(state_b) == ({"kernel", "bias"} if use_bias else {"kernel"})
        for key in state_a:
            np.testing.assert_array_equal(state_a[key], state_b[key])
    x = jax.random.normal(jax.random.key(1), (2, side, side, cin))
    if use_bias:  # a non-zero bias, the same on both sides
        bias = jax.random.normal(jax.random.key(2), (cout,))
        mine[0].bias.set_value(bias)
        theirs[0].bias.set_value(bias)
    expected = theirs[0](x)
    got = mine[0](x)
    assert got.shape == expected.shape
    exact = conv_float64(x, mine[0].kernel[...], stride, padding,
                         mine[0].bias[...] if use_bias else None)
    what = f"conv2d {kernel}x{kernel}/{stride}"
    assert_parity(expected, exact, got, f"{what} nnx.Conv")  # the float64 conv is nnx.Conv's
    assert_parity(got, exact, expected, what)


def test_world_patch_conv_keeps_its_random_stream_and_layout():
    """The world nets' ``PatchConv`` draws one key (no bias key), so their seeds still give the
    weights they were trained from; ``use_bias`` defaults to True."""
    rngs = nnx.Rngs(0)
    conv = PatchConv(3, 4, 3, padding=1, rngs=rngs)
    after = rngs.params()
    reference = nnx.Rngs(0)
    reference.params()
    np.testing.assert_array_equal(jax.random.key_data(after),
                                  jax.random.key_data(reference.params()))
    assert set(nnx.to_pure_dict(nnx.state(conv))) == {"kernel", "bias"}


@pytest.mark.parametrize("stride", [1, 2])
def test_one_by_one_conv_is_slices_and_one_matmul(stride):
    x, kernel = np.ones((2, 7, 7, 4), np.float32), np.ones((1, 1, 4, 6), np.float32)
    jaxpr = jax.make_jaxpr(lambda x, k: conv_patches(x, k, stride, 0))(x, kernel)
    primitives = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    assert "concatenate" not in primitives and "pad" not in primitives
    assert primitives.count("dot_general") == 1
    assert set(primitives) <= {"slice", "reshape", "dot_general"}


def test_accelerators_take_the_native_convolution(monkeypatch):
    """On GPU/TPU ``conv`` is ``lax.conv_general_dilated`` (checked here by pretending the
    backend is a GPU): same result as the patch matmul up to float32 rounding."""
    from cbcert.nn import layers

    x = jax.random.normal(jax.random.key(0), (2, 9, 9, 4))
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 4, 5))
    patches = layers.conv(x, kernel, 2, 1)
    calls = []
    native = jax.lax.conv_general_dilated
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.lax, "conv_general_dilated",
                        lambda *a, **k: calls.append(1) or native(*a, **k))
    gpu = layers.conv(x, kernel, 2, 1)
    assert calls and gpu.shape == patches.shape == (2, 5, 5, 5)
    exact = conv_float64(x, kernel, 2, 1)
    assert_parity(gpu, exact, patches, "native conv")
    assert_parity(patches, exact, gpu, "patch conv")


def _spy_native(monkeypatch, operand: int = 0) -> list:
    """The shapes of operand ``operand`` (0: the input, 1: the kernel) of every native
    convolution called from here on."""
    calls = []
    native = jax.lax.conv_general_dilated
    monkeypatch.setattr(jax.lax, "conv_general_dilated",
                        lambda *a, **k: calls.append(a[operand].shape) or native(*a, **k))
    return calls


@pytest.mark.parametrize("side,kernel,stride,native", [
    (8, 3, 1, True),    # 8×8 output: Eigen's convolution packs patches inside its matmul
    (16, 3, 2, True),   # stride 2 down to 8×8
    (14, 3, 2, False),  # 7×7 output: patch matmul
    (4, 3, 1, False),   # small maps, where the native convolution collapses
    (16, 1, 1, False),  # 1×1: a matmul either way
])
def test_cpu_conv_takes_the_native_convolution_on_large_maps(monkeypatch, side, kernel, stride,
                                                             native):
    """On CPU ``conv`` takes ``lax.conv_general_dilated`` iff the kernel is larger than 1×1
    and the output has at least ``NATIVE_MIN_SIDE`` pixels per side; both paths match float64."""
    from cbcert.nn import layers

    assert jax.default_backend() == "cpu" and layers.NATIVE_MIN_SIDE == 8
    calls = _spy_native(monkeypatch)
    x = jax.random.normal(jax.random.key(0), (2, side, side, 4))
    k = jax.random.normal(jax.random.key(1), (kernel, kernel, 4, 5))
    got = layers.conv(x, k, stride, kernel // 2)
    assert bool(calls) == native
    exact = conv_float64(x, k, stride, kernel // 2)
    other = (conv_patches(x, k, stride, kernel // 2) if native else
             jax.lax.conv_general_dilated(x, k, (stride, stride), [(kernel // 2,) * 2] * 2,
                                          dimension_numbers=("NHWC", "HWIO", "NHWC")))
    assert_parity(got, exact, other, f"conv {kernel}x{kernel}/{stride} on {side}x{side}")


@pytest.mark.parametrize("kernel_shape,computed", [
    ((3, 3, 3, 24), 48),   # the built-in world's RGB stem: Eigen's slow widths, padded
    ((3, 3, 3, 17), 48),
    ((3, 3, 3, 32), 48),
    ((3, 3, 3, 16), 16),   # fast widths as they are
    ((3, 3, 3, 64), 64),
    ((3, 3, 4, 24), 24),   # not an RGB stem
    ((7, 7, 3, 24), 24),
])
def test_cpu_rgb_stems_of_slow_widths_are_computed_with_padded_outputs(monkeypatch, kernel_shape,
                                                                       computed):
    """On CPU a 3×3 kernel on 3 channels with 17-32 outputs runs natively with its kernel padded
    to ``RGB_STEM_OUTPUTS`` outputs, the extra ones dropped: the result has the layer's outputs
    and matches the float64 convolution within float32 rounding; other shapes are unpadded."""
    from cbcert.nn import layers

    assert layers.native_outputs(kernel_shape) == computed
    kernels = _spy_native(monkeypatch, operand=1)
    x = jax.random.normal(jax.random.key(0), (2, 12, 12, kernel_shape[2]))
    k = jax.random.normal(jax.random.key(1), kernel_shape)
    pad = kernel_shape[0] // 2
    got = layers.conv(x, k, 1, pad)
    assert kernels == [(*kernel_shape[:3], computed)]
    assert got.shape == (2, 12, 12, kernel_shape[3])
    assert_parity(got, conv_float64(x, k, 1, pad), conv_patches(x, k, 1, pad),
                  f"conv {kernel_shape}")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert layers.native_outputs(kernel_shape) == kernel_shape[3]


def test_world_and_ported_convs_take_the_same_backend_path(monkeypatch):
    """The world nets' ``PatchConv`` and the ports' ``conv2d`` both compute ``conv``: XLA's
    native convolution on a 16×16 map, the patch matmul on a 4×4 one (on CPU), each within
    float32 rounding of the float64 convolution."""
    calls = _spy_native(monkeypatch)
    world = PatchConv(3, 4, 3, padding=1, rngs=nnx.Rngs(0))
    ported = conv2d(3, 4, 3, padding=1, rngs=nnx.Rngs(0))
    for side, native in ((16, True), (4, False)):
        x = jax.random.normal(jax.random.key(side), (1, side, side, 3))
        for layer in (world, ported):
            calls.clear()
            got = layer(x)
            assert calls == ([(1, side, side, 3)] if native else []), (side, layer)
            exact = conv_float64(x, layer.kernel[...], 1, 1) + layer.bias[...]
            other = conv_patches(x, layer.kernel[...], 1, 1) + layer.bias[...]
            assert_parity(got, exact, other, f"PatchConv on {side}x{side}")


@pytest.mark.parametrize("kernel, side", [(1, 8), (3, 4)])
def test_bf16_patch_matmuls_accumulate_in_float32_and_return_bf16(kernel, side):
    """On the patch path (1×1 kernels, small maps) bf16 inputs are multiplied with a float32
    output (XLA:CPU's bf16 matmul runs at the bf16 units' rate only so) and the result is
    rounded back to bf16: bit for bit ``conv_patches(..., float32)`` then the cast."""
    import jax.numpy as jnp

    from cbcert.nn.layers import conv, native_is_faster

    x = jax.random.normal(jax.random.key(0), (2, side, side, 40)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (kernel, kernel, 40, 24)).astype(jnp.bfloat16)
    pad = kernel // 2
    assert not native_is_faster(x.shape, w.shape, 1, pad)
    out = jax.jit(conv, static_argnums=(2, 3))(x, w, 1, pad)
    assert out.dtype == jnp.bfloat16
    expected = jax.jit(lambda a, b: conv_patches(a, b, 1, pad, jnp.float32).astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(expected(x, w), np.float32))
    dots = [e for e in jax.make_jaxpr(conv, static_argnums=(2, 3))(x, w, 1, pad).eqns
            if e.primitive.name == "dot_general"]
    assert [e.params["preferred_element_type"] for e in dots] == [jnp.float32]
