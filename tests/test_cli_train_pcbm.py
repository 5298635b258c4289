"""``certify train pcbm`` on the synthetic RIVAL-10 layout (image-level attributes, a 10-class
head); bad input exits 2 naming the flag. The CUB run (PCBM and PCBM-h, a binary head, pixel
space and a world directory) is tests/test_real_data_arm.py's."""

import json

import pytest
from click.testing import CliRunner
from flax import nnx

from cbcert.cli import main
from cbcert.datasets.synthetic import write_cub_layout, write_rival10_layout
from cbcert.io.registry import save_module
from cbcert.models.resnet import ResNet, ResNetConfig


@pytest.fixture(scope="module")
def backbone(resnet18_dir):
    """conftest's torchvision-architecture ResNet-18 (the PCBM / PixPNet checkpoints rebuild
    their backbone from its name, so it must be the named architecture)."""
    return resnet18_dir


@pytest.fixture(scope="module")
def cub_root(tmp_path_factory):
    return write_cub_layout(tmp_path_factory.mktemp("cub") / "CUB_200_2011", num_classes=4,
                            images_per_class=6, num_attributes=12, image_size=32)


def _train(backbone, dataset, out, *extra):
    return CliRunner().invoke(main, [
        "train", "pcbm", "--backbone", str(backbone), "--dataset", dataset, "--out", str(out),
        "--batch-size", "4", "--image-size", "32", "--n-samples", "4", "--quiet", *extra])


def test_pcbm_on_rival10_reads_image_level_attributes(backbone, tmp_path):
    root = write_rival10_layout(tmp_path / "RIVAL10", images_per_class=1, image_size=32)
    result = _train(backbone, f"rival10:{root}", tmp_path / "cbm", "--concepts", "3")
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output[:result.output.rindex("}") + 1])
    assert set(metrics) == {"pcbm"} and 0 <= metrics["pcbm"]["test_accuracy"] <= 1
    manifest = json.loads((tmp_path / "cbm" / "manifest.json").read_text())
    assert manifest["config"]["head_outputs"] == 10 and len(manifest["concept_names"]) == 3
    assert manifest["identity"]["concept_labels"] == "image"


def test_bad_input_exits_2_naming_the_flag(backbone, cub_root, tmp_path, tmp_path_factory):
    small = tmp_path / "small"
    save_module(small, "resnet18", ResNet(ResNetConfig("basic", (1, 1, 1, 1), num_classes=10),
                                          rngs=nnx.Rngs(0)), {"sources": {}})
    names = tmp_path / "names.txt"
    names.write_text("no_such_attribute\n")
    cases = [((backbone, "--svm-c", "0"), "--svm-c"),
             ((backbone, "--l1-ratio", "2"), "--l1-ratio"),
             ((backbone, "--concepts", "99"), "--concepts"),
             ((backbone, "--concepts", str(names)), "--concepts"),
             ((backbone, "--concepts", "some"), "--concepts"),
             ((backbone, "--hybrid-out", str(tmp_path / "out")), "--hybrid-out"),
             ((small,), "--backbone")]
    for (init, *extra), flag in cases:
        result = _train(init, f"cub:{cub_root}", tmp_path / "out", *extra)
        assert result.exit_code == 2, (extra, result.output)
        assert flag in result.output, (extra, result.output)
    assert not (tmp_path / "out").exists()
