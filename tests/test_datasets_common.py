"""The shared dataset pieces (`cbcert.datasets.common`): errors, table parsing, image decoding
and the streaming, deterministically shuffled input pipeline `batches`."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cbcert.datasets import common
from cbcert.datasets.common import (
    DatasetError,
    Example,
    batches,
    epoch_order,
    load_image,
    num_batches,
    parse_int,
    table_rows,
)
from cbcert.schema import ConfigError

N, SIZE = 11, 8


def _save(pixels: np.ndarray, path: Path, **kwargs) -> Path:
    Image.fromarray(pixels).save(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def items(tmp_path_factory) -> list[Example]:
    """11 small images (JPEG, greyscale and RGBA PNG), label i % 3, attributes the bits of i."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    out = []
    for i in range(N):
        pixels = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        if i % 3 == 1:
            path = _save(pixels[..., 0], root / f"{i}.png")  # greyscale
        elif i % 3 == 2:
            rgba = np.concatenate([pixels, np.full((12, 16, 1), 128, np.uint8)], axis=-1)
            path = _save(rgba, root / f"{i}.png")
        else:
            path = _save(pixels, root / f"{i}.jpg", quality=90)
        bits = np.array([(i >> k) & 1 for k in range(4)], np.uint8)
        out.append(Example(path=path, label=i % 3, attributes=bits, id=i))
    return out


def test_error_message_names_file_line_and_key(tmp_path):
    error = DatasetError(tmp_path / "images.txt", "expected '<image_id> <path>', got 'abc'",
                         line=17)
    assert str(error) == (f"{tmp_path / 'images.txt'}, line 17: expected '<image_id> <path>', "
                          "got 'abc'")
    assert isinstance(error, ValueError)
    assert (error.path, error.line, error.key) == (tmp_path / "images.txt", 17, None)
    keyed = DatasetError("meta/x.json", "bad", key="zebra", line=3)
    assert str(keyed) == "meta/x.json, line 3, key 'zebra': bad"
    again = pickle.loads(pickle.dumps(keyed))
    assert (str(again), again.key, again.line) == (str(keyed), "zebra", 3)


def test_table_rows_counts_every_line_and_names_bad_bytes(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"1 a\n\n  \r\n2  b c\r\n3\n")
    assert list(table_rows(path, "a table")) == [(1, ["1", "a"]), (4, ["2", "b", "c"]),
                                                 (5, ["3"])]
    path.write_bytes(b"1 a\n2 \xff\n")
    with pytest.raises(DatasetError, match=r"t\.txt, line 2: not UTF-8") as info:
        list(table_rows(path, "a table"))
    assert info.value.line == 2
    with pytest.raises(DatasetError, match=r"missing\.txt: no such file; expected a table"):
        list(table_rows(tmp_path / "missing.txt", "a table"))
    with pytest.raises(DatasetError, match="not a regular file"):
        list(table_rows(tmp_path, "a table"))


@pytest.mark.parametrize("text, detail", [
    ("x1", "image_id 'x1' is not an integer; allowed: 1..9"),
    ("-3", "image_id '-3' is not an integer; allowed: 1..9"),
    ("+3", "image_id '+3' is not an integer"),
    ("10", "image_id 10 is out of range; allowed: 1..9"),
    ("0", "image_id 0 is out of range"),
])
def test_parse_int_refuses(text, detail, tmp_path):
    with pytest.raises(DatasetError, match="line 4: " + detail.replace("+", r"\+")):
        parse_int(text, tmp_path / "f.txt", 4, "image_id", 1, 9)
    assert parse_int("07", tmp_path / "f.txt", 4, "image_id", 1, 9) == 7


def test_load_image_crops_centre_and_converts_to_rgb(tmp_path):
    wide = np.zeros((10, 20, 3), np.uint8)
    wide[:, :5] = (255, 0, 0)
    wide[:, 5:15] = (0, 255, 0)
    wide[:, 15:] = (0, 0, 255)
    out = load_image(_save(wide, tmp_path / "wide.png"), 5)
    assert out.shape == (5, 5, 3) and out.dtype == np.float32
    np.testing.assert_array_equal(out, np.broadcast_to([0.0, 1.0, 0.0], (5, 5, 3)))
    tall = np.zeros((20, 10), np.uint8)
    tall[5:15] = 200
    grey = load_image(_save(tall, tmp_path / "tall.png"), 10)  # greyscale, no resize
    np.testing.assert_array_equal(grey, np.full((10, 10, 3), np.float32(200) / 255))
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 1], rgba[..., 3] = 100, 0  # fully transparent: the alpha is dropped
    np.testing.assert_array_equal(load_image(_save(rgba, tmp_path / "a.png"), 4),
                                  np.broadcast_to([0, np.float32(100) / 255, 0], (4, 4, 3)))
    palette = Image.fromarray(wide).convert("P")
    palette.save(tmp_path / "p.png")
    assert load_image(tmp_path / "p.png", 3).shape == (3, 3, 3)


@pytest.mark.parametrize("content", [b"", b"not an image at all", "truncated"])
def test_corrupt_image_names_the_file(content, tmp_path, items):
    path = tmp_path / "broken.jpg"
    if content == "truncated":
        content = items[0].path.read_bytes()[:200]
    path.write_bytes(content)
    with pytest.raises(DatasetError, match="cannot decode the image") as info:
        load_image(path, 8)
    assert str(path) in str(info.value) and info.value.path == path
    with pytest.raises(DatasetError, match="no such file"):
        load_image(tmp_path / "gone.jpg", 8)


def test_epoch_order_is_the_documented_permutation():
    for seed, epoch in [(0, 0), (3, 1), (2**40, 7)]:
        expected = np.random.default_rng([seed, 11, epoch]).permutation(50)
        np.testing.assert_array_equal(epoch_order(50, seed=seed, epoch=epoch), expected)
    np.testing.assert_array_equal(epoch_order(5, seed=1, shuffle=False), np.arange(5))
    # Pinned values: the same on every machine (PCG64 through SeedSequence).
    assert epoch_order(8, seed=0, epoch=0).tolist() == [4, 0, 7, 2, 5, 6, 1, 3]
    assert epoch_order(8, seed=0, epoch=1).tolist() == [5, 0, 6, 3, 1, 2, 4, 7]
    orders = {tuple(epoch_order(30, seed=5, epoch=e)) for e in range(5)}
    assert len(orders) == 5
    assert epoch_order(30, seed=5).dtype == np.int64
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(ConfigError, match="seed"):
            epoch_order(5, seed=bad)


def _epoch(items, **kwargs) -> list[dict[str, np.ndarray]]:
    settings = {"batch_size": 4, "image_size": SIZE, "seed": 0} | kwargs
    return list(batches(items, **settings))


def test_batches_shapes_dtypes_ranges(items):
    out = _epoch(items)
    assert [len(b["label"]) for b in out] == [4, 4, 3]  # the last partial batch is kept
    for batch in out:
        b = len(batch["label"])
        assert set(batch) == {"image", "label", "attributes", "index"}
        assert batch["image"].shape == (b, SIZE, SIZE, 3) and batch["image"].dtype == np.float32
        assert 0.0 <= batch["image"].min() and batch["image"].max() <= 1.0
        assert batch["label"].dtype == np.int32 and batch["index"].dtype == np.int64
        assert batch["attributes"].shape == (b, 4) and batch["attributes"].dtype == np.uint8
        for row, i in enumerate(batch["index"]):
            assert batch["label"][row] == items[i].label
            np.testing.assert_array_equal(batch["attributes"][row], items[i].attributes)
            np.testing.assert_array_equal(batch["image"][row], load_image(items[i].path, SIZE))
    assert [len(b["label"]) for b in _epoch(items, drop_last=True)] == [4, 4]
    assert num_batches(N, 4) == 3 and num_batches(N, 4, drop_last=True) == 2


def test_every_item_once_per_epoch_and_orders_are_deterministic(items):
    def order(**kwargs):
        return np.concatenate([b["index"] for b in _epoch(items, image_size=2, **kwargs)])

    first = order(seed=3, epoch=0)
    assert sorted(first.tolist()) == list(range(N))
    np.testing.assert_array_equal(first, order(seed=3, epoch=0))
    np.testing.assert_array_equal(first, epoch_order(N, seed=3, epoch=0))
    assert not np.array_equal(first, order(seed=3, epoch=1))
    assert sorted(order(seed=3, epoch=1).tolist()) == list(range(N))
    assert not np.array_equal(first, order(seed=4, epoch=0))
    np.testing.assert_array_equal(order(seed=3, shuffle=False), np.arange(N))


def test_batches_decode_only_the_current_batch(items, monkeypatch):
    opened = []
    real_open = Image.open

    def counting_open(path, *args, **kwargs):
        opened.append(Path(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(common.Image, "open", counting_open)
    stream = batches(items, batch_size=4, image_size=SIZE, seed=1)
    assert opened == []  # nothing is decoded before the first batch is asked for
    first = next(stream)
    assert sorted(opened) == sorted(items[i].path for i in first["index"])
    second = next(stream)
    assert len(opened) == 8
    assert sorted(opened[4:]) == sorted(items[i].path for i in second["index"])
    next(stream)
    assert len(opened) == N
    with pytest.raises(StopIteration):
        next(stream)
    # start = 2 resumes at the epoch's third batch, decoding none of the batches before it.
    opened.clear()
    resumed = list(batches(items, batch_size=4, image_size=SIZE, seed=1, start=2))
    full = list(batches(items, batch_size=4, image_size=SIZE, seed=1))
    assert [b["index"].tolist() for b in resumed] == [b["index"].tolist() for b in full[2:]]
    assert len(opened) == (N - 8) + N  # the resumed last batch, then the full epoch


def test_batches_without_attributes_and_bad_arguments(items):
    bare = [Example(path=i.path, label=i.label, attributes=None, id=i.id) for i in items]
    batch = next(batches(bare, batch_size=2, image_size=4, seed=0))
    assert set(batch) == {"image", "label", "index"}
    with pytest.raises(ConfigError, match="mix records"):
        batches(bare[:2] + items[:2], batch_size=2, image_size=4, seed=0)
    for key, value in [("batch_size", 0), ("image_size", 0), ("epoch", -1), ("seed", -2)]:
        settings = {"batch_size": 2, "image_size": 4, "seed": 0, key: value}
        with pytest.raises(ConfigError, match=key):
            batches(items, **settings)  # checked at the call, before any decoding
    with pytest.raises(ConfigError, match="empty"):
        batches([], batch_size=2, image_size=4, seed=0)


def test_a_corrupt_image_in_a_batch_names_its_file(items, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(items[0].path.read_bytes()[:100])
    mixed = list(items[:3]) + [Example(path=broken, label=0, attributes=items[0].attributes,
                                       id="broken")]
    with pytest.raises(DatasetError, match="cannot decode") as info:
        list(batches(mixed, batch_size=2, image_size=4, seed=0, shuffle=False))
    assert str(broken) in str(info.value)
