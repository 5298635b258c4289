"""pytorch-pretrained-biggan checkpoints (``pytorch_model.bin`` + ``config.json``) -> ``BigGAN``.

Every spectrally normalised layer is stored as ``weight_orig`` plus the power-iteration vectors
``weight_u``, ``weight_v``; in ``eval()`` PyTorch uses ``W = W_orig / σ`` with
``σ = uᵀ W_mat v`` (``W_mat`` = ``W_orig`` flattened to ``[out, −1]``, no further iteration).
``fold_spectral_norm`` computes that once, then one strict key table maps the result (any
unknown, missing or mis-shaped key is an error naming it).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from cbcert.convert.common import (
    Entry,
    Table,
    conv_entries,
    fill_module,
    linear_entries,
    load_torch_state_dict,
)
from cbcert.generators.biggan import BigGAN, BigGANConfig
from cbcert.io.registry import abstract

_CONFIG_KEYS = {"output_dim", "z_dim", "class_embed_dim", "channel_width", "num_classes",
                "layers", "attention_layer_position", "eps", "n_stats"}


def fold_spectral_norm(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Replace each ``K.weight_orig`` / ``K.weight_u`` / ``K.weight_v`` triple by ``K.weight``.

    Raises:
      ValueError: a triple with a missing member (named) or vectors of the wrong length.
    """
    out = dict(tensors)
    for key in [k for k in tensors if k.endswith(".weight_orig")]:
        base = key[: -len("_orig")]
        missing = [f"{base}_{s}" for s in ("u", "v") if f"{base}_{s}" not in tensors]
        if missing:
            raise ValueError(f"spectral norm of {key}: missing keys {missing}")
        weight = np.asarray(tensors[key], np.float64)
        u = np.asarray(out.pop(f"{base}_u"), np.float64)
        v = np.asarray(out.pop(f"{base}_v"), np.float64)
        matrix = weight.reshape(weight.shape[0], -1)
        if u.shape != (matrix.shape[0],) or v.shape != (matrix.shape[1],):
            raise ValueError(f"spectral norm of {key}: u {u.shape} / v {v.shape} do not fit "
                             f"the weight matrix {matrix.shape}")
        del out[key]
        out[base] = (weight / (u @ matrix @ v)).astype(np.asarray(tensors[key]).dtype)
    return out


def _cbn_entries(table: Table, key: str, path: tuple) -> None:
    table[f"{key}.running_means"] = Entry((*path, "running_means"))
    table[f"{key}.running_vars"] = Entry((*path, "running_vars"))
    linear_entries(table, f"{key}.scale", (*path, "scale"), bias=False)
    linear_entries(table, f"{key}.offset", (*path, "offset"), bias=False)


def biggan_table(config: BigGANConfig) -> Table:
    """Upstream key (after ``fold_spectral_norm``) -> NNX path of ``BigGAN``."""
    table: Table = {}
    linear_entries(table, "embeddings", ("embeddings",), bias=False)
    linear_entries(table, "generator.gen_z", ("gen_z",))
    index = 0
    for i in range(len(config.layers)):
        if i == config.attention_layer_position:
            key, path = f"generator.layers.{index}", ("layers", index)
            for name in ("theta", "phi", "g", "o_conv"):
                conv_entries(table, f"{key}.snconv1x1_{name}", (*path, f"snconv1x1_{name}"))
            table[f"{key}.gamma"] = Entry((*path, "gamma"))
            index += 1
        key, path = f"generator.layers.{index}", ("layers", index)
        for j in range(4):
            _cbn_entries(table, f"{key}.bn_{j}", (*path, f"bn_{j}"))
            conv_entries(table, f"{key}.conv_{j}", (*path, f"conv_{j}"), bias=True)
        index += 1
    for name in ("running_means", "running_vars", "weight", "bias"):
        table[f"generator.bn.{name}"] = Entry(("bn", name))
    conv_entries(table, "generator.conv_to_rgb", ("conv_to_rgb",), bias=True)
    return table


def biggan_from_state_dict(config: BigGANConfig, tensors: Mapping[str, np.ndarray]) -> BigGAN:
    """``BigGAN`` from an upstream ``state_dict`` (spectral norm folded, strict key table)."""
    model = abstract(lambda rngs: BigGAN(config, rngs=rngs))
    return fill_module(model, fold_spectral_norm(tensors), biggan_table(config), "biggan")


def config_from_dict(fields: Mapping[str, Any]) -> BigGANConfig:
    """``BigGANConfig`` from upstream ``config.json`` fields (unknown fields are errors)."""
    unknown = sorted(set(fields) - _CONFIG_KEYS)
    if unknown:
        raise ValueError(f"BigGAN config: unknown fields {unknown}; allowed: "
                         f"{sorted(_CONFIG_KEYS)}")
    if "class_embed_dim" in fields and fields["class_embed_dim"] != fields.get("z_dim"):
        raise ValueError(f"class_embed_dim={fields['class_embed_dim']}; the generator's "
                         f"condition is 2 z_dim wide, so it must equal z_dim={fields.get('z_dim')}")
    kwargs = {k: v for k, v in fields.items() if k != "class_embed_dim"}
    if "layers" in kwargs:
        kwargs["layers"] = tuple((bool(up), int(cin), int(cout))
                                 for up, cin, cout in kwargs["layers"])
    try:
        return BigGANConfig(**kwargs)
    except TypeError as err:
        raise ValueError(f"BigGAN config: {err}") from None


def load_biggan(weights_path: str | pathlib.Path, config_path: str | pathlib.Path) -> BigGAN:
    """Read an upstream ``pytorch_model.bin`` with its ``config.json``."""
    config_path = pathlib.Path(config_path)
    if not config_path.is_file():
        raise ValueError(f"config_path={str(config_path)!r}; no such file")
    config = config_from_dict(json.loads(config_path.read_text()))
    return biggan_from_state_dict(config, load_torch_state_dict(weights_path))
