"""Pixel-space worlds: the identity "generator" over a user's images (Cohen et al.'s setting).

``pixels:IMAGES`` is a world whose latent is the image itself, flattened: ``z = vec(x)`` with
``x[H, W, 3]`` in [0, 1], ``g(z) = reshape(z)``. Gaussian latent smoothing is then exactly the
pixel-space smoothing of Cohen et al. (2019): ``x + σ ε`` with σ in pixel units on [0, 1],
no clipping, the classifier's normalisation applied *after* the noise (their
``NormalizeLayer``). The classifier is any converted torchvision ResNet/DenseNet (`certify
convert resnet50 …`), the model ``std``. The inputs are the images in file order, each with its
own label (no agreement set: ``label`` = ``true_label`` = the file's label). There are no
concepts, so only latent-space commands apply.

Image files:

* ``.npz`` with ``x`` ``[N, H, W, 3]`` (float in [0, 1], or uint8 0..255) and ``y`` ``[N]``
  integer labels; read with ``allow_pickle=False``.
* a folder of ``.png`` files plus ``labels.txt``: one ``<file name> <label>`` per line (``#``
  starts a comment); every PNG needs a line and every line a PNG, all of one size.

Untrusted input: every file must be a regular file (a FIFO is refused, never waited on); an
image may hold at most ``MAX_IMAGE_PIXELS`` pixels, checked from the ``.npz`` array header or
the PNG header before any pixel is read or allocated; labels are class indices that fit int64.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from cbcert.generators.base import Generator
from cbcert.io import checkpoint
from cbcert.io.registry import DENSENET_NAMES, RESNET_NAMES, load_module, pure_apply
from cbcert.schema import ConfigError, file_kind, shorten
from cbcert.worlds.manifest import Preprocess
from cbcert.worlds.world import World

PREFIX = "pixels:"
LABELS = "labels.txt"
# Largest image accepted (width × height): 4096² pixels, 200 MB as float32; the classifiers'
# inputs are 32² to 224². Bounds the memory a file can make the reader allocate per image.
MAX_IMAGE_SIDE = 4096
MAX_IMAGE_PIXELS = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE
_MAX_LABEL = int(np.iinfo(np.int64).max)
# Per-channel normalisation of the classifier input (Cohen et al.'s NormalizeLayer).
NORMALIZE = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "none": ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),
}
# What the classifier of a pixels world must be (ConfigError.allowed, key "classifier").
CLASSIFIERS = ("a converted or trained torchvision resnet*/densenet* directory, or a pcbm "
               "(`certify convert` / `certify train`)")


class ImagesError(ValueError):
    """An unreadable or invalid images/labels file; the message names the file and problem."""


@dataclass(frozen=True)
class Dataset:
    """Fixed inputs of a world: ``latents[N, d]`` (flattened images) and ``labels[N]``."""

    latents: np.ndarray
    labels: np.ndarray
    sha256: str


def _fail(path: Path, problem: str) -> ImagesError:
    return ImagesError(f"{shorten(str(path))}: {problem}")


def _too_large(width: int, height: int) -> str:
    return (f"{width} × {height} pixels; at most {MAX_IMAGE_PIXELS} ({MAX_IMAGE_SIDE} × "
            f"{MAX_IMAGE_SIDE}) per image (cbcert.worlds.pixels.MAX_IMAGE_PIXELS)")


def _open_regular(path: Path):
    """``path`` opened for binary reading; `ImagesError` unless it is a regular file.

    ``O_NONBLOCK``: opening a FIFO returns at once instead of waiting for a writer.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise _fail(path, f"cannot open it ({err.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _fail(path, f"not a regular file ({file_kind(mode)})")
    return os.fdopen(fd, "rb")


def read_images(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Images ``x[N, H, W, 3]`` float32 in [0, 1] and labels ``y[N]`` int64 (module docstring).

    Raises:
      ImagesError: a missing file or one that is not a regular file, an image of more than
        ``MAX_IMAGE_PIXELS`` pixels, wrong shapes or dtypes, values outside [0, 1] or NaN,
        negative labels or labels beyond int64, a PNG without a label or a label without a PNG.
    """
    path = Path(path)
    if path.is_dir():
        x, y = _read_folder(path)
    elif path.exists():
        x, y = _read_npz(path)
    else:
        raise _fail(path, "no such file or directory (expected an .npz with x and y, or a "
                          f"folder of .png files with {LABELS})")
    if x.ndim != 4 or x.shape[-1] != 3 or 0 in x.shape:
        raise _fail(path, f"x has shape {x.shape}; expected [N, H, W, 3] RGB images, N >= 1")
    if y.shape != (x.shape[0],):
        raise _fail(path, f"y has shape {y.shape}; expected [N] = [{x.shape[0]}], one label "
                          "per image")
    if not np.issubdtype(y.dtype, np.integer):
        raise _fail(path, f"y has dtype {y.dtype}; expected integer class labels")
    if y.dtype.kind == "u" and np.any(y > _MAX_LABEL):  # would wrap to negative as int64
        bad = int(np.flatnonzero(y > _MAX_LABEL)[0])
        raise _fail(path, f"label {int(y[bad])} of image {bad} is out of range; labels are "
                          f"class indices 0..{_MAX_LABEL}")
    if np.any(y < 0):
        raise _fail(path, f"label {int(y[y < 0][0])} of image {int(np.flatnonzero(y < 0)[0])} "
                          "is negative; labels are class indices >= 0")
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 255.0
    elif not np.issubdtype(x.dtype, np.floating):
        raise _fail(path, f"x has dtype {x.dtype}; expected floats in [0, 1] or uint8")
    bad = ~np.isfinite(x)
    if bad.any():
        raise _fail(path, f"x has {int(bad.sum())} NaN/inf values (first in image "
                          f"{int(np.argwhere(bad)[0][0])})")
    outside = (x < 0) | (x > 1)
    if outside.any():
        first = np.argwhere(outside)[0]
        raise _fail(path, f"x has {int(outside.sum())} values outside [0, 1] (e.g. "
                          f"{float(x[tuple(first)]):g} in image {int(first[0])}); pixels "
                          "must be in [0, 1] (divide 8-bit images by 255)")
    return x.astype(np.float32), y.astype(np.int64)


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}


def _npz_shape(data, key: str) -> tuple[int, ...]:
    """The shape array ``key`` of an open ``.npz`` declares, read from its header alone."""
    name = f"{key}.npy" if f"{key}.npy" in data.zip.namelist() else key
    with data.zip.open(name) as member:
        version = np.lib.format.read_magic(member)
        if version not in _NPY_HEADERS:
            raise ValueError(f"{key} has .npy format version {version}; expected 1.0 or 2.0")
        shape, _, _ = _NPY_HEADERS[version](member)
    return shape


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with _open_regular(path) as handle:
        try:
            if not zipfile.is_zipfile(handle):
                raise ValueError("not a zip archive")
            handle.seek(0)
            with np.load(handle, allow_pickle=False) as data:
                missing = [k for k in ("x", "y") if k not in data.files]
                if missing:
                    raise _fail(path, f"missing array(s) {missing}; an .npz needs x [N, H, W, "
                                      f"3] and y [N] (has {sorted(data.files)[:10]})")
                shape = _npz_shape(data, "x")
                if len(shape) != 4 or shape[-1] != 3 or 0 in shape:
                    raise _fail(path, f"x has shape {shape}; expected [N, H, W, 3] RGB images, "
                                      "N >= 1")
                if shape[1] * shape[2] > MAX_IMAGE_PIXELS:
                    raise _fail(path, f"x holds images of {_too_large(shape[2], shape[1])}")
                return data["x"], data["y"]
        except ImagesError:
            raise
        # not a zip, truncated or damaged, object arrays, more than memory holds
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error,
                MemoryError) as err:
            raise _fail(path, f"not a readable .npz ({shorten(str(err), 200)})") from None


def _read_labels(folder: Path) -> dict[str, int]:
    labels_path = folder / LABELS
    if not labels_path.exists():
        raise _fail(folder, f"no {LABELS} (one '<file name> <label>' line per .png)")
    labels: dict[str, int] = {}
    try:
        with _open_regular(labels_path) as handle:
            lines = handle.read().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise _fail(labels_path, f"unreadable ({shorten(str(err), 200)})") from None
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.rsplit(maxsplit=1)
        if len(parts) != 2 or not re.fullmatch(r"-?[0-9]+", parts[1]):
            raise _fail(labels_path, f"line {number}: {shorten(line, 80)!r}; expected "
                                     "'<file name> <integer label>'")
        if parts[0] in labels:
            raise _fail(labels_path, f"line {number}: {parts[0]!r} is labelled twice")
        digits = parts[1].lstrip("-")
        if len(digits) > len(str(_MAX_LABEL)) or int(digits) > _MAX_LABEL:
            raise _fail(labels_path, f"line {number}: label {shorten(parts[1], 40)} is out of "
                                     f"range; labels are class indices 0..{_MAX_LABEL}")
        labels[parts[0]] = int(parts[1])
    return labels


def _read_folder(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image, UnidentifiedImageError

    labels = _read_labels(folder)
    files = sorted(p.name for p in folder.glob("*.png"))
    if not files:
        raise _fail(folder, "no .png files")
    unlabelled = [f for f in files if f not in labels]
    if unlabelled:
        raise _fail(folder / LABELS, f"no label for {unlabelled[:5]}")
    orphans = [f for f in labels if f not in set(files)]
    if orphans:
        raise _fail(folder / LABELS, f"labels {orphans[:5]} name no .png in {folder.name}")
    images = []
    for name in files:
        path = folder / name
        with _open_regular(path) as handle:
            try:
                # PIL refuses (error) or warns about images far above MAX_IMAGE_PIXELS itself.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                    image = Image.open(handle)
            except Image.DecompressionBombError as err:
                raise _fail(path, f"{str(err).rstrip('.')}; at most {MAX_IMAGE_PIXELS} "
                                  f"({MAX_IMAGE_SIDE} × {MAX_IMAGE_SIDE}) per image") from None
            except (OSError, ValueError, UnidentifiedImageError) as err:
                raise _fail(path, f"unreadable PNG ({shorten(str(err), 200)})") from None
            with image:
                width, height = image.size  # from the header: nothing decoded yet
                if width * height > MAX_IMAGE_PIXELS:
                    raise _fail(path, _too_large(width, height))
                if images and (height, width) != images[0].shape[:2]:
                    raise _fail(path, f"size {(height, width)} differs from {files[0]}'s "
                                      f"{images[0].shape[:2]}; all images need one size")
                if image.mode not in ("RGB", "L", "P"):
                    raise _fail(path, f"mode {image.mode}; expected an 8-bit RGB, grayscale or "
                                      "palette PNG")
                try:
                    pixels = np.asarray(image.convert("RGB"))
                except (OSError, ValueError) as err:
                    raise _fail(path, f"unreadable PNG ({shorten(str(err), 200)})") from None
        images.append(pixels)
    return np.stack(images), np.array([labels[f] for f in files], np.int64)


def identity_generator(image_shape: tuple[int, int, int]) -> Generator:
    """``g(z) = reshape(z, [H, W, 3])`` with no concepts: pixel space as a "latent" space."""

    def identity(params, v):
        del params
        return v

    def to_image(params, v):
        del params
        return jnp.reshape(v, (v.shape[0], *image_shape))

    return Generator(name="pixels", latent_dim=int(np.prod(image_shape)), concept_names=(),
                     num_unsup=0, image_shape=tuple(image_shape), params={}, g1=identity,
                     encode=identity, decode=identity, g2=to_image)


def load_pixel_world(images: str | Path, classifier: str | Path | None,
                     normalize: str = "imagenet") -> World:
    """The world ``pixels:<images>`` with ``classifier`` as model ``std`` (module docstring).

    Args:
      images: an ``.npz`` or a folder of PNGs (module docstring).
      classifier: a torchvision resnet*/densenet* directory (`certify convert`, `certify train
        classifier`) or a PCBM / PCBM-h (kind ``pcbm``: `certify convert`, `certify train
        pcbm`).
      normalize: ``imagenet``, ``cifar10`` or ``none``: the per-channel ``(x − mean)/std``
        applied to the (noisy) image before the classifier.

    Raises:
      ImagesError: bad images or labels (a label ``>= C``).
      ConfigError: key ``classifier`` (missing, unreadable or not a classifier) or
        ``normalize`` (unknown statistics).
    """
    if classifier is None:
        raise ConfigError(f"a pixels world needs a classifier: a `certify convert`ed "
                          f"resnet*/densenet* directory ({PREFIX}{images})", key="classifier",
                          allowed=CLASSIFIERS)
    if normalize not in NORMALIZE:
        raise ConfigError(f"normalize={normalize!r}; allowed: {', '.join(NORMALIZE)}",
                          key="normalize", value=normalize, allowed=", ".join(NORMALIZE))
    x, y = read_images(images)
    try:
        module, manifest = load_module(classifier)
    except checkpoint.CheckpointError as err:
        raise ConfigError(f"classifier: {err}", key="classifier", value=str(classifier),
                          allowed=CLASSIFIERS) from None
    if manifest["kind"] not in (*RESNET_NAMES, *DENSENET_NAMES, "pcbm"):
        raise ConfigError(f"classifier {shorten(str(classifier))} is kind="
                          f"{shorten(repr(manifest['kind']), 80)}; a pixels world needs a "
                          "torchvision resnet*/densenet* or a pcbm", key="classifier",
                          value=str(classifier), allowed=CLASSIFIERS)
    apply_fn, params = pure_apply(module)
    embed_fn, _ = pure_apply(module, lambda m, v: m.embed(v))
    num_classes = int(module.config.num_classes)
    if np.any(y >= num_classes):
        bad = int(np.flatnonzero(y >= num_classes)[0])
        raise _fail(Path(images), f"label {int(y[bad])} of image {bad} is out of range: the "
                                  f"classifier has {num_classes} classes (labels 0.."
                                  f"{num_classes - 1})")
    mean, std = NORMALIZE[normalize]
    preprocess = Preprocess(size=None, mean=mean, std=std)

    def classify(p, images_, names):
        logits = apply_fn(p["std"], preprocess(images_))
        return jnp.stack([logits for _ in names], axis=1)

    def concept_scores(p, images_):
        raise ValueError("a pixels world has no concepts")

    def embed(p, images_):
        return embed_fn(p["std"], preprocess(images_))

    digest = hashlib.sha256(np.ascontiguousarray(x).tobytes())
    digest.update(np.ascontiguousarray(y).tobytes())
    dataset = Dataset(latents=x.reshape(len(x), -1), labels=y, sha256=digest.hexdigest())
    identity = {"images_sha256": dataset.sha256, "units": "pixel values on [0, 1] (σ too)",
                "classifier_kind": manifest["kind"],
                "classifier_params_sha256": manifest["params_sha256"], "normalize": normalize}
    return World(name=f"{PREFIX}{Path(images).name}", generator=identity_generator(x.shape[1:]),
                 classify=classify, concept_scores=concept_scores,
                 classifier_params={"std": params}, model_names=("std",),
                 class_names=tuple(str(c) for c in range(num_classes)), true_label=None,
                 metadata={"identity": identity, "concepts": False}, dataset=dataset,
                 embed=embed)
