"""``certify train pixpnet``: bad input exits 2 naming the flag. Its run on the synthetic CUB
layout (a ``pixpnet`` checkpoint a world directory reads as ``proto``) is
tests/test_real_data_arm.py's."""


import pytest
from click.testing import CliRunner

from cbcert.cli import main
from cbcert.datasets.synthetic import write_cub_layout


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


def test_bad_input_exits_2_naming_the_flag(init_dir, cub_root, tmp_path):
    cases = [(("--warm-steps", "-1"), "--warm-steps"), (("--lr-last", "0"), "--lr-last"),
             (("--prototype-dim", "0"), "--prototype-dim"),
             (("--feature-layer", "layer9"), "--feature-layer"),
             (("--batch-size", "64"), "--batch-size")]
    for extra, flag in cases:
        result = _train(init_dir, f"cub:{cub_root}", tmp_path / "out", *extra)
        assert result.exit_code == 2, (extra, result.output)
        assert flag in result.output, (extra, result.output)
