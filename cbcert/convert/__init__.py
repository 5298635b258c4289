"""Upstream checkpoints -> cbcert checkpoints: the write side, and the only package importing torch.

``read_module(kind, checkpoint_path, ...)`` reads an upstream checkpoint into its Flax NNX
module through one strict key table (see ``common``); ``convert(kind, checkpoint_path,
out_dir, ...)`` does that and writes the module in cbcert's one checkpoint format
(``cbcert.io.checkpoint``: orbax ``params/`` + ``manifest.json`` with the kind, the
architecture config, the sha256 of every source file, the params sha256 and the file hashes).
Loading is ``cbcert.io.registry.load_module`` / ``load_converted``, which need neither torch nor
this package.

Kinds: classifiers (torchvision ``resnet*`` / ``densenet*`` state_dicts, post-hoc-cbm ``pcbm``,
``pixpnet``) and generators (``stylegan2``: an NVlabs network pickle, read without torch;
``biggan``: pytorch-pretrained-biggan ``pytorch_model.bin`` + ``config.json``; ``cbae``: a
posthoc-generative-cbm CB-AE ``.pt`` + its YAML config). Classifier inputs are NHWC float32
images already preprocessed the way the source model expects (e.g. ImageNet mean/std for
torchvision weights); the converters do not add it.
"""

from __future__ import annotations

import pathlib
from typing import Any

from flax import nnx

from cbcert.io.checkpoint import sha256_file
from cbcert.io.registry import DENSENET_NAMES, RESNET_NAMES, save_module
from cbcert.schema import ConfigError

CLASSIFIER_KINDS = (*RESNET_NAMES, *DENSENET_NAMES, "pcbm", "pixpnet")
GENERATOR_KINDS = ("stylegan2", "biggan", "cbae")
KINDS = (*CLASSIFIER_KINDS, *GENERATOR_KINDS)
DEFAULT_NETWORK = "G_ema"


def _source(path: str | pathlib.Path) -> dict[str, str]:
    path = pathlib.Path(path)
    return {"file": path.name, "sha256": sha256_file(path)}


# The arguments each kind cannot do without (checked before any file is read).
_NEEDS = {"pcbm": ("backbone", "backbone_path"), "pixpnet": ("config_path",),
          "biggan": ("config_path",), "cbae": ("config_path",)}


def _require(kind: str, **given: Any) -> None:
    """Raise `ConfigError` (key: the argument) for the first argument ``kind`` needs that is
    None, so a front end can name its own option for it."""
    for name in _NEEDS.get(kind, ()):
        if given[name] is None:
            detail = f"not given; kind {kind!r} needs it"
            raise ConfigError(f"{name}=None; kind={kind!r} needs it", key=name, value=None,
                              detail=detail)


def read_module(kind: str, checkpoint_path: str | pathlib.Path, *,
                backbone: str | None = None,
                backbone_path: str | pathlib.Path | None = None,
                concept_bank_path: str | pathlib.Path | None = None,
                config_path: str | pathlib.Path | None = None,
                network: str | None = None,
                network_setting: str = "network") -> tuple[nnx.Module, dict[str, Any]]:
    """The Flax module of an upstream checkpoint (in memory) and its extra manifest fields.

    Args:
      kind: one of ``KINDS``; the arguments each needs are those of ``convert``.
      network_setting: how the caller's user spells ``network`` (``--network``,
        ``world.json: generator.network``), for error messages.

    Returns:
      ``(module, extra)``: ``extra`` holds kind-specific manifest fields (pcbm:
      ``concept_names``, ``upstream_backbone_name``; stylegan2: ``network``).

    Raises:
      ValueError: bad arguments (a missing one as `cbcert.schema.ConfigError` with its name as
        ``key``), or a checkpoint that does not match the architecture (every unknown, missing
        and mis-shaped key is listed by name).
      ImportError: torch is not installed and the kind's files need it (all but stylegan2).
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; allowed: {KINDS}")
    if network is not None and kind != "stylegan2":
        raise ValueError(f"{network_setting}={network!r}; only kind='stylegan2' takes it")
    _require(kind, backbone=backbone, backbone_path=backbone_path, config_path=config_path)
    if kind in RESNET_NAMES or kind in DENSENET_NAMES:
        from cbcert.convert import common, torchvision

        return torchvision.backbone_from_state_dict(
            kind, common.load_torch_state_dict(checkpoint_path)), {}
    if kind == "pcbm":
        from cbcert.convert import common, pcbm

        backbone_tensors = common.load_torch_state_dict(backbone_path)
        module, checkpoint = pcbm.pcbm_from_checkpoints(
            checkpoint_path, backbone, backbone_tensors, concept_bank_path)
        return module, {"concept_names": list(checkpoint.concept_names),
                        "upstream_backbone_name": checkpoint.backbone_name}
    if kind == "pixpnet":
        from cbcert.convert import pixpnet

        module, _ = pixpnet.pixpnet_from_checkpoint(checkpoint_path, config_path)
        return module, {}
    if kind == "stylegan2":
        from cbcert.convert import stylegan2

        network = DEFAULT_NETWORK if network is None else network
        return stylegan2.load_stylegan2(checkpoint_path, network, network_setting), {
            "network": network}
    if kind == "biggan":
        from cbcert.convert import biggan

        return biggan.load_biggan(checkpoint_path, config_path), {}
    from cbcert.convert import cbae

    return cbae.load_cbae(checkpoint_path, config_path), {}


def convert(kind: str, checkpoint_path: str | pathlib.Path, out_dir: str | pathlib.Path, *,
            backbone: str | None = None, backbone_path: str | pathlib.Path | None = None,
            concept_bank_path: str | pathlib.Path | None = None,
            config_path: str | pathlib.Path | None = None,
            network: str | None = None) -> dict:
    """Convert an upstream checkpoint into ``out_dir`` (orbax params + ``manifest.json``).

    Args:
      kind: one of ``KINDS``: a torchvision name (``resnet18``, ``resnet50``, ``densenet161``,
        ...; ``checkpoint_path`` is its state_dict), ``"pcbm"`` (``checkpoint_path`` is the
        post-hoc-cbm ``.ckpt``; needs ``backbone`` -- a torchvision name or pytorchcv's
        ``resnet18_cub`` -- and ``backbone_path``, its state_dict; optionally
        ``concept_bank_path``), ``"pixpnet"`` (``checkpoint_path`` is the Lightning
        checkpoint; needs ``config_path``, its ``config.yaml``), ``"stylegan2"``
        (``checkpoint_path`` is a stylegan2-ada-pytorch ``network-snapshot-*.pkl``;
        ``network`` names the generator in it, default ``G_ema``), ``"biggan"``
        (``pytorch_model.bin``; needs ``config_path``, its ``config.json``) or ``"cbae"``
        (a CB-AE ``.pt`` state_dict; needs ``config_path``, the YAML it was trained with).
      out_dir: new or empty directory.

    Returns:
      The manifest written (also ``out_dir/manifest.json``): ``sources`` maps each input role
      (``checkpoint``, ``backbone``, ``concept_bank``, ``config``) to ``{"file", "sha256"}``.

    Raises:
      ValueError: bad arguments, a checkpoint that does not match the architecture (every
        unknown, missing and mis-shaped key is listed by name), or an ``out_dir`` that already
        holds a checkpoint (``cbcert.io.checkpoint.CheckpointError``).
      ImportError: torch is not installed and the kind's files need it.
    """
    module, extra = read_module(kind, checkpoint_path, backbone=backbone,
                                backbone_path=backbone_path, concept_bank_path=concept_bank_path,
                                config_path=config_path, network=network)
    sources = {"checkpoint": _source(checkpoint_path)}
    if kind == "pcbm":
        sources["backbone"] = _source(backbone_path)
        if concept_bank_path is not None:
            sources["concept_bank"] = _source(concept_bank_path)
    if kind in ("pixpnet", "biggan", "cbae"):
        sources["config"] = _source(config_path)
    return save_module(out_dir, kind, module, {"sources": sources, **extra})


__all__ = ["CLASSIFIER_KINDS", "GENERATOR_KINDS", "KINDS", "convert", "read_module"]
