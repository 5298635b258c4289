"""Parity and strictness of the torchvision ResNet converter.

The PyTorch reference is written here from the public architecture description (torchvision
cannot be imported beside torch 2.13 in this environment); its state_dict key names are exactly
torchvision's. Every parameter and buffer is randomised, BN running statistics included.
Ports run in float32 and are compared with the reference in float64 (``parity.assert_parity``).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # JAX already uses the cores; oversubscription makes torch ~100x slower
nn = torch.nn

from parity import assert_parity, float64_copy  # noqa: E402

from cbcert.convert import common, convert, torchvision  # noqa: E402
from cbcert.io.registry import load_converted, pure_apply  # noqa: E402
from cbcert.models.resnet import ResNetConfig  # noqa: E402


class TorchBasicBlock(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = projection(cin, width, stride)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class TorchBottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, 4 * width, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(4 * width)
        self.downsample = projection(cin, 4 * width, stride)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


def projection(cin, cout, stride):
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class TorchResNet(nn.Module):
    """torchvision-compatible ResNet (same module names, so the same state_dict keys)."""

    def __init__(self, block, layers, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        expansion = 1 if block is TorchBasicBlock else 4
        cin = 64
        for i, depth in enumerate(layers):
            blocks = []
            for j in range(depth):
                blocks.append(block(cin, 64 * 2**i, 2 if (i > 0 and j == 0) else 1))
                cin = 64 * 2**i * expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def embed(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)

    def forward(self, x):
        return self.fc(self.embed(x))


def torch_resnet(name: str, num_classes: int, seed: int) -> TorchResNet:
    block, layers = {"resnet18": (TorchBasicBlock, (2, 2, 2, 2)),
                     "resnet50": (TorchBottleneck, (3, 4, 6, 3))}[name]
    model = TorchResNet(block, layers, num_classes)
    randomize(model, seed)
    return model.eval()


def randomize(model: nn.Module, seed: int) -> None:
    """Draw every parameter and buffer so that no identity (BN 0/1 stats, zero bias) hides a bug.

    Scales keep activations O(1) through deep stacks: conv weights ~ N(0, 1/fan_in), BN scale in
    [0.3, 0.7] (shrinks each residual branch), running variance in [0.5, 2].
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("num_batches_tracked"):
                tensor.fill_(7)
            elif name.endswith("running_var"):
                tensor.copy_(0.5 + 1.5 * torch.rand(tensor.shape, generator=gen))
            elif name.endswith("running_mean") or (name.endswith("bias") and tensor.ndim == 1):
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=gen))
            elif tensor.ndim == 1:  # BN scale
                tensor.copy_(0.3 + 0.4 * torch.rand(tensor.shape, generator=gen))
            else:
                fan_in = tensor[0].numel()
                tensor.copy_(torch.randn(tensor.shape, generator=gen) / fan_in**0.5)


def state_dict_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def images(batch: int, size: int, seed: int) -> np.ndarray:
    """NHWC float32 images, N(0, 1) like normalised inputs."""
    return np.random.default_rng(seed).standard_normal((batch, size, size, 3)).astype(np.float32)


def torch_forward(fn, x_nhwc: np.ndarray, dtype=None) -> np.ndarray:
    """``fn`` on NCHW ``x`` (cast to ``dtype``, e.g. ``torch.float64`` for a ``float64_copy``)."""
    with torch.no_grad():
        x = torch.from_numpy(x_nhwc.transpose(0, 3, 1, 2).copy())
        return fn(x if dtype is None else x.to(dtype)).numpy()


def torch_pair(fn, fn64, x_nhwc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(float64, float32)`` reference outputs: ``fn64`` belongs to ``float64_copy(model)``."""
    return torch_forward(fn64, x_nhwc, torch.float64), torch_forward(fn, x_nhwc)


@pytest.mark.parametrize(("name", "size"), [("resnet18", 33), ("resnet50", 32)])
def test_logits_and_embedding_match_pytorch(name, size):
    reference = torch_resnet(name, num_classes=10, seed=1)
    model = torchvision.resnet_from_state_dict(name, state_dict_numpy(reference))
    x = images(4, size, seed=2)  # odd size 33 exercises the floor in strided convs and pooling
    apply_fn, params = pure_apply(model)
    logits = np.asarray(jax.jit(apply_fn)(params, x))
    reference64 = float64_copy(reference)
    expected = torch_pair(reference, reference64, x)
    assert logits.shape == (4, 10)
    assert np.abs(expected[0]).max() > 0.1  # a degenerate (all-zero) network would prove nothing
    assert_parity(logits, *expected, f"{name} logits")
    embed_fn, params = pure_apply(model, lambda m, x: m.embed(x))
    assert_parity(jax.jit(embed_fn)(params, x), *torch_pair(reference.embed, reference64.embed, x),
                  f"{name} embedding")


def test_truncated_features_match_pytorch():
    reference = torch_resnet("resnet18", num_classes=5, seed=3)
    config = ResNetConfig.from_name("resnet18", num_classes=5, feature_layer="layer2")
    table = torchvision.resnet_table(config)
    tensors = {k: v for k, v in state_dict_numpy(reference).items() if k in table}
    model = common.fill_module(torchvision.abstract_resnet(config), tensors, table, "resnet18")
    x = images(2, 32, seed=4)

    def torch_layer2(net):
        def forward(t):
            t = net.maxpool(net.relu(net.bn1(net.conv1(t))))
            return net.layer2(net.layer1(t))
        return forward

    features = np.asarray(jax.jit(lambda m, x: m.features(x))(model, x))
    assert features.shape == (2, 4, 4, config.feature_channels)
    expected = torch_pair(torch_layer2(reference), torch_layer2(float64_copy(reference)), x)
    assert_parity(features, *(e.transpose(0, 2, 3, 1) for e in expected), "resnet18 layer2")


def test_max_pool_pads_with_minus_infinity():
    # All activations negative: zero padding would put 0 at the border maxima.
    from cbcert.models.resnet import max_pool_3x3_s2
    x = -1.0 - np.arange(16, dtype=np.float32).reshape(1, 4, 4, 1)
    pooled = np.asarray(max_pool_3x3_s2(x))
    expected = torch.nn.functional.max_pool2d(torch.from_numpy(x.transpose(0, 3, 1, 2)), 3, 2, 1)
    np.testing.assert_array_equal(pooled, expected.numpy().transpose(0, 2, 3, 1))
    assert pooled.max() < 0


@pytest.fixture(scope="module")
def resnet18_tensors():
    return state_dict_numpy(torch_resnet("resnet18", num_classes=10, seed=5))


def test_extra_key_is_named(resnet18_tensors):
    tensors = dict(resnet18_tensors, **{"layer5.0.conv1.weight": np.zeros((1, 1, 1, 1))})
    with pytest.raises(ValueError, match=r"unknown keys \(1\)[\s\S]*layer5\.0\.conv1\.weight"):
        torchvision.resnet_from_state_dict("resnet18", tensors)


def test_missing_key_is_named(resnet18_tensors):
    tensors = dict(resnet18_tensors)
    del tensors["layer3.1.bn2.running_var"]
    with pytest.raises(ValueError, match=r"missing keys \(1\)[\s\S]*layer3\.1\.bn2\.running_var"):
        torchvision.resnet_from_state_dict("resnet18", tensors)


def test_misshaped_key_is_named(resnet18_tensors):
    tensors = dict(resnet18_tensors)
    tensors["layer2.0.conv2.weight"] = np.zeros((128, 128, 5, 5), np.float32)
    with pytest.raises(ValueError, match=r"mis-shaped keys \(1\)[\s\S]*layer2\.0\.conv2\.weight: "
                                         r"checkpoint shape \(128, 128, 5, 5\), architecture "
                                         r"expects \(128, 128, 3, 3\)"):
        torchvision.resnet_from_state_dict("resnet18", tensors)


def test_wrong_architecture_lists_every_difference(resnet18_tensors):
    # A resnet18 state_dict is not a resnet34 one: the error lists the missing blocks.
    with pytest.raises(ValueError, match=r"missing keys[\s\S]*layer1\.2\.conv1\.weight"):
        torchvision.resnet_from_state_dict("resnet34", resnet18_tensors)


def test_convert_writes_a_checked_checkpoint(tmp_path):
    reference = torch_resnet("resnet18", num_classes=10, seed=6)
    torch.save(reference.state_dict(), tmp_path / "resnet18.pth")
    manifest = convert("resnet18", tmp_path / "resnet18.pth", tmp_path / "out")
    assert manifest["kind"] == "resnet18" and manifest["config"]["num_classes"] == 10
    apply_fn, params, loaded = load_converted(tmp_path / "out")
    assert loaded == manifest
    x = images(4, 32, seed=7)
    assert_parity(jax.jit(apply_fn)(params, x), *torch_pair(reference, float64_copy(reference), x),
                  "resnet18 converted")
    with pytest.raises(ValueError, match="kind='resnet19'; allowed"):
        convert("resnet19", tmp_path / "resnet18.pth", tmp_path / "other")


def test_full_module_pickles_are_refused(tmp_path):
    torch.save(torch_resnet("resnet18", num_classes=2, seed=8), tmp_path / "model.pt")
    with pytest.raises(ValueError, match="cannot read it as a weights-only PyTorch checkpoint"):
        convert("resnet18", tmp_path / "model.pt", tmp_path / "out")


def test_a_table_that_misses_a_module_variable_is_refused(resnet18_tensors):
    config = ResNetConfig.from_name("resnet18", num_classes=10)
    table = torchvision.resnet_table(config)
    del table["fc.bias"]
    tensors = {k: v for k, v in resnet18_tensors.items() if k != "fc.bias"}
    with pytest.raises(ValueError, match=r"module variables no key fills \(converter bug\) "
                                         r"\(1\):\n    \('fc', 'bias'\)"):
        common.fill_module(torchvision.abstract_resnet(config), tensors, table, "resnet18")


def test_num_batches_tracked_is_optional(resnet18_tensors):
    tensors = {k: v for k, v in resnet18_tensors.items() if not k.endswith("num_batches_tracked")}
    model = torchvision.resnet_from_state_dict("resnet18", tensors)
    assert model.config.num_classes == 10
