"""RIVAL-10 from its published layout (`cbcert.datasets.rival10`), on synthetic copies written
by `cbcert.datasets.synthetic.write_rival10_layout`, and every kind of bad file."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from cbcert.datasets import rival10
from cbcert.datasets.common import DatasetError, batches, load_image
from cbcert.datasets.rival10 import ATTRIBUTE_NAMES, CLASS_NAMES, load_rival10
from cbcert.datasets.synthetic import RIVAL10_SYNSETS, class_colour, write_rival10_layout
from cbcert.schema import ConfigError

PER_CLASS, SIZE = 2, 16


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """The RIVAL10 directory of a synthetic copy."""
    return write_rival10_layout(tmp_path_factory.mktemp("rival10"), images_per_class=PER_CLASS,
                                image_size=SIZE, seed=0)


@pytest.fixture
def copy(published, tmp_path) -> Path:
    """A private copy of the synthetic dataset to damage; its RIVAL10 directory."""
    return Path(shutil.copytree(published, tmp_path / "RIVAL10"))


def test_layout_is_the_published_one(published):
    assert sorted(p.name for p in published.iterdir()) == ["meta", "test", "train"]
    assert sorted(p.name for p in (published / "meta").iterdir()) == [
        "label_mappings.json", "wnid_to_class.json"]
    mappings = json.loads((published / "meta" / "label_mappings.json").read_text())
    assert mappings["zebra"] == ["equine", 6] and len(mappings) == 20
    ordinary = sorted(p.name for p in (published / "train" / "ordinary").iterdir())
    stems = sorted({name.split(".")[0] for name in ordinary if name.endswith(".npy")})
    assert len(stems) == 10 * PER_CLASS
    stem = stems[0].removesuffix("_attr_labels")
    assert {f"{stem}.JPEG", f"{stem}_attr_labels.npy", f"{stem}_merged_mask.JPEG",
            f"{stem}_attr_dict.pkl"} <= set(ordinary)
    labels = np.load(published / "train" / "ordinary" / f"{stem}_attr_labels.npy")
    assert labels.shape == (2, 18) and not labels[1].any()
    with open(published / "train" / "ordinary" / f"{stem}_attr_dict.pkl", "rb") as handle:
        masks = pickle.load(handle)  # our own file, written just above
    assert "entire-object" in masks
    assert set(masks) - {"entire-object"} == {ATTRIBUTE_NAMES[a] for a in np.flatnonzero(labels[0])}
    assert len(list((published / "test" / "entire_object_masks").iterdir())) == 10 * PER_CLASS


def test_round_trip_equals_what_the_writer_wrote(published):
    class_of = {wnid: c for wnid, _, c in RIVAL10_SYNSETS}
    ids = set()
    for split in ("train", "test"):
        data = load_rival10(published, split)
        assert isinstance(data, rival10.Rival10Dataset) and data.root == published
        assert data.class_names == CLASS_NAMES and data.num_classes == 10
        assert data.attribute_names == ATTRIBUTE_NAMES and data.num_attributes == 18
        assert len(data) == 10 * PER_CLASS
        assert np.bincount(data.labels(), minlength=10).tolist() == [PER_CLASS] * 10
        names = [item.path.name for item in data.items]
        assert names == sorted(names) and not any("merged_mask" in n for n in names)
        for item in data.items:
            assert item.path == published / split / "ordinary" / f"{item.id}.JPEG"
            assert item.label == class_of[item.id.split("_")[0]]
            written = np.load(item.path.with_name(f"{item.id}_attr_labels.npy"))[0]
            np.testing.assert_array_equal(item.attributes, written)
            assert item.attributes.dtype == np.uint8 and not item.attributes.flags.writeable
        ids |= {item.id for item in data.items}
    assert len(ids) == 20 * PER_CLASS  # train and test images are distinct


def test_images_show_their_class(published):
    data = load_rival10(published, "test")
    for item in data.items[::5]:
        pixels = load_image(item.path, SIZE) * 255
        background = pixels[np.broadcast_to(pixels.mean(axis=-1, keepdims=True) < 200,
                                            pixels.shape)].reshape(-1, 3)
        np.testing.assert_allclose(np.median(background, axis=0),
                                   class_colour(item.label, 10), atol=30)


def test_writer_is_deterministic_in_its_seed(tmp_path):
    def files(root):
        return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file()}

    a = write_rival10_layout(tmp_path / "a", images_per_class=1, image_size=8, seed=3)
    b = write_rival10_layout(tmp_path / "b", images_per_class=1, image_size=8, seed=3)
    c = write_rival10_layout(tmp_path / "c", images_per_class=1, image_size=8, seed=4)
    assert files(a) == files(b) and files(a) != files(c)


def test_roots_accepted_and_attributes_optional(copy):
    assert load_rival10(copy.parent, "train").root == copy
    for npy in copy.rglob("*_attr_labels.npy"):
        npy.unlink()
    bare = load_rival10(copy, "train", attributes=False)
    assert bare.attribute_names == () and all(i.attributes is None for i in bare.items)
    with pytest.raises(ConfigError, match="split='val'"):
        load_rival10(copy, "val")
    with pytest.raises(DatasetError, match="not a RIVAL-10 directory"):
        load_rival10(copy / "meta", "train")


def test_batches_over_rival10(published):
    data = load_rival10(published, "train")
    out = list(batches(data.items, batch_size=8, image_size=8, seed=2, epoch=1))
    assert [len(b["label"]) for b in out] == [8, 8, 4]
    assert out[0]["attributes"].shape == (8, 18)
    assert sorted(np.concatenate([b["index"] for b in out]).tolist()) == list(range(len(data)))


# ---- bad files: each case damages a copy and names the file, the line or key, the value ----

def _first(copy: Path, split: str = "train") -> Path:
    return min((copy / split / "ordinary").glob("n*_[0-9]*[0-9].JPEG"))


def _rewrite_json(path: Path, text: str) -> None:
    path.write_text(text)


def _missing_label_mappings(copy):
    (copy / "meta" / "label_mappings.json").unlink()
    return copy / "meta" / "label_mappings.json", None, None, ["no such file",
                                                               "class index 0..9"]


def _json_syntax_error(copy):
    _rewrite_json(copy / "meta" / "label_mappings.json", '{\n  "semi": ["truck", 0],\n  oops\n}')
    return copy / "meta" / "label_mappings.json", 3, None, ["not valid JSON"]


def _json_repeated_key(copy):
    _rewrite_json(copy / "meta" / "label_mappings.json",
                  '{\n"semi": ["truck", 0],\n"zebra": ["equine", 6],\n"semi": ["truck", 0]\n}')
    return copy / "meta" / "label_mappings.json", 2, "semi", ["appears twice"]


def _json_not_an_object(copy):
    _rewrite_json(copy / "meta" / "wnid_to_class.json", '["n01531178"]')
    return copy / "meta" / "wnid_to_class.json", None, None, ["holds a list", "wnid"]


def _mapping_value_malformed(copy):
    path = copy / "meta" / "label_mappings.json"
    mappings = json.loads(path.read_text())
    mappings["zebra"] = "equine"
    _rewrite_json(path, json.dumps(mappings, indent=2))
    line = json.dumps(mappings, indent=2).splitlines().index('  "zebra": "equine",') + 1
    return path, line, "zebra", ["value 'equine'", "<class index 0..9>"]


def _class_index_out_of_range(copy):
    path = copy / "meta" / "label_mappings.json"
    mappings = json.loads(path.read_text())
    mappings["gazelle"] = ["deer", 10]
    _rewrite_json(path, json.dumps(mappings, indent=2))
    line = json.dumps(mappings, indent=2).splitlines().index('  "gazelle": [') + 1
    return path, line, "gazelle", ["class index 10 is out of range; allowed: 0..9"]


def _two_names_for_one_index(copy):
    path = copy / "meta" / "label_mappings.json"
    mappings = json.loads(path.read_text())
    mappings["zebra"] = ["horse", 6]
    _rewrite_json(path, json.dumps(mappings))
    return path, 1, "zebra", ["class index 6 is named 'horse' here but 'equine'"]


def _class_without_entry(copy):
    path = copy / "meta" / "label_mappings.json"
    mappings = {k: v for k, v in json.loads(path.read_text()).items() if v[1] != 8}
    _rewrite_json(path, json.dumps(mappings))
    return path, None, None, ["no entry maps to class index 8"]


def _wnid_not_listed(copy):
    path = copy / "meta" / "wnid_to_class.json"
    wnid = _first(copy).name.split("_")[0]
    wnids = json.loads(path.read_text())
    del wnids[wnid]
    _rewrite_json(path, json.dumps(wnids))
    return path, None, wnid, ["no entry for the wnid of image", str(_first(copy))]


def _wnid_value_not_a_string(copy):
    path = copy / "meta" / "wnid_to_class.json"
    wnids = json.loads(path.read_text())
    wnids["n02391049"] = 6
    _rewrite_json(path, json.dumps(wnids, indent=1))
    line = json.dumps(wnids, indent=1).splitlines().index(' "n02391049": 6,') + 1
    return path, line, "n02391049", ["value 6; expected the ImageNet class name"]


def _imagenet_class_not_mapped(copy):
    path = copy / "meta" / "label_mappings.json"
    mappings = json.loads(path.read_text())
    del mappings["Carduelis carduelis"]
    _rewrite_json(path, json.dumps(mappings))
    return path, None, "Carduelis carduelis", ["no entry for ImageNet class", "n01531178"]


def _missing_attr_labels(copy):
    npy = _first(copy).with_name(_first(copy).stem + "_attr_labels.npy")
    npy.unlink()
    return npy, None, None, ["no such file", f"attribute labels of {_first(copy).name}"]


def _attr_labels_wrong_shape(copy):
    npy = _first(copy).with_name(_first(copy).stem + "_attr_labels.npy")
    np.save(npy, np.zeros(18))
    return npy, None, None, ["shape (18,)", "[2, 18] array of 0/1"]


def _attr_labels_not_binary(copy):
    npy = _first(copy).with_name(_first(copy).stem + "_attr_labels.npy")
    labels = np.load(npy)
    labels[0, 5] = 2
    np.save(npy, labels)
    return npy, None, None, ["value 2 at [0, 5]"]


def _attr_labels_not_npy(copy):
    npy = _first(copy).with_name(_first(copy).stem + "_attr_labels.npy")
    npy.write_bytes(b"garbage")
    return npy, None, None, ["not a readable .npy"]


def _attr_labels_pickled(copy):
    npy = _first(copy).with_name(_first(copy).stem + "_attr_labels.npy")
    np.save(npy, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return npy, None, None, ["not a readable .npy", "pickle"]


def _missing_split_folder(copy):
    shutil.rmtree(copy / "train")
    return copy / "train" / "ordinary", None, None, ["no such directory", "train images"]


def _empty_split(copy):
    for path in (copy / "train" / "ordinary").iterdir():
        if not path.name.endswith("_merged_mask.JPEG"):
            path.unlink()
    return copy / "train" / "ordinary", None, None, ["the train split is empty"]


@pytest.mark.parametrize("damage", [
    _missing_label_mappings, _json_syntax_error, _json_repeated_key, _json_not_an_object,
    _mapping_value_malformed, _class_index_out_of_range, _two_names_for_one_index,
    _class_without_entry, _wnid_not_listed, _wnid_value_not_a_string,
    _imagenet_class_not_mapped, _missing_attr_labels, _attr_labels_wrong_shape,
    _attr_labels_not_binary, _attr_labels_not_npy, _attr_labels_pickled, _missing_split_folder,
    _empty_split,
], ids=lambda f: f.__name__.strip("_"))
def test_bad_files_name_the_file_and_line_or_key(damage, copy):
    file, line, key, needles = damage(copy)
    with pytest.raises(DatasetError) as info:
        load_rival10(copy, "train")
    message = str(info.value)
    where = str(file)
    if line is not None:
        where += f", line {line}"
    if key is not None:
        where += f", key {key!r}"
    assert message.startswith(where + ": "), message
    assert (info.value.line, info.value.key) == (line, key)
    for needle in needles:
        assert needle in message, message


def test_corrupt_image_names_the_file(copy):
    data = load_rival10(copy, "train")
    victim = data.items[3].path
    victim.write_bytes(victim.read_bytes()[:150])  # truncated JPEG
    with pytest.raises(DatasetError, match="cannot decode the image") as info:
        list(batches(data.items, batch_size=4, image_size=8, seed=0, shuffle=False))
    assert str(info.value).startswith(f"{victim}: ")
