"""CUB-200-2011 (Wah et al. 2011) read from its published layout; class-level attribute labels.

``ROOT`` is the directory that holds ``images.txt`` (``CUB_200_2011/`` of the published
``CUB_200_2011.tgz``); its parent, the directory holding ``CUB_200_2011/``, is accepted too.
The files read, each line whitespace-separated (blank lines skipped)::

    ROOT/images.txt                 <image_id> <path under ROOT/images/>
    ROOT/image_class_labels.txt     <image_id> <class_id>          class ids from classes.txt
    ROOT/train_test_split.txt       <image_id> <is_training_image> 1 train, 0 test
    ROOT/classes.txt                <class_id> <class name>        ids 1..C (C = 200)
    ROOT/images/<path>              the image (JPEG)
    attributes.txt                  <attribute_id> <name>          ids 1..A (A = 312); looked
                                    for at ROOT/../attributes.txt (where the tarball puts it,
                                    next to CUB_200_2011/), then ROOT/attributes.txt and
                                    ROOT/attributes/attributes.txt (other copies)
    ROOT/attributes/image_attribute_labels.txt
                                    <image_id> <attribute_id> <is_present> <certainty_id> <time>

The two attribute files are read only with ``attributes=True``. Checks (each failure a
`cbcert.datasets.common.DatasetError` naming the file and line): every line has its fields,
ids and values are integers in range (class ids within classes.txt, attribute ids within
attributes.txt, ``is_training_image`` and ``is_present`` 0/1, ``certainty_id`` 1..4); image
ids are unique in images.txt and each has exactly one class label and one split entry (a label
or split line for an id not in images.txt is an error too); image paths are relative and stay
inside ``images/``; every image of the requested split exists on disk (the message names the
file and the images.txt line listing it; the other split's files are not checked).

Attribute labels. Each (image, attribute) pair appears at most once, and — since the published
file is complete (11 788 × 312 lines) — exactly once: a missing pair is an error naming the
image and attribute ids. ``is_present`` is taken as given (``certainty_id`` is checked but not
used). A handful of lines of the published file carry an extra trailing field (six, some
reports say seven, instead of five); lines of 5 to 7 fields are accepted and nothing after
``<certainty_id>`` is read (``<time>`` is never parsed). The file is streamed, never held as
text; parsing and checking its 3.7 M lines takes a few seconds on every `load_cub` call.

Labels are 0-based: ``Example.label = class_id − 1``; ``Example.attributes[a − 1]`` is the
``is_present`` of ``attribute_id`` ``a``; ``Example.id`` is the ``image_id``. Records follow
images.txt order.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from os import PathLike
from pathlib import Path, PurePosixPath

import numpy as np

from cbcert.datasets.common import (
    DatasetError,
    Example,
    ImageDataset,
    bad_line,
    parse_int,
    read_only,
    require_dir,
    require_file,
    table_rows,
)
from cbcert.schema import ConfigError, shorten

CUB_DIR = "CUB_200_2011"
IMAGES = "images.txt"
CLASS_LABELS = "image_class_labels.txt"
TRAIN_TEST_SPLIT = "train_test_split.txt"
CLASSES = "classes.txt"
ATTRIBUTES = "attributes.txt"
ATTRIBUTE_LABELS = "attributes/image_attribute_labels.txt"
IMAGE_DIR = "images"
SPLITS = ("train", "test")
CERTAINTIES = 4  # certainty_id 1..4 (attributes/certainties.txt: not visible .. definitely)
_MAX_ID = 10**9  # bound on any id, so that a corrupt file cannot ask for a huge table

_WHAT = {
    IMAGES: "the list of images of the CUB-200-2011 layout ('<image_id> <path>' per line)",
    CLASS_LABELS: "the class labels of the CUB-200-2011 layout ('<image_id> <class_id>' per "
                  "line)",
    TRAIN_TEST_SPLIT: "the train/test split of the CUB-200-2011 layout ('<image_id> "
                      "<is_training_image>' per line)",
    CLASSES: "the class names of the CUB-200-2011 layout ('<class_id> <name>' per line)",
    ATTRIBUTES: "the attribute names of the CUB-200-2011 layout ('<attribute_id> <name>' per "
                "line)",
    ATTRIBUTE_LABELS: "the per-image attribute labels of the CUB-200-2011 layout "
                      "('<image_id> <attribute_id> <is_present> <certainty_id> <time>' per "
                      "line)",
}


@dataclass(frozen=True, eq=False)
class CubDataset(ImageDataset):
    """One split of CUB-200-2011 (`ImageDataset`; ``root`` is the ``CUB_200_2011`` directory,
    ``class_names`` the classes.txt names such as ``"001.Black_footed_Albatross"``,
    ``attribute_names`` the attributes.txt names such as ``"has_bill_shape::dagger"``)."""


def find_root(root: str | PathLike) -> Path:
    """The directory holding images.txt: ``root`` itself or ``root/CUB_200_2011``.

    Raises:
      DatasetError: neither holds images.txt (naming the paths looked at).
    """
    root = Path(root).expanduser().absolute()
    for candidate in (root, root / CUB_DIR):
        if (candidate / IMAGES).exists():
            return candidate
    raise DatasetError(root / IMAGES, f"no such file (nor {root / CUB_DIR / IMAGES}); expected "
                                      f"{_WHAT[IMAGES]}, in the CUB_200_2011 directory or "
                                      "its parent")


def attributes_file(root: Path) -> Path:
    """attributes.txt for the CUB directory ``root``: the first of ``root/../attributes.txt``
    (the tarball's place), ``root/attributes.txt``, ``root/attributes/attributes.txt``.

    Raises:
      DatasetError: none exists (naming all three).
    """
    candidates = (root.parent / ATTRIBUTES, root / ATTRIBUTES, root / "attributes" / ATTRIBUTES)
    for candidate in candidates:
        if candidate.exists():
            return require_file(candidate, _WHAT[ATTRIBUTES])
    others = ", ".join(str(c) for c in candidates[1:])
    raise DatasetError(candidates[0], f"no such file (nor {others}); expected "
                                      f"{_WHAT[ATTRIBUTES]}, next to {CUB_DIR}/ as published")


def read_names(path: Path, what: str, id_name: str) -> tuple[str, ...]:
    """``<id> <name>`` lines (classes.txt, attributes.txt) as names ordered by id, ids 1..K.

    A name is the rest of the line (fields joined by one space). Every id from 1 to K (the
    number of lines) appears exactly once.

    Raises:
      DatasetError: a line without a name, a non-integer id, an id outside 1..K or repeated,
        or an empty file.
    """
    rows = list(table_rows(path, what))
    if not rows:
        raise DatasetError(path, f"no lines; expected {what}")
    names: dict[int, tuple[str, int]] = {}
    for number, fields in rows:
        if len(fields) < 2:
            raise bad_line(path, number, fields, f"<{id_name}> <name>")
        index = parse_int(fields[0], path, number, id_name, 1, len(rows))
        if index in names:
            raise DatasetError(path, f"{id_name} {index} appears twice (first on line "
                                     f"{names[index][1]})", line=number)
        names[index] = (" ".join(fields[1:]), number)
    return tuple(names[i][0] for i in range(1, len(rows) + 1))


def read_images(path: Path) -> dict[int, tuple[str, int]]:
    """images.txt as ``image_id -> (path relative to images/, line number)``, in file order.

    Raises:
      DatasetError: a line that is not ``<image_id> <path>``, a non-integer or repeated id, an
        absolute path or one with a ``..`` component, or an empty file.
    """
    images: dict[int, tuple[str, int]] = {}
    for number, fields in table_rows(path, _WHAT[IMAGES]):
        if len(fields) != 2:
            raise bad_line(path, number, fields, "<image_id> <path>")
        image_id = parse_int(fields[0], path, number, "image_id", 1, _MAX_ID)
        if image_id in images:
            raise DatasetError(path, f"image_id {image_id} appears twice (first on line "
                                     f"{images[image_id][1]})", line=number)
        relative = PurePosixPath(fields[1])
        if relative.is_absolute() or ".." in relative.parts or fields[1].startswith("\\"):
            raise DatasetError(path, f"path {shorten(fields[1], 80)!r} must be relative to "
                                     f"{IMAGE_DIR}/ and stay inside it", line=number)
        images[image_id] = (fields[1], number)
    if not images:
        raise DatasetError(path, f"no lines; expected {_WHAT[IMAGES]}")
    return images


def read_image_values(path: Path, images: dict[int, tuple[str, int]], value_name: str,
                      low: int, high: int, allowed: str) -> dict[int, int]:
    """A ``<image_id> <value>`` file (class labels, split) as ``image_id -> value``.

    Raises:
      DatasetError: a line that is not two fields, an image id not in images.txt or repeated, a
        value outside ``[low, high]`` (``allowed`` says where that range comes from), or an
        image of images.txt without a line.
    """
    what = _WHAT[path.name]
    values: dict[int, int] = {}
    lines: dict[int, int] = {}
    for number, fields in table_rows(path, what):
        if len(fields) != 2:
            raise bad_line(path, number, fields, f"<image_id> <{value_name}>")
        image_id = parse_int(fields[0], path, number, "image_id", 1, _MAX_ID)
        if image_id not in images:
            raise DatasetError(path, f"image_id {image_id} is not listed in {IMAGES}",
                               line=number)
        if image_id in values:
            raise DatasetError(path, f"image_id {image_id} appears twice (first on line "
                                     f"{lines[image_id]})", line=number)
        try:
            values[image_id] = parse_int(fields[1], path, number, value_name, low, high)
        except DatasetError as err:
            raise DatasetError(path, f"{err.detail} ({allowed})", line=number) from None
        lines[image_id] = number
    for image_id, (_, number) in images.items():
        if image_id not in values:
            raise DatasetError(path, f"no line for image_id {image_id} (listed on line {number} "
                                     f"of {path.parent / IMAGES}); expected one line per image")
    return values


def read_attribute_labels(path: Path, rows: dict[int, int], num_attributes: int) -> np.ndarray:
    """image_attribute_labels.txt as ``uint8[N, A]`` of ``is_present``, row ``rows[image_id]``.

    Streams the file (3.7 M lines for the real data) into compact arrays, then checks the
    pairs with numpy: each (image, attribute) exactly once.

    Raises:
      DatasetError: a line of fewer than 5 or more than 7 fields, a non-integer or
        out-of-range field (image ids from images.txt, attribute ids 1..A, ``is_present`` 0/1,
        ``certainty_id`` 1..4), a repeated pair (naming both lines) or a missing pair.
    """
    what = _WHAT[ATTRIBUTE_LABELS]
    image_rows, attributes, present, lines = array("q"), array("q"), array("b"), array("q")
    # Attribute ids as written -> 0-based column, and the valid is_present / certainty_id texts:
    # dictionary look-ups validate and convert the common case at once (3.7 M lines).
    columns = {str(a + 1): a for a in range(num_attributes)}
    binary, certainties = {"0": 0, "1": 1}, {str(c) for c in range(1, CERTAINTIES + 1)}
    for number, fields in table_rows(path, what):
        row = column = bit = None
        if 5 <= len(fields) <= 7 and fields[3] in certainties:
            image_id = fields[0]
            row = rows.get(int(image_id)) if image_id.isascii() and image_id.isdigit() else None
            column, bit = columns.get(fields[1]), binary.get(fields[2])
        if row is None or column is None or bit is None:  # an error, or an unusual form
            row, column, bit = _parse_attribute_line(path, number, fields, rows, num_attributes)
        image_rows.append(row)
        attributes.append(column)
        present.append(bit)
        lines.append(number)
    keys = (np.frombuffer(image_rows, np.int64) * num_attributes
            + np.frombuffer(attributes, np.int64))
    line_of = np.frombuffer(lines, np.int64)
    total = len(rows) * num_attributes
    order = np.argsort(keys, kind="stable")
    repeated = order[1:][keys[order][1:] == keys[order][:-1]]  # later occurrences
    if repeated.size:
        later = int(repeated.min())
        first = int(np.flatnonzero(keys == keys[later])[0])
        image_id = _image_id(rows, int(keys[later]) // num_attributes)
        raise DatasetError(path, f"image_id {image_id}, attribute_id "
                                 f"{int(keys[later]) % num_attributes + 1} appears twice "
                                 f"(first on line {int(line_of[first])})",
                           line=int(line_of[later]))
    seen = np.zeros(total, bool)
    seen[keys] = True
    if not seen.all():
        missing = int(np.flatnonzero(~seen)[0])
        image_id = _image_id(rows, missing // num_attributes)
        raise DatasetError(path, f"no line for image_id {image_id}, attribute_id "
                                 f"{missing % num_attributes + 1}; expected one line per image "
                                 f"and attribute ({len(rows)} × {num_attributes} = {total}), "
                                 "as in the published file")
    matrix = np.zeros(total, np.uint8)
    matrix[keys] = np.frombuffer(present, np.int8)
    return matrix.reshape(len(rows), num_attributes)


def _parse_attribute_line(path: Path, number: int, fields: list[str], rows: dict[int, int],
                          num_attributes: int) -> tuple[int, int, int]:
    """``(row, 0-based attribute, is_present)`` of a line of image_attribute_labels.txt that
    the fast path did not take (an error, or integers written with leading zeros).

    Raises:
      DatasetError: naming the line and the field at fault.
    """
    if not 5 <= len(fields) <= 7:
        raise bad_line(path, number, fields,
                       "<image_id> <attribute_id> <is_present> <certainty_id> <time>")
    image_id = parse_int(fields[0], path, number, "image_id", 1, _MAX_ID)
    if image_id not in rows:
        raise DatasetError(path, f"image_id {image_id} is not listed in {IMAGES}", line=number)
    try:
        attribute = parse_int(fields[1], path, number, "attribute_id", 1, num_attributes)
    except DatasetError as err:
        raise DatasetError(path, f"{err.detail} ({ATTRIBUTES} defines attribute ids "
                                 f"1..{num_attributes})", line=number) from None
    is_present = parse_int(fields[2], path, number, "is_present", 0, 1)
    parse_int(fields[3], path, number, "certainty_id", 1, CERTAINTIES)
    return rows[image_id], attribute - 1, is_present


def _image_id(rows: dict[int, int], row: int) -> int:
    return next(image_id for image_id, r in rows.items() if r == row)


def load_cub(root: str | PathLike, split: str, *, attributes: bool = True) -> CubDataset:
    """Read one split of CUB-200-2011 from its published layout (see the module docstring).

    Args:
      root: the ``CUB_200_2011`` directory (holding images.txt) or its parent.
      split: ``"train"`` (``is_training_image`` 1) or ``"test"`` (0).
      attributes: read attributes.txt and image_attribute_labels.txt and give every record its
        ``uint8[312]`` vector; False skips both files (``Example.attributes`` None).

    Returns:
      `CubDataset` of the split's records in images.txt order, C = 200 classes and, with
      ``attributes``, A = 312 attribute names (for the real data).

    Raises:
      ConfigError: ``split`` is not "train" or "test".
      DatasetError: any problem with the files (module docstring), or an empty split.
    """
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}; allowed: {', '.join(SPLITS)}", key="split",
                          value=split, allowed=", ".join(SPLITS))
    root = find_root(root)
    images = read_images(root / IMAGES)
    class_names = read_names(root / CLASSES, _WHAT[CLASSES], "class_id")
    labels = read_image_values(root / CLASS_LABELS, images, "class_id", 1, len(class_names),
                               f"{CLASSES} defines class ids 1..{len(class_names)}")
    is_train = read_image_values(root / TRAIN_TEST_SPLIT, images, "is_training_image", 0, 1,
                                 "1 for a training image, 0 for a test image")
    attribute_names: tuple[str, ...] = ()
    matrix = None
    if attributes:
        attribute_names = read_names(attributes_file(root), _WHAT[ATTRIBUTES], "attribute_id")
        rows = {image_id: row for row, image_id in enumerate(images)}
        matrix = read_only(read_attribute_labels(root / ATTRIBUTE_LABELS, rows,
                                                 len(attribute_names)))
    wanted = int(split == "train")
    image_dir = require_dir(root / IMAGE_DIR, f"the image directory of the CUB-200-2011 layout "
                                              f"(the paths of {IMAGES} are relative to it)")
    items = []
    for row, (image_id, (relative, number)) in enumerate(images.items()):
        if is_train[image_id] != wanted:
            continue
        path = image_dir / relative
        if not path.is_file():
            state = "does not exist" if not path.exists() else "is not a regular file"
            raise DatasetError(root / IMAGES, f"image file {path} {state}", line=number)
        items.append(Example(path=path, label=labels[image_id] - 1,
                             attributes=None if matrix is None else matrix[row], id=image_id))
    if not items:
        raise DatasetError(root / TRAIN_TEST_SPLIT, f"the {split} split is empty: no line has "
                                                    f"is_training_image={wanted}")
    return CubDataset(root=root, split=split, items=tuple(items), class_names=class_names,
                      attribute_names=attribute_names)


def class_attribute_majority(dataset: ImageDataset) -> np.ndarray:
    """``uint8[C, A]``: per class, the majority value of each attribute over its training images.

    The class-level attribute labels of the concept bottleneck models of Koh et al. (2020),
    "Concept Bottleneck Models": ``M[c, a] = 1`` iff at least half of the training images of
    class ``c`` have attribute ``a`` present (a tie counts as present, as in their
    preprocessing). Their further step, keeping the attributes present in at least 10 classes,
    is not done here.

    Args:
      dataset: the training split, loaded with attributes.

    Raises:
      ConfigError: ``dataset`` is not the training split, has no attributes, or a class has
        no image in it.
    """
    if dataset.split != "train":
        raise ConfigError(f"dataset.split={dataset.split!r}; the class majorities are taken over "
                          "the training images: pass the train split", key="split",
                          value=dataset.split, allowed="train")
    matrix = dataset.attribute_matrix().astype(np.int64)
    labels = dataset.labels()
    totals = np.bincount(labels, minlength=dataset.num_classes)
    if (totals == 0).any():
        empty = int(np.flatnonzero(totals == 0)[0])
        raise ConfigError(f"class {empty} ({dataset.class_names[empty]!r}) has no training "
                          "image; every class needs one for its majority", key="dataset")
    counts = np.zeros((dataset.num_classes, dataset.num_attributes), np.int64)
    np.add.at(counts, labels, matrix)
    return (2 * counts >= totals[:, None]).astype(np.uint8)
