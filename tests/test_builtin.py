"""The shipped default world: weights load, are verified, and reproduce the documented numbers."""

import json
import shutil

import jax
import pytest

from cbcert import checkpoint
from cbcert.builtin import load_builtin, weights_path
from cbcert.train_world import TrainConfig, evaluate


@pytest.fixture(scope="module")
def manifest():
    return json.loads((weights_path("default") / checkpoint.MANIFEST).read_text())


def test_shipped_weights_reproduce_documented_accuracies(manifest):
    """Re-evaluate on the exact held-out set of training (its key and size are in the manifest)."""


    from cbcert.builtin import abstract_classifiers, net_config_for
    from cbcert.generators.world import WorldConfig, make_world

    world = load_builtin("default")
    config = WorldConfig.from_preset("default")
    graphdef, state = abstract_classifiers(net_config_for(config))
    train = TrainConfig(**manifest["metrics"]["train_config"])
    key = jax.random.fold_in(jax.random.key(train.seed), 9)
    metrics = evaluate(make_world(config), graphdef, state, world.classifier_params, key,
                       train.eval_samples)
    documented = manifest["metrics"]
    for head, acc in documented["accuracy"].items():
        assert metrics["accuracy"][head] == pytest.approx(acc, abs=1e-6), head
    assert metrics["concept_accuracy"] == pytest.approx(documented["concept_accuracy"], abs=1e-6)
    assert documented["accuracy"]["std"] > 0.9 and documented["accuracy"]["cbm"] > 0.9



def test_shipped_manifest_names_its_world():
    world = load_builtin("default")
    assert world.name == "builtin:default"
    assert world.model_names == ("std", "cbm", "cbmh", "proto")
    assert world.num_classes == 10


def test_corrupted_shipped_checkpoint_is_refused(tmp_path):
    copy = tmp_path / "weights"
    shutil.copytree(weights_path("default"), copy)
    victim = max((p for p in (copy / "params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x55
    victim.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="corrupted"):
        load_builtin("default", weights=copy)


def test_missing_weights_say_how_to_train(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="certify train world --preset k8"):
        load_builtin("k8", weights=tmp_path)


def test_weights_for_another_world_are_refused():
    with pytest.raises(checkpoint.CheckpointError, match="not for preset 'k8'"):
        load_builtin("k8", weights=weights_path("default"))

