"""Worlds assembled from real parts: a directory with a ``world.json`` manifest.

A world directory names a pretrained generator (a stylegan2-ada-pytorch pickle or a
pytorch-pretrained-biggan checkpoint), the CB-AE that gives it concepts (SPEC §1), the
classifiers compared on it (directories written by ``certify convert``), the class names and the
classifier input preprocessing. ``load_world_dir(path)`` turns it into a ``pipeline.World`` that
every command accepts through ``--world <dir>``.

Design: the generator and CB-AE are converted **on load**, every time, from the upstream files
named in the manifest (StyleGAN2 pickles are read without torch by a restricted unpickler; CB-AE
``.pt`` and BigGAN ``.bin`` state_dicts need the ``torch`` extra and are read with
``weights_only=True``). There is no second, cached copy of the generator that could drift from
its source; the classifiers are the already converted, sha256-checked orbax directories.

``world.json`` (every key below; any other key is an error naming it)::

    {
      "format_version": 1,
      "name": "celebahq-smiling",                    # optional, default: the directory name
      "generator": {                                 # kind "stylegan2":
        "kind": "stylegan2",
        "pickle": "network-snapshot.pkl",           #   path relative to the directory
        "network": "G_ema",                         #   optional, default "G_ema"
        "truncation_psi": 0.7,                      #   optional, default 1.0
        "truncation_cutoff": null,                  #   optional, default null (all layers)
        "class_index": null                         #   required (0..c_dim-1) for a
                                                     #   conditional pickle, else absent/null
      },                                             # kind "biggan": "weights"
                                                     #   (pytorch_model.bin), "config"
                                                     #   (config.json), "class_index" (required),
                                                     #   "truncation" (optional, default 1.0)
      "cbae": {"checkpoint": "cbae.pt", "config": "cbae.yaml"},   # required for stylegan2;
                                                     # biggan (optional): {"trained": "cbae"},
                                                     # a directory from `certify train cbae`
      "classifiers": {"std": "std", "cbm": "pcbm", "cbmh": "pcbmh", "proto": "pixpnet"},
      "class_names": ["not smiling", "smiling"],
      "preprocess": {"size": [224, 224], "mean": [0.485, 0.456, 0.406],
                     "std": [0.229, 0.224, 0.225]}
    }

Every path is relative to the world directory and stays inside it: absolute paths and ``..``
components are refused (symbolic links inside the directory are followed). ``network`` must
name a pickled ``Generator`` (``G_ema`` or ``G`` in NVlabs snapshots).

Classifier roles: ``std`` (a torchvision ResNet/DenseNet) and ``cbm`` (a PCBM) are required,
``cbmh`` (a PCBM-h) and ``proto`` (a PixPNet) optional. Every classifier must output
``len(class_names)`` logits. ``preprocess`` maps the generated image ``g(z)`` in [0, 1] to the
classifiers' input: bilinear resize to ``size`` (``null``: keep the generator's resolution,
``jax.image.resize`` with antialiasing) then ``(x − mean) / std`` per channel. The DFS concept
scores are the PCBM's margins ``r = (V e + b)/‖V‖``. Upstream has no CB-AE for BigGAN: a BigGAN
world without ``cbae`` has K = 0 concepts, so only latent-space commands apply to it (concept
smoothing, concept attacks and τ budgets need a concept bottleneck); ``certify train cbae``
trains one on the condition vector ``[t·z ; E y]`` and ``"cbae": {"trained": DIR}`` plugs it in.
A trained CB-AE records the generator it was trained on (sha256 of the weights and config,
class index, truncation) and is refused on any other.

StyleGAN2 pickles of any synthesis architecture ("skip", "orig", "resnet") are accepted. A
conditional one (``c_dim > 0``, e.g. a class-conditional stylegan2-ada network) generates one
class per world: ``class_index`` selects it and ``g1`` feeds its one-hot label to the mapping
network, as BigGAN's class index does; an unconditional pickle refuses the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from cbcert.generators.base import Generator
from cbcert.pipeline import World

MANIFEST = "world.json"
FORMAT_VERSION = 1
ROLES = ("std", "cbm", "cbmh", "proto")
REQUIRED_ROLES = ("std", "cbm")

_TOP_KEYS = {"format_version", "name", "generator", "cbae", "classifiers", "class_names",
             "preprocess"}
_GENERATOR_KEYS = {
    "stylegan2": ({"kind", "pickle"}, {"network", "truncation_psi", "truncation_cutoff",
                                       "class_index"}),
    "biggan": ({"kind", "weights", "config", "class_index"}, {"truncation"}),
}
_CBAE_KEYS = {"checkpoint", "config"}  # upstream CB-AE of a stylegan2 world
_TRAINED_CBAE_KEYS = {"trained"}  # `certify train cbae` output, for a biggan world
_PREPROCESS_KEYS = {"size", "mean", "std"}


@dataclass(frozen=True)
class Preprocess:
    """Classifier input preprocessing: ``x[B, H, W, 3] in [0, 1] -> x'[B, h, w, 3]``.

    Attributes:
      size: ``(h, w)`` to resize to, or None to keep the generator's resolution.
      mean, std: per-channel normalisation ``(x − mean) / std``.
    """

    size: tuple[int, int] | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __call__(self, x: jax.Array) -> jax.Array:
        """Resize (bilinear, antialiased) then normalise: ``[B, H, W, 3] -> [B, h, w, 3]``."""
        if self.size is not None and tuple(x.shape[1:3]) != self.size:
            x = jax.image.resize(x, (x.shape[0], *self.size, x.shape[3]), "bilinear")
        return (x - jnp.asarray(self.mean, x.dtype)) / jnp.asarray(self.std, x.dtype)


@dataclass(frozen=True)
class WorldSpec:
    """A parsed, validated ``world.json``; every path is absolute and exists.

    Attributes:
      root: the world directory.
      name: world name (``World.name`` is ``dir:<name>``).
      generator: generator section, paths resolved (keys as in the manifest, defaults filled).
      cbae: ``{"checkpoint": Path, "config": Path}`` (stylegan2), ``{"trained": Path}``
        (biggan) or None.
      classifiers: role -> converted-model directory.
      class_names: C class names.
      preprocess: classifier input preprocessing.
    """

    root: Path
    name: str
    generator: dict[str, Any]
    cbae: dict[str, Path] | None
    classifiers: dict[str, Path]
    class_names: tuple[str, ...]
    preprocess: Preprocess


def _where(section: str, key: str) -> str:
    return f"{MANIFEST}: {section}.{key}" if section else f"{MANIFEST}: {key}"


def _check_keys(section: str, value: Any, required: set[str], optional: set[str]) -> dict:
    """The section as a dict; ValueError naming any unknown or missing key."""
    label = section or "top level"
    if not isinstance(value, Mapping):
        raise ValueError(f"{MANIFEST}: {label} must be an object, got {type(value).__name__}")
    allowed = required | optional
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(f"{MANIFEST}: unknown key {unknown[0]!r} in {label} "
                         f"(allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(value))
    if missing:
        raise ValueError(f"{MANIFEST}: missing key {missing[0]!r} in {label} "
                         f"(required: {', '.join(sorted(required))})")
    return dict(value)


def _file(root: Path, section: str, key: str, value: Any, directory: bool = False) -> Path:
    """An existing file (or directory) given relative to the world directory.

    The path as written must stay inside the directory: no absolute path, no ``..`` component
    (a manifest from elsewhere cannot reach ``../../home/...``). Symbolic links the directory
    itself contains are followed, so large checkpoints can be linked in rather than copied.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{_where(section, key)}={value!r}; expected a path relative to {root}")
    if Path(value).is_absolute():
        raise ValueError(f"{_where(section, key)}={value!r}; paths must be relative to the "
                         "world directory so that it can be moved")
    if ".." in Path(value).parts:
        raise ValueError(f"{_where(section, key)}={value!r}; paths must stay inside the world "
                         "directory ('..' is not allowed)")
    path = (root / value).resolve()
    exists = path.is_dir() if directory else path.is_file()
    if not exists:
        kind = "directory" if directory else "file"
        raise ValueError(f"{_where(section, key)}={value!r}: no such {kind} {path}")
    return path


def _number(section: str, key: str, value: Any, low: float, high: float,
            low_open: bool) -> float:
    ok = (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{_where(section, key)}={value!r}; allowed: {bracket}{low}, {high}]")
    return float(value)


def _integer(section: str, key: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{_where(section, key)}={value!r}; allowed: integers >= {low}")
    return value


def _parse_generator(root: Path, raw: Any) -> dict[str, Any]:
    kind = raw.get("kind") if isinstance(raw, Mapping) else None
    if kind not in _GENERATOR_KEYS:
        raise ValueError(f"{MANIFEST}: generator.kind={kind!r}; allowed: "
                         f"{', '.join(_GENERATOR_KEYS)}")
    required, optional = _GENERATOR_KEYS[kind]
    section = _check_keys("generator", raw, required, optional)
    if kind == "stylegan2":
        cutoff = section.get("truncation_cutoff")
        class_index = section.get("class_index")  # checked against c_dim once converted
        network = section.get("network", "G_ema")  # checked against the pickle once read
        if not isinstance(network, str) or not network:
            raise ValueError(f"{_where('generator', 'network')}={network!r}; expected the key of "
                             "a generator in the pickle (e.g. 'G_ema')")
        return {
            "kind": kind,
            "pickle": _file(root, "generator", "pickle", section["pickle"]),
            "network": network,
            "truncation_psi": _number("generator", "truncation_psi",
                                      section.get("truncation_psi", 1.0), 0.0, 1.0, True),
            "truncation_cutoff": None if cutoff is None
            else _integer("generator", "truncation_cutoff", cutoff, 1),
            "class_index": None if class_index is None
            else _integer("generator", "class_index", class_index, 0),
        }
    return {
        "kind": kind,
        "weights": _file(root, "generator", "weights", section["weights"]),
        "config": _file(root, "generator", "config", section["config"]),
        "class_index": _integer("generator", "class_index", section["class_index"], 0),
        "truncation": _number("generator", "truncation", section.get("truncation", 1.0),
                              0.0, 1.0, True),
    }


def _triple(key: str, value: Any, positive: bool) -> tuple[float, float, float]:
    ok = (isinstance(value, list) and len(value) == 3
          and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                  and (v > 0 or not positive) for v in value))
    if not ok:
        rule = "three numbers > 0" if positive else "three finite numbers"
        raise ValueError(f"{_where('preprocess', key)}={value!r}; expected {rule} (R, G, B)")
    return tuple(float(v) for v in value)


def _parse_preprocess(raw: Any) -> Preprocess:
    section = _check_keys("preprocess", raw, _PREPROCESS_KEYS, set())
    size = section["size"]
    if size is not None:
        if not (isinstance(size, list) and len(size) == 2
                and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                        for s in size)):
            raise ValueError(f"{_where('preprocess', 'size')}={size!r}; expected null or "
                             "[height, width], integers >= 1")
        size = (size[0], size[1])
    return Preprocess(size=size, mean=_triple("mean", section["mean"], False),
                      std=_triple("std", section["std"], True))


def read_manifest(path: str | Path) -> WorldSpec:
    """Parse and validate ``<path>/world.json`` (see the module docstring for the format).

    Raises:
      ValueError: no manifest, invalid JSON, an unknown or missing key (named), a value out of
        range, or a file or directory it names that does not exist.
    """
    root = Path(path).resolve()
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{root} has no {MANIFEST}; not a world directory")
    try:
        raw = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{manifest_path}: not valid JSON ({err})") from None
    top = _check_keys("", raw, _TOP_KEYS - {"name", "cbae"}, {"name", "cbae"})
    if top["format_version"] != FORMAT_VERSION:
        raise ValueError(f"{MANIFEST}: format_version={top['format_version']!r}; this cbcert "
                         f"reads version {FORMAT_VERSION}")
    generator = _parse_generator(root, top["generator"])
    cbae = None
    if top.get("cbae") is not None and generator["kind"] == "stylegan2":
        section = _check_keys("cbae", top["cbae"], _CBAE_KEYS, set())
        cbae = {key: _file(root, "cbae", key, section[key]) for key in sorted(_CBAE_KEYS)}
    elif top.get("cbae") is not None:
        section = _check_keys("cbae", top["cbae"], _TRAINED_CBAE_KEYS, set())
        cbae = {"trained": _file(root, "cbae", "trained", section["trained"], directory=True)}
    elif generator["kind"] == "stylegan2":
        raise ValueError(f"{MANIFEST}: missing key 'cbae'; a stylegan2 world takes its concepts "
                         "from a CB-AE ({\"checkpoint\": ..., \"config\": ...})")
    roles = _check_keys("classifiers", top["classifiers"], set(REQUIRED_ROLES),
                        set(ROLES) - set(REQUIRED_ROLES))
    classifiers = {role: _file(root, "classifiers", role, roles[role], directory=True)
                   for role in ROLES if role in roles}
    names = top["class_names"]
    if not (isinstance(names, list) and len(names) >= 2
            and all(isinstance(n, str) and n for n in names)):
        raise ValueError(f"{MANIFEST}: class_names={names!r}; expected a list of >= 2 names")
    name = top.get("name", root.name)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{MANIFEST}: name={name!r}; expected a non-empty string")
    return WorldSpec(root=root, name=name, generator=generator, cbae=cbae,
                     classifiers=classifiers, class_names=tuple(names),
                     preprocess=_parse_preprocess(top["preprocess"]))


def build_generator(spec: WorldSpec) -> Generator:
    """Convert the manifest's generator (and CB-AE) into a ``Generator`` (see module docstring).

    Raises:
      ValueError: unreadable or mismatched checkpoints (the converters name the offending keys).
    """
    try:
        return _convert_generator(spec)
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        raise ValueError(f"{spec.root / MANIFEST}: the CB-AE and BigGAN checkpoints are PyTorch "
                         "state_dicts; reading them needs the torch extra "
                         "(pip install 'cbcert[torch]')") from None


def generator_identity(spec: WorldSpec) -> dict[str, Any]:
    """What a CB-AE trained on this world's generator must match: kind, sha256 of the weights
    and config files, class index and truncation (biggan)."""
    from cbcert.convert.common import sha256_file

    gen = spec.generator
    if gen["kind"] != "biggan":
        raise ValueError(f"{MANIFEST}: generator.kind={gen['kind']!r}; `certify train cbae` "
                         "trains CB-AEs for biggan worlds (stylegan2 worlds use upstream's)")
    return {"kind": "biggan", "weights_sha256": sha256_file(gen["weights"]),
            "config_sha256": sha256_file(gen["config"]), "class_index": gen["class_index"],
            "truncation": gen["truncation"]}


def _trained_cbae(spec: WorldSpec):
    from cbcert.train_cbae import read_cbae

    path = spec.cbae["trained"]
    try:
        cbae, manifest = read_cbae(path)
    except ValueError as err:
        raise ValueError(f"{MANIFEST}: cbae.trained: {err}") from None
    trained_on = manifest.get("identity", {}).get("generator", {})
    expected = generator_identity(spec)
    for key in expected:
        if trained_on.get(key) != expected[key]:
            raise ValueError(f"{MANIFEST}: cbae.trained={path.name!r} was trained on a generator "
                             f"with {key}={trained_on.get(key)!r}, this world's has "
                             f"{expected[key]!r}; retrain it (`certify train cbae`)")
    return cbae


def _check_stylegan2_class(gen: dict[str, Any], c_dim: int) -> None:
    """``generator.class_index`` against the pickle's label width (module docstring)."""
    index, pickle_name = gen["class_index"], gen["pickle"].name
    if c_dim and index is None:
        raise ValueError(f"{MANIFEST}: missing key 'class_index' in generator; {pickle_name} is "
                         f"a conditional StyleGAN2 (c_dim={c_dim}): choose a class in "
                         f"0..{c_dim - 1}")
    if not c_dim and index is not None:
        raise ValueError(f"{_where('generator', 'class_index')}={index}; {pickle_name} is an "
                         "unconditional StyleGAN2 (c_dim=0): remove the key")
    if index is not None and index >= c_dim:
        raise ValueError(f"{_where('generator', 'class_index')}={index}; allowed: "
                         f"0..{c_dim - 1} ({pickle_name} has c_dim={c_dim})")


def _convert_generator(spec: WorldSpec) -> Generator:
    gen = spec.generator
    if gen["kind"] == "stylegan2":
        from cbcert.convert.cbae import load_cbae
        from cbcert.convert.stylegan2 import load_stylegan2
        from cbcert.generators.stylegan2 import stylegan2_generator

        model = load_stylegan2(gen["pickle"], gen["network"], _where("generator", "network"))
        _check_stylegan2_class(gen, model.config.c_dim)
        cbae = load_cbae(spec.cbae["checkpoint"], spec.cbae["config"])
        return stylegan2_generator(model, cbae, gen["truncation_psi"], gen["truncation_cutoff"],
                                   name=f"stylegan2:{gen['pickle'].name}",
                                   class_index=gen["class_index"])
    from cbcert.convert.biggan import load_biggan
    from cbcert.generators.biggan import biggan_generator

    cbae = _trained_cbae(spec) if spec.cbae is not None else None
    return biggan_generator(load_biggan(gen["weights"], gen["config"]), gen["class_index"],
                            gen["truncation"], name=f"biggan:{gen['weights'].name}", cbae=cbae)


def _kind_ok(role: str, manifest: dict) -> bool:
    from cbcert.convert.torchvision import DENSENET_NAMES, RESNET_NAMES

    kind = manifest.get("kind")
    if role == "std":
        return kind in RESNET_NAMES or kind in DENSENET_NAMES
    if role == "proto":
        return kind == "pixpnet"
    residual = manifest.get("config", {}).get("residual_outputs", 0)
    return kind == "pcbm" and (residual > 0) == (role == "cbmh")


_EXPECTED_KIND = {"std": "a torchvision resnet*/densenet*", "cbm": "a pcbm without residual head",
                  "cbmh": "a pcbm with a residual head (PCBM-h)", "proto": "a pixpnet"}


def load_classifiers(spec: WorldSpec) -> tuple[dict[str, Callable], Callable, dict, dict]:
    """The converted classifiers of a world, as pure functions on preprocessed images.

    Returns:
      ``(apply_fns, concept_fn, params, manifests)``: ``apply_fns[role](params[role],
      x[B, h, w, 3]) -> logits[B, C]``, ``concept_fn(params["cbm"], x) -> r[B, K]`` (the
      PCBM's margins), and each role's converter manifest.

    Raises:
      ValueError: a directory that is not a converted model, a kind that does not fit its role.
    """
    from cbcert.convert import load_converted_module, pure_apply

    apply_fns, params, manifests = {}, {}, {}
    concept_fn = None
    for role, directory in spec.classifiers.items():
        try:
            module, manifest = load_converted_module(directory)
        except ValueError as err:
            raise ValueError(f"{MANIFEST}: classifiers.{role}: {err}") from None
        if not _kind_ok(role, manifest):
            raise ValueError(f"{MANIFEST}: classifiers.{role} is kind={manifest.get('kind')!r}; "
                             f"role {role!r} needs {_EXPECTED_KIND[role]}")
        apply_fns[role], params[role] = pure_apply(module)
        manifests[role] = manifest
        if role == "cbm":
            concept_fn, _ = pure_apply(module, lambda m, x: m.concept_scores(x))
    return apply_fns, concept_fn, params, manifests


def load_world_dir(path: str | Path) -> World:
    """A ``pipeline.World`` from a world directory (``world.json``, see the module docstring).

    ``classify(params, x[B, H, W, 3], names) -> logits[B, len(names), C]`` applies the
    manifest's preprocessing to ``g(z)`` in [0, 1] once, then every named classifier;
    ``concept_scores(params, x) -> r[B, K]`` are the PCBM's concept margins. There is no
    ground-truth label (``true_label=None``).

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

    _check_class_counts(classify, params, generator.image_shape, spec)
    return World(
        name=f"dir:{spec.name}", generator=generator, classify=classify,
        concept_scores=concept_scores, classifier_params=params,
        model_names=tuple(role for role in ROLES if role in apply_fns),
        class_names=spec.class_names, true_label=None,
        metadata={"world_dir": str(spec.root), "concepts": generator.num_concepts > 0,
                  "classifiers": manifests})


def _check_class_counts(classify: Callable, params: dict, image_shape: tuple[int, ...],
                        spec: WorldSpec) -> None:
    """Every classifier must output ``len(class_names)`` logits on the generator's images.

    Runs shape inference only (``jax.eval_shape``), which also catches preprocessing sizes a
    backbone cannot take.
    """
    image = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
    for role in params:
        try:
            shape = jax.eval_shape(lambda p, x, r=role: classify(p, x, (r,)), params, image).shape
        except (TypeError, ValueError) as err:
            raise ValueError(f"{MANIFEST}: classifiers.{role} cannot classify the generator's "
                             f"{image_shape} images after preprocessing "
                             f"(size={spec.preprocess.size}): {err}") from None
        if shape[-1] != len(spec.class_names):
            raise ValueError(f"{MANIFEST}: classifiers.{role} outputs {shape[-1]} logits but "
                             f"class_names has {len(spec.class_names)} names")
