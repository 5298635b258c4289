"""Parity and strictness of the torchvision DenseNet converter (reference written in the test).

Ports run in float32 and are compared with the reference in float64 (``parity.assert_parity``).
"""

from __future__ import annotations

from collections import OrderedDict

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # JAX already uses the cores; oversubscription makes torch ~100x slower
nn = torch.nn

from parity import assert_parity, float64_copy  # noqa: E402
from test_convert_resnet import images, randomize, state_dict_numpy, torch_pair  # noqa: E402

from cbcert.convert import common, torchvision  # noqa: E402
from cbcert.io.registry import pure_apply  # noqa: E402
from cbcert.models.densenet import DenseNetConfig  # noqa: E402


class TorchDenseLayer(nn.Module):
    def __init__(self, cin, growth, bn_size):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, 1, 1, bias=False)

    def forward(self, x):
        y = self.conv1(self.relu1(self.norm1(x)))
        return torch.cat([x, self.conv2(self.relu2(self.norm2(y)))], 1)


class TorchDenseNet(nn.Module):
    """torchvision-compatible DenseNet (same module names, so the same state_dict keys)."""

    def __init__(self, growth, blocks, init, bn_size=4, num_classes=10):
        super().__init__()
        layers = OrderedDict(conv0=nn.Conv2d(3, init, 7, 2, 3, bias=False),
                             norm0=nn.BatchNorm2d(init), relu0=nn.ReLU(),
                             pool0=nn.MaxPool2d(3, 2, 1))
        channels = init
        for i, depth in enumerate(blocks):
            layers[f"denseblock{i + 1}"] = nn.Sequential(OrderedDict(
                (f"denselayer{k + 1}", TorchDenseLayer(channels + k * growth, growth, bn_size))
                for k in range(depth)))
            channels += depth * growth
            if i < len(blocks) - 1:
                layers[f"transition{i + 1}"] = nn.Sequential(OrderedDict(
                    norm=nn.BatchNorm2d(channels), relu=nn.ReLU(),
                    conv=nn.Conv2d(channels, channels // 2, 1, bias=False),
                    pool=nn.AvgPool2d(2, 2)))
                channels //= 2
        layers["norm5"] = nn.BatchNorm2d(channels)
        self.features = nn.Sequential(layers)
        self.classifier = nn.Linear(channels, num_classes)

    def embed(self, x):
        return torch.flatten(nn.functional.adaptive_avg_pool2d(
            torch.relu(self.features(x)), 1), 1)

    def forward(self, x):
        return self.classifier(self.embed(x))


def torch_densenet161(seed: int) -> TorchDenseNet:
    model = TorchDenseNet(48, (6, 12, 36, 24), 96)
    randomize(model, seed)
    return model.eval()


def test_densenet161_logits_and_embedding_match_pytorch():
    reference = torch_densenet161(seed=1)
    model = torchvision.densenet_from_state_dict("densenet161", state_dict_numpy(reference))
    x = images(4, 40, seed=2)  # 40 px gives an odd map (5 -> 2) in transition2
    # One compilation for both outputs: DenseNet-161 takes seconds to compile on CPU.
    apply_fn, params = pure_apply(model, lambda m, x: (m(x), m.embed(x)))
    logits, embedding = jax.jit(apply_fn)(params, x)
    reference64 = float64_copy(reference)
    expected = torch_pair(reference, reference64, x)
    assert logits.shape == (4, 10)
    assert np.abs(expected[0]).max() > 0.1
    assert_parity(logits, *expected, "densenet161 logits")
    assert_parity(embedding, *torch_pair(reference.embed, reference64.embed, x),
                  "densenet161 embedding")


# A small DenseNet keeps the structural tests fast; DenseNet-161 itself is checked above.
SMALL = {"growth_rate": 8, "block_config": (2, 3, 2, 2), "num_init_features": 16}


@pytest.fixture(scope="module")
def small_densenet():
    reference = TorchDenseNet(SMALL["growth_rate"], SMALL["block_config"],
                              SMALL["num_init_features"])
    randomize(reference, seed=3)
    return reference.eval(), state_dict_numpy(reference)


def small_from_state_dict(tensors):
    config = DenseNetConfig(**SMALL, num_classes=10)
    return common.fill_module(torchvision.abstract_densenet(config),
                              torchvision.canonical_densenet_keys(tensors),
                              torchvision.densenet_table(config), "small densenet")


def test_truncated_features_match_pytorch(small_densenet):
    reference, tensors = small_densenet
    config = DenseNetConfig(**SMALL, feature_layer="transition2")
    table = torchvision.densenet_table(config)
    model = common.fill_module(torchvision.abstract_densenet(config),
                               {k: v for k, v in tensors.items() if k in table}, table, "dn")
    x = images(2, 32, seed=4)
    features = np.asarray(jax.jit(lambda m, x: m.features(x))(model, x))
    assert features.shape == (2, 2, 2, config.feature_channels)
    expected = torch_pair(reference.features[:8], float64_copy(reference).features[:8], x)
    assert_parity(features, *(e.transpose(0, 2, 3, 1) for e in expected), "densenet transition2")


def test_legacy_key_spelling_is_accepted(small_densenet):
    _, tensors = small_densenet
    legacy = {k.replace(".norm1.", ".norm.1.").replace(".conv2.", ".conv.2."): v
              for k, v in tensors.items() if not k.endswith("num_batches_tracked")}
    assert "features.denseblock1.denselayer1.norm.1.weight" in legacy
    model = small_from_state_dict(legacy)
    np.testing.assert_array_equal(
        np.asarray(model.blocks[0].layers[0].norm1.scale[...]),
        tensors["features.denseblock1.denselayer1.norm1.weight"])


def test_extra_missing_and_misshaped_keys_are_named(small_densenet):
    _, tensors = small_densenet
    tensors = dict(tensors)
    tensors["features.denseblock1.denselayer7.conv1.weight"] = np.zeros((32, 64, 1, 1))
    del tensors["features.transition3.norm.running_mean"]
    tensors["classifier.bias"] = np.zeros(11, np.float32)
    with pytest.raises(ValueError, match=r"unknown keys \(1\)[\s\S]*denselayer7\.conv1\.weight"
                                         r"[\s\S]*missing keys \(1\)[\s\S]*transition3\.norm\."
                                         r"running_mean"):
        small_from_state_dict(tensors)
    del tensors["features.denseblock1.denselayer7.conv1.weight"]
    tensors["features.transition3.norm.running_mean"] = np.zeros(36, np.float32)
    with pytest.raises(ValueError, match=r"classifier\.bias: checkpoint shape \(11,\), "
                                         r"architecture expects \(10,\)"):
        small_from_state_dict(tensors)


def test_num_classes_is_read_from_the_classifier(small_densenet):
    _, tensors = small_densenet
    with pytest.raises(ValueError, match=r"densenet121: checkpoint does not match[\s\S]*"
                                         r"missing keys[\s\S]*features\.denseblock1\.denselayer3"):
        torchvision.densenet_from_state_dict("densenet121", tensors)
