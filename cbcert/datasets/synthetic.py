"""Tiny synthetic datasets written in the published CUB-200-2011 and RIVAL-10 layouts.

For tests and end-to-end runs without the real data: every file the readers
(`cbcert.datasets.cub`, `cbcert.datasets.rival10`) read is written with the real names and
formats, images as JPEG files. The content is learnable: an image is a background of its
class's colour (hues evenly spaced around the colour wheel, plus mild pixel noise) with a white
square marker in grid cell ``a`` for each attribute ``a`` present; attributes follow a per-class
prototype (present with probability 0.85 where the prototype has it, 0.15 elsewhere), so they
correlate with the class as in the real data. Images are 5/4 as wide as high, the markers inside
the centred square that `cbcert.datasets.common.load_image` crops to.

Everything is a function of ``seed`` only (numpy's ``default_rng`` streams, PIL's JPEG
encoder): the same call writes the same files.
"""

from __future__ import annotations

import base64
import colorsys
import io
import json
import math
import pickle
from os import PathLike
from pathlib import Path

import numpy as np
from PIL import Image

from cbcert.datasets import cub, rival10

_PRESENT, _ABSENT = 0.85, 0.15  # attribute probability where the class prototype has it / not
_JPEG_QUALITY = 92
# The 20 ImageNet synsets of RIVAL-10: wnid, ImageNet class name (as wnid_to_class.json names
# it), RIVAL-10 class index (label_mappings.json). Two per class, in class order.
RIVAL10_SYNSETS = (
    ("n03796401", "moving van", 0), ("n04467665", "semi", 0),
    ("n02814533", "waggon", 1), ("n03100240", "convertible", 1),
    ("n02690373", "airliner", 2), ("n04552348", "military plane", 2),
    ("n03673027", "ocean liner", 3), ("n03095699", "container vessel", 3),
    ("n02123394", "Persian cat", 4), ("n02124075", "Egyptian cat", 4),
    ("n02099712", "Labrador retriever", 5), ("n02099601", "golden retriever", 5),
    ("n02389026", "sorrel", 6), ("n02391049", "zebra", 6),
    ("n02423022", "gazelle", 7), ("n02422699", "Aepyceros melampus", 7),
    ("n01644900", "Ascaphus trui", 8), ("n01644373", "tree-frog", 8),
    ("n01531178", "Carduelis carduelis", 9), ("n01532829", "Carpodacus mexicanus", 9),
)


def class_colour(label: int, num_classes: int) -> np.ndarray:
    """``float64[3]`` in [0, 255]: the background colour of class ``label`` (evenly spaced
    hues, saturation 0.75, value 0.8)."""
    return np.array(colorsys.hsv_to_rgb(label / num_classes, 0.75, 0.8)) * 255.0


def _marker_boxes(attributes: np.ndarray, size: int) -> list[tuple[int, int, int]]:
    """``(top, left, extent)`` of the marker of each present attribute (see `draw`)."""
    left = (size // 4) // 2
    grid = max(1, math.ceil(math.sqrt(len(attributes))))
    cell = size / grid
    boxes = []
    for a in np.flatnonzero(attributes):
        row, column = divmod(int(a), grid)
        boxes.append((int(row * cell + cell / 4), int(left + column * cell + cell / 4),
                      max(1, int(cell / 2))))
    return boxes


def draw(label: int, num_classes: int, attributes: np.ndarray, size: int,
         rng: np.random.Generator) -> np.ndarray:
    """``uint8[size, size + size // 4, 3]``: one synthetic image (module docstring).

    Attribute ``a`` of ``A`` is a white square in cell ``a`` (row-major) of a
    ``⌈√A⌉ × ⌈√A⌉`` grid over the centred ``size × size`` square, half a cell wide.
    """
    pixels = class_colour(label, num_classes) + rng.normal(0.0, 8.0, (size, size + size // 4, 3))
    for top, left, extent in _marker_boxes(attributes, size):
        pixels[top:top + extent, left:left + extent] = 255.0
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def marker_mask(attributes: np.ndarray, size: int) -> np.ndarray:
    """``uint8[size, size + size // 4]``: 255 on the markers `draw` paints, else 0."""
    mask = np.zeros((size, size + size // 4), np.uint8)
    for top, left, extent in _marker_boxes(attributes, size):
        mask[top:top + extent, left:left + extent] = 255
    return mask


def _save_jpeg(pixels: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No chroma subsampling: a marker of 2 pixels keeps its white at 16 × 16.
    Image.fromarray(pixels).save(path, format="JPEG", quality=_JPEG_QUALITY, subsampling=0)


def _attributes(prototypes: np.ndarray, label: int, rng: np.random.Generator) -> np.ndarray:
    """``uint8[A]``: one image's attributes drawn around its class prototype."""
    p = np.where(prototypes[label] == 1, _PRESENT, _ABSENT)
    return (rng.random(len(p)) < p).astype(np.uint8)


def _prototypes(num_classes: int, num_attributes: int, rng: np.random.Generator) -> np.ndarray:
    """``uint8[C, A]``: each class's typical attributes, about half present; where
    ``A ≥ ⌈log2 C⌉`` the first ``⌈log2 C⌉`` columns hold the binary code of the class, so that
    the rows differ."""
    prototypes = (rng.random((num_classes, num_attributes)) < 0.5).astype(np.uint8)
    code = max(1, math.ceil(math.log2(max(num_classes, 2))))
    if num_attributes >= code:
        classes = np.arange(num_classes)[:, None]
        prototypes[:, :code] = (classes >> np.arange(code)[None, :]) & 1
    return prototypes


def write_cub_layout(root: str | PathLike, *, num_classes: int = 4, images_per_class: int = 6,
                     num_attributes: int = 12, image_size: int = 32, seed: int = 0) -> Path:
    """Write a synthetic CUB-200-2011 under ``root``; return its ``CUB_200_2011`` directory.

    Writes ``root/attributes.txt`` (next to ``CUB_200_2011/``, as the tarball does) and, in
    ``root/CUB_200_2011/``: images.txt, image_class_labels.txt, train_test_split.txt,
    classes.txt, attributes/image_attribute_labels.txt (every image × attribute, image-major,
    with random ``certainty_id`` 1..4 and ``time``) and ``images/<class>/<name>.jpg``
    (``image_size`` high, 5/4 as wide). Image ids run 1..C·n class by class; in each class
    ``⌈n/2⌉`` images, drawn at random, are training images.

    Returns:
      ``root/CUB_200_2011``, the directory `cbcert.datasets.cub.load_cub` takes.
    """
    rng = np.random.default_rng([seed, 1])
    top = Path(root)
    base = top / cub.CUB_DIR
    (base / "attributes").mkdir(parents=True, exist_ok=True)
    class_names = [f"{c + 1:03d}.Synthetic_Bird_{c + 1:02d}" for c in range(num_classes)]
    attribute_names = [f"has_mark_{a + 1:02d}::present" for a in range(num_attributes)]
    prototypes = _prototypes(num_classes, num_attributes, rng)
    images, labels, split, attribute_lines = [], [], [], []
    image_id = 0
    for c, name in enumerate(class_names):
        train = set(rng.permutation(images_per_class)[:(images_per_class + 1) // 2].tolist())
        for j in range(images_per_class):
            image_id += 1
            relative = f"{name}/{name.split('.', 1)[1]}_{j + 1:04d}_{image_id}.jpg"
            vector = _attributes(prototypes, c, rng)
            _save_jpeg(draw(c, num_classes, vector, image_size, rng),
                       base / cub.IMAGE_DIR / relative)
            images.append(f"{image_id} {relative}")
            labels.append(f"{image_id} {c + 1}")
            split.append(f"{image_id} {int(j in train)}")
            for a in range(num_attributes):
                certainty, seconds = int(rng.integers(1, 5)), rng.uniform(1.0, 30.0)
                attribute_lines.append(f"{image_id} {a + 1} {vector[a]} {certainty} "
                                       f"{seconds:.3f}")
    _write_lines(base / cub.IMAGES, images)
    _write_lines(base / cub.CLASS_LABELS, labels)
    _write_lines(base / cub.TRAIN_TEST_SPLIT, split)
    _write_lines(base / cub.CLASSES, [f"{c + 1} {n}" for c, n in enumerate(class_names)])
    _write_lines(base / cub.ATTRIBUTE_LABELS, attribute_lines)
    _write_lines(top / cub.ATTRIBUTES, [f"{a + 1} {n}" for a, n in enumerate(attribute_names)])
    return base


def _write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _png_base64(mask: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(mask).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def write_rival10_layout(root: str | PathLike, *, images_per_class: int = 4,
                         image_size: int = 32, seed: int = 0) -> Path:
    """Write a synthetic RIVAL-10 under ``root``; return its ``RIVAL10`` directory.

    Writes ``RIVAL10/meta/label_mappings.json`` (the 20 ImageNet synsets → 10 classes),
    ``RIVAL10/meta/wnid_to_class.json`` (only the 20 wnids; the real file lists all 1000) and,
    for each split ``train`` and ``test``, ``images_per_class`` images of every class in
    ``RIVAL10/<split>/ordinary/`` (alternating between the class's two synsets, named
    ``<wnid>_<n>.JPEG`` with ``n`` unique) with their ``_attr_labels.npy`` (int64 ``[2, 18]``:
    the attributes, then zeros for "changed"), ``_merged_mask.JPEG`` (the attribute markers),
    ``_attr_dict.pkl`` (attribute name → base64 PNG mask, plus ``entire-object``) and an
    object mask ``<split>/entire_object_masks/<wnid>_<file name>``.

    Returns:
      ``root/RIVAL10``, the directory `cbcert.datasets.rival10.load_rival10` takes.
    """
    rng = np.random.default_rng([seed, 2])
    base = Path(root) / rival10.RIVAL10_DIR
    (base / "meta").mkdir(parents=True, exist_ok=True)
    mappings = {name: [rival10.CLASS_NAMES[c], c] for _, name, c in RIVAL10_SYNSETS}
    (base / rival10.LABEL_MAPPINGS).write_text(json.dumps(mappings, indent=2) + "\n",
                                               encoding="utf-8")
    wnids = {wnid: name for wnid, name, _ in sorted(RIVAL10_SYNSETS)}
    (base / rival10.WNID_TO_CLASS).write_text(json.dumps(wnids) + "\n", encoding="utf-8")
    synsets = {c: [wnid for wnid, _, k in RIVAL10_SYNSETS if k == c]
               for c in range(rival10.NUM_CLASSES)}
    prototypes = _prototypes(rival10.NUM_CLASSES, rival10.NUM_ATTRIBUTES, rng)
    number = 1000
    for split in rival10.SPLITS:
        folder = base / split / rival10.INSTANCES
        masks = base / split / "entire_object_masks"
        folder.mkdir(parents=True, exist_ok=True)
        masks.mkdir(parents=True, exist_ok=True)
        for c in range(rival10.NUM_CLASSES):
            for j in range(images_per_class):
                number += int(rng.integers(1, 50))
                wnid = synsets[c][j % 2]
                stem = f"{wnid}_{number}"
                vector = _attributes(prototypes, c, rng)
                _save_jpeg(draw(c, rival10.NUM_CLASSES, vector, image_size, rng),
                           folder / (stem + rival10.IMAGE_SUFFIX))
                labels = np.stack([vector, np.zeros_like(vector)]).astype(np.int64)
                np.save(folder / (stem + rival10.ATTR_LABELS_SUFFIX), labels)
                merged = marker_mask(vector, image_size)
                _save_jpeg(merged, folder / (stem + rival10.MERGED_MASK_SUFFIX))
                obj = np.zeros_like(merged)
                obj[:, (image_size // 4) // 2:(image_size // 4) // 2 + image_size] = 255
                masks_by_attribute = {rival10.ATTRIBUTE_NAMES[a]: _png_base64(
                    marker_mask(np.eye(len(vector), dtype=np.uint8)[a], image_size))
                    for a in np.flatnonzero(vector)}
                masks_by_attribute["entire-object"] = _png_base64(obj)
                with open(folder / f"{stem}_attr_dict.pkl", "wb") as handle:
                    pickle.dump(masks_by_attribute, handle)
                _save_jpeg(obj, masks / f"{wnid}_{stem}{rival10.IMAGE_SUFFIX}")
    return base
