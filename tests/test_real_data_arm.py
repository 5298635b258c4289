"""The real-data arm end to end (docs/real-data.md), on a synthetic CUB written in its published
layout: `certify train classifier` (std) from a torchvision-architecture ResNet-18, `certify
train pcbm` on its embedding (cbm, and cbmh with --hybrid-out; a two-class task, so the
binary single-logit head), `certify train pixpnet` on its trunk (proto), assembled with
test_worlds' tiny StyleGAN2 and CB-AE into a world directory on which `certify latent`,
`concept`, `perturb` and `attack` run; the PCBM also certifies in pixel space.

Synthetic images and a few training steps: the models are barely trained, so what is checked is
the plumbing (files, shapes, manifests, every command's records), not accuracy. The trainers'
losses falling and their one-step parity with PyTorch are checked in their own test modules."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from test_worlds import write_cbae, write_stylegan2_pickle  # noqa: E402

from cbcert.cli import main  # noqa: E402
from cbcert.datasets.cub import load_cub  # noqa: E402
from cbcert.datasets.synthetic import write_cub_layout  # noqa: E402
from cbcert.io.registry import load_module  # noqa: E402


def _ok(args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, (args[:2], result.output)
    return result


@pytest.fixture(scope="module")
def arm(tmp_path_factory, resnet18_dir):
    """The trained parts and the world directory (module docstring)."""
    tmp = tmp_path_factory.mktemp("arm")
    cub = write_cub_layout(tmp / "CUB_200_2011", num_classes=2, images_per_class=8,
                           num_attributes=12, image_size=32)
    common = ["--dataset", f"cub:{cub}", "--image-size", "32", "--batch-size", "4", "--quiet"]
    world = tmp / "world"
    _ok(["train", "classifier", "--init", resnet18_dir, "--out", world / "std", "--steps", "4",
         "--save-every", "2", *common])
    _ok(["train", "pcbm", "--backbone", world / "std", "--out", world / "cbm", "--hybrid-out",
         world / "cbmh", "--n-samples", "4", "--hybrid-epochs", "2", *common])
    _ok(["train", "pixpnet", "--init", world / "std", "--out", world / "proto",
         "--feature-layer", "layer2", "--prototypes-per-class", "2", "--prototype-dim", "16",
         "--warm-steps", "1", "--joint-steps", "1", "--last-steps", "1", *common])
    write_stylegan2_pickle(world / "g.pkl")
    write_cbae(world)
    manifest = {
        "format_version": 1, "name": "synthetic-cub",
        "generator": {"kind": "stylegan2", "pickle": "g.pkl", "truncation_psi": 0.7},
        "cbae": {"checkpoint": "cbae.pt", "config": "cbae.yaml"},
        "classifiers": {"std": "std", "cbm": "cbm", "cbmh": "cbmh", "proto": "proto"},
        "class_names": list(load_cub(cub, "train", attributes=False).class_names),
        "preprocess": {"size": [32, 32], "mean": [0.485, 0.456, 0.406],
                       "std": [0.229, 0.224, 0.225]}}
    (world / "world.json").write_text(json.dumps(manifest))
    return world


def test_the_trainers_write_every_role_of_a_world(arm):
    std, std_manifest = load_module(arm / "std")
    cbm, manifest = load_module(arm / "cbm")
    cbmh, manifest_h = load_module(arm / "cbmh")
    proto, proto_manifest = load_module(arm / "proto")
    assert std_manifest["kind"] == "resnet18" and std.config.num_classes == 2
    assert manifest["kind"] == manifest_h["kind"] == "pcbm"
    # Two classes: the reference's single-logit head; PCBM-h broadcasts it onto its residual.
    assert cbm.config.head_outputs == 1 and cbm.config.num_classes == 2
    assert cbmh.config.residual_outputs == 2 and cbmh.config.head_outputs == 1
    k = cbm.config.num_concepts
    assert k == len(manifest["concept_names"]) == len(manifest["concepts"]) >= 1
    assert manifest["identity"]["concept_labels"] == "class"  # CUB's default
    assert manifest["identity"]["backbone"]["params_sha256"] == std_manifest["params_sha256"]
    assert manifest_h["metrics"]["hybrid"]["steps"] == 2 * 2  # 8 training images, batch 4
    # The concept bank and head are shared; PCBM-h only adds its residual.
    np.testing.assert_array_equal(np.asarray(cbm.cavs[...]), np.asarray(cbmh.cavs[...]))
    np.testing.assert_array_equal(np.asarray(cbm.head.kernel[...]),
                                  np.asarray(cbmh.head.kernel[...]))
    assert proto_manifest["kind"] == "pixpnet" and proto_manifest["steps"] == 3
    assert proto_manifest["identity"]["train"]["warm_steps"] == 1
    assert (proto.config.num_prototypes, proto.config.num_classes) == (4, 2)
    for m in (std_manifest, manifest, proto_manifest):
        assert 0 <= m["metrics"]["test_accuracy"] <= 1


ALL = "std,cbm,cbmh,proto"


@pytest.mark.parametrize("command,expected", [
    (["latent", "--sigma", "0.25", "--inputs", "2", "--n0", "8", "--n", "16"], ALL),
    (["concept", "--rho", "0.2", "--inputs", "2", "--n0", "8", "--n", "16"], ALL),
    (["perturb", "--eps", "", "--tau", "1", "--subsets", "2", "--subset-size", "2"], ALL),
    # APGD compiles one gradient through the generator per model (~10 s each here): the
    # prototype network, the trained part no other world test attacks
    (["attack", "--eps", "0.05", "--iters", "2", "--inputs", "2"], "proto"),
], ids=["latent", "concept", "perturb", "attack"])
def test_the_world_directory_runs_every_command(arm, tmp_path, command, expected):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, [*command, "--world", str(arm), "--models", expected,
                                       "--chunk-size", "8", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for path in sorted(out.glob("*.jsonl"))
               for line in path.read_text().splitlines()]
    assert records, sorted(p.name for p in out.iterdir())
    # certification and attack records name their model; perturb records carry every model's
    # prediction on the clean input and on each sample
    models = ({r["model"] for r in records} if "model" in records[0]
              else set().union(*(r["clean"]["pred"] for r in records)))
    assert models == set(expected.split(","))


def test_the_pcbm_certifies_in_pixel_space(arm, tmp_path):
    x = np.random.default_rng(0).uniform(0, 1, (2, 32, 32, 3)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x, y=np.array([0, 1]))
    for model in ("cbm", "cbmh"):
        _ok(["latent", "--world", f"pixels:{tmp_path / 'x.npz'}", "--classifier", arm / model,
             "--sigma", "0.25", "--n0", "8", "--n", "16", "--inputs", "2", "--out",
             tmp_path / model, "--quiet"])
        assert len((tmp_path / model / "records.jsonl").read_text().splitlines()) == 2
