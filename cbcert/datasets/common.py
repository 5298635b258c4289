"""What the dataset readers share: errors, records, text-table parsing and the input pipeline.

Records. A reader (`cbcert.datasets.cub.load_cub`, `cbcert.datasets.rival10.load_rival10`)
returns an `ImageDataset`: a tuple of `Example` records (absolute image path, 0-based class
index, the attribute vector ``uint8[A]`` of 0/1 where the dataset has one, the dataset's own id)
with the class and attribute names. Nothing is decoded at load time.

Errors. Every problem with the dataset's files is a `DatasetError` (a ``ValueError``) whose
message names the file, the 1-based line (text tables) or key (JSON) where one applies, the
value found and what is expected::

    /data/CUB_200_2011/images.txt, line 17: expected '<image_id> <path>', got 'abc'

A bad argument (``split="val"``, ``batch_size=0``) is a `cbcert.schema.ConfigError`.

Pipeline. `batches` streams an epoch of records as numpy batches, decoding with PIL only the
images of the batch being built (never the whole dataset). Each image is converted to RGB
(greyscale replicated, palette expanded, alpha dropped without compositing, CMYK converted by
PIL), **center-cropped** to the largest centred square (pixels outside it never reach the
filter; an odd margin leaves its extra pixel on the right or bottom), resized to
``image_size × image_size`` with PIL's bilinear filter (which widens its support when
shrinking, i.e. antialiases) and scaled to float32 in [0, 1] (``value / 255``). The order of
epoch ``e`` is ``numpy.random.default_rng([seed, 11, epoch]).permutation(N)``
(`epoch_order`): numpy's PCG64 seeded through ``SeedSequence``, the same on every machine (and
across numpy versions, under numpy's stream-compatibility policy for ``Generator``); every
epoch visits each record exactly once and different epochs give different orders.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from cbcert.schema import ConfigError, shorten

# The fixed second word of the shuffling seed, so that the data order does not share a stream
# with anything else seeded from the run's seed alone.
ORDER_STREAM = 11
_SHOWN = 80  # characters of a line quoted in a message


class DatasetError(ValueError):
    """A problem with a dataset's files: ``"<path>[, line <n> | , key <k>]: <detail>"``.

    Attributes:
      path: the file (or directory) at fault.
      line: 1-based line of a text file, or None.
      key: the JSON key at fault, or None.
      detail: the message without the location.
    """

    def __init__(self, path: str | PathLike, detail: str, *, line: int | None = None,
                 key: str | None = None):
        self.path, self.line, self.key, self.detail = Path(path), line, key, detail
        where = str(path)
        if line is not None:
            where += f", line {line}"
        if key is not None:
            where += f", key {shorten(key, _SHOWN)!r}"
        super().__init__(f"{where}: {detail}")

    def __reduce__(self):
        return _rebuild_error, (self.path, self.detail, self.line, self.key)


def _rebuild_error(path: Path, detail: str, line: int | None, key: str | None) -> DatasetError:
    return DatasetError(path, detail, line=line, key=key)


@dataclass(frozen=True, eq=False)
class Example:
    """One labelled image of a dataset.

    Attributes:
      path: absolute path of the image file.
      label: 0-based class index.
      attributes: ``uint8[A]`` of 0/1 (1: the attribute is present), read-only, or None where
        the dataset has none or they were not loaded.
      id: the dataset's own id of the image (CUB: the ``image_id`` of images.txt, an int;
        RIVAL-10: the file name without ``.JPEG``).
    """

    path: Path
    label: int
    attributes: np.ndarray | None
    id: int | str


@dataclass(frozen=True, eq=False)
class ImageDataset:
    """One split of a labelled image dataset, as read from disk (images not decoded).

    Attributes:
      root: the dataset directory read.
      split: ``"train"`` or ``"test"``.
      items: the split's ``N`` records, in the dataset's own order.
      class_names: ``C`` class names; ``Example.label`` indexes them.
      attribute_names: ``A`` attribute names (empty when attributes were not loaded);
        ``Example.attributes`` follows their order.
    """

    root: Path
    split: str
    items: tuple[Example, ...]
    class_names: tuple[str, ...]
    attribute_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_classes(self) -> int:
        """``C``, the number of classes."""
        return len(self.class_names)

    @property
    def num_attributes(self) -> int:
        """``A``, the number of attributes (0 when attributes were not loaded)."""
        return len(self.attribute_names)

    def labels(self) -> np.ndarray:
        """``int32[N]``: the class index of every record."""
        return np.array([item.label for item in self.items], np.int32)

    def attribute_matrix(self) -> np.ndarray:
        """``uint8[N, A]``: the attribute vectors of every record, stacked.

        Raises:
          ConfigError: the dataset was loaded with ``attributes=False``.
        """
        if not self.attribute_names:
            raise ConfigError(f"{self.root}: attributes were not loaded; load the dataset with "
                              "attributes=True", key="attributes", value=False, allowed="True")
        return np.stack([item.attributes for item in self.items]).astype(np.uint8)


def read_only(array: np.ndarray) -> np.ndarray:
    """``array`` with writing disabled (records are immutable; rows may share one buffer)."""
    array.setflags(write=False)
    return array


def require_file(path: Path, what: str) -> Path:
    """``path`` if it is an existing regular file, else `DatasetError` naming it as ``what``.

    ``what`` says which file of the published layout it is, e.g. ``"the list of images
    (<image_id> <path> per line) of the CUB-200-2011 layout"``.
    """
    if not path.exists():
        raise DatasetError(path, f"no such file; expected {what}")
    if not path.is_file():
        raise DatasetError(path, f"not a regular file; expected {what}")
    return path


def require_dir(path: Path, what: str) -> Path:
    """``path`` if it is an existing directory, else `DatasetError` naming it as ``what``."""
    if not path.is_dir():
        state = "not a directory" if path.exists() else "no such directory"
        raise DatasetError(path, f"{state}; expected {what}")
    return path


def table_rows(path: Path, what: str) -> Iterator[tuple[int, list[str]]]:
    """Stream a whitespace-separated text table: ``(1-based line number, fields)`` per line.

    Blank lines are skipped (their numbers still count); lines may end in ``\\n`` or
    ``\\r\\n``. The file is read line by line, never whole (CUB's attribute labels are 3.7 M
    lines).

    Raises:
      DatasetError: the file is missing or not a regular file (naming ``what``), unreadable,
        or a line is not UTF-8 (naming the line).
    """
    require_file(path, what)
    number = 0
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                try:
                    fields = raw.decode("utf-8").split()
                except UnicodeDecodeError as err:
                    raise DatasetError(path, f"not UTF-8 text ({err.reason} at byte "
                                             f"{err.start}); expected {what}",
                                       line=number) from None
                if fields:
                    yield number, fields
    except OSError as err:
        raise DatasetError(path, f"cannot read it ({err.strerror or err})",
                           line=number or None) from None


def bad_line(path: Path, number: int, fields: list[str], expected: str) -> DatasetError:
    """The error for a line that does not have the form ``expected`` (quoting the line)."""
    return DatasetError(path, f"expected {expected!r}, got {shorten(' '.join(fields), _SHOWN)!r}",
                        line=number)


def parse_int(text: str, path: Path, number: int, name: str, low: int, high: int) -> int:
    """The field ``text`` as an integer in ``[low, high]`` (plain ASCII digits only).

    Raises:
      DatasetError: naming the file, line, field ``name``, the value and the allowed range.
    """
    if text.isascii() and text.isdigit():
        value = int(text)
        if low <= value <= high:
            return value
        raise DatasetError(path, f"{name} {value} is out of range; allowed: {low}..{high}",
                           line=number)
    raise DatasetError(path, f"{name} {shorten(text, _SHOWN)!r} is not an integer; allowed: "
                             f"{low}..{high}", line=number)


def _check_integer(name: str, value, low: int) -> int:
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= low
    if not ok:
        raise ConfigError(f"{name}={value!r}; allowed: integers >= {low}", key=name, value=value,
                          allowed=f"integers >= {low}")
    return int(value)


def epoch_order(n: int, *, seed: int, epoch: int = 0, shuffle: bool = True) -> np.ndarray:
    """The order in which epoch ``epoch`` visits ``n`` records: ``int64[n]``, a permutation.

    ``numpy.random.default_rng([seed, 11, epoch]).permutation(n)`` when ``shuffle``, else
    ``0..n-1``. The same (seed, epoch) gives the same order on every machine; epochs differ.
    """
    n = _check_integer("n", n, 0)
    seed, epoch = _check_integer("seed", seed, 0), _check_integer("epoch", epoch, 0)
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, ORDER_STREAM, epoch]).permutation(n).astype(np.int64)


def num_batches(n: int, batch_size: int, drop_last: bool = False) -> int:
    """How many batches `batches` yields for ``n`` records: ``⌊n/B⌋`` or ``⌈n/B⌉``."""
    return n // batch_size if drop_last else -(-n // batch_size)


def load_image(path: Path, image_size: int) -> np.ndarray:
    """Decode one image file to ``float32[image_size, image_size, 3]`` in [0, 1].

    RGB conversion (greyscale replicated, alpha dropped), center crop to the largest centred
    square, PIL bilinear resize (antialiased when shrinking), ``/ 255``.

    Raises:
      DatasetError: the file is missing, not an image PIL can decode, truncated or over PIL's
        decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``, doubled), naming the file.
    """
    expected = "an image file (JPEG, PNG, ...) that PIL can decode"
    try:
        with Image.open(path) as image:
            rgb = image if image.mode == "RGB" else image.convert("RGB")
            width, height = rgb.size
            side = min(width, height)
            left, top = (width - side) // 2, (height - side) // 2
            square = rgb.crop((left, top, left + side, top + side))  # then no pixel outside
            resized = square.resize((image_size, image_size), Image.Resampling.BILINEAR)
    except FileNotFoundError:
        raise DatasetError(path, f"no such file; expected {expected}") from None
    except Image.DecompressionBombError as err:
        raise DatasetError(path, f"image too large to decode safely ({shorten(str(err), 200)})"
                           ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as err:
        raise DatasetError(path, f"cannot decode the image ({shorten(str(err), 200)}); "
                                 f"expected {expected}") from None
    return np.asarray(resized, dtype=np.float32) / np.float32(255.0)


def batches(items: Sequence[Example], *, batch_size: int, image_size: int, seed: int,
            epoch: int = 0, shuffle: bool = True, drop_last: bool = False, start: int = 0
            ) -> Iterator[dict[str, np.ndarray]]:
    """Stream one epoch of ``items`` as batches of numpy arrays, decoding one batch at a time.

    The epoch's order is `epoch_order` (``default_rng([seed, 11, epoch]).permutation(N)``
    when ``shuffle``); consecutive runs of ``batch_size`` records of that order make the
    batches, the last one smaller unless ``drop_last`` drops it. Each batch is::

        {"image": float32[B, H, W, 3] in [0, 1],  # H = W = image_size (see load_image)
         "label": int32[B],                        # class indices
         "attributes": uint8[B, A],                # only when every item has attributes
         "index": int64[B]}                        # positions of the records in ``items``

    ``start`` skips the epoch's first ``start`` batches without decoding them (a resumed
    training run continues mid-epoch). Arguments are checked at the call; images are decoded
    lazily as the iterator advances.

    Raises:
      ConfigError: a bad argument, an empty ``items``, or items with and without attributes.
      DatasetError: (while iterating) an image that cannot be decoded, naming its file.
    """
    batch_size = _check_integer("batch_size", batch_size, 1)
    image_size = _check_integer("image_size", image_size, 1)
    start = _check_integer("start", start, 0)
    if not len(items):
        raise ConfigError("items is empty; nothing to batch", key="items", value=0,
                          allowed="at least one record")
    order = epoch_order(len(items), seed=seed, epoch=epoch, shuffle=shuffle)
    with_attributes = {item.attributes is not None for item in items}
    if len(with_attributes) > 1:
        raise ConfigError("items mix records with and without attributes; load them alike",
                          key="items")
    return _stream(items, order, batch_size, image_size, drop_last, with_attributes.pop(),
                   start)


def _stream(items: Sequence[Example], order: np.ndarray, batch_size: int, image_size: int,
            drop_last: bool, with_attributes: bool, first: int
            ) -> Iterator[dict[str, np.ndarray]]:
    for start in range(first * batch_size,
                       num_batches(len(order), batch_size, drop_last) * batch_size, batch_size):
        index = order[start:start + batch_size]
        chosen = [items[i] for i in index]
        batch = {
            "image": np.stack([load_image(item.path, image_size) for item in chosen]),
            "label": np.array([item.label for item in chosen], np.int32),
        }
        if with_attributes:
            batch["attributes"] = np.stack([item.attributes for item in chosen]).astype(np.uint8)
        batch["index"] = index.astype(np.int64)
        yield batch
