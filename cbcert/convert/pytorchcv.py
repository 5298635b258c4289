"""pytorchcv (osmr/imgclsmob) ResNet state_dicts -> ``cbcert.models.resnet.ResNet`` (strict table).

pytorchcv's basic-block ResNets compute what torchvision's do (7x7/2 stem conv, BN, ReLU,
3x3/2 max-pool; units conv3x3(stride)-BN-ReLU, conv3x3-BN, plus an identity or 1x1 projection,
ReLU), under other module names and with a fixed ``AvgPool2d(7)`` where torchvision pools
adaptively (handled by ``cbcert.models.pcbm``; see ``PYTORCHCV_BACKBONES``). Only the names in
``PYTORCHCV_BACKBONES`` are accepted: pytorchcv's bottleneck ResNets put the stride on the first
1x1 conv, which the torchvision-layout port does not.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cbcert.convert.common import (
    Table,
    batch_norm_entries,
    conv_entries,
    fill_module,
    linear_entries,
)
from cbcert.io.registry import abstract
from cbcert.models.pcbm import PYTORCHCV_BACKBONES
from cbcert.models.resnet import ResNet, ResNetConfig


def _conv_block(table: Table, key: str, conv_path: tuple, bn_path: tuple) -> None:
    """pytorchcv ``ConvBlock``: ``key.conv`` (no bias) then ``key.bn``; its ReLU has no weights."""
    conv_entries(table, f"{key}.conv", conv_path)
    batch_norm_entries(table, f"{key}.bn", bn_path)


def resnet_table(config: ResNetConfig) -> Table:
    """pytorchcv ``resnet*`` keys (``features.init_block.conv.conv.weight``,
    ``features.stage2.unit1.identity_conv.bn.running_var``, ``output.weight``, ...)."""
    if config.block != "basic" or config.feature_layer is not None:
        raise ValueError(f"pytorchcv table: block={config.block!r}, feature_layer="
                         f"{config.feature_layer!r}; only full basic-block ResNets are mapped")
    table: Table = {}
    _conv_block(table, "features.init_block.conv", ("conv1",), ("bn1",))
    cin = 64
    for i, depth in enumerate(config.layers):
        cout = 64 * 2**i
        for j in range(depth):
            key, path = f"features.stage{i + 1}.unit{j + 1}", ("stages", i, j)
            for k in (1, 2):
                _conv_block(table, f"{key}.body.conv{k}", (*path, f"conv{k}"), (*path, f"bn{k}"))
            if j == 0 and (i > 0 or cin != cout):  # pytorchcv's resize_identity rule
                _conv_block(table, f"{key}.identity_conv", (*path, "downsample", 0),
                            (*path, "downsample", 1))
            cin = cout
    linear_entries(table, "output", ("fc",))
    return table


def resnet_config(name: str, num_classes: int) -> ResNetConfig:
    """The torchvision-layout config of a pytorchcv name in ``PYTORCHCV_BACKBONES``."""
    if name not in PYTORCHCV_BACKBONES:
        raise ValueError(f"pytorchcv name={name!r}; allowed: {sorted(PYTORCHCV_BACKBONES)}")
    return ResNetConfig.from_name(PYTORCHCV_BACKBONES[name], num_classes=num_classes)


def resnet_from_state_dict(name: str, tensors: Mapping[str, np.ndarray]) -> ResNet:
    """``ResNet`` holding a pytorchcv ``name`` state_dict (``num_classes`` read from ``output``).

    The module pools adaptively; it equals pytorchcv's classifier on inputs whose last feature
    map is 7x7 (193..224 px).

    Raises:
      ValueError: unknown ``name``, or any unknown / missing / mis-shaped key (all listed).
    """
    weight = tensors.get("output.weight")
    if weight is None or np.ndim(weight) != 2:
        raise ValueError(f"{name}: checkpoint has no 2-D 'output.weight'; cannot infer "
                         "num_classes (is this a pytorchcv classifier state_dict?)")
    config = resnet_config(name, int(np.shape(weight)[0]))
    return fill_module(abstract(lambda rngs: ResNet(config, rngs=rngs)), tensors,
                       resnet_table(config), name)
