"""CUB-200-2011 from its published layout (`cbcert.datasets.cub`), on synthetic copies
written by `cbcert.datasets.synthetic.write_cub_layout`, and every kind of bad file."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from cbcert.datasets import cub
from cbcert.datasets.common import DatasetError, batches, load_image
from cbcert.datasets.cub import class_attribute_majority, load_cub
from cbcert.datasets.synthetic import class_colour, write_cub_layout
from cbcert.schema import ConfigError

CLASSES, PER_CLASS, ATTRIBUTES, SIZE = 4, 6, 12, 16


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """The CUB_200_2011 directory of a synthetic copy (attributes.txt next to it)."""
    return write_cub_layout(tmp_path_factory.mktemp("cub"), num_classes=CLASSES,
                            images_per_class=PER_CLASS, num_attributes=ATTRIBUTES,
                            image_size=SIZE, seed=0)


@pytest.fixture
def copy(published, tmp_path) -> Path:
    """A private copy of the synthetic dataset to damage; its CUB_200_2011 directory."""
    shutil.copytree(published.parent, tmp_path / "data")
    return tmp_path / "data" / cub.CUB_DIR


def _table(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()]


def _set_line(path: Path, number: int, text: str | None) -> None:
    """Replace line ``number`` (1-based) of ``path`` by ``text``, or delete it (None)."""
    lines = path.read_text().splitlines()
    if text is None:
        del lines[number - 1]
    else:
        lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")


def test_round_trip_equals_what_the_writer_wrote(published):
    images = {int(i): p for i, p in _table(published / "images.txt")}
    classes = {int(i): int(c) for i, c in _table(published / "image_class_labels.txt")}
    split = {int(i): int(s) for i, s in _table(published / "train_test_split.txt")}
    present = {(int(f[0]), int(f[1])): int(f[2])
               for f in _table(published / "attributes" / "image_attribute_labels.txt")}
    names = [f[1] for f in _table(published.parent / "attributes.txt")]
    assert len(images) == CLASSES * PER_CLASS and len(present) == len(images) * ATTRIBUTES
    seen = []
    for name, wanted in (("train", 1), ("test", 0)):
        data = load_cub(published, name)
        assert isinstance(data, cub.CubDataset) and data.split == name
        assert data.root == published and data.num_classes == CLASSES
        assert data.attribute_names == tuple(names) and data.num_attributes == ATTRIBUTES
        assert data.class_names == tuple(f"{c:03d}.Synthetic_Bird_{c:02d}"
                                         for c in range(1, CLASSES + 1))
        ids = [item.id for item in data.items]
        assert ids == sorted(i for i in images if split[i] == wanted)  # images.txt order
        for item in data.items:
            assert item.path == published / "images" / images[item.id]
            assert item.path.is_absolute() and item.path.is_file()
            assert item.label == classes[item.id] - 1
            assert images[item.id].startswith(data.class_names[item.label])
            assert item.attributes.dtype == np.uint8 and not item.attributes.flags.writeable
            assert item.attributes.tolist() == [present[item.id, a]
                                                for a in range(1, ATTRIBUTES + 1)]
        np.testing.assert_array_equal(data.labels(), [classes[i] - 1 for i in ids])
        assert data.attribute_matrix().shape == (len(ids), ATTRIBUTES)
        seen += ids
    assert sorted(seen) == sorted(images)
    train = load_cub(published, "train")
    assert len(train) == CLASSES * ((PER_CLASS + 1) // 2)


def test_images_show_their_class_and_attributes(published):
    """Learnable content: the class colour in the background, a white marker per attribute."""
    data = load_cub(published, "train")
    grid = int(np.ceil(np.sqrt(ATTRIBUTES)))
    cell = SIZE // grid
    for item in data.items[:6]:
        pixels = load_image(item.path, SIZE) * 255  # the crop is the square the writer drew on
        colour = class_colour(item.label, CLASSES)
        for a in range(ATTRIBUTES):
            row, column = divmod(a, grid)
            centre = pixels[row * cell + cell // 2 - 1: row * cell + cell // 2 + 1,
                            column * cell + cell // 2 - 1: column * cell + cell // 2 + 1]
            if item.attributes[a]:
                assert centre.mean() > 200
            else:
                np.testing.assert_allclose(centre.mean(axis=(0, 1)), colour, atol=40)


def test_writer_is_deterministic_in_its_seed(tmp_path):
    def files(root):
        return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file()}

    settings = {"num_classes": 2, "images_per_class": 2, "num_attributes": 3, "image_size": 8}
    a = write_cub_layout(tmp_path / "a", seed=5, **settings).parent
    b = write_cub_layout(tmp_path / "b", seed=5, **settings).parent
    c = write_cub_layout(tmp_path / "c", seed=6, **settings).parent
    assert files(a) == files(b)
    assert files(a) != files(c)


def test_roots_accepted_and_attributes_optional(copy):
    by_parent = load_cub(copy.parent, "test")
    assert by_parent.root == copy
    assert [i.id for i in by_parent.items] == [i.id for i in load_cub(copy, "test").items]
    (copy.parent / "attributes.txt").unlink()
    (copy / "attributes" / "image_attribute_labels.txt").unlink()
    bare = load_cub(copy, "train", attributes=False)
    assert bare.attribute_names == () and all(i.attributes is None for i in bare.items)
    assert set(next(batches(bare.items, batch_size=3, image_size=4, seed=0))) == {
        "image", "label", "index"}
    with pytest.raises(ConfigError, match="attributes were not loaded"):
        bare.attribute_matrix()
    with pytest.raises(DatasetError, match="attributes.txt: no such file"):
        load_cub(copy, "train")
    with pytest.raises(ConfigError, match="split='val'; allowed: train, test"):
        load_cub(copy, "val")


def test_attributes_txt_beside_images_txt_and_in_attributes_dir(copy):
    source = copy.parent / "attributes.txt"
    for place in (copy / "attributes.txt", copy / "attributes" / "attributes.txt"):
        shutil.move(source, place)
        assert load_cub(copy, "train").num_attributes == ATTRIBUTES
        source = place


def test_extra_trailing_fields_of_the_published_file_are_tolerated(copy):
    labels = copy / "attributes" / "image_attribute_labels.txt"
    before = load_cub(copy, "train").attribute_matrix()
    first, second = _table(labels)[:2]
    _set_line(labels, 1, " ".join(first + ["0"]))          # 6 fields, as in the real file
    _set_line(labels, 2, " ".join(second + ["0", "1.5"]))  # 7 fields
    np.testing.assert_array_equal(load_cub(copy, "train").attribute_matrix(), before)
    _set_line(labels, 3, " ".join(["01", "003"] + _table(labels)[2][2:]))  # leading zeros
    np.testing.assert_array_equal(load_cub(copy, "train").attribute_matrix(), before)
    _set_line(labels, 2, " ".join(second + ["0", "1.5", "x"]))
    with pytest.raises(DatasetError, match="line 2: expected '<image_id> <attribute_id>"):
        load_cub(copy, "train")


def test_class_attribute_majority(published, tmp_path):
    train = load_cub(published, "train")
    majority = class_attribute_majority(train)
    assert majority.shape == (CLASSES, ATTRIBUTES) and majority.dtype == np.uint8
    matrix, labels = train.attribute_matrix(), train.labels()
    for c in range(CLASSES):
        share = matrix[labels == c].mean(axis=0)
        np.testing.assert_array_equal(majority[c], (share >= 0.5).astype(np.uint8))
    with pytest.raises(ConfigError, match="train split"):
        class_attribute_majority(load_cub(published, "test"))
    # A tie (2 of 4 images) counts as present, as in Koh et al.'s preprocessing.
    base = write_cub_layout(tmp_path, num_classes=1, images_per_class=8, num_attributes=1,
                            image_size=8, seed=0)
    labels_file = base / "attributes" / "image_attribute_labels.txt"
    split = {int(i): int(s) for i, s in _table(base / "train_test_split.txt")}
    train_ids = [i for i in sorted(split) if split[i]]
    rows = _table(labels_file)
    for k, image_id in enumerate(train_ids):
        rows[image_id - 1][2] = str(int(k < 2))
    labels_file.write_text("".join(" ".join(r) + "\n" for r in rows))
    assert class_attribute_majority(load_cub(base, "train")).tolist() == [[1]]


# ---- bad files: each case damages a copy and names the file, line and what is expected ----

def _missing_images_txt(base):
    (base / "images.txt").unlink()
    return base / "images.txt", None, ["no such file", "CUB_200_2011", "<image_id> <path>"]


def _short_line(base):
    _set_line(base / "images.txt", 3, "3")
    return base / "images.txt", 3, ["expected '<image_id> <path>', got '3'"]


def _non_integer_id(base):
    _set_line(base / "images.txt", 2, "abc 001.Synthetic_Bird_01/x.jpg")
    return base / "images.txt", 2, ["image_id 'abc' is not an integer"]


def _duplicate_id(base):
    path = _table(base / "images.txt")[4][1]
    _set_line(base / "images.txt", 5, f"1 {path}")
    return base / "images.txt", 5, ["image_id 1 appears twice (first on line 1)"]


def _escaping_path(base):
    _set_line(base / "images.txt", 4, "4 ../../secret.jpg")
    return base / "images.txt", 4, ["must be relative to images/ and stay inside it"]


def _class_out_of_range(base):
    _set_line(base / "image_class_labels.txt", 4, "4 99")
    return base / "image_class_labels.txt", 4, ["class_id 99 is out of range; allowed: 1..4",
                                                "classes.txt defines class ids 1..4"]


def _label_for_unknown_image(base):
    with open(base / "image_class_labels.txt", "a") as handle:
        handle.write("999 1\n")
    return (base / "image_class_labels.txt", CLASSES * PER_CLASS + 1,
            ["image_id 999 is not listed in images.txt"])


def _duplicate_label(base):
    _set_line(base / "image_class_labels.txt", 7, "6 2")
    return base / "image_class_labels.txt", 7, ["image_id 6 appears twice (first on line 6)"]


def _missing_label(base):
    _set_line(base / "image_class_labels.txt", 3, None)
    return base / "image_class_labels.txt", None, ["no line for image_id 3 (listed on line 3 of",
                                                   "images.txt"]


def _image_missing_on_disk(base):
    split = {int(i): int(s) for i, s in _table(base / "train_test_split.txt")}
    image_id = min(i for i in split if split[i] == 1)
    relative = dict((int(i), p) for i, p in _table(base / "images.txt"))[image_id]
    (base / "images" / relative).unlink()
    return base / "images.txt", image_id, [f"image file {base / 'images' / relative} does not "
                                           "exist"]


def _split_not_binary(base):
    _set_line(base / "train_test_split.txt", 6, "6 2")
    return base / "train_test_split.txt", 6, ["is_training_image 2 is out of range; allowed: 0..1"]


def _classes_repeated_id(base):
    _set_line(base / "classes.txt", 3, "2 003.Other")
    return base / "classes.txt", 3, ["class_id 2 appears twice (first on line 2)"]


def _classes_without_name(base):
    _set_line(base / "classes.txt", 2, "2")
    return base / "classes.txt", 2, ["expected '<class_id> <name>', got '2'"]


def _classes_not_utf8(base):
    (base / "classes.txt").write_bytes(b"1 001.A\n2 002.\xff\n3 003.C\n4 004.D\n")
    return base / "classes.txt", 2, ["not UTF-8"]


def _missing_attributes_txt(base):
    (base.parent / "attributes.txt").unlink()
    return base.parent / "attributes.txt", None, ["no such file", "<attribute_id> <name>"]


def _attribute_out_of_range(base):
    _set_line(base / "attributes" / "image_attribute_labels.txt", 10, "1 13 0 3 1.0")
    return (base / "attributes" / "image_attribute_labels.txt", 10,
            ["attribute_id 13 is out of range; allowed: 1..12", "attributes.txt defines"])


def _attribute_present_not_binary(base):
    _set_line(base / "attributes" / "image_attribute_labels.txt", 8, "1 8 2 3 1.0")
    return (base / "attributes" / "image_attribute_labels.txt", 8,
            ["is_present 2 is out of range; allowed: 0..1"])


def _certainty_out_of_range(base):
    _set_line(base / "attributes" / "image_attribute_labels.txt", 9, "1 9 1 5 1.0")
    return (base / "attributes" / "image_attribute_labels.txt", 9,
            ["certainty_id 5 is out of range; allowed: 1..4"])


def _attribute_line_short(base):
    _set_line(base / "attributes" / "image_attribute_labels.txt", 12, "1 12 1 3")
    return (base / "attributes" / "image_attribute_labels.txt", 12,
            ["expected '<image_id> <attribute_id> <is_present> <certainty_id> <time>', "
             "got '1 12 1 3'"])


def _attribute_pair_twice(base):
    _set_line(base / "attributes" / "image_attribute_labels.txt", 15, "2 2 1 3 1.0")
    return (base / "attributes" / "image_attribute_labels.txt", 15,
            ["image_id 2, attribute_id 2 appears twice (first on line 14)"])


def _attribute_pair_missing(base):
    _set_line(base / "attributes" / "image_attribute_labels.txt", 30, None)
    return (base / "attributes" / "image_attribute_labels.txt", None,
            ["no line for image_id 3, attribute_id 6", "one line per image and attribute"])


def _attribute_unknown_image(base):
    _set_line(base / "attributes" / "image_attribute_labels.txt", 20, "777 8 1 3 1.0")
    return (base / "attributes" / "image_attribute_labels.txt", 20,
            ["image_id 777 is not listed in images.txt"])


def _empty_split(base):
    ids = [i for i, _ in _table(base / "train_test_split.txt")]
    (base / "train_test_split.txt").write_text("".join(f"{i} 1\n" for i in ids))
    return base / "train_test_split.txt", None, ["the test split is empty",
                                                 "is_training_image=0"]


@pytest.mark.parametrize("damage", [
    _missing_images_txt, _short_line, _non_integer_id, _duplicate_id, _escaping_path,
    _class_out_of_range, _label_for_unknown_image, _duplicate_label, _missing_label,
    _image_missing_on_disk, _split_not_binary, _classes_repeated_id, _classes_without_name,
    _classes_not_utf8, _missing_attributes_txt, _attribute_out_of_range,
    _attribute_present_not_binary, _certainty_out_of_range, _attribute_line_short,
    _attribute_pair_twice, _attribute_pair_missing, _attribute_unknown_image, _empty_split,
], ids=lambda f: f.__name__.strip("_"))
def test_bad_files_name_the_file_and_line(damage, copy):
    file, line, needles = damage(copy)
    split = "test" if damage is _empty_split else "train"
    with pytest.raises(DatasetError) as info:
        load_cub(copy, split)
    message = str(info.value)
    where = str(file) if line is None else f"{file}, line {line}: "
    assert message.startswith(where), message
    assert info.value.line == line
    for needle in needles:
        assert needle in message, message


def test_corrupt_image_names_the_file(copy):
    data = load_cub(copy, "train")
    victim = data.items[2].path
    victim.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(DatasetError, match="cannot decode the image") as info:
        list(batches(data.items, batch_size=4, image_size=8, seed=0))
    assert str(info.value).startswith(f"{victim}: ")
