"""PixPNet conversion: parity with a PyTorch ProtoNet reference and strictness.

The reference is written here from the paper and the public structure of merlresearch/PixPNet
(``features.module_dict`` with PixPNet's layer names, ``add_on_layers``, ``prototype_vectors``
[P, D, 1, 1], ``last_layer``; squared-L2 distances in ProtoPNet's expanded form, cosine
distances, global min-pool, ``log(1 / (d + eps) + 1)``), saved as a Lightning-style checkpoint
with pickled hyper-parameter objects. Ports run in float32 and are compared with the reference in
float64 (``parity.assert_parity``).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # JAX already uses the cores
nn = torch.nn
F = torch.nn.functional

from parity import assert_parity, float64_copy  # noqa: E402
from test_convert_densenet import TorchDenseNet  # noqa: E402
from test_convert_resnet import images, randomize, torch_pair, torch_resnet  # noqa: E402

from cbcert.convert import convert, pixpnet  # noqa: E402
from cbcert.io.checkpoint import sha256_file  # noqa: E402
from cbcert.io.registry import load_converted, pure_apply  # noqa: E402
from cbcert.models.pixpnet import PixPNetConfig, add_on_layer_specs  # noqa: E402


def resnet18_layers(feature_layer: str) -> OrderedDict:
    ref = torch_resnet("resnet18", num_classes=3, seed=31)
    layers = OrderedDict(conv1_no_act=ref.conv1, bn1=ref.bn1, conv1=ref.relu, maxpool=ref.maxpool,
                         layer1=ref.layer1, layer2=ref.layer2, layer3=ref.layer3,
                         layer4=ref.layer4)
    return truncate(layers, feature_layer)


def vgg11_bn_layers(feature_layer: str) -> OrderedDict:
    layers, cin, convs, pools = OrderedDict(), 3, 0, 0
    for item in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if item == "M":
            pools += 1
            layers[f"maxpool{pools}"] = nn.MaxPool2d(2, 2)
            continue
        convs += 1
        layers[f"conv_no_act{convs}"] = nn.Conv2d(cin, item, 3, padding=1)
        layers[f"bn{convs}"] = nn.BatchNorm2d(item)
        layers[f"conv{convs}"] = nn.ReLU()
        cin = item
    return truncate(layers, feature_layer)


def densenet121_layers(feature_layer: str) -> OrderedDict:
    ref = TorchDenseNet(32, (6, 12, 24, 16), 64)
    return truncate(OrderedDict(ref.features.named_children()), feature_layer)


def truncate(layers: OrderedDict, last: str) -> OrderedDict:
    names = list(layers)
    return OrderedDict((n, layers[n]) for n in names[: names.index(last) + 1])


class TorchFeatures(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.module_dict = nn.ModuleDict(layers)

    def forward(self, x):
        for module in self.module_dict.values():
            x = module(x)
        return x


class TorchGroupedLinear(nn.Module):
    def __init__(self, prototypes, classes):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, prototypes // classes))

    def forward(self, s):
        grouped = s.reshape(s.shape[0], self.weight.shape[0], -1)
        return torch.einsum("bji,ji->bj", grouped, self.weight)


class TorchProtoNet(nn.Module):
    def __init__(self, features, config: PixPNetConfig):
        super().__init__()
        p, d, c = config.num_prototypes, config.prototype_dim, config.num_classes
        self.config = config
        self.features = TorchFeatures(features)
        add_on = OrderedDict()
        for name, cin, cout, act in add_on_layer_specs(config):
            add_on[name] = nn.Conv2d(cin, cout, 1)
            add_on[name.replace("conv", "act")] = nn.Sigmoid() if act == "sigmoid" else nn.ReLU()
        self.add_on_layers = nn.Sequential(add_on)
        self.prototype_vectors = nn.Parameter(torch.rand(p, d, 1, 1))
        self.register_buffer("ones", torch.ones(p, d, 1, 1))
        self.register_buffer("corresponding_sample_idxs", torch.full((p,), -1))
        self.register_buffer("min_fmap_idxs", torch.full((p, 4), -1))
        identity = torch.zeros(p, c, dtype=torch.int)
        identity[torch.arange(p), torch.arange(p) // (p // c)] = 1
        self.register_buffer("prototype_class_identity", identity)
        if config.readout_type == "linear":
            self.last_layer = nn.Linear(p, c, bias=False)
        elif config.readout_type == "sparse":
            self.last_layer = TorchGroupedLinear(p, c)

    def forward(self, x):
        z = self.add_on_layers(self.features(x))
        protos = self.prototype_vectors
        if self.config.distance == "l2":
            xp = F.conv2d(z, protos)
            d = F.relu(F.conv2d(z * z, self.ones) - (xp + xp)
                       + (protos**2).sum(dim=(1, 2, 3)).view(-1, 1, 1))
        else:
            d = 1 - torch.clamp(F.conv2d(F.normalize(z, dim=1), F.normalize(protos, dim=1)), -1, 1)
        d = -F.max_pool2d(-d, kernel_size=d.shape[2:]).flatten(1)
        if self.config.prototype_activation == "log":
            s = torch.log(1 / (d + self.config.epsilon) + 1)
        else:
            s = 1 - d if self.config.distance == "cosine" else -d
        if self.config.readout_type == "proto":
            return s.reshape(s.shape[0], self.config.num_classes, -1).sum(-1)
        return self.last_layer(s)


def config_yaml(config: PixPNetConfig, **extra) -> str:
    model = {"name": "protonet", "init-weights": True, "pretrained": True,
             "feature-extractor": config.feature_extractor, "feature-layer": config.feature_layer,
             "num-prototypes": config.num_prototypes, "prototype-dim": config.prototype_dim,
             "prototype-kernel-size": 1, "prototype-activation": config.prototype_activation,
             "add-on-layers-type": config.add_on_layers_type, "epsilon": "1e-6",
             "learn-prototypes": True, "class-specific": True,
             "readout-type": config.readout_type, "distance": config.distance, **extra}
    lines = ["seed: 42", "dataset:", "  name: CUB200224", "model:"]
    return "\n".join(lines + [f"  {k}: {v}" for k, v in model.items()]) + "\n"


def save_lightning(reference: TorchProtoNet, config: PixPNetConfig, directory, **yaml_extra):
    state = OrderedDict(("model." + k, v) for k, v in reference.state_dict().items())
    ckpt = {"epoch": 19, "global_step": 100, "state_dict": state,
            "hyper_parameters": {"config": argparse.Namespace(seed=42, lr=3e-3)},
            "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(3)}}}]}
    torch.save(ckpt, directory / "last.ckpt")
    (directory / "config.yaml").write_text(config_yaml(config, **yaml_extra))
    return directory / "last.ckpt", directory / "config.yaml"


def make_reference(config: PixPNetConfig, layers: OrderedDict, seed: int) -> TorchProtoNet:
    reference = TorchProtoNet(layers, config)
    for part in (reference.features, reference.add_on_layers, getattr(reference, "last_layer",
                                                                       None)):
        if part is not None:
            randomize(part, seed)
    with torch.no_grad():
        # Prototypes live where the sigmoid outputs do, (0, 1)^D, so that distances are
        # away from zero and the log similarity is well conditioned (as after push).
        reference.prototype_vectors.copy_(torch.rand(reference.prototype_vectors.shape,
                                                     generator=torch.Generator().manual_seed(seed)))
    return reference.eval()


CASES = [
    (PixPNetConfig("resnet18", "layer2", num_prototypes=20, prototype_dim=16, num_classes=4),
     resnet18_layers),
    (PixPNetConfig("vgg11_bn", "maxpool3", num_prototypes=12, prototype_dim=32, num_classes=3,
                   add_on_layers_type="bottleneck", distance="cosine", readout_type="sparse"),
     vgg11_bn_layers),
    (PixPNetConfig("densenet121", "transition1", num_prototypes=10, prototype_dim=8,
                   num_classes=5, prototype_activation="linear", readout_type="proto"),
     densenet121_layers),
]


@pytest.mark.parametrize(("config", "layers"), CASES, ids=["resnet-l2", "vgg-cos", "dense-lin"])
def test_logits_match_pytorch(config, layers, tmp_path):
    reference = make_reference(config, layers(config.feature_layer), seed=32)
    ckpt, yaml_path = save_lightning(reference, config, tmp_path)
    model, loaded_config = pixpnet.pixpnet_from_checkpoint(ckpt, yaml_path)
    assert loaded_config == config
    x = images(16, 32, seed=33)  # 16 x (3..5) classes: the 32+ outputs a parity check needs
    apply_fn, params = pure_apply(model, lambda m, x: (m(x), m.similarities(x),
                                                       *m.class_weights()))
    logits, s, w, owner = (np.asarray(a) for a in jax.jit(apply_fn)(params, x))
    expected = torch_pair(reference, float64_copy(reference), x)
    assert logits.shape == (16, config.num_classes)
    assert np.abs(expected[0]).max() > 0.1
    assert_parity(logits, *expected, f"pixpnet {config.feature_extractor} {config.distance}")
    # The readout as weights (explanations: contributions s_j W[y, j]): logits = s Wᵀ.
    np.testing.assert_allclose(s @ w.T, logits, rtol=1e-5, atol=1e-5)
    p, c = config.num_prototypes, config.num_classes
    grouped = np.arange(p) // (p // c)
    expected_owner = np.argmax(w, axis=0) if config.readout_type == "linear" else grouped
    np.testing.assert_array_equal(owner, expected_owner)


def test_bottleneck_add_on_layers_halve_to_the_prototype_dim():
    config = CASES[1][0]  # vgg11_bn maxpool3: 256 channels, D = 32
    assert [s[0] for s in add_on_layer_specs(config)] == [
        "conv1", "conv2", "conv3", "conv4", "conv5", "conv_last"]
    assert [s[2] for s in add_on_layer_specs(config)] == [128, 128, 64, 64, 32, 32]



@pytest.mark.parametrize("case", [0, 1], ids=["l2", "cosine"])
def test_prototype_distances_run_in_float32_under_bfloat16(case):
    """``--dtype bfloat16`` casts parameters and images; the distance maps are still computed
    in float32 from the bf16 add-on output and the bf16-rounded prototypes (the expanded L2
    form cancels near a prototype), exactly as the float32 functions would on those values."""
    import jax.numpy as jnp
    from flax import nnx

    config = CASES[case][0]
    from cbcert.engine.sampler import cast_floating
    from cbcert.models import pixpnet as net

    graph, state = nnx.split(net.PixPNet(config, rngs=nnx.Rngs(0)))
    model = nnx.merge(graph, cast_floating(state, jnp.bfloat16))
    model.prototypes[...] = jax.random.uniform(jax.random.key(1), model.prototypes[...].shape,
                                               dtype=jnp.bfloat16)
    x = jnp.asarray(images(2, 32, seed=3), jnp.bfloat16)
    d = model.distances(x)
    assert d.dtype == jnp.float32
    z, p = model.latent(x).astype(jnp.float32), model.prototypes[...].astype(jnp.float32)
    distance = (net.squared_l2_distances if config.distance == "l2"
                else net.cosine_distances)
    np.testing.assert_array_equal(np.asarray(d), np.asarray(distance(z, p)))

@pytest.fixture(scope="module")
def resnet_checkpoint(tmp_path_factory):
    config, layers = CASES[0]
    directory = tmp_path_factory.mktemp("pixpnet")
    reference = make_reference(config, layers(config.feature_layer), seed=34)
    return save_lightning(reference, config, directory), reference


def test_convert_round_trip_and_hash_check(resnet_checkpoint, tmp_path):
    (ckpt, yaml_path), reference = resnet_checkpoint
    manifest = convert("pixpnet", ckpt, tmp_path / "out", config_path=yaml_path)
    assert manifest["config"]["feature_layer"] == "layer2"
    assert manifest["sources"]["checkpoint"]["sha256"] == sha256_file(ckpt)
    apply_fn, params, _ = load_converted(tmp_path / "out")
    x = images(8, 32, seed=35)
    assert_parity(jax.jit(apply_fn)(params, x), *torch_pair(reference, float64_copy(reference), x),
                  "pixpnet converted")
    manifest_path = tmp_path / "out" / "manifest.json"
    manifest_path.write_text(manifest_path.read_text().replace(
        manifest["params_sha256"], "0" * 64))
    with pytest.raises(ValueError, match="params sha256 .* does not match the manifest"):
        load_converted(tmp_path / "out")
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        convert("pixpnet", ckpt, tmp_path / "out", config_path=yaml_path)


def resave(tmp_path, ckpt, edit):
    state = OrderedDict(torch.load(ckpt, weights_only=False)["state_dict"])
    edit(state)
    torch.save({"state_dict": state}, tmp_path / "edited.ckpt")
    return tmp_path / "edited.ckpt"


def test_extra_missing_and_misshaped_keys_are_named(resnet_checkpoint, tmp_path):
    (ckpt, yaml_path), _ = resnet_checkpoint

    def edit(state):
        state["model.add_on_layers.conv9.weight"] = torch.zeros(1)
        del state["model.features.module_dict.layer2.0.downsample.1.running_var"]
        state["model.prototype_vectors"] = torch.zeros(20, 16, 3, 3)

    with pytest.raises(ValueError) as error:
        pixpnet.pixpnet_from_checkpoint(resave(tmp_path, ckpt, edit), yaml_path)
    message = str(error.value)
    assert "unknown keys (1)" in message and "model.add_on_layers.conv9.weight" in message
    assert "missing keys (1)" in message
    assert "model.features.module_dict.layer2.0.downsample.1.running_var" in message
    assert ("model.prototype_vectors: checkpoint shape (20, 16, 3, 3), architecture expects "
            "(20, 16, 1, 1)") in message


def test_config_errors_are_named(resnet_checkpoint, tmp_path):
    (ckpt, _), _ = resnet_checkpoint
    config = CASES[0][0]
    (tmp_path / "bad.yaml").write_text(config_yaml(config, **{"prototype-kernel-size": 3}))
    with pytest.raises(ValueError, match="prototype-kernel-size=3"):
        pixpnet.pixpnet_from_checkpoint(ckpt, tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text(config_yaml(config, **{"prototype-shape": 3}))
    with pytest.raises(ValueError, match=r"unknown model keys \['prototype_shape'\]"):
        pixpnet.pixpnet_from_checkpoint(ckpt, tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text(config_yaml(config, **{"feature-layer": "layer9"}))
    with pytest.raises(ValueError, match="feature_layer='layer9'"):
        pixpnet.pixpnet_from_checkpoint(ckpt, tmp_path / "bad.yaml")
