"""Tests for cbcert.runs.attack (APGD through generator + classifier) and `certify attack`.

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
from cbcert.attacks.smoothed import smoothed_logits_fn
from cbcert.certify.cohen import ABSTAIN
from cbcert.cli import common as cli_common
from cbcert.engine.noise import Gaussian
from cbcert.generators.base import Generator
from cbcert.runs.attack import AttackJob, run, summarize_records
from cbcert.runs.attacker import Attacker, attack_keys, eot_keys
from cbcert.runs.directory import RECORDS, SUMMARY, RunMismatchError
from cbcert.runs.pool import agreement_pool
from cbcert.runs.units import units_at_once
from cbcert.worlds.world import World

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
    before = apgd_module._pass_jit._cache_size()
    summary = run(WORLD, BASE, out)
    return out, summary, apgd_module._pass_jit._cache_size() - before


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
    listed = json.loads((resumed / "run.json").read_text())["sessions"]
    assert [e["records_before"] for e in listed] == [0, 13]  # the first run's entry kept


def test_rerun_with_other_settings_is_refused(base_run, tmp_path):
    out, _, _ = base_run
    other = tmp_path / "other"
    shutil.copytree(out, other)
    with pytest.raises(RunMismatchError, match="different settings"):
        run(WORLD, dataclasses.replace(BASE, eps=(0.1,)), other)


def test_units_at_once_write_the_same_records_in_the_same_order(base_run, tmp_path):
    """The base run ran two units at once (the CPU default); one at a time and three at once
    write the same records, in the same order, and the same summary."""
    out, summary, _ = base_run
    assert units_at_once() == 2 and jax.default_backend() == "cpu"
    untimed = [{k: v for k, v in r.items() if k != "seconds"} for r in _records(out)]
    for units in (1, 3):
        assert run(WORLD, BASE, tmp_path / str(units), units=units) == summary
        assert [{k: v for k, v in r.items() if k != "seconds"}
                for r in _records(tmp_path / str(units))] == untimed


def test_smoothed_units_at_once_write_the_same_records(tmp_path):
    job = AttackJob(eps=(0.05, 0.3), iters=3, models=("std", "proto"), num_inputs=6, batch=4,
                    smoothed=True, scale=0.5, eot=2, n=40)
    one, two = (run(WORLD, job, tmp_path / str(u), units=u) for u in (1, 2))
    assert one == two
    assert _without_time(_records(tmp_path / "1")) == _without_time(_records(tmp_path / "2"))


def test_a_failing_unit_stops_the_run_keeping_the_units_before_it(base_run, tmp_path,
                                                                   monkeypatch):
    """With two units at once, the first batch's fourth unit (proto at ε = 0.05) raises: the
    error reaches the caller, the three units before it are on disk, nothing after them, and
    the rerun finishes with the uninterrupted summary."""
    out, summary, _ = base_run
    real = Attacker.attack

    def attack(self, model, eps, *args):
        if (model, eps) == ("proto", 0.05):
            raise RuntimeError("unit failed")
        return real(self, model, eps, *args)

    monkeypatch.setattr(Attacker, "attack", attack)
    with pytest.raises(RuntimeError, match="unit failed"):
        run(WORLD, BASE, tmp_path, units=2)
    kept = _records(tmp_path)
    assert [(r["model"], r["eps"]) for r in kept] == [
        ("std", eps) for eps in BASE.eps for _ in range(BASE.batch)]
    monkeypatch.setattr(Attacker, "attack", real)
    assert run(WORLD, BASE, tmp_path) == summary


def test_rerun_with_another_batch_resumes(base_run, tmp_path):
    """--batch never changes records: pinned in run.json as before, but not compared."""
    out, summary, _ = base_run
    again = tmp_path / "again"
    shutil.copytree(out, again)
    assert run(WORLD, dataclasses.replace(BASE, batch=8), again) == summary
    assert (again / "run.json").read_text() == (out / "run.json").read_text()


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


def test_keys_depend_on_model_eps_and_input_only():
    root = jax.random.key(0)
    data = lambda k: tuple(np.asarray(jax.random.key_data(k)).ravel())
    keys = attack_keys(root, 0, 0.01, np.array([7, 3, 7]))
    assert data(keys[0]) == data(keys[2]) != data(keys[1])
    assert data(attack_keys(root, 0, 0.01, np.array([3]))[0]) == data(keys[1])
    assert len({data(keys[0]), data(attack_keys(root, 1, 0.01, np.array([7]))[0]),
                data(attack_keys(root, 0, 0.03, np.array([7]))[0])}) == 3
    keys = eot_keys(root, np.array([7, 3, 7]))
    assert data(keys[0]) == data(keys[2]) != data(keys[1])


def test_explanations_at_the_clean_and_the_adversarial_point(tmp_path):
    """``explain`` on the shipped world: the clean explanation is the model's own (concepts for
    cbm, prototypes for proto, recomputed here), a negligible budget keeps every explanation
    (overlap 1), the summary carries the means, and a run without the option pins the same
    settings as before it existed."""
    from cbcert.robustness import explain as ex
    from cbcert.worlds.builtin import load_builtin

    world = load_builtin("default")
    job = AttackJob(eps=(1e-6, 0.5), iters=2, models=("cbm", "proto"), num_inputs=4, batch=4,
                    explain=True)
    summary = run(world, job, tmp_path / "x", chunk_size=16)
    records = _records(tmp_path / "x")
    pool = agreement_pool(world, 0, 4)
    params = world.params
    images = world.latent_images(params, jnp.asarray(pool.latents))
    logits = np.asarray(world.classify(params["clf"], images, ("cbm", "proto")))
    activations = {"cbm": (np.asarray(world.concept_scores(params["clf"], images)),
                           np.asarray(world.concept_head(params["clf"])[0])),
                   "proto": (np.asarray(world.prototypes(params["clf"], images)),
                             np.asarray(world.prototype_head(params["clf"])[0]))}
    for r in records:
        h = ("cbm", "proto").index(r["model"])
        row = pool.indices.tolist().index(r["index"])
        a, w = activations[r["model"]]
        e = ex.explain(ex.contributions(a[row:row + 1], w, logits[row:row + 1, h].argmax(-1)))
        assert [u for u, _ in r["explain"]["clean"]] == [int(u) for u in e.concepts[0] if u >= 0]
        if r["eps"] == 1e-6:
            kendall = r["explain"]["kendall"]  # τ-b = 1 up to scipy's float rounding
            assert r["explain"]["overlap"] == 1.0
            assert kendall is None or kendall == pytest.approx(1.0, abs=1e-12)
    for m in ("cbm", "proto"):
        tiny, large = summary["models"][m]["budgets"]
        assert tiny["explanation_overlap"] == 1.0
        assert 0.0 <= large["explanation_overlap"] <= 1.0
    pinned = json.loads((tmp_path / "x" / "run.json").read_text())
    assert json.dumps(pinned).count('"explain": true') == 1
    assert "explain" not in dataclasses.replace(job, explain=False).settings()


def _assert_agree_up_to_rounding(a: list[dict], b: list[dict], world, job) -> None:
    """Records of one attack run at two batch or chunk shapes: every decision identical, the
    two float fields within float32 error (docs/reproducibility.md).

    APGD's gradient comes from matmuls over the batch, whose float32 rounding XLA's CPU kernels
    choose by shape and ISA (on AVX-512 a row's logits and its adversarial point differ in the
    last bits between 4 and 16 rows), so:

    * perturbation_norm: while the attack takes the same decisions (signs, step halvings, best
      points), each iteration rounds a coordinate of the point at most 8 times (step, momentum,
      two projections), each time by <= u·(max|x0| + ε) with u = 2⁻²⁴, after the random start's
      2 roundings; max|x_adv − x0| then differs by at most that sum plus one rounding of the
      subtraction.
    * loss: a row's logits differ by up to 4e-6 between two shapes even on AVX2, and CE is
      2-Lipschitz in the max-norm of the logits, so final losses may differ by 1e-5.
    """
    a, b = [dict(r) for r in a], [dict(r) for r in b]
    u = np.finfo(np.float32).eps / 2
    pool = agreement_pool(world, job.seed, job.num_inputs)
    scale = float(np.abs(pool.latents).max()) + max(job.eps)
    norm_tol = (8 * job.iters + 2 + 1) * u * scale
    for field, atol in (("loss", 1e-5), ("perturbation_norm", norm_tol)):
        values = [np.array([r.pop(field) for r in records], float) for records in (a, b)]
        np.testing.assert_allclose(*values, rtol=0, atol=atol, err_msg=field)
    assert a == b


@pytest.mark.float_bits
@pytest.mark.parametrize("smoothed", [False, True])
def test_records_do_not_depend_on_batch(tmp_path, smoothed):
    # Random starts, restarts and EOT noise follow the input, not its batch: batch 4
    # (three batches, the last one padded) and batch 16 (one padded batch) agree.
    smoothing = dict(smoothed=True, scale=0.5, eot=2, n=50) if smoothed else {}
    job = AttackJob(eps=(0.3,), iters=2, restarts=3, models=("std",), num_inputs=10, **smoothing)
    for b in (4, 16):
        run(WORLD, dataclasses.replace(job, batch=b), tmp_path / str(b))
    small, large = (_without_time(_records(tmp_path / str(b))) for b in (4, 16))
    _assert_agree_up_to_rounding(small, large, WORLD, job)
    fooled = [r["attack_fooled"] for r in small]
    assert any(fooled) and not all(fooled)


def test_a_call_pads_to_its_own_inputs_and_probes_memory_only_when_that_can_matter(
        monkeypatch):
    # --batch 16: a call of 2 inputs runs on MIN_ATTACK_CHUNK = 4 rows without compiling the
    # memory probe; a call of 5 inputs asks the probe (mocked: 16 fit) and runs on 8 rows;
    # 16 inputs on the probe's 16; a tighter probe (2 fit) caps every call at MIN_ATTACK_CHUNK.
    from cbcert.runs import attacker as attacker_module

    probes = []

    def probe(*args, maximum, minimum, **kwargs):
        probes.append((minimum, maximum))
        return fits

    monkeypatch.setattr(attacker_module, "batch_within_memory", probe)
    job = AttackJob(eps=(0.3,), iters=2, models=("std",), num_inputs=16, batch=16)
    fits = 16
    attacker = attacker_module.Attacker(WORLD, job)
    x = np.zeros((16, LATENT_DIM), np.float32)
    assert attacker.chunk("std", x[:2]) == 4 and probes == []
    assert attacker.chunk("std", x[:5]) == 8 and probes == [(4, 16)]
    assert attacker.chunk("std", x) == 16 and len(probes) == 1  # probed once per model
    fits = 4
    attacker = attacker_module.Attacker(WORLD, job)
    assert attacker.chunk("std", x) == 4 and attacker.chunk("std", x[:3]) == 4
    # --chunk-size decides alone.
    attacker = attacker_module.Attacker(WORLD, job, chunk_size=2)
    assert attacker.chunk("std", x) == 2


def test_smoothed_attack_attacks_inputs_whose_eot_estimate_is_wrong(tmp_path):
    # With eot = 1 the attacker's estimate argmax p_hat misclassifies some clean inputs
    # that PREDICT (n = 200) classifies correctly (asserted); they must be attacked too.
    job = AttackJob(eps=(1.0,), iters=10, smoothed=True, scale=1.0, eot=1, n=200, alpha=0.01,
                    models=("std",), num_inputs=16, batch=16)
    run(WORLD, job, tmp_path)
    records = {r["index"]: r for r in _records(tmp_path)}
    pool = agreement_pool(WORLD, job.seed, job.num_inputs)
    root = jax.random.key(job.seed)
    head = lambda z: WORLD.latent_apply(("std",))(WORLD.params, z)[:, 0]
    p_hat = smoothed_logits_fn(head, noise=Gaussian().perturb, noise_scale=job.scale,
                               noise_keys=eot_keys(root, pool.indices), eot=job.eot)
    eot_pred = np.argmax(p_hat(jnp.asarray(pool.latents)), axis=-1)
    disagree = [int(i) for i, p in zip(pool.indices, eot_pred, strict=True)
                if p != records[int(i)]["label"] == records[int(i)]["clean_prediction"]]
    assert disagree, "expected an input whose EOT estimate alone is wrong at the clean point"
    for r in records.values():
        if r["clean_prediction"] == r["label"]:
            assert r["perturbation_norm"] == pytest.approx(r["eps"], rel=1e-5), r
    # The attack succeeds on some of them (robust accuracy drops below clean accuracy).
    assert any(not records[i]["robust"] for i in disagree)


@pytest.mark.parametrize("kwargs, match", [
    ({"eps": ()}, "eps"),
    ({"eps": (0.1, -0.1)}, "eps"),
    ({"eps": (0.1, 0.1)}, "each budget once"),
    ({"smoothed": True}, "sigma"),
    ({"space": "concept", "smoothed": True}, "rho"),
    ({"scale": 0.1}, "smoothed"),
    ({"explain": True, "smoothed": True, "scale": 0.1}, "base attacks only"),
    ({"explain": True, "models": ("std",)}, "name no model that explains"),
    ({"explain": 1}, "true or false"),
])
def test_job_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttackJob(**kwargs)


# ---------------------------------------------------------------------------- CLI


@pytest.fixture
def linear_cli(monkeypatch):
    monkeypatch.setattr(cli_common, "load_world", lambda name, **_: WORLD)
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
    (["--explain", "--models", "std"], "--explain"),
    (["--explain", "--models", "proto"], "--world"),  # the linear world has no prototypes
    (["--explain", "--smoothed", "--sigma", "0.1"], "--explain"),
    (["--units-at-once", "0"], "--units-at-once"),
])
def test_cli_rejects_bad_values_with_exit_2(linear_cli, tmp_path, args, flag):
    result = linear_cli.invoke(cli.main, ["attack", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output
    assert not (tmp_path / "o").exists()  # nothing pinned: a corrected rerun may use --out


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
    # Also the acceptance test of `certify attack --batch`: 8 inputs in two batches of 4 or
    # one padded batch of 16 give identical records (restart 1 runs on gathered subsets).
    from cbcert.worlds.builtin import untrained_world

    world = untrained_world("default", seed=0)
    job = AttackJob(eps=(0.03, 1.0), iters=3, restarts=2, models=("std",), num_inputs=8)
    # chunk_size: APGD on whole batches, skipping the memory probe's extra compilation.
    summaries = [run(world, dataclasses.replace(job, batch=b), tmp_path / str(b), chunk_size=16)
                 for b in (4, 16)]
    records = _records(tmp_path / "4")
    _assert_agree_up_to_rounding(_without_time(records), _without_time(_records(tmp_path / "16")),
                                 world, job)
    # The summary's means of the float fields agree as those fields do; its counts exactly.
    for summary in summaries:
        for budget in summary["models"]["std"]["budgets"]:
            budget.pop("mean_loss"), budget.pop("mean_perturbation_norm")
    assert summaries[0] == summaries[1]
    robust = [b["robust_accuracy"] for b in summaries[0]["models"]["std"]["budgets"]]
    assert summaries[0]["models"]["std"]["clean_accuracy"] == 1.0
    assert robust[1] < robust[0] <= 1.0
    assert all(r["perturbation_norm"] <= r["eps"] * (1 + 1e-5) for r in records)


@pytest.mark.float_bits
@pytest.mark.parametrize("smoothed", [False, True])
def test_every_generator_call_respects_the_chunk_size(tmp_path, smoothed):
    """APGD runs on sub-batches of --chunk-size inputs (EOT multiplies them); clean passes and
    PREDICT counts stay within the chunk too; records equal an unchunked run's."""
    from spying import spy_world

    world, seen = spy_world(_linear_world())
    extra = dict(smoothed=True, scale=0.3, eot=2, n=64) if smoothed else {}
    job = AttackJob(eps=(0.3,), iters=5, models=("std",), num_inputs=10, batch=8, **extra)
    run(world, job, tmp_path / "chunked", chunk_size=4)
    limit = 4 * (2 if smoothed else 1)
    assert seen and max(batch for _, batch in seen) <= limit, sorted(set(seen))
    run(_linear_world(), job, tmp_path / "whole")
    chunked, whole = (_strip_times(tmp_path / d) for d in ("chunked", "whole"))
    assert [r["index"] for r in chunked] == [r["index"] for r in whole]
    _assert_agree_up_to_rounding(chunked, whole, _linear_world(), job)


def _strip_times(out):
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (out / RECORDS).read_text().splitlines()]


def test_records_of_another_budget_are_refused(tmp_path):
    from cbcert.runs.directory import RecordsError

    job = AttackJob(eps=(0.3,), iters=3, models=("std",), num_inputs=4, batch=4)
    run(_linear_world(), job, tmp_path)
    text = (tmp_path / RECORDS).read_text()
    first = json.loads(text.splitlines()[0])
    (tmp_path / RECORDS).write_text(text + json.dumps({**first, "eps": 0.5}) + "\n")
    with pytest.raises(RecordsError, match=r"line 5: eps=0.5 is not one of the run's budgets"):
        run(_linear_world(), job, tmp_path)


def test_explanation_means_count_only_inputs_the_attack_fooled():
    """``explanation_*_fooled`` averages over inputs correct at the clean point and wrong at the
    adversarial one; an input wrong at both is in the overall mean only; undefined τ is left
    out."""
    def record(index, clean, adv, overlap, kendall):
        return {"index": index, "model": "cbm", "eps": 0.1, "label": 0, "clean_prediction": clean,
                "adversarial_prediction": adv, "loss": 1.0, "perturbation_norm": 0.1,
                "attack_fooled": adv != 0, "robust": clean == adv == 0,
                "explain": {"clean": [], "adversarial": [], "overlap": overlap,
                            "kendall": kendall}}

    records = [record(0, 0, 1, 0.2, -0.5), record(1, 1, 1, 0.9, None), record(2, 0, 0, 1.0, 1.0)]
    (budget,) = summarize_records(records, AttackJob(eps=(0.1,), models=("cbm",)))[
        "models"]["cbm"]["budgets"]
    assert budget["explanation_overlap"] == pytest.approx(0.7)
    assert budget["explanation_kendall"] == pytest.approx(0.25)
    assert budget["explanation_overlap_fooled"] == pytest.approx(0.2)
    assert budget["explanation_kendall_fooled"] == pytest.approx(-0.5)
