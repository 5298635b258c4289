"""``certify train classifier`` end to end on a synthetic CUB layout: bad datasets exit 2 naming
the file and line; the trained classifier certifies in pixel space; an attribute labeler on
the RIVAL-10 layout."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx

from cbcert.cli import main
from cbcert.datasets.synthetic import write_cub_layout, write_rival10_layout
from cbcert.io.registry import save_module
from cbcert.models.resnet import ResNet, ResNetConfig


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    """A small converted-format resnet (one block per stage, 10 ImageNet-like classes)."""
    out = tmp_path_factory.mktemp("init") / "resnet"
    module = ResNet(ResNetConfig("basic", (1, 1, 1, 1), num_classes=10), rngs=nnx.Rngs(0))
    save_module(out, "resnet18", module, {"sources": {}})
    return out


@pytest.fixture(scope="module")
def cub_root(tmp_path_factory):
    return write_cub_layout(tmp_path_factory.mktemp("cub") / "CUB_200_2011", num_classes=4,
                            images_per_class=6, num_attributes=12, image_size=32)


def _train(init_dir, dataset, out, *extra):
    return CliRunner().invoke(main, [
        "train", "classifier", "--init", str(init_dir), "--dataset", dataset, "--out", str(out),
        "--steps", "4", "--batch-size", "4", "--image-size", "32", "--lr", "0.01",
        "--save-every", "2", "--quiet", *extra])


def test_trained_classifier_certifies_in_pixel_space(init_dir, cub_root, tmp_path):
    result = _train(init_dir, f"cub:{cub_root}", tmp_path / "std")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "std" / "manifest.json").read_text())
    assert manifest["kind"] == "resnet18" and manifest["config"]["num_classes"] == 4
    assert manifest["steps"] == 4 and 0 <= manifest["metrics"]["test_accuracy"] <= 1
    assert manifest["identity"]["dataset"] == "cub"
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "x.npz", x=rng.uniform(0, 1, (2, 32, 32, 3)).astype(np.float32),
             y=np.array([0, 1]))
    result = CliRunner().invoke(main, [
        "latent", "--world", f"pixels:{tmp_path / 'x.npz'}", "--classifier",
        str(tmp_path / "std"), "--sigma", "0.25", "--n0", "8", "--n", "16", "--inputs", "2",
        "--out", str(tmp_path / "cert")])
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "cert" / "records.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(("damage", "message"), [
    (lambda root: (root / "images.txt").unlink(), "images.txt"),
    (lambda root: (root / "train_test_split.txt").write_text("1 1\n2\n"),
     "train_test_split.txt, line 2"),
])
def test_bad_dataset_files_exit_2_naming_file_and_line(init_dir, tmp_path, damage, message):
    root = write_cub_layout(tmp_path / "CUB_200_2011", num_classes=2, images_per_class=2,
                            num_attributes=4, image_size=16)
    damage(root)
    result = _train(init_dir, f"cub:{root}", tmp_path / "out")
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "--dataset" in output and message in output, output
    result = _train(init_dir, f"mnist:{root}", tmp_path / "out")
    assert result.exit_code == 2 and "expected cub:ROOT or rival10:ROOT" in result.output


def test_attribute_labeler_on_the_rival10_layout(init_dir, tmp_path):
    root = write_rival10_layout(tmp_path / "RIVAL10", images_per_class=1, image_size=32)
    result = _train(init_dir, f"rival10:{root}", tmp_path / "labeler", "--target",
                    "attributes", "--batch-size", "2")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "labeler" / "manifest.json").read_text())
    assert manifest["config"]["num_classes"] == 18  # one logit per RIVAL-10 attribute
    assert 0 <= manifest["metrics"]["test_attribute_accuracy"] <= 1


def test_attribute_labeler_on_chosen_attributes(init_dir, tmp_path):
    """--attributes FILE: the labeler's outputs are the named attributes, in the file's order
    (the K concepts a CB-AE is trained with); unknown names and --target class exit 2."""
    root = write_rival10_layout(tmp_path / "RIVAL10", images_per_class=1, image_size=32)
    names = tmp_path / "names.txt"
    names.write_text("wings\nlong\n")
    result = _train(init_dir, f"rival10:{root}", tmp_path / "labeler", "--target",
                    "attributes", "--attributes", str(names), "--batch-size", "2")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "labeler" / "manifest.json").read_text())
    assert manifest["config"]["num_classes"] == 2
    assert manifest["identity"]["attributes"] == ["wings", "long"]
    names.write_text("wings\nfeathers-and-scales\n")
    for extra, message in ((("--target", "attributes"), "'feathers-and-scales' is not an"),
                           ((), "only with --target attributes")):
        result = _train(init_dir, f"rival10:{root}", tmp_path / "x", "--attributes",
                        str(names), *extra)
        assert result.exit_code == 2 and "--attributes" in result.output, result.output
        assert message in " ".join(result.output.split()), result.output
