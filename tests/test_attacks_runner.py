"""Tests for cbcert.attacks.runner (APGD through generator + classifier) and `certify attack`.

Most tests use a tiny linear world (d = 6, images 2×2×3, 3 classes) that compiles in well
under a second; one test runs the built-in world with untrained classifiers end to end.
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from cbcert import cli
from cbcert.attacks import apgd as apgd_module
from cbcert.attacks.runner import AttackJob, attack_key, eot_keys, run, summarize_records
from cbcert.certify.cohen import ABSTAIN
from cbcert.certify.runner import RECORDS, SUMMARY, RunMismatchError
from cbcert.generators.base import Generator
from cbcert.pipeline import World

LATENT_DIM, NUM_CONCEPTS = 6, 2


def _linear_world(seed: int = 0) -> World:
    """``g(z) = tanh(A z)`` reshaped to 2×2×3; E/D an orthogonal map and its inverse.

    std and cbm share their weights, so the agreement set is the whole pool; proto differs.
    """
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(LATENT_DIM, LATENT_DIM)))
    gen_params = {
        "enc": jnp.asarray(q, jnp.float32),  # [d, 2K + U] with 2K + U = d
        "g2": jnp.asarray(rng.normal(size=(LATENT_DIM, 12)), jnp.float32),
    }
    generator = Generator(
        name="linear",
        latent_dim=LATENT_DIM,
        concept_names=tuple(f"k{i}" for i in range(NUM_CONCEPTS)),
        num_unsup=LATENT_DIM - 2 * NUM_CONCEPTS,
        image_shape=(2, 2, 3),
        params=gen_params,
        g1=lambda p, z: z,
        encode=lambda p, w: w @ p["enc"],
        decode=lambda p, c: c @ p["enc"].T,
        g2=lambda p, w: jnp.tanh(w @ p["g2"]).reshape(-1, 2, 2, 3),
    )
    std = jnp.asarray(3.0 * rng.normal(size=(12, 3)), jnp.float32)
    clf_params = {
        "std": std,
        "cbm": std,
        "proto": jnp.asarray(3.0 * rng.normal(size=(12, 3)), jnp.float32),
    }

    def classify(params, x, names):
        flat = x.reshape(x.shape[0], -1)  # [B, 12]
        return jnp.stack([flat @ params[name] for name in names], axis=1)  # [B, H, 3]

    return World(
        name="test:linear",
        generator=generator,
        classify=classify,
        concept_scores=lambda params, x: x.reshape(x.shape[0], -1),
        classifier_params=clf_params,
        model_names=("std", "cbm", "proto"),
        class_names=("a", "b", "c"),
    )


WORLD = _linear_world()
BASE = AttackJob(eps=(0.05, 0.3, 2.0), iters=10, models=("std", "proto"), num_inputs=10, batch=4)


def _records(out):
    return [json.loads(line) for line in (out / RECORDS).read_text().splitlines()]


def _without_time(records):
    return sorted(
        ({k: v for k, v in r.items() if k != "seconds"} for r in records),
        key=lambda r: (r["index"], r["model"], r["eps"]),
    )


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    before = apgd_module._attack_jit._cache_size()
    summary = run(WORLD, BASE, out)
    return out, summary, apgd_module._attack_jit._cache_size() - before


def test_records_cover_every_input_model_and_budget(base_run):
    out, _, _ = base_run
    records = _records(out)
    keys = {(r["index"], r["model"], r["eps"]) for r in records}
    assert len(records) == len(keys) == BASE.num_inputs * len(BASE.models) * len(BASE.eps)


def test_perturbations_stay_in_the_ball(base_run):
    out, _, _ = base_run
    for r in _records(out):
        assert 0.0 <= r["perturbation_norm"] <= r["eps"] * (1 + 1e-5)


def test_robust_only_if_clean_and_adversarial_are_correct(base_run):
    out, summary, _ = base_run
    for r in _records(out):
        assert r["robust"] == (r["clean_prediction"] == r["label"] == r["adversarial_prediction"])
        # A base attack is judged by the classifier it optimised against.
        assert r["robust"] == (not r["attack_fooled"])
    # The reference label is std's clean prediction.
    assert summary["models"]["std"]["clean_accuracy"] == 1.0


def test_robust_accuracy_at_most_clean_and_non_increasing_in_eps(base_run):
    _, summary, _ = base_run
    for model, entry in summary["models"].items():
        robust = [b["robust_accuracy"] for b in entry["budgets"]]
        assert all(r <= entry["clean_accuracy"] for r in robust), model
        assert robust == sorted(robust, reverse=True), (model, robust)
    std = [b["robust_accuracy"] for b in summary["models"]["std"]["budgets"]]
    # The attack must actually work: the largest budget fools std on some inputs.
    assert std[-1] < std[0]


def test_one_apgd_compilation_per_model(base_run):
    # 3 batches (the last one padded) x 3 budgets per model reuse one compiled attack.
    _, _, compilations = base_run
    assert compilations == len(BASE.models)


def test_resume_gives_the_same_records_and_summary(base_run, tmp_path):
    out, summary, _ = base_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    lines = (resumed / RECORDS).read_text().splitlines(keepends=True)
    # Keep a partial unit plus a torn last line, as after a crash mid-write.
    (resumed / RECORDS).write_text("".join(lines[:13]) + lines[13][:20])
    (resumed / SUMMARY).unlink()
    again = run(WORLD, BASE, resumed)
    assert again == summary
    assert _without_time(_records(resumed)) == _without_time(_records(out))


def test_rerun_with_other_settings_is_refused(base_run, tmp_path):
    out, _, _ = base_run
    other = tmp_path / "other"
    shutil.copytree(out, other)
    with pytest.raises(RunMismatchError, match="different settings"):
        run(WORLD, dataclasses.replace(BASE, eps=(0.1,)), other)


def test_l2_concept_space_attack(tmp_path):
    job = AttackJob(space="concept", norm="l2", eps=(0.5, 3.0), iters=10, models=("std",),
                    num_inputs=6, batch=6)
    summary = run(WORLD, job, tmp_path)
    for r in _records(tmp_path):
        assert r["perturbation_norm"] <= r["eps"] * (1 + 1e-5)
    robust = [b["robust_accuracy"] for b in summary["models"]["std"]["budgets"]]
    assert robust[1] <= robust[0] <= summary["models"]["std"]["clean_accuracy"]
    assert robust[1] < 1.0


@pytest.mark.parametrize("space, scale", [("latent", 0.5), ("concept", 0.2)])
def test_smoothed_attack_is_judged_by_predict_and_abstain_is_wrong(tmp_path, space, scale):
    # n = 12 PREDICT samples at alpha = 0.05: a split vote cannot reach significance, so
    # some inputs abstain (checked below on these fixed seeds).
    job = AttackJob(space=space, eps=(1.0,), iters=5, smoothed=True, scale=scale, eot=4, n=12,
                    alpha=0.05, models=("std",), num_inputs=8, batch=8)
    summary = run(WORLD, job, tmp_path)
    records = _records(tmp_path)
    assert summary[job.noise_name] == scale
    abstained = [r for r in records
                 if ABSTAIN in (r["clean_prediction"], r["adversarial_prediction"])]
    assert abstained, "expected at least one abstention with n = 12"
    assert not any(r["robust"] for r in abstained)
    for r in records:
        assert r["robust"] == (r["clean_prediction"] == r["label"] == r["adversarial_prediction"])
        assert 0.0 <= r["clean_p_value"] <= 1.0 and 0.0 <= r["adversarial_p_value"] <= 1.0
    entry = summary["models"]["std"]
    clean = np.mean([r["clean_prediction"] == r["label"] for r in records])
    assert entry["clean_accuracy"] == pytest.approx(clean)
    assert entry["budgets"][0]["robust_accuracy"] <= entry["clean_accuracy"]


def test_summary_counts_abstentions_as_wrong():
    job = AttackJob(eps=(0.1,), models=("std",))
    records = [
        {"index": i, "model": "std", "eps": 0.1, "label": 1, "clean_prediction": c,
         "adversarial_prediction": a, "robust": c == a == 1, "perturbation_norm": 0.1,
         "loss": 1.0}
        for i, (c, a) in enumerate([(1, 1), (1, ABSTAIN), (ABSTAIN, ABSTAIN), (1, 0)])
    ]
    entry = summarize_records(records, job)["models"]["std"]
    assert entry["clean_accuracy"] == 0.75
    assert entry["budgets"][0]["robust_accuracy"] == 0.25
    assert entry["budgets"][0]["adversarial_abstain_rate"] == 0.5


def test_keys_depend_on_model_eps_and_batch_only():
    root = jax.random.key(0)
    data = lambda k: tuple(np.asarray(jax.random.key_data(k)).ravel())
    base = data(attack_key(root, 0, 0.01, 0))
    assert base == data(attack_key(root, 0, 0.01, 0))
    assert len({base, data(attack_key(root, 1, 0.01, 0)), data(attack_key(root, 0, 0.03, 0)),
                data(attack_key(root, 0, 0.01, 1))}) == 4
    keys = eot_keys(root, np.array([7, 3, 7]))
    assert data(keys[0]) == data(keys[2]) != data(keys[1])


@pytest.mark.parametrize("kwargs, match", [
    ({"eps": ()}, "eps"),
    ({"eps": (0.1, -0.1)}, "eps"),
    ({"eps": (0.1, 0.1)}, "twice"),
    ({"smoothed": True}, "sigma"),
    ({"space": "concept", "smoothed": True}, "rho"),
    ({"scale": 0.1}, "smoothed"),
])
def test_job_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttackJob(**kwargs)


# ---------------------------------------------------------------------------- CLI


@pytest.fixture
def linear_cli(monkeypatch):
    monkeypatch.setattr(cli, "_load_world", lambda name: WORLD)
    return CliRunner()


@pytest.mark.parametrize("args, flag", [
    (["--eps", "0.01,-1"], "--eps"),
    (["--eps", "0.01,abc"], "--eps"),
    (["--iters", "0"], "--iters"),
    (["--restarts", "0"], "--restarts"),
    (["--inputs", "0"], "--inputs"),
    (["--batch", "-3"], "--batch"),
    (["--seed", "-1"], "--seed"),
    (["--smoothed", "--sigma", "0"], "--sigma"),
    (["--smoothed", "--sigma", "0.1", "--eot", "0"], "--eot"),
    (["--smoothed", "--sigma", "0.1", "--n", "0"], "--n"),
    (["--smoothed", "--sigma", "0.1", "--alpha", "1.5"], "--alpha"),
    (["--space", "concept", "--smoothed", "--rho", "0.7"], "--rho"),
    (["--smoothed"], "--sigma"),
    (["--space", "concept", "--smoothed"], "--rho"),
    (["--sigma", "0.1"], "--smoothed"),
    (["--space", "concept", "--smoothed", "--sigma", "0.1"], "--sigma"),
    (["--models", "std,nope"], "--models"),
])
def test_cli_rejects_bad_values_with_exit_2(linear_cli, tmp_path, args, flag):
    result = linear_cli.invoke(cli.main, ["attack", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output


def test_cli_runs_prints_the_table_and_resumes(linear_cli, tmp_path):
    args = ["attack", "--eps", "0.05,2", "--iters", "5", "--inputs", "4", "--batch", "4",
            "--models", "std,cbm", "--out", str(tmp_path)]
    first = linear_cli.invoke(cli.main, args)
    assert first.exit_code == 0, first.output
    assert "ε=0.05" in first.output and "ε=2" in first.output and "cbm" in first.output
    summary = json.loads((tmp_path / SUMMARY).read_text())
    assert set(summary["models"]) == {"std", "cbm"}
    again = linear_cli.invoke(cli.main, [*args, "--quiet"])
    assert again.exit_code == 0 and again.output == ""
    assert json.loads((tmp_path / SUMMARY).read_text()) == summary
    other = linear_cli.invoke(cli.main, [*args[:-2], "--iters", "6", "--out", str(tmp_path)])
    assert other.exit_code == 2 and "--out" in other.output


def test_builtin_world_untrained_end_to_end(tmp_path):
    from cbcert.builtin import untrained_world

    world = untrained_world("default", seed=0)
    job = AttackJob(eps=(0.03, 1.0), iters=5, models=("std",), num_inputs=2, batch=2)
    summary = run(world, job, tmp_path)
    robust = [b["robust_accuracy"] for b in summary["models"]["std"]["budgets"]]
    assert summary["models"]["std"]["clean_accuracy"] == 1.0
    assert robust[1] <= robust[0] <= 1.0
    assert all(r["perturbation_norm"] <= r["eps"] * (1 + 1e-5) for r in _records(tmp_path))
