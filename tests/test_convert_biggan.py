"""Parity and strictness of the BigGAN-deep port and converter.

The PyTorch reference is written here from the paper and the public layout of
pytorch-pretrained-biggan (that package cannot be imported here: it needs boto3 and requests);
its state_dict keys are upstream's, and it uses torch's own ``nn.utils.spectral_norm`` in
``eval()`` mode, so the ``W_orig / σ(u, v)`` folding is checked against PyTorch itself. All
weights, power-iteration vectors, BN statistic tables and the attention gain are random.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
nn = torch.nn
F = torch.nn.functional

from parity import assert_parity, float64_copy  # noqa: E402

from cbcert import convert as cbcert_convert  # noqa: E402
from cbcert.convert import biggan as convert  # noqa: E402
from cbcert.generators import biggan as bg  # noqa: E402
from cbcert.io import checkpoint, registry  # noqa: E402

FIELDS = dict(output_dim=16, z_dim=8, class_embed_dim=8, channel_width=4, num_classes=5,
              layers=[[False, 16, 8], [True, 8, 4], [True, 4, 2], [False, 2, 1]],
              attention_layer_position=2, eps=1e-4, n_stats=5)
POWER_STEPS = 3


def sn(module):
    return nn.utils.spectral_norm(module)


class TorchCBN(nn.Module):
    def __init__(self, channels, cond, n_stats, eps, conditional=True):
        super().__init__()
        self.register_buffer("running_means", torch.randn(n_stats, channels) * 0.3)
        self.register_buffer("running_vars", torch.rand(n_stats, channels) + 0.5)
        self.step, self.eps, self.conditional = 1.0 / (n_stats - 1), eps, conditional
        self.calibrate = False
        if conditional:
            self.scale = sn(nn.Linear(cond, channels, bias=False))
            self.offset = sn(nn.Linear(cond, channels, bias=False))
        else:
            self.weight = nn.Parameter(torch.rand(channels) + 0.5)
            self.bias = nn.Parameter(torch.randn(channels) * 0.3)

    def forward(self, x, truncation, h=None):
        if self.calibrate:  # random statistics near the batch's own, like a trained model's
            mean, var = x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3))
            self.running_means.copy_(mean + 0.2 * var.sqrt() * torch.randn_like(
                self.running_means))
            self.running_vars.copy_(var * (0.7 + 0.6 * torch.rand_like(self.running_vars)))
        frac, start = math.modf(truncation / self.step)
        start = int(start)
        mean, var = self.running_means[start], self.running_vars[start]
        if frac != 0.0:
            mean = mean * frac + self.running_means[start + 1] * (1 - frac)
            var = var * frac + self.running_vars[start + 1] * (1 - frac)
        if not self.conditional:
            return F.batch_norm(x, mean, var, self.weight, self.bias, False, 0.0, self.eps)
        gain = 1 + self.scale(h)[:, :, None, None]
        bias = self.offset(h)[:, :, None, None]
        return (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None]
                                                            + self.eps) * gain + bias


class TorchAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.snconv1x1_theta = sn(nn.Conv2d(c, c // 8, 1, bias=False))
        self.snconv1x1_phi = sn(nn.Conv2d(c, c // 8, 1, bias=False))
        self.snconv1x1_g = sn(nn.Conv2d(c, c // 2, 1, bias=False))
        self.snconv1x1_o_conv = sn(nn.Conv2d(c // 2, c, 1, bias=False))
        self.gamma = nn.Parameter(torch.tensor([0.7]))

    def forward(self, x):
        b, c, h, w = x.shape
        theta = self.snconv1x1_theta(x).view(b, c // 8, h * w)
        phi = F.max_pool2d(self.snconv1x1_phi(x), 2).view(b, c // 8, h * w // 4)
        attention = torch.softmax(torch.bmm(theta.transpose(1, 2), phi), dim=-1)
        g = F.max_pool2d(self.snconv1x1_g(x), 2).view(b, c // 2, h * w // 4)
        out = torch.bmm(g, attention.transpose(1, 2)).view(b, c // 2, h, w)
        return x + self.gamma * self.snconv1x1_o_conv(out)


class TorchGenBlock(nn.Module):
    def __init__(self, cin, cout, cond, up, n_stats, eps):
        super().__init__()
        mid, self.up, self.cout = cin // 4, up, cout
        for j, (a, b, k) in enumerate([(cin, mid, 1), (mid, mid, 3), (mid, mid, 3),
                                       (mid, cout, 1)]):
            setattr(self, f"bn_{j}", TorchCBN(a, cond, n_stats, eps))
            setattr(self, f"conv_{j}", sn(nn.Conv2d(a, b, k, padding=k // 2)))

    def forward(self, x, h, t):
        y = self.conv_0(F.relu(self.bn_0(x, t, h)))
        y = F.relu(self.bn_1(y, t, h))
        if self.up:
            y = F.interpolate(y, scale_factor=2, mode="nearest")
        y = self.conv_2(F.relu(self.bn_2(self.conv_1(y), t, h)))
        y = self.conv_3(F.relu(self.bn_3(y, t, h)))
        skip = x[:, : self.cout]
        if self.up:
            skip = F.interpolate(skip, scale_factor=2, mode="nearest")
        return y + skip


class TorchGenerator(nn.Module):
    def __init__(self, f):
        super().__init__()
        ch, cond = f["channel_width"], 2 * f["z_dim"]
        self.ch = ch
        self.gen_z = sn(nn.Linear(cond, 4 * 4 * 16 * ch))
        layers = []
        for i, (up, cin, cout) in enumerate(f["layers"]):
            if i == f["attention_layer_position"]:
                layers.append(TorchAttention(ch * cin))
            layers.append(TorchGenBlock(ch * cin, ch * cout, cond, up, f["n_stats"], f["eps"]))
        self.layers = nn.ModuleList(layers)
        self.bn = TorchCBN(ch, None, f["n_stats"], f["eps"], conditional=False)
        self.conv_to_rgb = sn(nn.Conv2d(ch, ch, 3, padding=1))

    def forward(self, h, t):
        x = self.gen_z(h).view(-1, 4, 4, 16 * self.ch).permute(0, 3, 1, 2)
        for layer in self.layers:
            x = layer(x, h, t) if isinstance(layer, TorchGenBlock) else layer(x)
        return torch.tanh(self.conv_to_rgb(F.relu(self.bn(x, t)))[:, :3])


class TorchBigGAN(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.embeddings = nn.Linear(f["num_classes"], f["z_dim"], bias=False)
        self.generator = TorchGenerator(f)

    def forward(self, z, y, t):
        return self.generator(torch.cat([z, self.embeddings(y)], dim=1), t)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = TorchBigGAN(FIELDS)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_u"):
                # Power-iteration state as after training: POWER_STEPS iterations from a random
                # v, so σ(u, v) = uᵀWv is near, never equal to, σ_max (the fold must use u, v).
                # A raw random v gives σ(u, v) down to 0.04 σ_max: 25x too large weights,
                # saturated images and attention logits so large that float32 rounding alone
                # moves outputs by 2e-4.
                matrix = module.weight_orig.reshape(module.weight_orig.shape[0], -1)
                v = F.normalize(torch.randn(matrix.shape[1]), dim=0)
                for _ in range(POWER_STEPS):
                    v = F.normalize(matrix.T @ F.normalize(matrix @ v, dim=0), dim=0)
                module.weight_v.copy_(v)
                module.weight_u.copy_(F.normalize(matrix @ module.weight_v, dim=0))
            if isinstance(module, (nn.Conv2d, nn.Linear)) and module.bias is not None:
                module.bias.normal_(0, 0.2)
        # Statistics calibrated on a batch keep activations O(1) through the depth, as in a
        # trained model; uncalibrated random tables blow them up to ~1e7, where float32
        # rounding (not the port) dominates any comparison after tanh.
        norms = [m for m in model.modules() if isinstance(m, TorchCBN)]
        model.eval()
        for norm in norms:
            norm.calibrate = True
        model(torch.randn(16, 8), F.one_hot(torch.arange(16) % 5, 5).float(), 1.0)
        for norm in norms:
            norm.calibrate = False
    return model


@pytest.fixture(scope="module")
def reference64(reference):
    return float64_copy(reference)


@pytest.fixture(scope="module")
def tensors(reference):
    return {k: v.numpy() for k, v in reference.state_dict().items()}


@pytest.fixture(scope="module")
def ported(tensors):
    return convert.biggan_from_state_dict(convert.config_from_dict(FIELDS), tensors)


@pytest.mark.parametrize("truncation", [1.0, 0.5, 0.6])  # exact level, exact level, mixed
def test_parity(reference, reference64, ported, truncation):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 8, generator=g)
    y = F.one_hot(torch.tensor([0, 3, 4]), 5).float()
    with torch.no_grad():
        expected32 = reference(z, y, truncation).numpy().transpose(0, 2, 3, 1)
        expected = reference64(z.double(), y.double(), truncation).numpy().transpose(0, 2, 3, 1)
    got = np.asarray(ported(jnp.asarray(z.numpy()), jnp.asarray(y.numpy()), truncation))
    assert got.shape == (3, 16, 16, 3)
    assert_parity(got, expected, expected32, f"biggan truncation={truncation}")
    assert np.std(expected) > 0.05
    assert np.mean(np.abs(expected) > 0.99) < 0.1  # tanh mostly unsaturated: errors show


def test_spectral_norm_fold_matches_torch(reference, tensors):
    folded = convert.fold_spectral_norm(tensors)
    with torch.no_grad():
        reference(torch.zeros(1, 8), torch.zeros(1, 5), 1.0)  # eval hooks set .weight
    module = reference.generator.layers[2].snconv1x1_g
    expected = module.weight.numpy()
    matrix = module.weight_orig.detach().reshape(module.weight_orig.shape[0], -1)
    sigma = float(module.weight_u @ matrix @ module.weight_v)
    assert sigma < (1 - 1e-3) * float(torch.linalg.matrix_norm(matrix, 2))  # u, v matter
    np.testing.assert_allclose(folded["generator.layers.2.snconv1x1_g.weight"], expected,
                               rtol=1e-6, atol=0)
    assert not any(k.endswith(("_orig", "_u", "_v")) for k in folded)


def test_strict_keys(tensors):
    config = convert.config_from_dict(FIELDS)
    missing = {k: v for k, v in tensors.items() if k != "generator.layers.3.bn_2.running_vars"}
    with pytest.raises(ValueError, match=r"generator\.layers\.3\.bn_2\.running_vars"):
        convert.biggan_from_state_dict(config, missing)
    no_u = {k: v for k, v in tensors.items() if k != "generator.gen_z.weight_u"}
    with pytest.raises(ValueError, match=r"generator\.gen_z\.weight_u"):
        convert.biggan_from_state_dict(config, no_u)
    extra = {**tensors, "generator.layers.9.gamma": np.zeros(1, np.float32)}
    with pytest.raises(ValueError, match=r"generator\.layers\.9\.gamma"):
        convert.biggan_from_state_dict(config, extra)
    wider = convert.config_from_dict({**FIELDS, "num_classes": 6})
    with pytest.raises(ValueError, match=r"embeddings\.weight: checkpoint shape \(8, 5\)"):
        convert.biggan_from_state_dict(wider, tensors)


def test_config_validation(tmp_path, reference):
    with pytest.raises(ValueError, match="unknown fields"):
        convert.config_from_dict({**FIELDS, "dropout": 0.1})
    with pytest.raises(ValueError, match="output_dim=32"):
        convert.config_from_dict({**FIELDS, "output_dim": 32})
    with pytest.raises(ValueError, match="truncation=0"):
        bg.stats_index(0.0, 51)
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(FIELDS))
    model = convert.load_biggan(tmp_path / "pytorch_model.bin", tmp_path / "config.json")
    assert model.config.layers[1] == (True, 8, 4)


def test_generator_protocol(ported):
    gen = bg.biggan_generator(ported, class_index=3, truncation=0.5)
    z = jax.random.normal(jax.random.key(0), (3, 8))  # batch 3: reuses the eager op cache
    w = gen.g1(gen.params, z)
    assert w.shape == (3, 16) and gen.concept_dim == 16
    np.testing.assert_allclose(w[:, :8], 0.5 * z, rtol=1e-6)
    x = gen.image(gen.params, z)
    y = jax.nn.one_hot(jnp.array([3, 3, 3]), 5)
    expected = (ported(0.5 * z, y, 0.5) + 1) / 2
    np.testing.assert_allclose(x, expected, atol=1e-5)
    with pytest.raises(ValueError, match="class_index=5"):
        bg.biggan_generator(ported, class_index=5, truncation=0.5)


def test_multi_class_generator_renders_the_class_each_input_asks_for(ported):
    """``class_index`` a list: input ``[z ; k]`` renders class ``classes[k]`` (the one-class
    generator's image for that class), prior samples ask for every class, bad lists fail."""
    classes = [4, 0, 2]
    gen = bg.biggan_generator(ported, class_index=classes, truncation=0.5)
    assert gen.classes == (4, 0, 2) and gen.input_dim == 9 and gen.latent_dim == 8
    z = jax.random.normal(jax.random.key(0), (3, 8))
    x = gen.with_classes(np.asarray(z), np.array([2, 0, 1]))  # classes 2, 4, 0
    got = gen.image(gen.params, jnp.asarray(x))
    for row, cls in enumerate((2, 4, 0)):
        one = bg.biggan_generator(ported, class_index=cls, truncation=0.5)
        np.testing.assert_allclose(got[row], one.image(one.params, z[row:row + 1])[0],
                                   atol=1e-5)
    drawn = np.asarray(gen.sample_inputs(jax.random.key(1), 64))
    assert drawn.shape == (64, 9) and set(drawn[:, 8]) == {0.0, 1.0, 2.0}  # P(miss) < 3·(2/3)⁶⁴
    for bad in ([], [1, 1], [5], [True]):
        with pytest.raises(ValueError, match=r"class_index=.*allowed: 1 to 256 distinct "
                                             r"integers in 0\.\.4"):
            bg.biggan_generator(ported, class_index=bad, truncation=0.5)
    with pytest.raises(ValueError, match="takes no class positions"):
        bg.biggan_generator(ported, class_index=3, truncation=0.5).with_classes(z, [0, 0, 0])


def test_convert_writes_a_checkpoint(reference, ported, tmp_path):
    """`certify convert biggan`: weights + config.json once; loads back without torch's help."""
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(FIELDS))
    manifest = cbcert_convert.convert("biggan", tmp_path / "pytorch_model.bin", tmp_path / "out",
                                      config_path=tmp_path / "config.json")
    assert manifest["kind"] == "biggan" and manifest["sources"] == {
        "checkpoint": {"file": "pytorch_model.bin",
                       "sha256": checkpoint.sha256_file(tmp_path / "pytorch_model.bin")},
        "config": {"file": "config.json",
                   "sha256": checkpoint.sha256_file(tmp_path / "config.json")}}
    restored, _ = registry.load_module(tmp_path / "out")
    assert restored.config == ported.config
    assert checkpoint.params_sha256(restored) == manifest["params_sha256"] \
        == checkpoint.params_sha256(ported)
    with pytest.raises(ValueError, match="config_path=None; kind='biggan' needs it"):
        cbcert_convert.convert("biggan", tmp_path / "pytorch_model.bin", tmp_path / "other")
