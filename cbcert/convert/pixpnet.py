"""PixPNet (merlresearch/PixPNet) Lightning checkpoints + ``config.yaml`` -> ``PixPNet``.

Checkpoint layout (``ProtoLitModel.model`` is the ``ProtoNet``):

* ``model.features.module_dict.<layer>.*``: the truncated torchvision backbone under PixPNet's
  layer names (ResNet: ``conv1_no_act``, ``bn1``, ``layer1``...; VGG: ``conv_no_act{i}``,
  ``bn{i}``; DenseNet: torchvision's ``features`` children);
* ``model.add_on_layers.<conv name>.weight|bias``;
* ``model.prototype_vectors`` ``[P, D, 1, 1]``;
* ``model.last_layer.weight``: ``[C, P]`` (linear) or ``[C, P/C]`` (sparse); absent for ``proto``;
* bookkeeping buffers that do not change the logits: ``model.ones``,
  ``model.corresponding_sample_idxs``, ``model.min_fmap_idxs``, ``model.prototype_class_identity``.

The Lightning file is read with ``pickles.load_torch_zip`` (no torch, no Lightning, no
PixPNet import); its hyper-parameter objects become inert stand-ins.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import numpy as np

from cbcert.convert import pickles
from cbcert.convert.common import (
    Entry,
    Table,
    batch_norm_entries,
    conv_entries,
    fill_module,
    linear_entries,
    nested,
)
from cbcert.convert.torchvision import canonical_densenet_keys, densenet_table, resnet_table
from cbcert.io.registry import abstract
from cbcert.models.densenet import DenseNetConfig
from cbcert.models.pixpnet import PixPNet, PixPNetConfig, add_on_layer_specs, vgg_sequence
from cbcert.models.resnet import ResNetConfig

FEATURES = "model.features.module_dict."
# Classes a Lightning checkpoint may pickle next to the tensors (hyper-parameters, loop state).
LIGHTNING_CLASSES = ("argparse.Namespace",
                     "lightning_fabric.utilities.data.AttributeDict",
                     "pytorch_lightning.utilities.parsing.AttributeDict",
                     "lightning.fabric.utilities.data.AttributeDict")
# config.yaml ``model:`` keys that only matter for training or for building from torchvision.
_TRAINING_ONLY = {"name", "init_weights", "pretrained", "learn_prototypes", "incorrect_strength",
                  "correct_strength", "class_specific"}
_DEFAULT_FEATURE_LAYER = {"resnet": "layer4", "densenet": "norm5", "vgg": None}


def read_config_yaml(path: str | pathlib.Path, num_classes: int) -> PixPNetConfig:
    """``PixPNetConfig`` from PixPNet's ``config.yaml`` (its ``model:`` section).

    Defaults are those of PixPNet's ``protonet()``; ``num_classes`` comes from the checkpoint
    (the YAML names a dataset, not a class count). Unknown keys and a prototype kernel size
    other than 1 are refused.
    """
    import yaml

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"config_path={str(path)!r}; no such file")
    model = (yaml.safe_load(path.read_text()) or {}).get("model")
    if not isinstance(model, Mapping):
        raise ValueError(f"config_path={str(path)!r}: no 'model:' mapping")
    options = {str(k).replace("-", "_"): v for k, v in model.items()}
    known = set(PixPNetConfig.__dataclass_fields__) | _TRAINING_ONLY | {"prototype_kernel_size"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"config_path={str(path)!r}: unknown model keys {unknown}")
    if int(options.get("prototype_kernel_size", 1)) != 1:
        raise ValueError(f"config_path={str(path)!r}: prototype-kernel-size="
                         f"{options['prototype_kernel_size']}; only 1 (the paper's) is ported")
    extractor = str(options.get("feature_extractor", ""))
    layer = options.get("feature_layer") or _default_feature_layer(extractor)
    return PixPNetConfig(
        feature_extractor=extractor,
        feature_layer=str(layer),
        num_prototypes=int(options.get("num_prototypes", 2000)),
        prototype_dim=int(options.get("prototype_dim", 512)),
        num_classes=num_classes,
        add_on_layers_type=options.get("add_on_layers_type", "regular"),
        distance=options.get("distance", "l2"),
        prototype_activation=options.get("prototype_activation", "log"),
        readout_type=options.get("readout_type", "linear"),
        epsilon=float(options.get("epsilon", 1e-6)),  # YAML 1.1 reads "1e-6" as a string
    )


def _default_feature_layer(extractor: str) -> str:
    """PixPNet's ``final_feature_extractor`` of a torchvision model."""
    if extractor.startswith("vgg"):
        return [layer[0] for layer in vgg_sequence(extractor) if layer[1] == "pool"][-1]
    for family, layer in _DEFAULT_FEATURE_LAYER.items():
        if extractor.startswith(family) and layer:
            return layer
    raise ValueError(f"feature_extractor={extractor!r}; allowed: resnet*, densenet*, vgg*")


def vgg_table(name: str, feature_layer: str) -> Table:
    """PixPNet VGG keys (``conv_no_act{i}.weight``, ``bn{i}.running_mean``, ...) -> VGGFeatures."""
    sequence = vgg_sequence(name)
    names = [layer[0] for layer in sequence]
    table: Table = {}
    for layer, op, index, _ in sequence[: names.index(feature_layer) + 1]:
        if op == "conv":
            conv_entries(table, layer, ("convs", index - 1), bias=True)
        elif op == "bn":
            batch_norm_entries(table, layer, ("norms", index - 1))
    return table


def _backbone_table(config: PixPNetConfig) -> Table:
    """Backbone keys under PixPNet's layer names, paths under ``("backbone", ...)``."""
    backbone = config.backbone_config()
    if isinstance(backbone, ResNetConfig):
        # torchvision's "conv1" is PixPNet's "conv1_no_act" ("conv1" names the ReLU there).
        table = {("conv1_no_act" + k[5:] if k.startswith("conv1.") else k): e
                 for k, e in resnet_table(backbone).items()}
    elif isinstance(backbone, DenseNetConfig):
        table = {k.removeprefix("features."): e for k, e in densenet_table(backbone).items()}
    else:
        table = vgg_table(config.feature_extractor, config.feature_layer)
    return nested(table, FEATURES, ("backbone",))


def pixpnet_table(config: PixPNetConfig) -> Table:
    """The whole key table of a PixPNet Lightning checkpoint."""
    table = _backbone_table(config)
    for i, (name, *_) in enumerate(add_on_layer_specs(config)):
        conv_entries(table, f"model.add_on_layers.{name}", ("add_on", i), bias=True)
    table["model.prototype_vectors"] = Entry(("prototypes",), "squeeze_hw")
    if config.readout_type == "linear":
        linear_entries(table, "model.last_layer", ("readout",), bias=False)
    elif config.readout_type == "sparse":
        table["model.last_layer.weight"] = Entry(("readout_weight",))
    for buffer in ("ones", "corresponding_sample_idxs", "min_fmap_idxs",
                   "prototype_class_identity"):
        table[f"model.{buffer}"] = Entry(None, "ignore", optional=True)
    return table


def load_lightning_state_dict(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """``state_dict`` of a PyTorch Lightning checkpoint (or a bare state_dict), as numpy."""
    obj = pickles.load_torch_zip(path, LIGHTNING_CLASSES)
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ValueError(f"checkpoint_path={str(path)!r}: expected a Lightning checkpoint or a "
                         f"state_dict, got {type(obj).__name__}")
    bad = sorted(k for k, v in obj.items() if not isinstance(v, np.ndarray))
    if bad:
        raise ValueError(f"checkpoint_path={str(path)!r}: entries that are not tensors: {bad}")
    return dict(obj)


def infer_num_classes(tensors: Mapping[str, np.ndarray]) -> int:
    """C from ``last_layer.weight`` (linear / sparse) or ``prototype_class_identity`` ([P, C])."""
    for key in ("model.last_layer.weight", "model.prototype_class_identity"):
        if key in tensors and np.ndim(tensors[key]) == 2:
            return int(np.shape(tensors[key])[0 if key.endswith("weight") else 1])
    raise ValueError("pixpnet: the checkpoint has neither model.last_layer.weight nor "
                     "model.prototype_class_identity; cannot infer num_classes")


def pixpnet_from_checkpoint(checkpoint_path: str | pathlib.Path,
                            config_path: str | pathlib.Path) -> tuple[PixPNet, PixPNetConfig]:
    """``PixPNet`` from a Lightning checkpoint and its ``config.yaml``.

    Raises:
      ValueError: bad config, or every unknown / missing / mis-shaped checkpoint key.
    """
    tensors = load_lightning_state_dict(checkpoint_path)
    config = read_config_yaml(config_path, infer_num_classes(tensors))
    if config.feature_extractor.startswith("densenet"):
        tensors = canonical_densenet_keys(tensors)
    model = fill_module(abstract(lambda rngs: PixPNet(config, rngs=rngs)), tensors,
                        pixpnet_table(config), f"pixpnet ({config.feature_extractor})")
    return model, config
