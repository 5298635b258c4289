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
    batch_norm_entries,
    fill_module,
    linear_entries,
    load_torch_state_dict,
)
from cbcert.generators.cbae import CBAE, NUM_HIDDEN, CBAEConfig
from cbcert.io.registry import abstract


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
    """Shape-only ``CBAE`` (see ``cbcert.io.registry.abstract``)."""
    return abstract(lambda rngs: CBAE(config, rngs=rngs))


def cbae_from_state_dict(config: CBAEConfig, tensors: Mapping[str, np.ndarray]) -> CBAE:
    """``CBAE`` filled from an upstream ``CB_AE.state_dict()`` (strict; see module docstring).

    Raises:
      ValueError: naming every unknown, missing or mis-shaped key (a wrong ``latent_dim`` or
        concept count shows up as mis-shaped ``encoder.9`` / ``decoder.0`` weights).
    """
    return fill_module(abstract_cbae(config), tensors, cbae_table(), "cbae")


def _list(key: str, value: Any, items: tuple[type, ...]) -> list:
    ok = isinstance(value, list) and all(isinstance(v, items) and not isinstance(v, bool)
                                         for v in value)
    if not ok:
        kinds = " or ".join(t.__name__ for t in items)
        raise ValueError(f"model.concepts.{key}={value!r}; expected a list of {kinds}")
    return value


def config_from_upstream(model_section: Mapping[str, Any]) -> CBAEConfig:
    """``CBAEConfig`` from the ``model`` section of an upstream YAML config.

    Reads ``latent_noise_dim``, ``num_ws`` and ``concepts.{concept_bins, concept_names, types}``
    and pairs them as upstream does (``CBAEConfig.from_upstream``: the first K bins are the
    named concepts, the rest the unsupervised part). Upstream sizes the bottleneck by
    ``concepts.concept_output`` and slices it by ``concept_bins``; every upstream config has
    the two equal, and a config where they differ is refused.

    Raises:
      ValueError: a missing key, a value of the wrong kind, ``concept_output`` differing from
        ``concept_bins``, or a pairing ``from_upstream`` refuses (each message names the key).
    """
    needed = "needs latent_noise_dim, num_ws and concepts.concept_bins/concept_names/types"
    for key in ("latent_noise_dim", "num_ws", "concepts"):
        if key not in model_section:
            raise ValueError(f"missing key model.{key} ({needed})")
    concepts = model_section["concepts"]
    if not isinstance(concepts, Mapping):
        raise ValueError(f"model.concepts={concepts!r}; expected a mapping ({needed})")
    for key in ("concept_bins", "concept_names", "types"):
        if key not in concepts:
            raise ValueError(f"missing key model.concepts.{key} ({needed})")
    for key in ("latent_noise_dim", "num_ws"):
        value = model_section[key]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"model.{key}={value!r}; expected an integer")
    bins = _list("concept_bins", concepts["concept_bins"], (int,))
    output = concepts.get("concept_output", bins)
    if output != bins:
        raise ValueError(f"model.concepts.concept_output={output!r} differs from concept_bins="
                         f"{bins!r}; upstream sizes the bottleneck by the one and slices it by "
                         "the other")
    names = _list("concept_names", concepts["concept_names"], (str, int, float))
    try:
        return CBAEConfig.from_upstream(
            latent_dim=model_section["latent_noise_dim"], num_ws=model_section["num_ws"],
            concept_bins=bins, concept_names=[str(n) for n in names],
            types=_list("types", concepts["types"], (str,)))
    except ValueError as err:
        raise ValueError(f"model.concepts: {err}") from None


def load_cbae(checkpoint_path: str | pathlib.Path, config_path: str | pathlib.Path) -> CBAE:
    """Read an upstream CB-AE: ``.pt`` state_dict plus the YAML config it was trained with.

    Raises:
      ValueError: a missing or unreadable file, a config ``config_from_upstream`` refuses
        (prefixed with the config's path), or a state_dict that does not fit the config.
    """
    import yaml

    config_path = pathlib.Path(config_path)
    if not config_path.is_file():
        raise ValueError(f"config_path={str(config_path)!r}; no such file")
    try:
        document = yaml.safe_load(config_path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path}: not readable YAML ({err})") from None
    if not isinstance(document, Mapping) or not isinstance(document.get("model"), Mapping):
        raise ValueError(f"config_path={str(config_path)!r}: no 'model' section")
    try:
        config = config_from_upstream(document["model"])
    except ValueError as err:
        raise ValueError(f"{config_path}: {err}") from None
    return cbae_from_state_dict(config, load_torch_state_dict(checkpoint_path))
