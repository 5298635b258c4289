"""``certify train pixpnet`` end to end on the synthetic CUB layout: the PixPNet is written as a
``pixpnet`` checkpoint a world directory reads; bad input exits 2 naming the flag."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from cbcert.cli import main
from cbcert.datasets.synthetic import write_cub_layout
from cbcert.io.registry import load_module, pure_apply


@pytest.fixture(scope="module")
def init_dir(resnet18_dir):
    """conftest's torchvision-architecture ResNet-18 (the PCBM / PixPNet checkpoints rebuild
    their backbone from its name, so it must be the named architecture)."""
    return resnet18_dir


@pytest.fixture(scope="module")
def cub_root(tmp_path_factory):
    return write_cub_layout(tmp_path_factory.mktemp("cub") / "CUB_200_2011", num_classes=4,
                            images_per_class=6, num_attributes=12, image_size=32)


def _train(init, dataset, out, *extra):
    return CliRunner().invoke(main, [
        "train", "pixpnet", "--init", str(init), "--dataset", dataset, "--out", str(out),
        "--feature-layer", "layer2", "--prototypes-per-class", "2", "--prototype-dim", "16",
        "--warm-steps", "1", "--joint-steps", "1", "--last-steps", "1", "--batch-size", "4",
        "--image-size", "32", "--quiet", *extra])


def test_trained_pixpnet_loads_as_a_prototype_classifier(init_dir, cub_root, tmp_path):
    result = _train(init_dir, f"cub:{cub_root}", tmp_path / "proto")
    assert result.exit_code == 0, result.output
    module, manifest = load_module(tmp_path / "proto")
    assert manifest["kind"] == "pixpnet" and manifest["steps"] == 3
    assert (module.config.num_prototypes, module.config.num_classes) == (8, 4)
    assert 0 <= manifest["metrics"]["test_accuracy"] <= 1
    assert manifest["identity"]["train"]["warm_steps"] == 1
    apply_fn, params = pure_apply(module)
    x = np.random.default_rng(0).uniform(0, 1, (2, 32, 32, 3)).astype(np.float32)
    assert np.isfinite(np.asarray(apply_fn(params, x))).all()
    metrics = json.loads(result.output[:result.output.rindex("}") + 1])
    assert metrics["test_images"] == 12


def test_bad_input_exits_2_naming_the_flag(init_dir, cub_root, tmp_path):
    cases = [(("--warm-steps", "-1"), "--warm-steps"), (("--lr-last", "0"), "--lr-last"),
             (("--prototype-dim", "0"), "--prototype-dim"),
             (("--feature-layer", "layer9"), "--feature-layer"),
             (("--batch-size", "64"), "--batch-size")]
    for extra, flag in cases:
        result = _train(init_dir, f"cub:{cub_root}", tmp_path / "out", *extra)
        assert result.exit_code == 2, (extra, result.output)
        assert flag in result.output, (extra, result.output)
