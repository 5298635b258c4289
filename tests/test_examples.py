"""Every script in examples/ runs on tiny settings and returns what it printed.

The scripts are run in this process (``runpy``; their ``main(argv)``), so the suite pays for
their compilations, not for six interpreter starts.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _main(name: str):
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="example")["main"]


def test_every_example_is_covered():
    assert {p.stem for p in EXAMPLES.glob("*.py")} == {
        "jax_function", "latent", "concept", "attack", "pixels", "pytorch_model"}


def test_jax_function(capsys):
    out = _main("jax_function")(["--n", "500", "--n0", "20", "--steps", "100"])
    assert out["prediction"].tolist()[0] == 0 and out["prediction"].tolist()[-1] == 1
    assert out["radius"][0] > 0.5  # far from the boundary at σ = 0.5
    assert "certified L2 radius" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["latent", "concept"])
def test_world_examples(name, capsys):
    out = _main(name)(["--inputs", "3", "--n0", "10", "--n", "100"])
    assert out["prediction"].shape == (3, 3)
    assert "SmAcc" in capsys.readouterr().out


def test_attack(capsys):
    out = _main("attack")(["--inputs", "4", "--iters", "5", "--n", "50"])
    assert out["fooled"].shape == (4,) and out["kept"].shape == (4,)
    assert "fooled" in capsys.readouterr().out


def test_pixels_and_pytorch_model(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from test_convert_resnet import torch_resnet

    from cbcert.convert import convert

    torch.save(torch_resnet("resnet18", num_classes=10, seed=3).state_dict(), tmp_path / "r.pth")
    out = _main("pytorch_model")(["--checkpoint", str(tmp_path / "r.pth"), "--size", "32",
                                  "--n0", "10", "--n", "60"])
    assert out["prediction"].shape == (3,)
    assert "resnet18" in capsys.readouterr().out
    convert("resnet18", tmp_path / "r.pth", tmp_path / "r18")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.uniform(0, 1, (2, 32, 32, 3)), y=np.array([1, 2]))
    out = _main("pixels")(["--images", str(tmp_path / "d.npz"), "--classifier",
                           str(tmp_path / "r18"), "--n0", "10", "--n", "60"])
    assert out["labels"].tolist() == [1, 2]
    assert capsys.readouterr().out.startswith("idx\tlabel\tpredict\tradius\tcorrect")
