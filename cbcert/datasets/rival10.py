"""RIVAL-10 (Moayeri et al., CVPR 2022) read from its published layout.

RIVAL-10 ("RIch Visual Attributes with Localization"): ImageNet images of 10 CIFAR-10-like
classes, each made of two ImageNet synsets, with 18 binary attributes per image and
segmentation masks. ``ROOT`` is the ``RIVAL10`` directory that ``rival10.zip`` unzips to (its
parent, holding ``RIVAL10/``, is accepted too). The layout, as the authors' loader reads it::

    ROOT/meta/label_mappings.json   {"<ImageNet class name>": ["<RIVAL-10 class>", <0..9>], ...}
                                    20 entries, two per class
    ROOT/meta/wnid_to_class.json    {"<wnid>": "<ImageNet class name>", ...}  (all of ImageNet)
    ROOT/<split>/ordinary/<wnid>_<n>.JPEG               the image, split "train" or "test"
    ROOT/<split>/ordinary/<wnid>_<n>_attr_labels.npy    [2, 18] array: row 0 the attributes
                                                        present (0/1), row 1 those changed by
                                                        an augmentation (0 for "ordinary")
    ROOT/<split>/ordinary/<wnid>_<n>_merged_mask.JPEG   union of the attribute masks
    ROOT/<split>/ordinary/<wnid>_<n>_attr_dict.pkl      pickled {attribute: base64 PNG mask}
    ROOT/<split>/entire_object_masks/...                object masks

Files read here: the two JSON files, the images (every ``*.JPEG`` of ``ordinary/`` whose name
does not end in ``_merged_mask.JPEG``) and, with ``attributes=True``, their
``_attr_labels.npy`` (row 0; loaded with ``allow_pickle=False``). The masks are not needed for
classification or attributes and are neither read nor required; pickles are never loaded. The
``superimposed`` and ``removed`` folders of attribute-augmented copies, which the authors'
loader can add, are not read.

Class of an image: its wnid is the file name up to the first ``_``; ``wnid_to_class.json``
maps it to an ImageNet class name, ``label_mappings.json`` maps that to the RIVAL-10 class
name and index (0 truck, 1 car, 2 plane, 3 ship, 4 cat, 5 dog, 6 equine, 7 deer, 8 frog,
9 bird). Attributes: `ATTRIBUTE_NAMES`, the column order of ``_attr_labels.npy`` (the dataset
ships no attribute-name file; the order is the authors' loader's list).

Where the layout was learned: the authors' repository github.com/mmoayeri/RIVAL10 (branch
gh-pages), ``datasets/local_rival10.py`` (class ``LocalRIVAL10``: ``_DATA_ROOT`` of
``RIVAL10/{train,test}/``, the ``ordinary`` folder, the per-image file suffixes, the wnid from
the file name, the 18 attribute names, ``labels[0]``/``labels[1]`` of the ``.npy``),
``datasets/label_mappings.json`` and ``datasets/wnid_to_class.json`` (the formats; that
repository's README points to the data's download); ``meta/`` as the JSON files' place in the
unzipped data comes from users' copies of that loader (e.g. ``_LABEL_MAPPINGS =
'.../RIVAL10/meta/label_mappings.json'``). No code was taken from it (its licence forbids
copying).

Checks (each failure a `cbcert.datasets.common.DatasetError`): the JSON files parse (the
message names the line of a syntax error) without repeated keys, have the formats above
(naming the key at fault) and define classes 0..9 with one name each; every image's wnid is in
``wnid_to_class.json`` and its ImageNet class in ``label_mappings.json``; each
``_attr_labels.npy`` exists, is a numeric ``[2, 18]`` array of 0/1; the split has images.
Records are sorted by file name; ``Example.id`` is the file name without ``.JPEG``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from cbcert.datasets.common import (
    DatasetError,
    Example,
    ImageDataset,
    read_only,
    require_dir,
    require_file,
)
from cbcert.schema import ConfigError, short_repr, shorten

RIVAL10_DIR = "RIVAL10"
LABEL_MAPPINGS = "meta/label_mappings.json"
WNID_TO_CLASS = "meta/wnid_to_class.json"
INSTANCES = "ordinary"
IMAGE_SUFFIX = ".JPEG"
ATTR_LABELS_SUFFIX = "_attr_labels.npy"
MERGED_MASK_SUFFIX = "_merged_mask.JPEG"
SPLITS = ("train", "test")
# Index order of the classes (label_mappings.json) and the attribute columns of the .npy files.
CLASS_NAMES = ("truck", "car", "plane", "ship", "cat", "dog", "equine", "deer", "frog", "bird")
ATTRIBUTE_NAMES = ("long-snout", "wings", "wheels", "text", "horns", "floppy-ears", "ears",
                   "colored-eyes", "tail", "mane", "beak", "hairy", "metallic", "rectangular",
                   "wet", "long", "tall", "patterned")
NUM_CLASSES, NUM_ATTRIBUTES = len(CLASS_NAMES), len(ATTRIBUTE_NAMES)

_WHAT = {
    LABEL_MAPPINGS: "the class mapping of the RIVAL-10 layout (a JSON object: ImageNet class "
                    "name -> [RIVAL-10 class name, class index 0..9])",
    WNID_TO_CLASS: "the wnid mapping of the RIVAL-10 layout (a JSON object: ImageNet wnid -> "
                   "ImageNet class name)",
}


@dataclass(frozen=True, eq=False)
class Rival10Dataset(ImageDataset):
    """One split of RIVAL-10 (`ImageDataset`; ``root`` is the ``RIVAL10`` directory,
    ``class_names`` from label_mappings.json by index, ``attribute_names`` `ATTRIBUTE_NAMES`)."""


def find_root(root: str | PathLike) -> Path:
    """The ``RIVAL10`` directory: ``root`` if it holds ``meta/``, ``train/`` or ``test/``, else
    ``root/RIVAL10``.

    Raises:
      DatasetError: neither looks like the unzipped data (naming what was expected).
    """
    root = Path(root).expanduser().absolute()
    for candidate in (root, root / RIVAL10_DIR):
        if any((candidate / name).is_dir() for name in ("meta", *SPLITS)):
            return candidate
    raise DatasetError(root, f"not a RIVAL-10 directory: no meta/, train/ or test/ in it nor in "
                             f"{root / RIVAL10_DIR}; expected the {RIVAL10_DIR} directory that "
                             "rival10.zip unzips to")


def _key_line(text: str, key: str) -> int | None:
    """The line where ``key`` first appears as a JSON string in ``text`` (for messages)."""
    at = text.find(json.dumps(key))
    if at < 0:
        at = text.find(json.dumps(key, ensure_ascii=False))
    return None if at < 0 else text.count("\n", 0, at) + 1


class _RepeatedKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def read_json_object(path: Path, what: str) -> tuple[dict[str, Any], str]:
    """A JSON file holding one object: ``(object, file text)`` (the text locates keys).

    Raises:
      DatasetError: missing or unreadable file, not UTF-8, a syntax error (naming its line), a
        repeated key (naming it and its line), or a top-level value that is not an object.
    """
    require_file(path, what)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise DatasetError(path, f"cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise DatasetError(path, f"not UTF-8 text ({err.reason}); expected {what}",
                           line=line) from None
    try:
        value = json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as err:
        raise DatasetError(path, f"not valid JSON ({err.msg}, column {err.colno}); expected "
                                 f"{what}", line=err.lineno) from None
    except _RepeatedKey as err:
        raise DatasetError(path, f"the key appears twice; expected {what}", key=err.key,
                           line=_key_line(text, err.key)) from None
    if not isinstance(value, dict):
        raise DatasetError(path, f"the file holds a {type(value).__name__}; expected {what}")
    return value, text


def read_label_mappings(path: Path) -> tuple[dict[str, int], tuple[str, ...]]:
    """label_mappings.json: ``(ImageNet class name -> class index, class names by index)``.

    Raises:
      DatasetError: a value that is not ``[name, index]`` with a string name and an integer
        index in 0..9, two names for one index (naming the key), or an index without entry.
    """
    mapping, text = read_json_object(path, _WHAT[LABEL_MAPPINGS])
    index_of: dict[str, int] = {}
    names: dict[int, tuple[str, str]] = {}  # index -> (RIVAL-10 name, first key)
    for key, value in mapping.items():
        ok = (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
              and isinstance(value[1], int) and not isinstance(value[1], bool))
        if not ok:
            raise DatasetError(path, f"value {short_repr(value)}; expected [\"<RIVAL-10 class "
                                     "name>\", <class index 0..9>]", key=key,
                               line=_key_line(text, key))
        name, index = value
        if not 0 <= index < NUM_CLASSES:
            raise DatasetError(path, f"class index {index} is out of range; allowed: "
                                     f"0..{NUM_CLASSES - 1} (RIVAL-10 has {NUM_CLASSES} classes)",
                               key=key, line=_key_line(text, key))
        if index in names and names[index][0] != name:
            raise DatasetError(path, f"class index {index} is named {name!r} here but "
                                     f"{names[index][0]!r} under key {names[index][1]!r}; one "
                                     "name per index", key=key, line=_key_line(text, key))
        names.setdefault(index, (name, key))
        index_of[key] = index
    missing = [i for i in range(NUM_CLASSES) if i not in names]
    if missing:
        raise DatasetError(path, f"no entry maps to class index {missing[0]}; expected the "
                                 f"{NUM_CLASSES} classes 0..{NUM_CLASSES - 1}")
    return index_of, tuple(names[i][0] for i in range(NUM_CLASSES))


def read_wnid_to_class(path: Path) -> dict[str, str]:
    """wnid_to_class.json: ``wnid -> ImageNet class name``.

    Raises:
      DatasetError: a value that is not a string (naming the key).
    """
    mapping, text = read_json_object(path, _WHAT[WNID_TO_CLASS])
    for key, value in mapping.items():
        if not isinstance(value, str):
            raise DatasetError(path, f"value {short_repr(value)}; expected the ImageNet class "
                                     "name (a string)", key=key, line=_key_line(text, key))
    return mapping


def image_files(folder: Path) -> list[Path]:
    """The images of an ``ordinary/`` folder: ``*.JPEG`` but ``*_merged_mask.JPEG``, sorted."""
    return sorted(path for path in folder.iterdir() if path.name.endswith(IMAGE_SUFFIX)
                  and not path.name.endswith(MERGED_MASK_SUFFIX))


def read_attr_labels(path: Path, image: Path) -> np.ndarray:
    """``uint8[18]``: row 0 (attributes present) of one ``_attr_labels.npy`` of ``image``.

    Raises:
      DatasetError: the file is missing, not a plain ``.npy`` (pickled objects are refused),
        not a numeric ``[2, 18]`` array or holds values other than 0 and 1 (naming the file).
    """
    expected = (f"the attribute labels of {image.name}: a [2, {NUM_ATTRIBUTES}] array of 0/1 "
                "(.npy; row 0 present, row 1 changed)")
    require_file(path, expected)
    try:
        labels = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise DatasetError(path, f"not a readable .npy ({shorten(str(err), 200)}); expected "
                                 f"{expected}") from None
    if not isinstance(labels, np.ndarray) or labels.dtype.kind not in "biuf":
        raise DatasetError(path, f"holds {getattr(labels, 'dtype', type(labels))!s} data; "
                                 f"expected {expected}")
    if labels.shape != (2, NUM_ATTRIBUTES):
        raise DatasetError(path, f"shape {labels.shape}; expected {expected}")
    bad = ~np.isin(labels, (0, 1))
    if bad.any():
        row, column = (int(i) for i in np.argwhere(bad)[0])
        raise DatasetError(path, f"value {labels[row, column].item()!r} at [{row}, {column}]; "
                                 f"expected {expected}")
    return labels[0].astype(np.uint8)


def load_rival10(root: str | PathLike, split: str, *, attributes: bool = True
                 ) -> Rival10Dataset:
    """Read one split of RIVAL-10 from its published layout (see the module docstring).

    Args:
      root: the ``RIVAL10`` directory or its parent.
      split: ``"train"`` or ``"test"`` (the folder ``ROOT/<split>/ordinary``).
      attributes: read each image's ``_attr_labels.npy`` into ``Example.attributes``
        (``uint8[18]``); False reads no ``.npy`` (``Example.attributes`` None).

    Returns:
      `Rival10Dataset` of the split's records sorted by file name, 10 classes, and the 18
      attribute names (empty without ``attributes``).

    Raises:
      ConfigError: ``split`` is not "train" or "test".
      DatasetError: any problem with the files (module docstring), or an empty split.
    """
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}; allowed: {', '.join(SPLITS)}", key="split",
                          value=split, allowed=", ".join(SPLITS))
    root = find_root(root)
    mappings_path, wnids_path = root / LABEL_MAPPINGS, root / WNID_TO_CLASS
    index_of, class_names = read_label_mappings(mappings_path)
    wnid_to_class = read_wnid_to_class(wnids_path)
    folder = require_dir(root / split / INSTANCES, f"the {split} images of the RIVAL-10 layout "
                                                   f"(<wnid>_<n>{IMAGE_SUFFIX} and their "
                                                   f"{ATTR_LABELS_SUFFIX})")
    items = []
    for path in image_files(folder):
        if not path.is_file():
            raise DatasetError(path, "not a regular file; expected an image")
        stem = path.name[:-len(IMAGE_SUFFIX)]
        wnid = stem.split("_", 1)[0]
        if wnid not in wnid_to_class:
            raise DatasetError(wnids_path, f"no entry for the wnid of image {path} (its file "
                                           "name up to the first '_'); expected every image's "
                                           "ImageNet wnid", key=wnid)
        imagenet_class = wnid_to_class[wnid]
        if imagenet_class not in index_of:
            raise DatasetError(mappings_path, f"no entry for ImageNet class {imagenet_class!r} "
                                              f"(wnid {wnid} of image {path}); RIVAL-10 images "
                                              "come from the classes this file lists",
                               key=imagenet_class)
        vector = None
        if attributes:
            vector = read_only(read_attr_labels(path.with_name(stem + ATTR_LABELS_SUFFIX), path))
        items.append(Example(path=path, label=index_of[imagenet_class], attributes=vector,
                             id=stem))
    if not items:
        raise DatasetError(folder, f"the {split} split is empty: no <wnid>_<n>{IMAGE_SUFFIX} "
                                   "image in it")
    return Rival10Dataset(root=root, split=split, items=tuple(items), class_names=class_names,
                          attribute_names=ATTRIBUTE_NAMES if attributes else ())
