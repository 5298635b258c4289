"""PyTorch -> Flax NNX converters for pretrained classifiers (the only package importing torch).

``convert(kind, checkpoint_path, out_dir, ...)`` maps a checkpoint through one strict key table
(see ``common``), writes the params as an orbax checkpoint and a ``manifest.json`` (kind,
architecture config, sha256 of every source file and of the written params).
``load_converted(out_dir)`` restores it, re-checks the params hash and returns the model as a
pure function ``apply_fn(params, x[B, H, W, 3]) -> logits[B, C]``.

Inputs are NHWC float32 images already preprocessed the way the source model expects (e.g.
ImageNet mean/std normalisation for torchvision weights); the converters do not add it.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from cbcert.convert import common
from cbcert.convert.common import pure_apply
from cbcert.convert.torchvision import DENSENET_NAMES, RESNET_NAMES
from cbcert.generators.cbae import CBAE, CBAEConfig
from cbcert.models.densenet import DenseNet, DenseNetConfig
from cbcert.models.pcbm import PCBM, PCBMConfig
from cbcert.models.pixpnet import PixPNet, PixPNetConfig
from cbcert.models.resnet import ResNet, ResNetConfig

KINDS = (*RESNET_NAMES, *DENSENET_NAMES, "pcbm", "pixpnet")
# kind -> (config class, module class); the manifest's "config" rebuilds the module.
_ARCHITECTURES: dict[str, tuple[type, type[nnx.Module]]] = {
    **{name: (ResNetConfig, ResNet) for name in RESNET_NAMES},
    **{name: (DenseNetConfig, DenseNet) for name in DENSENET_NAMES},
    "pcbm": (PCBMConfig, PCBM),
    "pixpnet": (PixPNetConfig, PixPNet),
    "cbae": (CBAEConfig, CBAE),  # written by `certify train cbae` (cbcert.train_cbae), not here
}


def _source(path: str | pathlib.Path) -> dict[str, str]:
    path = pathlib.Path(path)
    return {"file": path.name, "sha256": common.sha256_file(path)}


def _require(value: Any, name: str, kind: str) -> Any:
    if value is None:
        raise ValueError(f"{name}=None; kind={kind!r} needs it")
    return value


def convert(kind: str, checkpoint_path: str | pathlib.Path, out_dir: str | pathlib.Path, *,
            backbone: str | None = None, backbone_path: str | pathlib.Path | None = None,
            concept_bank_path: str | pathlib.Path | None = None,
            config_path: str | pathlib.Path | None = None) -> dict:
    """Convert a PyTorch checkpoint into ``out_dir`` (orbax params + ``manifest.json``).

    Args:
      kind: one of ``KINDS``: a torchvision name (``resnet18``, ``resnet50``, ``densenet161``,
        ...; ``checkpoint_path`` is its state_dict), ``"pcbm"`` (``checkpoint_path`` is the
        post-hoc-cbm ``.ckpt``; needs ``backbone`` -- a torchvision name or pytorchcv's
        ``resnet18_cub`` -- and ``backbone_path``, its state_dict; optionally
        ``concept_bank_path``) or ``"pixpnet"`` (``checkpoint_path`` is the Lightning
        checkpoint; needs ``config_path``, its ``config.yaml``).
      out_dir: new or empty directory.

    Returns:
      The manifest written (also ``out_dir/manifest.json``).

    Raises:
      ValueError: bad arguments, or a checkpoint that does not match the architecture (every
        unknown, missing and mis-shaped key is listed by name).
    """
    sources = {"checkpoint": _source(checkpoint_path)}
    extra: dict[str, Any] = {}
    if kind in RESNET_NAMES or kind in DENSENET_NAMES:
        from cbcert.convert import torchvision

        module = torchvision.backbone_from_state_dict(
            kind, common.load_torch_state_dict(checkpoint_path))
    elif kind == "pcbm":
        from cbcert.convert import pcbm

        backbone_tensors = common.load_torch_state_dict(
            _require(backbone_path, "backbone_path", kind))
        module, checkpoint = pcbm.pcbm_from_checkpoints(
            checkpoint_path, _require(backbone, "backbone", kind), backbone_tensors,
            concept_bank_path)
        sources["backbone"] = _source(backbone_path)
        if concept_bank_path is not None:
            sources["concept_bank"] = _source(concept_bank_path)
        extra["concept_names"] = list(checkpoint.concept_names)
        extra["upstream_backbone_name"] = checkpoint.backbone_name
    elif kind == "pixpnet":
        from cbcert.convert import pixpnet

        module, _ = pixpnet.pixpnet_from_checkpoint(
            checkpoint_path, _require(config_path, "config_path", kind))
        sources["config"] = _source(config_path)
    else:
        raise ValueError(f"kind={kind!r}; allowed: {KINDS}")
    manifest = {"kind": kind, "config": dataclasses.asdict(module.config), "sources": sources,
                **extra}
    return common.write_converted(out_dir, module, manifest)


def _as_tuples(value: Any) -> Any:
    """JSON turns config tuples into lists; frozen configs want them back as tuples."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def _abstract_from_manifest(manifest: dict) -> nnx.Module:
    kind = manifest.get("kind")
    if kind not in _ARCHITECTURES:
        raise ValueError(f"manifest kind={kind!r}; allowed: {KINDS}")
    config_class, module_class = _ARCHITECTURES[kind]
    fields = {f.name for f in dataclasses.fields(config_class)}
    config = manifest.get("config", {})
    if set(config) != fields:
        raise ValueError(f"manifest config keys {sorted(config)} do not match "
                         f"{config_class.__name__} fields {sorted(fields)}")
    config = config_class(**{k: _as_tuples(v) for k, v in config.items()})
    return common.abstract(lambda rngs: module_class(config, rngs=rngs))


def load_converted_module(out_dir: str | pathlib.Path) -> tuple[nnx.Module, dict]:
    """The converted NNX module (with ``embed``/``features``/... methods) and its manifest."""
    return common.read_converted(out_dir, _abstract_from_manifest)


def load_converted(out_dir: str | pathlib.Path) -> tuple[
        Callable[[nnx.State, jax.Array], jax.Array], nnx.State, dict]:
    """``(apply_fn, params, manifest)`` of a model written by ``convert``.

    ``apply_fn(params, x[B, H, W, 3]) -> logits[B, C]`` is pure; wrap it in ``jax.jit``.

    Raises:
      ValueError: missing files, unknown kind or config, or params whose sha256 differs from
        the manifest.
    """
    module, manifest = load_converted_module(out_dir)
    apply_fn, params = pure_apply(module)
    return apply_fn, params, manifest


__all__ = ["KINDS", "convert", "load_converted", "load_converted_module", "pure_apply"]
