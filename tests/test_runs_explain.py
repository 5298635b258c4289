"""`certify explain` (`cbcert.runs.explain`): records, certificate families, known answer,
counterfactuals, export and bad input, on the shipped built-in world at small sizes."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from cbcert import cli
from cbcert.cli import common as cli_common
from cbcert.cli import explain as cli_explain
from cbcert.concepts import concept_state
from cbcert.generators.concept_world import label_of
from cbcert.runs import explain as explain_runner
from cbcert.runs.explain import EXPORT_FORMAT, FIGURE, RECORDS, ExplainJob, export, run
from cbcert.runs.pool import agreement_pool
from cbcert.schema import ConfigError
from cbcert.worlds.builtin import load_builtin

JOB = ExplainJob(num_inputs=6, n0=20, n=64, figure_inputs=1, seed=1, rho=0.1)


@pytest.fixture(scope="module")
def world():
    return load_builtin("default")


@pytest.fixture(scope="module")
def finished(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("explain")
    result = run(world, JOB, out, chunk_size=64)
    assert not (out / FIGURE).exists()  # runs never draw: the CLI draws what they return
    cli_explain.draw_figure(result, out)
    return out, result.summary, result.extras["figure"]


def _records(out):
    return [json.loads(line) for line in (out / RECORDS).read_text().splitlines()]


def test_records_cover_every_input_and_model(finished, world):
    out, summary, figure = finished
    records = _records(out)
    assert [(r["model"], r["index"]) for r in records] == [
        (m, i) for m in JOB.models for i in agreement_pool(world, 1, 6).indices.tolist()]
    assert (out / FIGURE).stat().st_size > 0
    (row,) = figure.rows  # figure_inputs=1: the first input, explained by the first model
    assert (figure.model, set(row), set(figure.titles)) == ("cbm", {"clean", "eps", "tau"},
                                                            {"clean", "eps", "tau"})
    first = next(r for r in records if r["model"] == "cbm")
    for view in ("clean", "eps", "tau"):
        assert row[view]["image"].shape == tuple(world.generator.image_shape)
        cited = first["cited"] if view == "clean" else first[view]["cited"]
        assert row[view]["cited"] == cited
    assert set(summary["models"]) == {"cbm", "cbmh", "proto"}
    assert "all_cited_certified_flips" in summary["models"]["cbm"]
    assert "all_cited_certified_flips" in summary["models"]["proto"]
    assert "f1" not in summary["models"]["proto"]  # prototypes name no concept
    for r in records:
        unit = "prototype" if r["model"] == "proto" else "concept"
        cited = [c[unit] for c in r["cited"]]
        assert 1 <= len(cited) <= 5
        assert sum(abs(c["share"]) for c in r["cited"]) <= 1 + 1e-9
        # Each certificate's family is exactly the cited concepts.
        for suffix in ("", "_flips"):
            assert [c[unit] for c in r[f"certified{suffix}"]] == cited
            assert r[f"all_certified{suffix}"] == all(
                c["stable_at_radius"] for c in r[f"certified{suffix}"])
        assert all(c["radius"] == int(c["radius"]) for c in r["certified_flips"])  # Hamming
        for view in ("eps", "tau"):
            assert 0.0 <= r[view]["overlap"] <= 1.0
        for c in r["certified"]:
            assert c["radius"] >= 0
            if unit == "concept":
                assert c["sign"] in (-1, 1)
            else:  # a prototype is claimed stable only where the noise keeps it cited
                assert c["cited_under_noise"] or not (c["stable_at_radius"] or c["radius"])
        assert ("counterfactuals" in r) == (unit == "concept")


def test_prototype_explanations_are_the_proto_heads_contributions(finished, world):
    """proto records cite the top prototype contributions ``s_j W[y, j]`` of the clean image,
    named after the class each prototype was made for."""
    out = finished[0]
    pool = agreement_pool(world, 1, 6)
    params = world.params
    images = world.latent_images(params, jnp.asarray(pool.latents))
    s = np.asarray(world.prototypes(params["clf"], images), np.float64)
    w, owner = (np.asarray(a) for a in world.prototype_head(params["clf"]))
    for r in _records(out):
        if r["model"] != "proto":
            continue
        row = list(pool.indices).index(r["index"])
        c = s[row] * w[r["prediction"]]
        top = np.argsort(-np.abs(c), kind="stable")[:5]
        cited = [e["prototype"] for e in r["cited"]]
        assert cited == top[:len(cited)].tolist()
        for e in r["cited"]:
            assert e["name"] == f"p{e['prototype']} ({world.class_names[owner[e['prototype']]]})"
            assert e["share"] == pytest.approx(c[e["prototype"]] / np.abs(c[top]).sum(),
                                               rel=1e-4, abs=1e-6)


def test_cited_prototypes_are_certified_under_negligible_noise(world, tmp_path):
    """With σ = 1e-4 the noisy images are the clean image to float32 precision, so the device
    membership rule (`top_k_members`) must cite exactly what the host `explain` cites on all 32
    estimation samples: every cited prototype is then certified at R = σ/4 (one-sided p-value
    Φ(1/4)^32 ≈ 7e-8 before Holm, far under α = 0.001). A device rule that cited a different
    set would fail here."""
    job = ExplainJob(models=("proto",), num_inputs=4, sigma=1e-4, n0=10, n=32, figure_inputs=0,
                     seed=2)
    result = run(world, job, tmp_path / "p", chunk_size=64)
    assert result.extras["figure"] is None  # figure_inputs=0
    records = _records(tmp_path / "p")
    assert len(records) == 4 and all(r["all_certified"] for r in records)
    assert all(c["cited_under_noise"] for r in records for c in r["certified"])
    assert result.summary["models"]["proto"]["all_cited_certified"]["mean"] == 1.0


def test_known_answer_and_counterfactuals_follow_the_class_rule(finished, world):
    """Precision/recall against the class-defining concepts present, recomputed from the
    world's patterns; every edit verifies on the built-in world (E(D(c)) = c), and
    ``should_change`` is the class rule on the edited concepts."""
    out = finished[0]
    pool = agreement_pool(world, 1, 6)
    patterns = np.asarray(world.generator.params["patterns"], bool)
    c = world.generator.concepts(world.params["gen"], jnp.asarray(pool.latents))
    state = np.asarray(concept_state(c, world.generator.num_concepts))
    for r in _records(out):
        if r["model"] == "proto":
            continue
        row = list(pool.indices).index(r["index"])
        relevant = state[row] & patterns[r["true_label"]]
        cited = [c["concept"] for c in r["cited"]]
        hits = sum(bool(relevant[i]) for i in cited)
        assert r["precision"] == pytest.approx(hits / len(cited))
        assert r["recall"] == (None if not relevant.any() else pytest.approx(
            hits / relevant.sum()))
        for edit in r["counterfactuals"]["single"]:
            assert edit["valid"] is True
            flipped = state[row].copy()
            flipped[edit["concept"]] ^= True
            before, after = (int(label_of(jnp.asarray(s[None]), jnp.asarray(patterns))[0])
                             for s in (state[row], flipped))
            assert edit["should_change"] == (before != after)


def test_the_builtin_class_rule_is_the_ground_truth(world):
    """`World.class_rule` of a built-in world: ``defining`` is the class patterns on the
    concepts they cover, and ``label`` of the encoded concept state (on the built-in world,
    the true concepts: ``E(g1(z))`` carries ``sin(ω (A z))`` exactly) is ``true_label``."""
    gen, gen_params = world.generator, world.params["gen"]
    patterns = np.asarray(gen_params["patterns"], bool)  # [C, Kc]
    rule = world.class_rule
    assert rule.defining.shape == (world.num_classes, gen.num_concepts)
    np.testing.assert_array_equal(rule.defining[:, :patterns.shape[1]], patterns)
    assert not rule.defining[:, patterns.shape[1]:].any()
    z = jnp.asarray(agreement_pool(world, 1, 6).latents)
    state = concept_state(gen.concepts(gen_params, z), gen.num_concepts)  # [N, K]
    np.testing.assert_array_equal(rule.label(state), world.true_label(gen_params, z))
    np.testing.assert_array_equal(rule.label(state), label_of(state, jnp.asarray(patterns)))


def test_export_is_the_documented_format(finished, world, tmp_path):
    out = finished[0]
    count = export(out, world, tmp_path / "judge.json")
    data = json.loads((tmp_path / "judge.json").read_text())
    assert (data["format"], data["version"], count) == (EXPORT_FORMAT, 1, 18)
    assert data["concept_names"] == list(world.generator.concept_names)
    first = data["explanations"][0]
    assert set(first) == {"id", "index", "model", "prediction", "label", "concepts"}
    assert first["prediction"] in data["class_names"]
    assert all(c["name"] in data["concept_names"] for c in first["concepts"])
    proto = [e for e in data["explanations"] if e["model"] == "proto"]
    assert len(proto) == 6 and all("prototypes" in e and "concepts" not in e for e in proto)


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="models: got \\['std'\\]"):
        ExplainJob(models=("std",))
    with pytest.raises(ConfigError, match="radius=-1"):
        ExplainJob(radius=-1.0)
    assert ExplainJob(sigma=0.2).radius == pytest.approx(0.05)


@pytest.mark.parametrize("args,flag", [(["--tau", "13"], "--tau"),
                                       (["--models", "std"], "--models"),
                                       (["--inputs", "0"], "--inputs")])
def test_cli_bad_input_exits_2_naming_the_flag(args, flag, tmp_path):
    result = CliRunner().invoke(cli.main, ["explain", *args, "--n", "10", "--n0", "5",
                                           "--out", str(tmp_path / "x"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert flag in result.output


def test_cli_export_into_a_missing_folder_exits_2_before_any_work(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the world was loaded or the job ran")

    monkeypatch.setattr(cli_common, "load_world", never)
    monkeypatch.setattr(explain_runner, "run", never)
    target = tmp_path / "missing" / "dir" / "x.json"
    result = CliRunner().invoke(cli.main, ["explain", "--n", "10", "--n0", "5", "--out",
                                           str(tmp_path / "run"), "--export", str(target),
                                           "--quiet"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "--export" in result.output and str(target.parent) in result.output
    assert "does not exist" in result.output
    assert list(tmp_path.iterdir()) == []
