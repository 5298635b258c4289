"""Worlds assembled from real parts: a ``World`` from a directory with a ``world.json``.

``load_world_dir(path)`` reads the manifest (``cbcert.worlds.manifest``, which documents the
format), builds the generator (+ CB-AE) and the classifiers, and returns the
``cbcert.worlds.world.World`` every command accepts through ``--world <dir>``.

Parts come in two forms:

* **converted directories** (``certify convert``, ``certify train cbae``): cbcert checkpoints
  loaded through ``cbcert.io.registry`` with their file and params hashes checked. Loading
  them needs no torch: a world whose parts are all converted runs on a machine without it.
* **upstream files** (a convenience for the generator and the StyleGAN2 CB-AE): converted on
  every load by ``cbcert.convert.read_module`` (StyleGAN2 pickles are read without torch by a
  restricted unpickler; CB-AE ``.pt`` and BigGAN ``.bin`` state_dicts need the ``torch`` extra
  and are read with ``weights_only=True``). ``_upstream`` is the one place worlds reach into
  ``cbcert.convert``: reading those files *is* conversion (their strict key tables), and
  keeping a second copy of it here would let the two drift.

The DFS concept scores are the PCBM's margins ``r = (V e + b)/‖V‖``. A world without ``cbae``
has K = 0 concepts, so only latent-space commands apply to it; ``certify train cbae`` trains one
(BigGAN: on the condition vector ``[t·z ; E y]``; StyleGAN2: on ``w+``, as upstream's) and
``"cbae": {"trained": DIR}`` plugs it in. A trained CB-AE records the generator it was trained
on (``generator_identity``) and is refused on any other.

StyleGAN2 networks of any synthesis architecture ("skip", "orig", "resnet") are accepted. A
conditional one (``c_dim > 0``) generates one class per world: ``class_index`` selects it and
``g1`` feeds its one-hot label to the mapping network, as BigGAN's class index does; an
unconditional one refuses the key. A list of classes (either generator) makes a multi-class
world: each input ``[z ; k]`` asks for ``class_index[k]`` (`cbcert.worlds.manifest`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbcert.generators.base import Generator
from cbcert.generators.biggan import biggan_generator
from cbcert.generators.stylegan2.generator import stylegan2_generator
from cbcert.io import checkpoint
from cbcert.io.registry import DENSENET_NAMES, RESNET_NAMES, load_module, pure_apply
from cbcert.schema import shorten
from cbcert.worlds.manifest import CONVERTED, MANIFEST, ROLES, WorldSpec, read_manifest, where
from cbcert.worlds.world import World

# Weight identity of a generator: either group identifies the same weights.
_WEIGHT_KEYS = (("params_sha256",), ("weights_sha256", "config_sha256"),
                ("pickle_sha256", "network"))


def build_generator(spec: WorldSpec) -> Generator:
    """The manifest's generator (and CB-AE) as a ``Generator`` (see the module docstring).

    Raises:
      ValueError: unreadable or mismatched checkpoints (the converters name the offending
        keys), a converted directory of another kind, or upstream ``.pt``/``.bin`` files
        without torch installed.
    """
    try:
        return _build_generator(spec)
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        raise ValueError(f"{spec.root / MANIFEST}: the CB-AE and BigGAN checkpoints are PyTorch "
                         "state_dicts; reading them needs the torch extra "
                         "(pip install 'cbcert[torch]'), or convert them once where torch is "
                         "installed (`certify convert cbae|biggan ...`) and name the "
                         "directories with \"converted\"") from None


def _build_generator(spec: WorldSpec) -> Generator:
    gen = spec.generator
    model, source = _generator_module(spec)
    if spec.cbae is None:
        cbae = None
    elif "trained" in spec.cbae:
        cbae = _trained_cbae(spec)
    else:
        cbae = _stylegan2_cbae(spec)
    if gen["kind"] == "stylegan2":
        _check_stylegan2_class(gen, model.config.c_dim, source)
        return stylegan2_generator(model, cbae, gen["truncation_psi"],
                                   gen["truncation_cutoff"], name=f"stylegan2:{source}",
                                   class_index=gen["class_index"])
    return biggan_generator(model, gen["class_index"], gen["truncation"],
                            name=f"biggan:{source}", cbae=cbae)


def _generator_module(spec: WorldSpec) -> tuple[nnx.Module, str]:
    """The generator's module and the name of its source (file or converted directory)."""
    gen = spec.generator
    if CONVERTED in gen:
        module, _ = _converted(gen[CONVERTED], gen["kind"], "generator")
        return module, gen[CONVERTED].name
    if gen["kind"] == "stylegan2":
        return _upstream("stylegan2", gen["pickle"], network=gen["network"],
                         network_setting=where("generator", "network")), gen["pickle"].name
    return _upstream("biggan", gen["weights"], config_path=gen["config"]), gen["weights"].name


def _stylegan2_cbae(spec: WorldSpec) -> nnx.Module:
    if CONVERTED in spec.cbae:
        return _converted(spec.cbae[CONVERTED], "cbae", "cbae")[0]
    return _upstream("cbae", spec.cbae["checkpoint"], config_path=spec.cbae["config"])


def _upstream(kind: str, path: Path, **options: Any) -> nnx.Module:
    """An upstream file read into its module (the convenience path, module docstring)."""
    from cbcert.convert import read_module

    module, _ = read_module(kind, path, **options)
    return module


def _converted_manifest(directory: Path, kind: str, section: str) -> dict[str, Any]:
    """The checked manifest of a converted directory that must hold ``kind``."""
    try:
        manifest = checkpoint.read_manifest(directory)
    except checkpoint.CheckpointError as err:
        raise ValueError(f"{where(section, CONVERTED)}: {err}") from None
    if manifest["kind"] != kind:
        raise ValueError(f"{where(section, CONVERTED)}={directory.name!r} is kind="
                         f"{shorten(repr(manifest['kind']), 80)}; expected a "
                         f"`certify convert {kind}` directory")
    return manifest


def _converted(directory: Path, kind: str, section: str) -> tuple[nnx.Module, dict[str, Any]]:
    """Module and manifest of a converted directory that must hold ``kind``."""
    _converted_manifest(directory, kind, section)
    try:
        return load_module(directory)
    except checkpoint.CheckpointError as err:
        raise ValueError(f"{where(section, CONVERTED)}: {err}") from None


def generator_identity(spec: WorldSpec) -> dict[str, Any]:
    """What a CB-AE trained on this world's generator must match.

    BigGAN from upstream files: ``kind``, sha256 of the weights and config files,
    ``class_index``, ``truncation``; converted: ``kind``, the converted ``params_sha256``, the
    weights/config sha256 its converter recorded in ``sources``, ``class_index``,
    ``truncation``. StyleGAN2 from its pickle: ``kind``, ``pickle_sha256``, ``network``,
    ``class_index``, ``truncation_psi``, ``truncation_cutoff``; converted: ``params_sha256``
    and the pickle's sha256 and network its converter recorded instead. A class list is
    recorded as a JSON list (a CB-AE trained on a multi-class world covers exactly those
    classes).
    """
    gen = dict(spec.generator)
    if isinstance(gen.get("class_index"), tuple):
        gen["class_index"] = list(gen["class_index"])
    if gen["kind"] == "stylegan2":
        settings = {"class_index": gen["class_index"], "truncation_psi": gen["truncation_psi"],
                    "truncation_cutoff": gen["truncation_cutoff"]}
        if CONVERTED not in gen:
            return {"kind": "stylegan2", "pickle_sha256": checkpoint.sha256_file(gen["pickle"]),
                    "network": gen["network"], **settings}
        manifest = _converted_manifest(gen[CONVERTED], "stylegan2", "generator")
        identity = {"kind": "stylegan2"}
        recorded = (manifest.get("sources") or {}).get("checkpoint")
        if isinstance(recorded, dict) and isinstance(recorded.get("sha256"), str):
            identity["pickle_sha256"] = recorded["sha256"]
        if isinstance(manifest.get("network"), str):
            identity["network"] = manifest["network"]
        return {**identity, "params_sha256": manifest["params_sha256"], **settings}
    if CONVERTED in gen:
        manifest = _converted_manifest(gen[CONVERTED], "biggan", "generator")
        sources = manifest.get("sources") if isinstance(manifest.get("sources"), dict) else {}
        identity = {"kind": "biggan"}
        for role, key in (("checkpoint", "weights_sha256"), ("config", "config_sha256")):
            recorded = sources.get(role)
            if isinstance(recorded, dict) and isinstance(recorded.get("sha256"), str):
                identity[key] = recorded["sha256"]
        return {**identity, "params_sha256": manifest["params_sha256"],
                "class_index": gen["class_index"], "truncation": gen["truncation"]}
    return {"kind": "biggan", "weights_sha256": checkpoint.sha256_file(gen["weights"]),
            "config_sha256": checkpoint.sha256_file(gen["config"]),
            "class_index": gen["class_index"], "truncation": gen["truncation"]}


def _identity_mismatch(trained_on: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """The first key on which a trained CB-AE's generator differs from this world's, or None.

    The weights count as the same when a weight-identity group (``_WEIGHT_KEYS``) both record
    is equal: a CB-AE trained on upstream files fits the same files converted, and the reverse.
    """
    weight_keys = {key for group in _WEIGHT_KEYS for key in group}
    shared = {key for group in _WEIGHT_KEYS for key in group
              if all(k in trained_on and k in expected for k in group)}
    checked = [key for key in expected if key not in weight_keys or key in shared or not shared]
    for key in checked:
        if trained_on.get(key) != expected[key]:
            return key
    return None


def _trained_cbae(spec: WorldSpec) -> nnx.Module:
    path = spec.cbae["trained"]
    try:
        cbae, manifest = load_module(path)
    except checkpoint.CheckpointError as err:
        raise ValueError(f"{MANIFEST}: cbae.trained: {err}") from None
    if manifest["kind"] != "cbae":
        raise ValueError(f"{MANIFEST}: cbae.trained={path.name!r} is kind="
                         f"{shorten(repr(manifest['kind']), 80)}; not a CB-AE written by "
                         "`certify train cbae`")
    identity = manifest.get("identity")
    trained_on = identity.get("generator") if isinstance(identity, dict) else None
    trained_on = trained_on if isinstance(trained_on, dict) else {}
    expected = generator_identity(spec)
    key = _identity_mismatch(trained_on, expected)
    if key is not None:
        raise ValueError(f"{MANIFEST}: cbae.trained={path.name!r} was trained on a generator "
                         f"with {key}={shorten(repr(trained_on.get(key)), 80)}, this world's has "
                         f"{expected[key]!r}; retrain it (`certify train cbae`)")
    return cbae


def _check_stylegan2_class(gen: dict[str, Any], c_dim: int, source: str) -> None:
    """``generator.class_index`` (one class or a list) against the network's label width."""
    index = gen["class_index"]
    shown = list(index) if isinstance(index, tuple) else index
    if c_dim and index is None:
        raise ValueError(f"{MANIFEST}: missing key 'class_index' in generator; {source} is "
                         f"a conditional StyleGAN2 (c_dim={c_dim}): choose a class in "
                         f"0..{c_dim - 1}")
    if not c_dim and index is not None:
        raise ValueError(f"{where('generator', 'class_index')}={shown}; {source} is an "
                         "unconditional StyleGAN2 (c_dim=0): remove the key")
    if index is not None and max(index if isinstance(index, tuple) else (index,)) >= c_dim:
        raise ValueError(f"{where('generator', 'class_index')}={shown}; allowed: "
                         f"0..{c_dim - 1} ({source} has c_dim={c_dim})")


def _kind_ok(role: str, kind: Any, module: nnx.Module) -> bool:
    if role == "std":
        return kind in RESNET_NAMES or kind in DENSENET_NAMES
    if role == "proto":
        return kind == "pixpnet"
    return kind == "pcbm" and (module.config.residual_outputs > 0) == (role == "cbmh")


_EXPECTED_KIND = {"std": "a torchvision resnet*/densenet*", "cbm": "a pcbm without residual head",
                  "cbmh": "a pcbm with a residual head (PCBM-h)", "proto": "a pixpnet"}


def load_classifiers(spec: WorldSpec) -> tuple[dict[str, Callable], Callable, dict, dict]:
    """The converted classifiers of a world, as pure functions on preprocessed images.

    Returns:
      ``(apply_fns, concept_fn, params, manifests)``: ``apply_fns[role](params[role],
      x[B, h, w, 3]) -> logits[B, C]``, ``concept_fn(params["cbm"], x) -> r[B, K]`` (the
      PCBM's margins), and each role's checkpoint manifest; ``apply_fns["std:embed"]`` is the
      standard classifier's pooled embedding ``(params["std"], x) -> e[B, D]``;
      ``apply_fns["cbm:head"](params["cbm"], None) -> (W[C, K], b[C])`` the PCBM's class head
      (`PCBM.class_head`); ``apply_fns["proto:similarities"](params["proto"], x) -> s[B, P]``
      and ``apply_fns["proto:head"](params["proto"], None) -> (W[C, P], owner[P])`` the
      PixPNet's similarities and readout (`PixPNet.class_weights`).

    Raises:
      ValueError: a directory that is not a converted model, a kind that does not fit its role.
    """
    apply_fns, params, manifests = {}, {}, {}
    concept_fn = None
    for role, directory in spec.classifiers.items():
        try:
            module, manifest = load_module(directory)
        except checkpoint.CheckpointError as err:
            raise ValueError(f"{MANIFEST}: classifiers.{role}: {err}") from None
        if not _kind_ok(role, manifest["kind"], module):
            raise ValueError(f"{MANIFEST}: classifiers.{role} is kind="
                             f"{shorten(repr(manifest['kind']), 80)}; role {role!r} needs "
                             f"{_EXPECTED_KIND[role]}")
        apply_fns[role], params[role] = pure_apply(module)
        manifests[role] = manifest
        if role == "std":
            apply_fns["std:embed"], _ = pure_apply(module, lambda m, x: m.embed(x))
        if role == "cbm":
            concept_fn, _ = pure_apply(module, lambda m, x: m.concept_scores(x))
            apply_fns["cbm:head"], _ = pure_apply(module, lambda m, _: m.class_head())
        if role == "proto":
            apply_fns["proto:similarities"], _ = pure_apply(module, lambda m, x: m.similarities(x))
            apply_fns["proto:head"], _ = pure_apply(module, lambda m, _: m.class_weights())
    return apply_fns, concept_fn, params, manifests


def load_world_dir(path: str | Path) -> World:
    """A ``World`` from a world directory (``world.json``: ``cbcert.worlds.manifest``).

    ``classify(params, x[B, H, W, 3], names) -> logits[B, len(names), C]`` applies the
    manifest's preprocessing to ``g(z)`` in [0, 1] once, then every named classifier;
    ``concept_scores(params, x) -> r[B, K]`` are the PCBM's concept margins. There is no
    ground-truth label (``true_label=None``). Explanations: ``concept_head`` is the ``cbm``
    PCBM's class head; a ``cbmh`` is explained with it only when its concept bottleneck
    (backbone, CAVs, head) is the cbm's, as PCBM-h is trained (`metadata["concept_head_models"]`
    lists the models the head explains); ``prototypes``/``prototype_head`` come from ``proto``.

    Raises:
      ValueError: any manifest, checkpoint or shape problem, naming the key or file.
    """
    spec = read_manifest(path)
    generator = build_generator(spec)
    apply_fns, concept_fn, params, manifests = load_classifiers(spec)
    preprocess = spec.preprocess

    def classify(p, x, names):
        x = preprocess(x)
        return jnp.stack([apply_fns[m](p[m], x) for m in names], axis=1)

    def concept_scores(p, x):
        return concept_fn(p["cbm"], preprocess(x))

    def embed(p, x):
        return apply_fns["std:embed"](p["std"], preprocess(x))

    def concept_head(p):
        return apply_fns["cbm:head"](p["cbm"], None)

    def prototypes(p, x):
        return apply_fns["proto:similarities"](p["proto"], preprocess(x))

    def prototype_head(p):
        return apply_fns["proto:head"](p["proto"], None)

    concept_readout = None
    if spec.concept_classifier is not None:
        read, params[CONCEPT_CLASSIFIER] = _concept_classifier(spec, generator)

        def concept_readout(p, x):
            return read(p[CONCEPT_CLASSIFIER], preprocess(x)) > 0

    _check_class_counts(classify, params, generator.image_shape, spec)
    return World(
        name=f"dir:{spec.name}", generator=generator, classify=classify,
        concept_scores=concept_scores, classifier_params=params,
        model_names=tuple(role for role in ROLES if role in apply_fns),
        class_names=spec.class_names, true_label=None,
        metadata={"world_dir": str(spec.root), "concepts": generator.num_concepts > 0,
                  "classifiers": manifests,
                  "concept_head_models": _concept_head_models(params),
                  "cbm_concept_names": _bank_names(manifests["cbm"], params["cbm"])},
        embed=embed,
        concept_head=concept_head, prototypes=prototypes if "proto" in params else None,
        prototype_head=prototype_head if "proto" in params else None,
        concept_readout=concept_readout)


CONCEPT_CLASSIFIER = "concept_classifier"  # its parameters' key in the classifier parameters


def _concept_classifier(spec: WorldSpec, generator: Generator) -> tuple[Callable, Any]:
    """``(apply(params, x) -> logits[B, K], params)`` of the manifest's concept classifier: a
    converted torchvision resnet*/densenet* with one logit per generator concept (ValueError
    naming the key otherwise)."""
    try:
        module, manifest = load_module(spec.concept_classifier)
    except checkpoint.CheckpointError as err:
        raise ValueError(f"{MANIFEST}: concept_classifier: {err}") from None
    kind, k = manifest["kind"], generator.num_concepts
    if kind not in (*RESNET_NAMES, *DENSENET_NAMES):
        raise ValueError(f"{MANIFEST}: concept_classifier is kind={shorten(repr(kind), 80)}; "
                         "it needs a torchvision resnet*/densenet* with one logit per concept")
    outputs = manifest["config"].get("num_classes")
    if not k or outputs != k:
        raise ValueError(f"{MANIFEST}: concept_classifier outputs {outputs} logits; the "
                         f"generator has {k} concepts (one logit per concept)")
    return pure_apply(module)


def _bank_names(manifest: dict, params) -> list[str]:
    """The cbm PCBM's concept names: its converted manifest's ``concept_names`` (the concept
    bank), else ``concept <i>`` for each of its CAVs."""
    names = manifest.get("concept_names")
    count = int(nnx.to_pure_dict(params)["cavs"].shape[0])
    return list(names) if names and len(names) == count else [f"concept {i}" for i in range(count)]


def _concept_head_models(params: dict) -> list[str]:
    """The concept models explained by the cbm's class head: cbm, and cbmh when everything
    but its residual head equals the cbm's parameters."""
    if "cbmh" not in params:
        return ["cbm"]
    mine = {k: v for k, v in nnx.to_pure_dict(params["cbmh"]).items() if k != "residual"}
    theirs = {k: v for k, v in nnx.to_pure_dict(params["cbm"]).items() if k != "residual"}
    same = jax.tree.structure(mine) == jax.tree.structure(theirs) and all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs),
                                             strict=True))
    return ["cbm", "cbmh"] if same else ["cbm"]


def _check_class_counts(classify: Callable, params: dict, image_shape: tuple[int, ...],
                        spec: WorldSpec) -> None:
    """Every classifier must output ``len(class_names)`` logits on the generator's images.

    Runs shape inference only (``jax.eval_shape``), which also catches preprocessing sizes a
    backbone cannot take.
    """
    image = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
    for role in spec.classifiers:
        try:
            shape = jax.eval_shape(lambda p, x, r=role: classify(p, x, (r,)), params, image).shape
        except (TypeError, ValueError) as err:
            raise ValueError(f"{MANIFEST}: classifiers.{role} cannot classify the generator's "
                             f"{image_shape} images after preprocessing "
                             f"(size={spec.preprocess.size}): {err}") from None
        if shape[-1] != len(spec.class_names):
            raise ValueError(f"{MANIFEST}: classifiers.{role} outputs {shape[-1]} logits but "
                             f"class_names has {len(spec.class_names)} names")
