"""torchvision ResNet / DenseNet state_dicts -> ``cbcert.models`` (strict key tables).

The tables below are the whole mapping: torchvision key -> NNX variable path + layout transform.
They are generated from the architecture config (and cover truncated networks, which PixPNet
reuses with its own key prefix).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from cbcert.convert.common import (
    Table,
    batch_norm_entries,
    conv_entries,
    fill_module,
    linear_entries,
)
from cbcert.io.registry import DENSENET_NAMES, RESNET_NAMES, abstract
from cbcert.models.densenet import DENSENET_PRESETS, DenseNet, DenseNetConfig, stage_names
from cbcert.models.resnet import RESNET_PRESETS, ResNet, ResNetConfig


def resnet_table(config: ResNetConfig) -> Table:
    """torchvision ``resnet*`` keys (``conv1.weight``, ``layer2.0.downsample.1.running_var``...)."""
    table: Table = {}
    conv_entries(table, "conv1", ("conv1",))
    batch_norm_entries(table, "bn1", ("bn1",))
    n_convs = 2 if config.block == "basic" else 3
    cin = 64
    for i, depth in enumerate(config.layers[: max(config.num_stages - 2, 0)]):
        cout = 64 * 2**i * config.expansion
        for j in range(depth):
            key, path = f"layer{i + 1}.{j}", ("stages", i, j)
            for k in range(1, n_convs + 1):
                conv_entries(table, f"{key}.conv{k}", (*path, f"conv{k}"))
                batch_norm_entries(table, f"{key}.bn{k}", (*path, f"bn{k}"))
            if j == 0 and (i > 0 or cin != cout):  # the model's projection rule
                conv_entries(table, f"{key}.downsample.0", (*path, "downsample", 0))
                batch_norm_entries(table, f"{key}.downsample.1", (*path, "downsample", 1))
            cin = cout
    if config.feature_layer is None:
        linear_entries(table, "fc", ("fc",))
    return table


def densenet_table(config: DenseNetConfig) -> Table:
    """torchvision ``densenet*`` keys (``features.denseblock1.denselayer1.norm1.weight``, ...)."""
    names = stage_names(config)[: config.num_stages]
    table: Table = {}
    conv_entries(table, "features.conv0", ("conv0",))
    if "norm0" in names:
        batch_norm_entries(table, "features.norm0", ("norm0",))
    for i, depth in enumerate(config.block_config):
        if f"denseblock{i + 1}" in names:
            for k in range(depth):
                key = f"features.denseblock{i + 1}.denselayer{k + 1}"
                path = ("blocks", i, "layers", k)
                batch_norm_entries(table, f"{key}.norm1", (*path, "norm1"))
                conv_entries(table, f"{key}.conv1", (*path, "conv1"))
                batch_norm_entries(table, f"{key}.norm2", (*path, "norm2"))
                conv_entries(table, f"{key}.conv2", (*path, "conv2"))
        if f"transition{i + 1}" in names:
            key, path = f"features.transition{i + 1}", ("transitions", i)
            batch_norm_entries(table, f"{key}.norm", (*path, "norm"))
            conv_entries(table, f"{key}.conv", (*path, "conv"))
    if "norm5" in names:
        batch_norm_entries(table, "features.norm5", ("norm5",))
    if config.feature_layer is None:
        linear_entries(table, "classifier", ("classifier",))
    return table


# Checkpoints from torchvision's original download URLs spell "denselayer1.norm.1.weight";
# torchvision itself renames them with this pattern when it loads them.
_LEGACY_DENSE = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$")


def canonical_densenet_keys(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename legacy ``denselayerN.norm.1.weight`` keys to ``denselayerN.norm1.weight``."""
    out = {}
    for key, value in tensors.items():
        match = _LEGACY_DENSE.match(key)
        out[match.group(1) + match.group(2) if match else key] = value
    return out


def _num_classes(tensors: Mapping[str, np.ndarray], key: str, what: str) -> int:
    if key not in tensors or np.ndim(tensors[key]) != 2:
        raise ValueError(f"{what}: checkpoint has no 2-D {key!r}; cannot infer num_classes "
                         "(is this a full torchvision classifier state_dict?)")
    return int(np.shape(tensors[key])[0])


def abstract_resnet(config: ResNetConfig) -> ResNet:
    """Shape-only ``ResNet`` (no weights are drawn)."""
    return abstract(lambda rngs: ResNet(config, rngs=rngs))


def abstract_densenet(config: DenseNetConfig) -> DenseNet:
    """Shape-only ``DenseNet`` (no weights are drawn)."""
    return abstract(lambda rngs: DenseNet(config, rngs=rngs))


def resnet_from_state_dict(name: str, tensors: Mapping[str, np.ndarray]) -> ResNet:
    """``ResNet`` holding a torchvision ``name`` state_dict (``num_classes`` read from ``fc``).

    Raises:
      ValueError: unknown ``name``, or any unknown / missing / mis-shaped key (all listed).
    """
    config = ResNetConfig.from_name(name, num_classes=_num_classes(tensors, "fc.weight", name))
    return fill_module(abstract_resnet(config), tensors, resnet_table(config), name)


def densenet_from_state_dict(name: str, tensors: Mapping[str, np.ndarray]) -> DenseNet:
    """``DenseNet`` holding a torchvision ``name`` state_dict (legacy key spelling accepted)."""
    tensors = canonical_densenet_keys(tensors)
    config = DenseNetConfig.from_name(
        name, num_classes=_num_classes(tensors, "classifier.weight", name))
    return fill_module(abstract_densenet(config), tensors, densenet_table(config), name)


def backbone_from_state_dict(name: str, tensors: Mapping[str, np.ndarray]) -> ResNet | DenseNet:
    """Dispatch on a torchvision model name (``RESNET_NAMES`` or ``DENSENET_NAMES``)."""
    if name in RESNET_PRESETS:
        return resnet_from_state_dict(name, tensors)
    if name in DENSENET_PRESETS:
        return densenet_from_state_dict(name, tensors)
    raise ValueError(f"backbone={name!r}; allowed: {RESNET_NAMES + DENSENET_NAMES}")


def abstract_backbone(name: str, num_classes: int) -> ResNet | DenseNet:
    """Shape-only backbone for a torchvision model name."""
    if name in RESNET_PRESETS:
        return abstract_resnet(ResNetConfig.from_name(name, num_classes=num_classes))
    if name in DENSENET_PRESETS:
        return abstract_densenet(DenseNetConfig.from_name(name, num_classes=num_classes))
    raise ValueError(f"backbone={name!r}; allowed: {RESNET_NAMES + DENSENET_NAMES}")
