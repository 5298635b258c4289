"""post-hoc-cbm (mertyg/post-hoc-cbm) checkpoints -> ``cbcert.models.pcbm.PCBM``.

Inputs, as the reference writes them:

* the concept bank pickle (``learn_concepts_*.py``): ``{concept name: (svm.coef_ [1, D],
  train_acc, test_acc, svm.intercept_ [1], margin_info)}``, float64 numpy;
* the PCBM ``.ckpt`` (``train_pcbm.py``): ``torch.save`` of the whole ``PosthocLinearCBM`` module
  (CAVs, intercepts, norms as float32 tensors, ``classifier`` = Linear whose weights were set
  from scikit-learn, so float64 and ``[1, K]`` for a binary task), or of a ``PosthocHybridCBM``
  (``train_pcbm_h.py``: ``bottleneck`` + ``residual_classifier``);
* the backbone as a torchvision state_dict, or as the pytorchcv state_dict of post-hoc-cbm's
  CUB backbone (``resnet18_cub``, ``models/model_zoo.py``; its embedding is the flattened output
  of ``features``, i.e. up to the fixed ``AvgPool2d(7)``, without ``output``).

The module pickle is read by ``pickles.load_torch_zip`` with stand-ins for the three classes it
contains; nothing from the upstream repository is imported and nothing in the file runs.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from cbcert.convert import pickles, pytorchcv
from cbcert.convert.common import Entry, Table, fill_module, linear_entries, nested
from cbcert.convert.torchvision import (
    DENSENET_PRESETS,
    RESNET_PRESETS,
    canonical_densenet_keys,
    densenet_table,
    resnet_table,
)
from cbcert.io.registry import abstract
from cbcert.models.pcbm import BACKBONES, PCBM, PYTORCHCV_BACKBONES, PCBMConfig
from cbcert.models.resnet import ResNetConfig

PCBM_CLASSES = ("models.pcbm_utils.PosthocLinearCBM", "models.pcbm_utils.PosthocHybridCBM",
                "torch.nn.modules.linear.Linear")


@dataclasses.dataclass(frozen=True)
class ConceptBank:
    """A concept bank as the reference's ``ConceptBank`` builds it.

    Attributes:
      names: K concept names, in the pickle's order.
      vectors: ``[K, D]`` float32 CAVs (float64 coefficients cast to float32).
      intercepts: ``[K]`` float32.
      norms: ``[K]`` float32 ``||vectors_k||_2``, computed from the float32 vectors.
    """

    names: tuple[str, ...]
    vectors: np.ndarray
    intercepts: np.ndarray
    norms: np.ndarray


def load_concept_bank(path: str | pathlib.Path) -> ConceptBank:
    """Read a post-hoc-cbm concept bank pickle (restricted unpickler, no code runs).

    Raises:
      ValueError: not a dict of 5-tuples, CAVs of different widths, or an intercept that is
        not a single number (each message names the concept).
    """
    bank = pickles.load_pickle(path)
    if not isinstance(bank, Mapping) or not bank:
        raise ValueError(f"concept_bank_path={str(path)!r}: expected a non-empty dict "
                         f"{{concept: (cav, train_acc, test_acc, intercept, margins)}}")
    vectors, intercepts = [], []
    for name, entry in bank.items():
        if not isinstance(entry, tuple) or len(entry) != 5:
            raise ValueError(f"concept_bank_path={str(path)!r}: concept {name!r} is not a "
                             "(cav, train_acc, test_acc, intercept, margin_info) tuple")
        cav, intercept = np.asarray(entry[0]), np.asarray(entry[3])
        if cav.ndim not in (1, 2) or (cav.ndim == 2 and cav.shape[0] != 1) or intercept.size != 1:
            raise ValueError(f"concept_bank_path={str(path)!r}: concept {name!r} has CAV shape "
                             f"{cav.shape} and intercept shape {intercept.shape}; expected "
                             "[1, D] (or [D]) and one number")
        vectors.append(cav.reshape(1, -1))
        intercepts.append(intercept.reshape(1))
    widths = {v.shape[1] for v in vectors}
    if len(widths) != 1:
        raise ValueError(f"concept_bank_path={str(path)!r}: CAVs have different widths {widths}")
    vectors32 = np.concatenate(vectors).astype(np.float32)
    return ConceptBank(names=tuple(str(n) for n in bank),
                       vectors=vectors32,
                       intercepts=np.concatenate(intercepts).astype(np.float32),
                       norms=np.linalg.norm(vectors32, axis=1))


def _module_tensors(obj: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Every array a pickled ``nn.Module`` holds: parameters, buffers, array attributes and those
    of its children (keys are attribute paths)."""
    out: dict[str, np.ndarray] = {}
    for attr, value in obj.state.items():
        if attr in ("_parameters", "_buffers"):
            for key, tensor in value.items():
                if tensor is not None and not isinstance(tensor, np.ndarray):
                    raise TypeError(f"{prefix}{key} is a {type(tensor).__name__}, not a tensor")
            out.update({prefix + k: v for k, v in value.items() if v is not None})
        elif attr == "_modules":
            for child, module in value.items():
                out.update(_module_tensors(module, f"{prefix}{child}."))
        elif isinstance(value, np.ndarray):
            out[prefix + attr] = value
    return out


@dataclasses.dataclass(frozen=True)
class PCBMCheckpoint:
    """What a post-hoc-cbm ``.ckpt`` holds: its tensors (by attribute path) and metadata."""

    tensors: dict[str, np.ndarray]
    concept_names: tuple[str, ...]
    hybrid: bool
    backbone_name: str


def load_pcbm_checkpoint(path: str | pathlib.Path) -> PCBMCheckpoint:
    """Read a ``torch.save``-d ``PosthocLinearCBM`` / ``PosthocHybridCBM`` without torch.

    Tensor keys follow the module's attributes: ``cavs``, ``intercepts``, ``norms``,
    ``classifier.weight``, ``classifier.bias``; a hybrid prefixes them with ``bottleneck.`` and adds
    ``residual_classifier.weight`` / ``.bias``.
    """
    obj = pickles.load_torch_zip(path, PCBM_CLASSES)
    kind = getattr(obj, "pickled_class", None)
    if kind not in PCBM_CLASSES[:2]:
        raise ValueError(f"checkpoint_path={str(path)!r}: holds {kind or type(obj).__name__}, "
                         f"expected one of {PCBM_CLASSES[:2]}")
    hybrid = kind.endswith("PosthocHybridCBM")
    try:
        bottleneck = obj.state["_modules"]["bottleneck"] if hybrid else obj
        return PCBMCheckpoint(
            tensors=_module_tensors(obj),
            concept_names=tuple(str(n) for n in bottleneck.state.get("names", ())),
            hybrid=hybrid,
            backbone_name=str(bottleneck.state.get("backbone_name", "")))
    except (KeyError, AttributeError, TypeError) as err:
        # A crafted or damaged file: the pickled module lacks the structure of a PCBM.
        raise ValueError(f"checkpoint_path={str(path)!r}: not a post-hoc-cbm {kind} "
                         f"({type(err).__name__}: {err})") from None


def pcbm_table(config: PCBMConfig) -> Table:
    """Keys: ``backbone.<torchvision or pytorchcv key>`` plus the PCBM module's attribute paths."""
    backbone_config = config.backbone_config()
    if config.backbone in PYTORCHCV_BACKBONES:
        backbone = pytorchcv.resnet_table(backbone_config)
    elif isinstance(backbone_config, ResNetConfig):
        backbone = resnet_table(backbone_config)
    else:
        backbone = densenet_table(backbone_config)
    table = nested(backbone, "backbone.", ("backbone",))
    head = "bottleneck." if config.residual_outputs else ""
    table[f"{head}cavs"] = Entry(("cavs",))
    table[f"{head}intercepts"] = Entry(("intercepts",), "column")
    table[f"{head}norms"] = Entry(("norms",), "column")
    linear_entries(table, f"{head}classifier", ("head",))
    if config.residual_outputs:
        linear_entries(table, "residual_classifier", ("residual",))
    return table


def _check_bank(bank: ConceptBank, checkpoint: PCBMCheckpoint, path: str) -> None:
    """The ckpt embeds the bank it was trained with; a different bank is a user error."""
    key = "bottleneck.cavs" if checkpoint.hybrid else "cavs"
    if checkpoint.concept_names and bank.names != checkpoint.concept_names:
        raise ValueError(f"concept_bank_path={path!r}: concept names differ from the "
                         f"checkpoint's ({len(bank.names)} vs {len(checkpoint.concept_names)} "
                         "concepts, or a different order)")
    cavs = checkpoint.tensors.get(key)
    if cavs is None or cavs.shape != bank.vectors.shape or not np.array_equal(cavs, bank.vectors):
        raise ValueError(f"concept_bank_path={path!r}: CAVs differ from the ones stored in the "
                         "PCBM checkpoint; pass the bank the PCBM was trained with")


_PYTORCHCV_STEM = "features.init_block.conv.conv.weight"


def _check_backbone_family(backbone: str, tensors: Mapping[str, np.ndarray]) -> None:
    """A pytorchcv state_dict under a torchvision name (or the reverse) would fail key by key;
    name the fix instead."""
    if backbone not in BACKBONES:
        raise ValueError(f"backbone={backbone!r}; allowed: {BACKBONES}")
    pytorchcv_keys = _PYTORCHCV_STEM in tensors
    if pytorchcv_keys and backbone not in PYTORCHCV_BACKBONES:
        raise ValueError(f"backbone={backbone!r} is a torchvision name, but the backbone "
                         f"state_dict has pytorchcv keys ({_PYTORCHCV_STEM}); pass one of "
                         f"{sorted(PYTORCHCV_BACKBONES)}")
    if backbone in PYTORCHCV_BACKBONES and not pytorchcv_keys and "conv1.weight" in tensors:
        raise ValueError(f"backbone={backbone!r} is a pytorchcv name, but the backbone "
                         "state_dict has torchvision keys (conv1.weight); pass "
                         f"backbone={PYTORCHCV_BACKBONES[backbone]!r}")


def pcbm_from_checkpoints(checkpoint_path: str | pathlib.Path, backbone: str,
                          backbone_tensors: Mapping[str, np.ndarray],
                          concept_bank_path: str | pathlib.Path | None = None,
                          ) -> tuple[PCBM, PCBMCheckpoint]:
    """``PCBM`` filled from a post-hoc-cbm ``.ckpt`` and a backbone state_dict.

    Args:
      checkpoint_path: the PCBM or PCBM-h ``.ckpt``.
      backbone: name of the backbone: torchvision (``resnet18`` ... ``densenet201``) or pytorchcv
        (``resnet18_cub``, the backbone post-hoc-cbm uses for CUB).
      backbone_tensors: the backbone's state_dict as numpy arrays.
      concept_bank_path: optional concept bank pickle; if given it must equal the CAVs stored
        in the checkpoint (same names, same float32 vectors).

    Raises:
      ValueError: every unknown / missing / mis-shaped key (backbone keys prefixed
        ``backbone.``), e.g. CAVs whose width differs from the backbone embedding; a pytorchcv
        state_dict under a torchvision name or the reverse.
    """
    checkpoint = load_pcbm_checkpoint(checkpoint_path)
    if concept_bank_path is not None:
        _check_bank(load_concept_bank(concept_bank_path), checkpoint, str(concept_bank_path))
    _check_backbone_family(backbone, backbone_tensors)
    head = "bottleneck." if checkpoint.hybrid else ""
    if backbone in DENSENET_PRESETS:
        backbone_tensors = canonical_densenet_keys(backbone_tensors)
    tensors = {**{f"backbone.{k}": v for k, v in backbone_tensors.items()}, **checkpoint.tensors}
    classifier = ("output.weight" if backbone in PYTORCHCV_BACKBONES
                  else "fc.weight" if backbone in RESNET_PRESETS else "classifier.weight")
    for key in (f"{head}cavs", f"{head}classifier.weight", f"backbone.{classifier}"):
        if key not in tensors or np.ndim(tensors[key]) != 2:
            raise ValueError(f"pcbm: missing 2-D {key!r}; cannot infer the architecture")
    residual = tensors.get("residual_classifier.weight")
    config = PCBMConfig(backbone=backbone,
                        backbone_classes=int(tensors[f"backbone.{classifier}"].shape[0]),
                        num_concepts=int(tensors[f"{head}cavs"].shape[0]),
                        head_outputs=int(tensors[f"{head}classifier.weight"].shape[0]),
                        residual_outputs=0 if residual is None else int(residual.shape[0]))
    model = fill_module(abstract(lambda rngs: PCBM(config, rngs=rngs)), tensors,
                        pcbm_table(config), "pcbm")
    return model, checkpoint

