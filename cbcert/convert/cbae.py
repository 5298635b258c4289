"""CB-AE state_dicts (posthoc-generative-cbm ``CB_AE``) -> ``cbcert.generators.cbae.CBAE``.

Upstream saves ``model.cbae.state_dict()``: two ``nn.Sequential``s whose indices are
``encoder.{0,3,6,9}`` / ``decoder.{0,3,6,9}`` (Linear) and ``encoder.{2,5,8}`` /
``decoder.{2,5,8}`` (BatchNorm1d); the LeakyReLUs at 1, 4, 7 hold no weights. The table below is
the whole mapping; any other key, a missing key or a wrong shape is an error naming the key.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from cbcert.convert.common import (
    Table,
    abstract,
    batch_norm_entries,
    fill_module,
    linear_entries,
    load_torch_state_dict,
)
from cbcert.generators.cbae import CBAE, NUM_HIDDEN, CBAEConfig


def cbae_table() -> Table:
    """Upstream key -> NNX path for ``CBAE`` (the same for every size)."""
    table: Table = {}
    for side in ("encoder", "decoder"):
        for i in range(NUM_HIDDEN):
            linear_entries(table, f"{side}.{3 * i}", (side, i, "linear"))
            batch_norm_entries(table, f"{side}.{3 * i + 2}", (side, i, "norm"))
        linear_entries(table, f"{side}.{3 * NUM_HIDDEN}", (f"{side}_out",))
    return table


def abstract_cbae(config: CBAEConfig) -> CBAE:
    """Shape-only ``CBAE`` (see ``common.abstract``)."""
    return abstract(lambda rngs: CBAE(config, rngs=rngs))


def cbae_from_state_dict(config: CBAEConfig, tensors: Mapping[str, np.ndarray]) -> CBAE:
    """``CBAE`` filled from an upstream ``CB_AE.state_dict()`` (strict; see module docstring).

    Raises:
      ValueError: naming every unknown, missing or mis-shaped key (a wrong ``latent_dim`` or
        concept count shows up as mis-shaped ``encoder.9`` / ``decoder.0`` weights).
    """
    return fill_module(abstract_cbae(config), tensors, cbae_table(), "cbae")


def config_from_upstream(model_section: Mapping[str, Any]) -> CBAEConfig:
    """``CBAEConfig`` from the ``model`` section of an upstream YAML config.

    Reads ``latent_noise_dim``, ``num_ws`` and ``concepts.{concept_bins, concept_names, types}``.
    """
    try:
        concepts = model_section["concepts"]
        return CBAEConfig.from_upstream(
            latent_dim=int(model_section["latent_noise_dim"]),
            num_ws=int(model_section["num_ws"]),
            concept_bins=[int(b) for b in concepts["concept_bins"]],
            concept_names=[str(n) for n in concepts["concept_names"]],
            types=[str(t) for t in concepts["types"]])
    except KeyError as err:
        raise ValueError(f"upstream model config lacks the key {err.args[0]!r} (needs "
                         "latent_noise_dim, num_ws and concepts.concept_bins/concept_names/"
                         "types)") from None


def load_cbae(checkpoint_path: str | pathlib.Path, config_path: str | pathlib.Path) -> CBAE:
    """Read an upstream CB-AE: ``.pt`` state_dict plus the YAML config it was trained with."""
    import yaml

    config_path = pathlib.Path(config_path)
    if not config_path.is_file():
        raise ValueError(f"config_path={str(config_path)!r}; no such file")
    document = yaml.safe_load(config_path.read_text())
    if not isinstance(document, Mapping) or not isinstance(document.get("model"), Mapping):
        raise ValueError(f"config_path={str(config_path)!r}: no 'model' section")
    return cbae_from_state_dict(config_from_upstream(document["model"]),
                                load_torch_state_dict(checkpoint_path))
