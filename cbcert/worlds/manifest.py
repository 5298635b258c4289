"""``world.json``: the manifest of a world directory, parsed and validated into a ``WorldSpec``.

A world directory names a pretrained generator, the CB-AE that gives it concepts (SPEC §1), the
classifiers compared on it, the class names and the classifier input preprocessing;
``cbcert.worlds.directory.load_world_dir`` builds the ``World`` from it. Every part is either a
directory in cbcert's checkpoint format (``certify convert``, ``certify train cbae``; loaded
through ``cbcert.io`` without torch) or, for the generator and the StyleGAN2 CB-AE, the
upstream files themselves (converted on every load, a convenience).

``world.json`` (every key below; any other key is an error naming it)::

    {
      "format_version": 1,
      "name": "celebahq-smiling",                    # optional, default: the directory name
      "generator": {                                 # kind "stylegan2":
        "kind": "stylegan2",
        "pickle": "network-snapshot.pkl",           #   path relative to the directory, or
                                                     #   "converted": "sg2" (a `certify convert
                                                     #   stylegan2` directory; no "network")
        "network": "G_ema",                         #   optional, default "G_ema"
        "truncation_psi": 0.7,                      #   optional, default 1.0
        "truncation_cutoff": null,                  #   optional, default null (all layers)
        "class_index": null                         #   required (0..c_dim-1) for a
                                                     #   conditional generator, else absent/null;
                                                     #   a list [3, 5, ...] makes a multi-class
                                                     #   world (below)
      },                                             # kind "biggan": "weights"
                                                     #   (pytorch_model.bin) and "config"
                                                     #   (config.json), or "converted" (a
                                                     #   `certify convert biggan` directory);
                                                     #   "class_index" (required; one class
                                                     #   or a list),
                                                     #   "truncation" (optional, default 1.0)
      "cbae": {"checkpoint": "cbae.pt", "config": "cbae.yaml"},   # stylegan2: upstream's, or
                                                     # {"converted": "cbae"} (`certify convert
                                                     # cbae`); either generator:
                                                     # {"trained": "cbae"}, a directory from
                                                     # `certify train cbae`; optional (none:
                                                     # K = 0, latent-space commands only)
      "classifiers": {"std": "std", "cbm": "pcbm", "cbmh": "pcbmh", "proto": "pixpnet"},
      "concept_classifier": "cc",                    # optional: a converted torchvision
                                                     # resnet*/densenet* with one logit per
                                                     # CB-AE concept (concept i on iff logit
                                                     # > 0), read on edited images
      "class_names": ["not smiling", "smiling"],
      "preprocess": {"size": [224, 224], "mean": [0.485, 0.456, 0.406],
                     "std": [0.229, 0.224, 0.225]}
    }

A section names either its ``converted`` directory or its upstream files, never both. Every
path is relative to the world directory and stays inside it: absolute paths and ``..``
components are refused (symbolic links inside the directory are followed). ``network`` must
name a pickled ``Generator`` (``G_ema`` or ``G`` in NVlabs snapshots).

``class_index`` as a list (1 to 256 distinct classes) makes one **multi-class world**: each
input asks the generator for one class of the list, drawn uniformly per input from the run's
seed, and carries it through every command while noise, shifts and attacks move only its
latent z (`cbcert.generators.base.Generator`, ``classes``). The classifiers see every class of
the world, so ``class_names`` is the classifiers' label set, not the generator's.

Classifier roles: ``std`` (a torchvision ResNet/DenseNet) and ``cbm`` (a PCBM) are required,
``cbmh`` (a PCBM-h) and ``proto`` (a PixPNet) optional. Every classifier must output
``len(class_names)`` logits. ``preprocess`` maps the generated image ``g(z)`` in [0, 1] to the
classifiers' input: bilinear resize to ``size`` (``null``: keep the generator's resolution,
``jax.image.resize`` with antialiasing; each side at most ``MAX_PREPROCESS_SIDE``) then
``(x − mean) / std`` per channel.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from cbcert.generators.base import MAX_CLASSES
from cbcert.schema import ConfigError, short_repr, shorten

MANIFEST = "world.json"
FORMAT_VERSION = 1
ROLES = ("std", "cbm", "cbmh", "proto")
REQUIRED_ROLES = ("std", "cbm")
CONVERTED = "converted"
# Largest classifier input side: the supported classifiers take 32 to 299 pixels, and a resize
# to [100000, 100000] would allocate 120 GB per image.
MAX_PREPROCESS_SIDE = 4096

_TOP_KEYS = {"format_version", "name", "generator", "cbae", "classifiers", "class_names",
             "preprocess", "concept_classifier"}
_OPTIONAL_TOP_KEYS = {"name", "cbae", "concept_classifier"}
# kind -> (keys always required, upstream files (replaced by "converted"), options of the
# upstream files only, options of both)
_GENERATOR_KEYS = {
    "stylegan2": (set(), {"pickle"}, {"network"},
                  {"truncation_psi", "truncation_cutoff", "class_index"}),
    "biggan": ({"class_index"}, {"weights", "config"}, set(), {"truncation"}),
}
_CBAE_FILES = {"checkpoint", "config"}  # upstream CB-AE of a stylegan2 world
_TRAINED_CBAE_KEYS = {"trained"}  # `certify train cbae` output, for either generator
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
      generator: generator section, paths resolved (keys as in the manifest, defaults filled;
        ``"converted"`` or the upstream file keys).
      cbae: ``{"checkpoint": Path, "config": Path}`` or ``{"converted": Path}`` (stylegan2),
        ``{"trained": Path}`` (either generator) or None.
      classifiers: role -> converted-model directory.
      class_names: C class names.
      preprocess: classifier input preprocessing.
      concept_classifier: converted-model directory of the concept classifier (one logit per
        CB-AE concept, read on edited images to verify counterfactual edits), or None.
    """

    root: Path
    name: str
    generator: dict[str, Any]
    cbae: dict[str, Path] | None
    classifiers: dict[str, Path]
    class_names: tuple[str, ...]
    preprocess: Preprocess
    concept_classifier: Path | None = None


def where(section: str, key: str) -> str:
    """How a message names a manifest key: ``world.json: generator.network``."""
    return f"{MANIFEST}: {section}.{key}" if section else f"{MANIFEST}: {key}"


def invalid(key: str, message: str, value: Any = None, allowed: str | None = None
            ) -> ConfigError:
    """A bad world directory: `ConfigError` whose ``key`` is the world.json key at fault,
    dotted (``generator.class_index``, ``classifiers.std``), or ``world`` for the directory or
    the file as a whole; ``message`` names the file and the key (front ends add no label)."""
    return ConfigError(message, key=key, value=value, allowed=allowed)


def _dotted(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _check_keys(section: str, value: Any, required: set[str], optional: set[str]) -> dict:
    """The section as a dict; `ConfigError` (`invalid`) naming any unknown or missing key."""
    label = section or "top level"
    if not isinstance(value, Mapping):
        raise invalid(section or "world", f"{MANIFEST}: {label} must be an object, got "
                      f"{type(value).__name__}", short_repr(value), "an object")
    allowed = required | optional
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise invalid(_dotted(section, unknown[0]), f"{MANIFEST}: unknown key {unknown[0]!r} in "
                      f"{label} (allowed: {', '.join(sorted(allowed))})",
                      allowed=", ".join(sorted(allowed)))
    missing = sorted(required - set(value))
    if missing:
        raise invalid(_dotted(section, missing[0]), f"{MANIFEST}: missing key {missing[0]!r} in "
                      f"{label} (required: {', '.join(sorted(required))})")
    return dict(value)


def _one_source(section: str, value: dict, files: set[str], file_options: set[str] = frozenset()
                ) -> bool:
    """Whether the section names a ``converted`` directory (True) or its upstream ``files``.

    Raises:
      ConfigError: ``converted`` beside a file or one of its ``file_options``, or neither
        ``converted`` nor every file (naming the first key concerned).
    """
    if CONVERTED in value:
        mixed = sorted((files | file_options) & set(value))
        if mixed:
            raise invalid(_dotted(section, mixed[0]), f"{MANIFEST}: {section} has both "
                          f"{CONVERTED!r} and {mixed[0]!r}; name either the converted directory "
                          "or the upstream files")
        return True
    missing = sorted(files - set(value))
    if missing:
        raise invalid(_dotted(section, missing[0]), f"{MANIFEST}: missing key {missing[0]!r} in "
                      f"{section} (required: {', '.join(sorted(files))}; or {CONVERTED!r}, a "
                      "converted directory)")
    return False


def _file(root: Path, section: str, key: str, value: Any, directory: bool = False) -> Path:
    """An existing file (or directory) given relative to the world directory.

    The path as written must stay inside the directory: no absolute path, no ``..`` component
    (a manifest from elsewhere cannot reach ``../../home/...``). Symbolic links the directory
    itself contains are followed, so large checkpoints can be linked in rather than copied.
    """
    at, relative = _dotted(section, key), "a path relative to the world directory, inside it"
    if not isinstance(value, str) or not value:
        raise invalid(at, f"{where(section, key)}={value!r}; expected a path relative to {root}",
                      value, relative)
    if Path(value).is_absolute():
        raise invalid(at, f"{where(section, key)}={value!r}; paths must be relative to the "
                      "world directory so that it can be moved", value, relative)
    if ".." in Path(value).parts:
        raise invalid(at, f"{where(section, key)}={value!r}; paths must stay inside the world "
                      "directory ('..' is not allowed)", value, relative)
    path = (root / value).resolve()
    exists = path.is_dir() if directory else path.is_file()
    if not exists:
        kind = "directory" if directory else "file"
        raise invalid(at, f"{where(section, key)}={value!r}: no such {kind} {path}", value,
                      f"an existing {kind}")
    return path


def _number(section: str, key: str, value: Any, low: float, high: float,
            low_open: bool) -> float:
    ok = (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        allowed = f"{'(' if low_open else '['}{low}, {high}]"
        raise invalid(_dotted(section, key), f"{where(section, key)}={value!r}; allowed: "
                      f"{allowed}", value, allowed)
    return float(value)


def _integer(section: str, key: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise invalid(_dotted(section, key), f"{where(section, key)}={value!r}; allowed: "
                      f"integers >= {low}", value, f"integers >= {low}")
    return value


def _class_index(value: Any) -> int | tuple[int, ...]:
    """``generator.class_index``: one class (an integer >= 0) or a class list (1 to 256
    distinct integers >= 0: a multi-class world, each input asks for one of them); the upper
    bound is checked against the network once loaded."""
    if isinstance(value, list):
        if not 0 < len(value) <= MAX_CLASSES or len(set(map(repr, value))) != len(value):
            allowed = f"an integer >= 0, or a list of 1 to {MAX_CLASSES} distinct ones"
            raise invalid("generator.class_index", f"{where('generator', 'class_index')}="
                          f"{shorten(repr(value), 80)}; allowed: {allowed}", short_repr(value),
                          allowed)
        return tuple(_integer("generator", "class_index", v, 0) for v in value)
    return _integer("generator", "class_index", value, 0)


def _parse_generator(root: Path, raw: Any) -> dict[str, Any]:
    kind = raw.get("kind") if isinstance(raw, Mapping) else None
    if kind not in _GENERATOR_KEYS:
        raise invalid("generator.kind", f"{MANIFEST}: generator.kind={kind!r}; allowed: "
                      f"{', '.join(_GENERATOR_KEYS)}", kind, ", ".join(_GENERATOR_KEYS))
    always, files, file_options, options = _GENERATOR_KEYS[kind]
    section = _check_keys("generator", raw, {"kind"} | always,
                          files | file_options | options | {CONVERTED})
    if _one_source("generator", section, files, file_options):
        source = {CONVERTED: _file(root, "generator", CONVERTED, section[CONVERTED], True)}
    else:
        source = {key: _file(root, "generator", key, section[key]) for key in sorted(files)}
    if kind == "stylegan2":
        if CONVERTED not in source:
            network = section.get("network", "G_ema")  # checked against the pickle once read
            if not isinstance(network, str) or not network:
                raise invalid("generator.network", f"{where('generator', 'network')}="
                              f"{network!r}; expected the key of a generator in the pickle "
                              "(e.g. 'G_ema')", network, "a non-empty string")
            source["network"] = network
        cutoff = section.get("truncation_cutoff")
        class_index = section.get("class_index")  # checked against c_dim once loaded
        return {
            "kind": kind, **source,
            "truncation_psi": _number("generator", "truncation_psi",
                                      section.get("truncation_psi", 1.0), 0.0, 1.0, True),
            "truncation_cutoff": None if cutoff is None
            else _integer("generator", "truncation_cutoff", cutoff, 1),
            "class_index": None if class_index is None else _class_index(class_index),
        }
    return {
        "kind": kind, **source,
        "class_index": _class_index(section["class_index"]),
        "truncation": _number("generator", "truncation", section.get("truncation", 1.0),
                              0.0, 1.0, True),
    }


def _parse_cbae(root: Path, raw: Any, generator_kind: str) -> dict[str, Path] | None:
    if raw is None:
        return None
    if generator_kind == "stylegan2" and not (isinstance(raw, Mapping) and "trained" in raw):
        section = _check_keys("cbae", raw, set(), _CBAE_FILES | {CONVERTED})
        if _one_source("cbae", section, _CBAE_FILES):
            return {CONVERTED: _file(root, "cbae", CONVERTED, section[CONVERTED], True)}
        return {key: _file(root, "cbae", key, section[key]) for key in sorted(_CBAE_FILES)}
    section = _check_keys("cbae", raw, _TRAINED_CBAE_KEYS, set())
    return {"trained": _file(root, "cbae", "trained", section["trained"], directory=True)}


def _triple(key: str, value: Any, positive: bool) -> tuple[float, float, float]:
    ok = (isinstance(value, list) and len(value) == 3
          and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                  and (v > 0 or not positive) for v in value))
    if not ok:
        rule = "three numbers > 0" if positive else "three finite numbers"
        raise invalid(f"preprocess.{key}", f"{where('preprocess', key)}={short_repr(value)}; "
                      f"expected {rule} (R, G, B)", short_repr(value), rule)
    return tuple(float(v) for v in value)


def _parse_preprocess(raw: Any) -> Preprocess:
    section = _check_keys("preprocess", raw, _PREPROCESS_KEYS, set())
    size = section["size"]
    if size is not None:
        if not (isinstance(size, list) and len(size) == 2
                and all(isinstance(s, int) and not isinstance(s, bool)
                        and 1 <= s <= MAX_PREPROCESS_SIDE for s in size)):
            allowed = f"null or [height, width], integers in [1, {MAX_PREPROCESS_SIDE}]"
            raise invalid("preprocess.size", f"{where('preprocess', 'size')}="
                          f"{short_repr(size)}; expected {allowed}", short_repr(size), allowed)
        size = (size[0], size[1])
    return Preprocess(size=size, mean=_triple("mean", section["mean"], False),
                      std=_triple("std", section["std"], True))


def read_manifest(path: str | Path) -> WorldSpec:
    """Parse and validate ``<path>/world.json`` (see the module docstring for the format).

    Raises:
      ConfigError: (`invalid`: key = the world.json key at fault, or ``world``) no manifest,
        invalid JSON (not UTF-8, or nested deeper than Python's recursion limit), an unknown
        or missing key (named), a section naming both a converted directory and upstream
        files, a value out of range, or a file or directory it names that does not exist.
    """
    root = Path(path).resolve()
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise invalid("world", f"{root} has no {MANIFEST}; not a world directory", str(root),
                      f"a directory with a {MANIFEST}")
    try:
        raw = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise invalid("world", f"{manifest_path}: not valid JSON ({shorten(str(err))})",
                      str(root)) from None
    except RecursionError:
        raise invalid("world", f"{manifest_path}: not valid JSON (nested too deeply)",
                      str(root)) from None
    top = _check_keys("", raw, _TOP_KEYS - _OPTIONAL_TOP_KEYS, _OPTIONAL_TOP_KEYS)
    if top["format_version"] != FORMAT_VERSION:
        raise invalid("format_version", f"{MANIFEST}: format_version="
                      f"{top['format_version']!r}; this cbcert reads version {FORMAT_VERSION}",
                      top["format_version"], str(FORMAT_VERSION))
    generator = _parse_generator(root, top["generator"])
    cbae = _parse_cbae(root, top.get("cbae"), generator["kind"])
    roles = _check_keys("classifiers", top["classifiers"], set(REQUIRED_ROLES),
                        set(ROLES) - set(REQUIRED_ROLES))
    classifiers = {role: _file(root, "classifiers", role, roles[role], directory=True)
                   for role in ROLES if role in roles}
    names = top["class_names"]
    if not (isinstance(names, list) and len(names) >= 2
            and all(isinstance(n, str) and n for n in names)):
        raise invalid("class_names", f"{MANIFEST}: class_names={short_repr(names)}; expected a "
                      "list of >= 2 names", short_repr(names), "a list of >= 2 names")
    name = top.get("name", root.name)
    if not isinstance(name, str) or not name:
        raise invalid("name", f"{MANIFEST}: name={short_repr(name)}; expected a non-empty "
                      "string", short_repr(name), "a non-empty string")
    concept_classifier = (None if top.get("concept_classifier") is None else _file(
        root, "", "concept_classifier", top["concept_classifier"], directory=True))
    return WorldSpec(root=root, name=name, generator=generator, cbae=cbae,
                     classifiers=classifiers, class_names=tuple(names),
                     preprocess=_parse_preprocess(top["preprocess"]),
                     concept_classifier=concept_classifier)
