"""StyleGAN2 port: ops against scipy / torch references, whole-generator parity, safe unpickling.

The PyTorch reference generator below is written from the paper's equations (Karras et al. 2020)
with NVlabs' attribute and state_dict names; it uses the per-sample *grouped* convolution
(``conv2d`` / ``conv_transpose2d`` with ``groups=B``), i.e. a different computation from the
port's modulate-the-input formulation. Its modules pickle themselves the way
``torch_utils.persistence`` does (reconstructor + class source + ``__dict__``), with stand-in
``torch_utils.persistence`` and ``dnnlib.util`` modules, so ``load_snapshot`` is exercised on a
file laid out like a real ``network-snapshot-*.pkl``. All weights, biases, noise strengths,
noise buffers, ``w_avg`` and the (asymmetric, non-separable) FIR filters are random.

It builds the three synthesis architectures of the paper's Figure 7 -- "skip" (every block adds
its RGB to the up-sampled running image), "orig" (one ToRGB, after the last block) and "resnet"
(as "orig", plus a residual 1×1 up-sampling branch, ``(skip(x) + convs(x)) / √2`` with the
second conv's gain and clamp scaled by ``1/√2``) -- and conditional generators (a label embedding
normalised and concatenated to the normalised z before the mapping layers). The residual branch
up-samples with a transposed convolution first and applies the 1×1 weights after, the reverse
order of the port. Ports run in float32 and are compared with references in float64
(``parity.assert_parity``).
"""

from __future__ import annotations

import math
import os
import pickle
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.signal
from click.testing import CliRunner
from flax import nnx

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
nn = torch.nn
F = torch.nn.functional

from parity import assert_parity  # noqa: E402

from cbcert import cli  # noqa: E402
from cbcert.convert import stylegan2 as convert  # noqa: E402
from cbcert.generators.cbae import CBAE, CBAEConfig  # noqa: E402
from cbcert.generators.stylegan2 import config as sg_config  # noqa: E402
from cbcert.generators.stylegan2 import ops as sg_ops  # noqa: E402
from cbcert.generators.stylegan2.generator import stylegan2_generator  # noqa: E402
from cbcert.io import checkpoint, registry  # noqa: E402

SQRT2 = math.sqrt(2.0)
SOURCE = "raise RuntimeError('the pickled class source must never be executed')"


# ------------------------------------------------------------------ persistence stand-ins

persistence = types.ModuleType("torch_utils.persistence")
dnnlib_util = types.ModuleType("dnnlib.util")


def _reconstruct_persistent_obj(meta):  # only the pickled name matters
    raise AssertionError("the test never unpickles with the real reconstructor")


_reconstruct_persistent_obj.__module__ = "torch_utils.persistence"
persistence._reconstruct_persistent_obj = _reconstruct_persistent_obj


class EasyDict(dict):
    pass


EasyDict.__module__ = "dnnlib.util"
dnnlib_util.EasyDict = EasyDict


@pytest.fixture(autouse=True, scope="module")
def fake_upstream_modules():
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "torch_utils", types.ModuleType("torch_utils"))
        patch.setitem(sys.modules, "torch_utils.persistence", persistence)
        patch.setitem(sys.modules, "dnnlib", types.ModuleType("dnnlib"))
        patch.setitem(sys.modules, "dnnlib.util", dnnlib_util)
        yield


class Persistent:
    """Pickles like ``@persistence.persistent_class``: reconstructor, source, ``__dict__``."""

    def __reduce__(self):
        meta = dict(type="class", version=6, module_src=SOURCE,
                    class_name=f"training.networks.{type(self).__name__}",
                    state=dict(self.__dict__))
        return _reconstruct_persistent_obj, (meta,)


# ------------------------------------------------------------------ torch reference ops


def random_filter(generator, size=4):
    f = torch.rand(size, size, generator=generator) + 0.1
    return f / f.sum()


def fir_after_transpose(y, f):
    """Filter (gain 4) the ``conv_transpose2d`` output ``[.., 2H+1, 2W+1]`` down to 2H x 2W."""
    c = y.shape[1]
    return F.conv2d(F.pad(y, [1, 1, 1, 1]), (4 * f).flip([0, 1])[None, None].repeat(c, 1, 1, 1),
                    groups=c)


def upsample_reference(x, f):
    """2x FIR up-sampling as a depthwise transposed convolution with ``4 f``."""
    c = x.shape[1]
    return F.conv_transpose2d(x, (4 * f)[None, None].repeat(c, 1, 1, 1), stride=2, padding=1,
                              groups=c)


def modconv_reference(x, weight, styles, demodulate, up=1, f=None):
    """Per-sample weights and a grouped (transposed) convolution, NCHW."""
    b, cin, h, w = x.shape
    cout, _, k, _ = weight.shape
    wt = weight[None] * styles[:, None, :, None, None]  # [B, O, I, k, k]
    if demodulate:
        wt = wt * (wt.square().sum(dim=[2, 3, 4]) + 1e-8).rsqrt()[:, :, None, None, None]
    x = x.reshape(1, b * cin, h, w)
    if up == 1:
        y = F.conv2d(x, wt.reshape(b * cout, cin, k, k), padding=k // 2, groups=b)
    else:
        y = F.conv_transpose2d(x, wt.transpose(1, 2).reshape(b * cin, cout, k, k), stride=2,
                               groups=b)
        y = fir_after_transpose(y, f)
    return y.reshape(b, cout, *y.shape[2:])


def bias_act_reference(x, b, lrelu, clamp, gain=1.0):
    """``clamp(act(x + b) · gain', ±clamp · gain)``, ``gain' = √2 · gain`` for the lrelu."""
    x = x + b.reshape(1, -1, *([1] * (x.ndim - 2)))
    if lrelu:
        x = F.leaky_relu(x, 0.2) * (SQRT2 * gain)
    return x if clamp is None else x.clamp(-clamp * gain, clamp * gain)


# ------------------------------------------------------------------ torch reference network


class FullyConnectedLayer(Persistent, nn.Module):
    def __init__(self, din, dout, g, lr=1.0, activation="linear", bias_init=0.0):
        super().__init__()
        self.activation = activation
        self.weight = nn.Parameter(torch.randn(dout, din, generator=g) / lr)
        self.bias = nn.Parameter((bias_init + 0.3 * torch.randn(dout, generator=g)) / lr)
        self.weight_gain = lr / math.sqrt(din)
        self.bias_gain = lr

    def forward(self, x):
        y = x @ (self.weight * self.weight_gain).T
        return bias_act_reference(y, self.bias * self.bias_gain, self.activation == "lrelu", None)


def normalize_reference(x):
    return x * (x.square().mean(dim=1, keepdim=True) + 1e-8).rsqrt()


class MappingNetwork(Persistent, nn.Module):
    def __init__(self, z_dim, w_dim, num_ws, num_layers, g, lr, c_dim=0):
        super().__init__()
        self.z_dim, self.c_dim, self.w_dim, self.num_ws = z_dim, c_dim, w_dim, num_ws
        self.num_layers = num_layers
        if c_dim:  # label embedding of width w_dim (NVlabs' default embed_features)
            self.embed = FullyConnectedLayer(c_dim, w_dim, g)
        for i in range(num_layers):
            din = z_dim + (w_dim if c_dim else 0) if i == 0 else w_dim
            setattr(self, f"fc{i}", FullyConnectedLayer(din, w_dim, g, lr, "lrelu"))
        self.register_buffer("w_avg", torch.randn(w_dim, generator=g))

    def forward(self, z, psi=1.0, cutoff=None, c=None):
        x = normalize_reference(z)
        if self.c_dim:
            x = torch.cat([x, normalize_reference(self.embed(c))], dim=1)
        for i in range(self.num_layers):
            x = getattr(self, f"fc{i}")(x)
        ws = x.unsqueeze(1).repeat(1, self.num_ws, 1)
        cutoff = self.num_ws if cutoff is None else cutoff
        ws[:, :cutoff] = self.w_avg + psi * (ws[:, :cutoff] - self.w_avg)
        return ws


class SynthesisLayer(Persistent, nn.Module):
    def __init__(self, cin, cout, w_dim, resolution, up, clamp, g):
        super().__init__()
        self.resolution, self.up, self.use_noise, self.activation = resolution, up, True, "lrelu"
        self.conv_clamp, self.padding, self.act_gain = clamp, 1, SQRT2
        self.affine = FullyConnectedLayer(w_dim, cin, g, bias_init=1.0)
        self.weight = nn.Parameter(torch.randn(cout, cin, 3, 3, generator=g))
        self.bias = nn.Parameter(0.3 * torch.randn(cout, generator=g))
        self.register_buffer("resample_filter", random_filter(g))
        self.register_buffer("noise_const", torch.randn(resolution, resolution, generator=g))
        self.noise_strength = nn.Parameter(0.5 * torch.randn([], generator=g))

    def forward(self, x, w, gain=1.0):
        y = modconv_reference(x, self.weight, self.affine(w), True, self.up,
                              self.resample_filter)
        y = y + self.noise_const * self.noise_strength
        return bias_act_reference(y, self.bias, True, self.conv_clamp, gain)


class ToRGBLayer(Persistent, nn.Module):
    def __init__(self, cin, img_channels, w_dim, clamp, g):
        super().__init__()
        self.conv_clamp, self.weight_gain = clamp, 1 / math.sqrt(cin)
        self.affine = FullyConnectedLayer(w_dim, cin, g, bias_init=1.0)
        self.weight = nn.Parameter(torch.randn(img_channels, cin, 1, 1, generator=g))
        self.bias = nn.Parameter(0.3 * torch.randn(img_channels, generator=g))

    def forward(self, x, w):
        y = modconv_reference(x, self.weight, self.affine(w) * self.weight_gain, False)
        return bias_act_reference(y, self.bias, False, self.conv_clamp)


class Conv2dLayer(Persistent, nn.Module):
    """Residual branch of a "resnet" block: 2× FIR up-sampling, then 1×1 linear, no bias."""

    def __init__(self, cin, cout, g):
        super().__init__()
        self.activation, self.up, self.down, self.conv_clamp, self.padding = "linear", 2, 1, None, 0
        self.weight_gain, self.act_gain = 1 / math.sqrt(cin), 1.0
        self.weight = nn.Parameter(torch.randn(cout, cin, 1, 1, generator=g))
        self.bias = None
        self.register_buffer("resample_filter", random_filter(g))

    def forward(self, x, gain=1.0):
        x = upsample_reference(x, self.resample_filter)
        return F.conv2d(x, self.weight * self.weight_gain) * gain


class SynthesisBlock(Persistent, nn.Module):
    def __init__(self, cin, cout, w_dim, resolution, clamp, g, architecture="skip",
                 is_last=False):
        super().__init__()
        self.in_channels, self.resolution, self.architecture = cin, resolution, architecture
        self.is_last = is_last
        self.register_buffer("resample_filter", random_filter(g))
        if cin == 0:
            self.const = nn.Parameter(torch.randn(cout, resolution, resolution, generator=g))
        else:
            self.conv0 = SynthesisLayer(cin, cout, w_dim, resolution, 2, clamp, g)
        self.conv1 = SynthesisLayer(cout, cout, w_dim, resolution, 1, clamp, g)
        self.num_conv, self.num_torgb = (1 if cin == 0 else 2), 0
        if is_last or architecture == "skip":
            self.torgb = ToRGBLayer(cout, 3, w_dim, clamp, g)
            self.num_torgb = 1
        if cin and architecture == "resnet":
            self.skip = Conv2dLayer(cin, cout, g)

    def forward(self, x, img, ws):
        if self.in_channels == 0:
            x = self.conv1(self.const[None].repeat(ws.shape[0], 1, 1, 1), ws[:, 0])
        elif self.architecture == "resnet":
            y = self.skip(x, gain=math.sqrt(0.5))
            x = y + self.conv1(self.conv0(x, ws[:, 0]), ws[:, 1], gain=math.sqrt(0.5))
        else:
            x = self.conv1(self.conv0(x, ws[:, 0]), ws[:, 1])
        if img is not None:
            img = upsample_reference(img, self.resample_filter)
        if self.num_torgb:
            y = self.torgb(x, ws[:, self.num_conv])
            img = y if img is None else img + y
        return x, img


class SynthesisNetwork(Persistent, nn.Module):
    def __init__(self, w_dim, resolution, channels, clamp, g, architecture="skip"):
        super().__init__()
        self.w_dim, self.img_resolution, self.img_channels = w_dim, resolution, 3
        self.block_resolutions = [2**i for i in range(2, int(math.log2(resolution)) + 1)]
        for i, res in enumerate(self.block_resolutions):
            setattr(self, f"b{res}", SynthesisBlock(
                channels[i - 1] if i else 0, channels[i], w_dim, res, clamp, g, architecture,
                is_last=res == resolution))
        self.num_ws = 2 * len(self.block_resolutions)

    def forward(self, ws):
        x = img = None
        start = 0
        for res in self.block_resolutions:
            block = getattr(self, f"b{res}")
            x, img = block(x, img, ws[:, start:start + block.num_conv + block.num_torgb])
            start += block.num_conv
        return img


class Generator(Persistent, nn.Module):
    def __init__(self, z_dim, w_dim, resolution, channels, clamp, mapping_layers, seed,
                 architecture="skip", c_dim=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.z_dim, self.c_dim, self.w_dim = z_dim, c_dim, w_dim
        self.img_resolution, self.img_channels = resolution, 3
        self.synthesis = SynthesisNetwork(w_dim, resolution, channels, clamp, g, architecture)
        self.num_ws = self.synthesis.num_ws
        self.mapping = MappingNetwork(z_dim, w_dim, self.num_ws, mapping_layers, g, lr=0.01,
                                      c_dim=c_dim)
        self._init_kwargs = EasyDict(mapping_kwargs=EasyDict(num_layers=mapping_layers))


CHANNELS = sg_config.channels_from_base(128, 16, 16)  # (16, 16, 8)
CLAMP = 4.0  # low enough that the clamp is active on random weights
MAIN = dict(z_dim=12, w_dim=10, resolution=16, channels=CHANNELS, clamp=CLAMP, mapping_layers=3,
            seed=0)
ARCHITECTURE = dict(z_dim=12, w_dim=10, resolution=16, channels=CHANNELS, clamp=CLAMP,
                    mapping_layers=2)
CONDITIONAL = dict(z_dim=6, w_dim=8, resolution=8, channels=(16, 8), clamp=CLAMP,
                   mapping_layers=2, seed=9, c_dim=4)


def float64_twin(generator: Generator, **kwargs) -> Generator:
    """``generator``'s weights in a float64 ``Generator(**kwargs)`` (``copy.deepcopy`` would go
    through the persistence ``__reduce__``)."""
    twin = Generator(**kwargs).eval()
    twin.load_state_dict(generator.state_dict())
    return twin.double()


def reference_outputs(reference, reference64, z, psi, cutoff, c=None):
    """The reference's ws and images: ``ws32`` (a tensor), then ``(float64, float32)`` pairs of
    ws and of images; both syntheses read ``ws32``, the ws the port is given."""
    with torch.no_grad():
        ws32 = reference.mapping(z, psi, cutoff, c=c)
        ws64 = reference64.mapping(z.double(), psi, cutoff, c=None if c is None else c.double())
        img32 = reference.synthesis(ws32).numpy().transpose(0, 2, 3, 1)
        img64 = reference64.synthesis(ws32.double()).numpy().transpose(0, 2, 3, 1)
    return ws32, (ws64.numpy(), ws32.numpy()), (img64, img32)


@pytest.fixture(scope="module")
def reference():
    return Generator(**MAIN).eval()


@pytest.fixture(scope="module")
def reference64(reference):
    return float64_twin(reference, **MAIN)


def write_snapshot(generator, path):
    """``generator`` pickled as an NVlabs training snapshot (``G``, ``D``, ``G_ema``, ...)."""
    data = dict(G=generator, D=None, G_ema=generator, augment_pipe=None,
                training_set_kwargs=EasyDict(resolution=generator.img_resolution))
    path.write_bytes(pickle.dumps(data))
    return path


def jitted_synthesize(model):
    """Jitted ``synthesize`` (eager dispatch of every small op is ~10x slower here)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(ws, key=None):
        mode = "const" if key is None else "random"
        return nnx.merge(graphdef, params).synthesize(ws, mode, key)

    return run


@pytest.fixture(scope="module")
def snapshot(reference, tmp_path_factory):
    return write_snapshot(reference,
                          tmp_path_factory.mktemp("sg2") / "network-snapshot-000000.pkl")


@pytest.fixture(scope="module")
def ported(snapshot):
    return convert.load_stylegan2(snapshot)


@pytest.fixture(scope="module")
def synth(ported):
    return jitted_synthesize(ported)


@pytest.fixture(scope="module")
def architectures(tmp_path_factory):
    """"orig" and "resnet" references (16 px, blocks 4/8/16) and their snapshots."""
    out = {}
    for seed, arch in enumerate(("orig", "resnet"), start=5):
        kwargs = dict(ARCHITECTURE, seed=seed, architecture=arch)
        generator = Generator(**kwargs).eval()
        out[arch] = (generator, float64_twin(generator, **kwargs),
                     write_snapshot(generator, tmp_path_factory.mktemp(arch) / "g.pkl"))
    return out


@pytest.fixture(scope="module")
def conditional(tmp_path_factory):
    """A conditional (c_dim=4) 8 px reference and its port."""
    generator = Generator(**CONDITIONAL).eval()
    path = write_snapshot(generator, tmp_path_factory.mktemp("cond") / "g.pkl")
    return generator, convert.load_stylegan2(path)


@pytest.fixture(scope="module")
def conditional64(conditional):
    return float64_twin(conditional[0], **CONDITIONAL)


# ------------------------------------------------------------------ op tests


def nvlabs_rows(full, fh, pad0, out_len):
    """Rows ``n + fh − 1 − pad0`` of a full convolution (zeros outside), n < out_len."""
    index = np.arange(out_len) + fh - 1 - pad0
    valid = (index >= 0) & (index < full.shape[0])
    out = np.zeros((out_len, *full.shape[1:]))
    out[valid] = full[index[valid]]
    return out


def upfirdn_scipy(x, fy, fx, up, padding):
    """NVlabs' upfirdn2d of ``x[H, W]`` from scipy's 1-D ``upfirdn`` along each axis (computed
    in the arrays' dtype)."""
    (h, w), taps = x.shape, len(fy)
    px0, px1, py0, py1 = padding
    full = scipy.signal.upfirdn(fy, x, up=up, axis=0)
    full = np.pad(full, ((0, h * up + taps - 1 - full.shape[0]), (0, 0)))
    full = scipy.signal.upfirdn(fx, full, up=up, axis=1)
    full = np.pad(full, ((0, 0), (0, w * up + taps - 1 - full.shape[1])))
    rows = nvlabs_rows(full, taps, py0, h * up + py0 + py1 - taps + 1)
    return nvlabs_rows(rows.T, taps, px0, w * up + px0 + px1 - taps + 1).T


@pytest.mark.parametrize("up,padding,taps", [(2, (2, 1, 2, 1), 4), (1, (2, 0, 1, 3), 3),
                                              (2, (0, -1, 1, 0), 5)])
def test_upfirdn2d_matches_scipy(up, padding, taps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 6)).astype(np.float32)
    fy = rng.uniform(0.1, 1, taps).astype(np.float32)  # asymmetric taps
    fx = rng.uniform(0.1, 1, taps).astype(np.float32)
    ours = np.asarray(sg_ops.upfirdn2d(jnp.asarray(x[None, :, :, None]),
                                   jnp.asarray(np.outer(fy, fx)), up, padding,
                                   gain=1.0))[0, :, :, 0]
    expected = upfirdn_scipy(*(a.astype(np.float64) for a in (x, fy, fx)), up, padding)
    assert ours.shape == expected.shape
    assert_parity(ours, expected, upfirdn_scipy(x, fy, fx, up, padding),
                  f"upfirdn2d up={up} taps={taps}")


def test_upsample2d_matches_transposed_conv():
    g = torch.Generator().manual_seed(1)
    x, f = torch.randn(2, 3, 5, 5, generator=g), random_filter(g)
    expected = upsample_reference(x, f).numpy().transpose(0, 2, 3, 1)
    expected64 = upsample_reference(x.double(), f.double()).numpy().transpose(0, 2, 3, 1)
    ours = np.asarray(sg_ops.upsample2d(jnp.asarray(x.numpy().transpose(0, 2, 3, 1)),
                                    jnp.asarray(f.numpy())))
    assert_parity(ours, expected64, expected, "upsample2d")


@pytest.mark.parametrize("up,demodulate,k,taps", [(1, True, 3, 4), (2, True, 3, 4),
                                                   (2, False, 3, 4), (1, False, 1, 4)])
def test_modulated_conv2d_matches_grouped_conv(up, demodulate, k, taps):
    """Up-sampling 3×3 convs take the polyphase path (``transposed_conv3_up2``); the grouped
    per-sample reference (4-tap filters, as every StyleGAN2 uses)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 6, 6, generator=g)
    weight = torch.randn(5, 4, k, k, generator=g)
    styles = torch.randn(3, 4, generator=g) + 1
    f = random_filter(g, taps)
    expected = modconv_reference(x, weight, styles, demodulate, up, f).numpy()
    expected64 = modconv_reference(x.double(), weight.double(), styles.double(), demodulate, up,
                                   f.double()).numpy().transpose(0, 2, 3, 1)
    ours = sg_ops.modulated_conv2d(jnp.asarray(x.numpy().transpose(0, 2, 3, 1)),
                               jnp.asarray(weight.numpy().transpose(2, 3, 1, 0)),
                               jnp.asarray(styles.numpy()), demodulate, up,
                               jnp.asarray(f.numpy()))
    expected = expected.transpose(0, 2, 3, 1)
    assert ours.shape == expected.shape == (3, 6 * up, 6 * up, 5)
    assert_parity(ours, expected64, expected,
                  f"modulated_conv2d up={up} demodulate={demodulate} k={k}")


@pytest.mark.parametrize("taps", [2, 4, 6])
def test_polyphase_up_conv_equals_zero_insertion_fir_then_conv(taps):
    """The two orders of the 2× up-sampling conv (transposed conv by phase then FIR, vs zero
    insertion, FIR, dense 3×3 conv at twice the resolution) are one linear map, any filter."""
    x = jax.random.normal(jax.random.key(0), (2, 5, 7, 3))
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 3, 4))
    f = jax.random.uniform(jax.random.key(2), (taps, taps)) + 0.1
    f = f / f.sum()
    fh, fw = f.shape
    padding = (1 + (fw + 1) // 2, 1 + (fw - 2) // 2, 1 + (fh + 1) // 2, 1 + (fh - 2) // 2)

    def dense_path(x, kernel, f):
        return jax.lax.conv_general_dilated(
            sg_ops.upfirdn2d(x, f, up=2, padding=padding, gain=4.0), kernel[::-1, ::-1], (1, 1),
            "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    dense = np.asarray(dense_path(x, kernel, f))
    with jax.enable_x64(True):  # the dense path in float64 on the same numbers
        dense64 = np.asarray(dense_path(*(jnp.asarray(np.asarray(a), jnp.float64)
                                          for a in (x, kernel, f))))
    assert dense64.dtype == np.float64
    ours = sg_ops.modulated_conv2d(x, kernel, jnp.ones((2, 3)), False, 2, f)
    assert ours.shape == dense.shape == (2, 10, 14, 4)
    assert_parity(ours, dense64, dense, f"polyphase up-conv taps={taps}")


# ------------------------------------------------------------------ whole generator


def test_config_from_pickle(ported):
    config = ported.config
    assert config.channels == (16, 16, 8) and config.num_ws == 6
    assert (config.z_dim, config.w_dim, config.mapping_layers) == (12, 10, 3)
    assert config.conv_clamp == CLAMP and config.lr_multiplier == pytest.approx(0.01)


@pytest.mark.parametrize("psi,cutoff", [(1.0, None), (0.7, 2)])
def test_generator_parity(reference, reference64, ported, synth, psi, cutoff):
    z = torch.randn(3, 12, generator=torch.Generator().manual_seed(3))
    ws_ref, ws_pair, img_pair = reference_outputs(reference, reference64, z, psi, cutoff)
    ws = ported.map(jnp.asarray(z.numpy()), None, psi, cutoff)
    assert_parity(ws, *ws_pair, f"stylegan2 mapping psi={psi}")
    img = np.asarray(synth(jnp.asarray(ws_ref.numpy())))
    assert img.shape == (3, 16, 16, 3)
    assert_parity(img, *img_pair, f"stylegan2 synthesis psi={psi}")
    assert np.abs(img_pair[0]).max() > 0.1


@pytest.mark.parametrize("arch", ["orig", "resnet"])
def test_architecture_parity(architectures, arch):
    """"orig"/"resnet": one ToRGB (last block), residual 1×1 up-sampling branch for "resnet"."""
    reference, reference64, path = architectures[arch]
    ported = convert.load_stylegan2(path)
    assert ported.config.architecture == arch and ported.config.num_ws == 6
    blocks = ported.blocks
    assert [b.torgb is not None for b in blocks] == [False, False, True]
    assert [b.skip is not None for b in blocks] == [False, arch == "resnet", arch == "resnet"]
    assert all(b.resample_filter is None for b in blocks)  # no running image to up-sample
    z = torch.randn(3, 12, generator=torch.Generator().manual_seed(3))
    ws_ref, ws_pair, (img64, img_ref) = reference_outputs(reference, reference64, z, 0.7, 2)
    ws = ported.map(jnp.asarray(z.numpy()), None, 0.7, 2)
    assert_parity(ws, *ws_pair, f"stylegan2 {arch} mapping")
    img = np.asarray(jitted_synthesize(ported)(jnp.asarray(ws_ref.numpy())))
    assert img.shape == (3, 16, 16, 3)
    assert_parity(img, img64, img_ref, f"stylegan2 {arch} synthesis")
    assert np.abs(img_ref).max() > 0.1
    # The (for "resnet": gain-scaled, ±CLAMP/√2) clamp of the second convs is active, so the
    # parity above covers it.
    convs = [reference.synthesis.b8.conv1, reference.synthesis.b16.conv1]
    with torch.no_grad():
        try:
            for conv in convs:
                conv.conv_clamp = None
            unclamped = reference.synthesis(ws_ref).numpy().transpose(0, 2, 3, 1)
        finally:
            for conv in convs:
                conv.conv_clamp = CLAMP
    assert not np.allclose(unclamped, img_ref)


def test_conditional_generator_parity(conditional, conditional64):
    """c_dim > 0: g1 feeds the one-hot label of class_index to the mapping network."""
    reference, ported = conditional
    config = ported.config
    assert (config.c_dim, config.embed_width, config.num_ws) == (4, 8, 4)
    gen = stylegan2_generator(ported, None, 0.7, 3, class_index=2)
    z = torch.randn(3, 6, generator=torch.Generator().manual_seed(4))
    label = F.one_hot(torch.full((3,), 2), 4).float()
    ws_ref, (ws64, ws32), (img64, img_ref) = reference_outputs(reference, conditional64, z, 0.7,
                                                               3, c=label)
    zj = jnp.asarray(z.numpy())
    w = np.asarray(gen.g1(gen.params, zj))
    assert_parity(w, ws64.reshape(3, -1), ws32.reshape(3, -1), "stylegan2 conditional g1")
    img = np.asarray(jitted_synthesize(ported)(jnp.asarray(ws32)))
    assert_parity(img, img64, img_ref, "stylegan2 conditional synthesis")
    # g2(g1(z)) end to end, against the whole reference in float64 (its own ws).
    with torch.no_grad():
        end64 = conditional64.synthesis(torch.from_numpy(ws64)).numpy().transpose(0, 2, 3, 1)
    x = np.asarray(jax.jit(gen.image)(gen.params, zj))
    assert_parity(x, np.clip((end64 + 1) / 2, 0, 1), np.clip((img_ref + 1) / 2, 0, 1),
                  "stylegan2 conditional image")
    assert 0.1 < np.mean((x > 0) & (x < 1))  # not all clipped
    other = stylegan2_generator(ported, None, 0.7, 3, class_index=0)
    assert not np.allclose(other.g1(other.params, zj), w)  # the label matters


def test_class_index_is_checked(conditional, ported):
    _, model = conditional
    with pytest.raises(ValueError, match=r"class_index=None; this StyleGAN2 is conditional "
                                         r"\(c_dim=4\): pick a class in 0\.\.3"):
        stylegan2_generator(model)
    for bad in (4, -1, True, 1.0):
        with pytest.raises(ValueError, match=rf"class_index={bad!r}; allowed: 0\.\.3"):
            stylegan2_generator(model, class_index=bad)
    with pytest.raises(ValueError, match=r"class_index=0; this StyleGAN2 is unconditional"):
        stylegan2_generator(ported, class_index=0)


def test_reference_clamp_is_active(reference):
    """CLAMP changes the image, so the parity test covers the clamp."""
    z = torch.randn(3, 12, generator=torch.Generator().manual_seed(3))
    clamped = [m for m in reference.modules() if hasattr(m, "conv_clamp")]
    with torch.no_grad():
        ws = reference.mapping(z)
        image = reference.synthesis(ws)
        try:
            for module in clamped:
                module.conv_clamp = None
            unclamped = reference.synthesis(ws)
        finally:
            for module in clamped:
                module.conv_clamp = CLAMP
    assert not torch.allclose(image, unclamped)


def test_noise_modes(ported, synth):
    ws = jax.random.normal(jax.random.key(0), (2, 6, 10))
    const = synth(ws)
    random = synth(ws, jax.random.key(1))
    assert not np.allclose(random, const)
    np.testing.assert_array_equal(random, synth(ws, jax.random.key(1)))
    with pytest.raises(ValueError, match="noise_mode='random' with key=None"):
        ported.synthesize(ws, "random")
    with pytest.raises(ValueError, match="noise_mode='const' with key=a key"):
        ported.synthesize(ws, "const", jax.random.key(1))


def test_generator_protocol_with_cbae(ported, synth):
    cbae = CBAE(CBAEConfig(latent_dim=10, num_ws=6, concept_names=("a", "b"), num_unsup=3),
                rngs=nnx.Rngs(0))
    gen = stylegan2_generator(ported, cbae, truncation_psi=0.8)
    z = jax.random.normal(jax.random.key(4), (2, 12))
    w = gen.g1(gen.params, z)
    assert w.shape == (2, 60) and gen.concept_dim == 7
    assert gen.concepts(gen.params, z).shape == (2, 7)
    x = jax.jit(gen.image)(gen.params, z)
    assert x.shape == (2, 16, 16, 3) and float(x.min()) >= 0 and float(x.max()) <= 1
    w_cb = gen.decode(gen.params, gen.encode(gen.params, w))
    expected = np.clip((synth(w_cb.reshape(2, 6, 10)) + 1) / 2, 0, 1)
    np.testing.assert_allclose(x, expected, atol=1e-6)
    plain = stylegan2_generator(ported)  # no CB-AE: E = D = identity, K = 0
    assert plain.concept_dim == 60 and plain.encode(plain.params, w) is w
    assert plain.decode(plain.params, w) is w
    bad = CBAE(CBAEConfig(latent_dim=10, num_ws=5, concept_names=("a",), num_unsup=0),
               rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_ws=5"):
        stylegan2_generator(ported, bad)


# ------------------------------------------------------------------ unpickler and strictness


def test_snapshot_objects_are_inert(snapshot):
    data = convert.load_snapshot(snapshot)
    g = data["G_ema"]
    assert isinstance(g, convert.PersistentObject)
    assert g.class_name == "training.networks.Generator"
    assert "module_src" not in vars(g)  # the source is dropped unread
    assert data["training_set_kwargs"].items == {"resolution": 16}


def test_refuses_unknown_globals(tmp_path):
    path = tmp_path / "evil.pkl"

    class Evil:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    path.write_bytes(pickle.dumps({"G_ema": Evil()}))
    with pytest.raises(ValueError, match="refusing to load global"):
        convert.load_snapshot(path)


def test_strict_keys(snapshot, ported):
    g = convert.load_snapshot(snapshot)["G_ema"]
    tensors = convert.module_tensors(g)
    config = ported.config
    assert "synthesis.b8.conv0.noise_const" in tensors
    missing = {k: v for k, v in tensors.items() if k != "synthesis.b16.conv0.noise_strength"}
    with pytest.raises(ValueError, match=r"synthesis\.b16\.conv0\.noise_strength"):
        convert.stylegan2_from_state_dict(config, missing)
    with pytest.raises(ValueError, match=r"synthesis\.b16\.skip\.weight"):
        convert.stylegan2_from_state_dict(config, {**tensors, "synthesis.b16.skip.weight":
                                                   np.zeros((8, 8, 1, 1), np.float32)})
    misshaped = {**tensors, "mapping.fc1.weight": np.zeros((10, 9), np.float32)}
    with pytest.raises(ValueError, match=r"mapping\.fc1\.weight: checkpoint shape \(10, 9\)"):
        convert.stylegan2_from_state_dict(config, misshaped)


def test_refuses_unknown_and_mixed_architectures(snapshot):
    g = convert.load_snapshot(snapshot)["G_ema"]
    blocks = g.attr("_modules")["synthesis"].attr("_modules")
    blocks["b8"].state["architecture"] = "fancy"
    with pytest.raises(ValueError, match=r"synthesis\.b8 \(training\.networks\.SynthesisBlock\): "
                                         r"architecture='fancy'; supported: 'orig', 'skip', "
                                         r"'resnet'"):
        convert.stylegan2_from_pickle(g)
    blocks["b8"].state["architecture"] = "orig"
    with pytest.raises(ValueError, match=r"synthesis\.b8 .*architecture='orig', but "
                                         r"synthesis\.b4 has 'skip'"):
        convert.stylegan2_from_pickle(g)
    with pytest.raises(ValueError, match="architecture='fancy'; allowed: 'orig', 'skip'"):
        sg_config.StyleGAN2Config(z_dim=4, w_dim=4, img_resolution=4, img_channels=3, channels=(4,),
                           architecture="fancy")


def test_resnet_skip_branch_is_checked(architectures):
    def load():
        return convert.load_snapshot(architectures["resnet"][2])["G_ema"]

    g = load()
    b16 = g.attr("_modules")["synthesis"].attr("_modules")["b16"]
    b16.attr("_modules")["skip"].state["up"] = 1
    with pytest.raises(ValueError, match=r"synthesis\.b16\.skip: up=1; the resnet skip branch "
                                         r"must have up=2"):
        convert.stylegan2_from_pickle(g)
    g = load()
    g.attr("_modules")["synthesis"].attr("_modules")["b8"].attr("_modules").pop("skip")
    with pytest.raises(ValueError, match="submodule 'skip' is missing"):
        convert.stylegan2_from_pickle(g)
    tensors = convert.module_tensors(load())  # a ToRGB on a non-last block is not "resnet"
    config = convert.config_from_pickle(load())
    extra = {**tensors, "synthesis.b8.torgb.bias": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"synthesis\.b8\.torgb\.bias"):
        convert.stylegan2_from_state_dict(config, extra)


def test_separable_filters_become_outer_products(snapshot, ported):
    g = convert.load_snapshot(snapshot)["G_ema"]
    tensors = convert.module_tensors(g)
    taps = np.array([1.0, 3.0, 3.0, 1.0], np.float32) / 8
    tensors = {k: (taps if k.endswith("resample_filter") else v) for k, v in tensors.items()}
    model = convert.stylegan2_from_state_dict(ported.config, tensors)
    np.testing.assert_array_equal(model.blocks[1].resample_filter[...], np.outer(taps, taps))


def test_converted_round_trip(ported, snapshot, tmp_path):
    """`certify convert stylegan2` (a pickle: no torch involved) writes the port in the one
    checkpoint format; it loads back bit-identical, with its source and network recorded."""
    result = CliRunner().invoke(cli.main, ["convert", "stylegan2", str(snapshot),
                                           str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    restored, manifest = registry.load_module(tmp_path / "out")
    assert (manifest["kind"], manifest["network"]) == ("stylegan2", "G_ema")
    assert manifest["sources"] == {"checkpoint": {"file": snapshot.name,
                                                  "sha256": checkpoint.sha256_file(snapshot)}}
    assert restored.config == ported.config
    assert checkpoint.params_sha256(restored) == checkpoint.params_sha256(ported)
    np.testing.assert_array_equal(restored.blocks[2].conv0.kernel[...],
                                  ported.blocks[2].conv0.kernel[...])
    for args, message in [
            (["stylegan2", str(snapshot), str(tmp_path / "d"), "--network", "D"],
             "network='D': network-snapshot-000000.pkl holds a NoneType there"),
            (["resnet18", str(snapshot), str(tmp_path / "e"), "--network", "G"],
             "network='G'; only kind='stylegan2' takes it"),
            (["stylegan2", str(snapshot), str(tmp_path / "out")], "already holds a checkpoint")]:
        result = CliRunner().invoke(cli.main, ["convert", *args])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
