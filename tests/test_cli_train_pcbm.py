"""``certify train pcbm`` end to end on the synthetic CUB and RIVAL-10 layouts: a PCBM and a
PCBM-h are written, load as pcbm checkpoints and certify in pixel space; bad input exits 2
naming the flag."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx

from cbcert.cli import main
from cbcert.datasets.synthetic import write_cub_layout, write_rival10_layout
from cbcert.io.registry import load_module, save_module
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


def test_pcbm_and_pcbm_h_on_cub_certify_in_pixel_space(backbone, cub_root, tmp_path):
    result = _train(backbone, f"cub:{cub_root}", tmp_path / "cbm", "--hybrid-out",
                    str(tmp_path / "cbmh"), "--hybrid-epochs", "2", "--concepts", "6")
    assert result.exit_code == 0, result.output
    cbm, manifest = load_module(tmp_path / "cbm")
    cbmh, manifest_h = load_module(tmp_path / "cbmh")
    assert manifest["kind"] == manifest_h["kind"] == "pcbm"
    assert (cbm.config.num_concepts, cbm.config.head_outputs) == (6, 4)
    assert cbm.config.residual_outputs == 0 and cbmh.config.residual_outputs == 4
    assert len(manifest["concept_names"]) == 6 == len(manifest["concepts"])
    assert manifest["identity"]["concept_labels"] == "class"  # CUB's default
    assert 0 <= manifest["metrics"]["test_accuracy"] <= 1
    assert manifest_h["metrics"]["hybrid"]["steps"] == 2 * 3  # 12 training images, batch 4
    # The concept bank and head are shared; PCBM-h only adds its residual.
    np.testing.assert_array_equal(np.asarray(cbm.cavs[...]), np.asarray(cbmh.cavs[...]))
    x = np.random.default_rng(0).uniform(0, 1, (2, 32, 32, 3)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x, y=np.array([0, 1]))
    for model in ("cbm", "cbmh"):
        result = CliRunner().invoke(main, [
            "latent", "--world", f"pixels:{tmp_path / 'x.npz'}", "--classifier",
            str(tmp_path / model), "--sigma", "0.25", "--n0", "8", "--n", "16", "--inputs", "2",
            "--out", str(tmp_path / f"cert-{model}")])
        assert result.exit_code == 0, result.output
        records = (tmp_path / f"cert-{model}" / "records.jsonl").read_text().splitlines()
        assert len(records) == 2


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
