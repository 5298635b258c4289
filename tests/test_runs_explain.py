"""`certify explain` (`cbcert.runs.explain`): records, certificate families, known answer,
counterfactuals, export and bad input, on the shipped built-in world at small sizes."""

import json
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from cbcert import cli
from cbcert.cli import common as cli_common
from cbcert.cli import explain as cli_explain
from cbcert.concepts import concept_state
from cbcert.generators.concept_world import label_of
from cbcert.robustness import explain as ex
from cbcert.runs import bundle
from cbcert.runs import explain as explain_runner
from cbcert.runs.bundle import draw_subset
from cbcert.runs.explain import EXPORT_FORMAT, FIGURE, RECORDS, ExplainJob, export, run
from cbcert.runs.explanations import edit_keys
from cbcert.runs.pool import agreement_pool
from cbcert.schema import ConfigError
from cbcert.worlds.builtin import load_builtin

JOB = ExplainJob(num_inputs=6, n0=20, n=64, figure_inputs=1, seed=1, rho=0.1, judge_inputs=4)


@pytest.fixture(scope="module")
def world():
    return load_builtin("default")


@pytest.fixture(scope="module")
def finished(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("explain")
    result = run(world, JOB, out, chunk_size=64, judge_bundle=True)
    assert not (out / FIGURE).exists()  # runs never draw: the CLI draws what they return
    cli_explain.draw_figure(result, out)
    cli_explain.write_judge_bundle(result, out, world, out / "bundle")
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
        assert row[view]["cited"] == [{k: v for k, v in c.items() if k != "contribution"}
                                      for c in cited]  # the bars show shares
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
    assert data == json.loads((out / "bundle" / bundle.EXPLANATIONS).read_text())
    assert data["concept_names"] == list(world.generator.concept_names)
    first = data["explanations"][0]
    assert set(first) == {"id", "index", "model", "prediction", "label", "concepts"}
    assert first["prediction"] in data["class_names"]
    assert all(c["name"] in data["concept_names"] for c in first["concepts"])
    proto = [e for e in data["explanations"] if e["model"] == "proto"]
    assert len(proto) == 6 and all("prototypes" in e and "concepts" not in e for e in proto)


def test_pcbm_h_is_explained_with_its_residual(finished, world):
    """cbm's predicted logit is its concept contributions plus the head's bias; cbmh's adds its
    residual ρ_y(e), recomputed here from the residual layer's weights on the backbone's
    embedding, and its share of the evidence |ρ_y| / (Σ|r_i W[y, i]| + |ρ_y|). Where the two
    predict alike they share the concept head, so they cite alike; their records differ by the
    residual, which cbm does not have."""
    out, summary = finished[:2]
    pool = agreement_pool(world, 1, 6)
    params = world.params
    e = np.asarray(world.embed(params["clf"], world.latent_images(params, jnp.asarray(
        pool.latents))), np.float64)
    layer = params["clf"]["pcbm"]["residual"]
    rho = e @ np.asarray(layer["kernel"], np.float64) + np.asarray(layer["bias"], np.float64)
    records = {(r["model"], r["index"]): r for r in _records(out)}
    for row, index in enumerate(pool.indices.tolist()):
        cbm, cbmh = records[("cbm", index)], records[("cbmh", index)]
        lc, lh = cbm["logit"], cbmh["logit"]
        assert "residual" not in lc
        assert lc["value"] == pytest.approx(lc["concepts"] + lc["bias"], abs=1e-4)
        assert lh["residual"] == pytest.approx(rho[row, cbmh["prediction"]], abs=1e-4)
        total = sum(abs(c["contribution"]) for c in cbmh["cited"])  # the top k only
        assert 0 < lh["residual_share"] <= abs(lh["residual"]) / (total + abs(lh["residual"]))
        if cbm["prediction"] == cbmh["prediction"]:
            assert cbm["cited"] == cbmh["cited"]
    assert "residual_share" not in summary["models"]["cbm"]
    assert 0 < summary["models"]["cbmh"]["residual_share"]["mean"] < 1


def test_judge_bundle_holds_the_pre_registered_inputs(finished, world):
    """The bundle's inputs are the seed's draw from stream JUDGE, written in the run directory;
    one item per input and model, with images, the cited concepts' contributions and (concept
    models) the all-cited edit; answers are 1 + 8·F1 of the records."""
    out = finished[0]
    positions = draw_subset(1, 6, 4)
    assert len(set(positions.tolist())) == 4 and positions.tolist() == sorted(positions.tolist())
    pool = agreement_pool(world, 1, 6)
    registered = json.loads((out / bundle.SUBSET).read_text())
    assert registered["positions"] == positions.tolist()
    assert registered["indices"] == pool.indices[positions].tolist()
    manifest = json.loads((out / "bundle" / bundle.MANIFEST).read_text())
    assert (manifest["format"], manifest["version"]) == (bundle.FORMAT, bundle.VERSION)
    assert manifest["subset"] == registered
    items = [json.loads(x) for x in (out / "bundle" / bundle.ITEMS).read_text().splitlines()]
    assert [i["id"] for i in items] == [f"{i}-{m}" for i in registered["indices"]
                                        for m in JOB.models]
    records = {f"{r['index']}-{r['model']}": r for r in _records(out)}
    for item in items:
        r = records[item["id"]]
        assert item["schema"] == bundle.ITEM_SCHEMA
        assert [c["name"] for c in item["cited"]] == [c["name"] for c in r["cited"]]
        assert [c["contribution"] for c in item["cited"]] == [c["contribution"]
                                                            for c in r["cited"]]
        assert set(item["images"]) == ({"clean", "eps", "tau"} | (
            {"edit"} if item["model"] != "proto" else set()))
        for path in item["images"].values():
            pixels = np.asarray(Image.open(out / "bundle" / path))
            assert pixels.shape[0] >= bundle.MIN_PIXELS and pixels.shape[2] == 3
        if item["model"] == "proto":
            assert item["edit"] is None
        else:
            flipped = [c["concept"] for c in r["counterfactuals"]["single"]]
            assert item["edit"]["flipped"] == [manifest["concept_names"][i] for i in flipped]
            assert item["edit"]["verified"] == r["counterfactuals"]["all"]["valid"]
        assert (item["residual"] is not None) == (item["model"] == "cbmh")
    answers = [json.loads(x) for x in (out / "bundle" / bundle.ANSWERS).read_text().splitlines()]
    assert [a["id"] for a in answers] == [i["id"] for i in items if i["model"] != "proto"]
    assert all(a["known_answer"] == 1 + 8 * records[a["id"]]["f1"] for a in answers)
    assert json.loads((out / "bundle" / bundle.EXPLANATIONS).read_text())["format"] == (
        EXPORT_FORMAT)


def test_the_judge_subset_is_written_before_any_explanation(world, tmp_path, monkeypatch):
    """Pre-registration: the run writes judge_subset.json after drawing the pool and before
    the first observation of any explanation."""
    def stop(*args, **kwargs):
        raise RuntimeError("explanations start here")

    monkeypatch.setattr(explain_runner, "_observations", stop)
    with pytest.raises(RuntimeError, match="explanations start here"):
        run(world, replace(JOB, seed=5), tmp_path / "r", chunk_size=64)
    registered = json.loads((tmp_path / "r" / bundle.SUBSET).read_text())
    assert registered["positions"] == draw_subset(5, 6, 4).tolist()


def test_bundle_round_trip_with_two_scripted_judges(finished, tmp_path):
    """Bundle → scores → report on the built-in world: the known-answer scorer and a noisy
    judge (the known answer plus rounded N(0, 1.5²) noise, clipped to [1, 9], fixed seed) score
    the concept models' items; the report's means, agreement with the known answer and model
    comparison are recomputed here from the scores."""
    from cbcert.robustness.judges import krippendorff_alpha

    folder = finished[0] / "bundle"
    answers = {json.loads(x)["id"]: json.loads(x)["known_answer"]
               for x in (folder / bundle.ANSWERS).read_text().splitlines()}
    rng = np.random.default_rng(7)
    noisy = {i: float(np.clip(np.round(a + rng.normal(0, 1.5)), 1, 9)) for i, a in answers.items()}
    scores = tmp_path / "noisy.jsonl"
    scores.write_text("".join(json.dumps({"judge": "noisy", "id": i, "score": s}) + "\n"
                              for i, s in noisy.items()))
    result = CliRunner().invoke(cli.main, ["judge", str(folder), str(scores), "--known-answer",
                                           "--out", str(tmp_path / "judge.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "judge.json").read_text())
    ids = list(answers)
    for m in ("cbm", "cbmh"):
        mine = [(answers[i] + noisy[i]) / 2 for i in ids if i.endswith(f"-{m}")]
        assert report["models"][m]["mean"] == pytest.approx(np.mean(mine))
        assert report["models"][m]["low"] <= report["models"][m]["mean"] <= (
            report["models"][m]["high"])
    assert report["models"]["proto"] is None  # nobody scored it
    both = np.array([[noisy[i] for i in ids], [answers[i] for i in ids]])
    alpha = report["agreement"]["krippendorff_alpha"]["interval"]
    assert alpha == pytest.approx(krippendorff_alpha(both, "interval")) and alpha < 1
    assert report["known_answer"]["noisy"]["alpha_interval"] == pytest.approx(alpha)
    assert set(report["known_answer"]) == {"noisy"}
    (pair,) = [c for c in report["comparisons"] if (c["model_a"], c["model_b"]) == ("cbm",
                                                                                    "cbmh")]
    assert pair["inputs"] == 4


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="models: got \\['std'\\]"):
        ExplainJob(models=("std",))
    with pytest.raises(ConfigError, match="radius=-1"):
        ExplainJob(radius=-1.0)
    assert ExplainJob(sigma=0.2).radius == pytest.approx(0.05)
    assert (ExplainJob().judge_inputs, ExplainJob(num_inputs=7).judge_inputs) == (20, 7)
    with pytest.raises(ConfigError, match=r"judge_inputs=5: allowed range \[1, num_inputs=4\]"):
        ExplainJob(num_inputs=4, judge_inputs=5)


@pytest.mark.parametrize("args,flag", [(["--tau", "13"], "--tau"),
                                       (["--models", "std"], "--models"),
                                       (["--inputs", "0"], "--inputs"),
                                       (["--judge-inputs", "0"], "--judge-inputs"),
                                       (["--inputs", "3", "--judge-inputs", "4"],
                                        "--judge-inputs")])
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


def test_cli_export_never_overwrites_a_bundle(tmp_path, monkeypatch):
    """A folder that holds a judge bundle (judges may have scored it) is refused before any
    work, exit 2 naming --export."""
    def never(*args, **kwargs):
        raise AssertionError("the world was loaded or the job ran")

    monkeypatch.setattr(cli_common, "load_world", never)
    target = tmp_path / "bundle"
    target.mkdir()
    (target / bundle.MANIFEST).write_text("{}")
    result = CliRunner().invoke(cli.main, ["explain", "--n", "10", "--n0", "5", "--out",
                                           str(tmp_path / "run"), "--export", str(target),
                                           "--quiet"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "--export" in result.output and "already holds a judge bundle" in result.output
    assert not (tmp_path / "run").exists()


def test_an_imperfect_editor_is_caught_by_edit_verification(tmp_path):
    """On the imperfect-editor world every record's ``valid`` is what the generator's read-out
    shows of the editor's output with the run's edit keys (recomputed here); discarded edits
    are counted; an edit that failed outright (nothing changed) is inconsistent without
    verification exactly when the class rule says it should have changed the class; and every
    accepted edit scores exactly as on the default world's perfect editor."""
    world = load_builtin("imperfect-editor")
    job = ExplainJob(models=("cbm",), num_inputs=8, n0=10, n=16, figure_inputs=0, seed=4)
    result = run(world, job, tmp_path / "r", chunk_size=64)
    gen, params, k = world.generator, world.params["gen"], world.generator.num_concepts
    pool = agreement_pool(world, 4, 8)
    c = gen.concepts(params, jnp.asarray(pool.latents))
    before = np.asarray(concept_state(c, k))
    slots = job.top_k + 1
    keys = edit_keys(4, pool.indices, slots).reshape(8, slots)
    rejected = attempted = 0
    for row, r in enumerate(_records(tmp_path / "r")):
        for j, edit in enumerate(r["counterfactuals"]["single"]):
            targets = np.zeros((1, k), bool)
            targets[0, edit["concept"]] = True
            after = world.edit(keys[row, j][None], c[row][None], targets)
            read = np.asarray(concept_state(gen.encode(params, gen.decode(params, after)), k))
            assert edit["valid"] == bool(ex.verify_edit(before[row][None], read, targets)[0])
            if (read[0] == before[row]).all():  # failed outright: the image did not change
                rule = world.class_rule
                should = int(rule.label(jnp.asarray(targets ^ before[row]))[0]) != int(
                    rule.label(jnp.asarray(before[row][None]))[0])
                assert edit["consistent_unverified"] == (not should)
            rejected += not edit["valid"]
            attempted += 1
    assert 0 < rejected < attempted
    assert result.summary["models"]["cbm"]["single_edits"] == {"attempted": attempted,
                                                               "discarded": rejected}
    # Verification restores the perfect editor's scores exactly: every accepted edit is the
    # asked one, so it scores as the same edit does on the default world (same classifiers).
    run(load_builtin("default"), job, tmp_path / "d", chunk_size=64)
    perfect = {(r["index"], e["concept"]): e for r in _records(tmp_path / "d")
               for e in r["counterfactuals"]["single"]}
    assert all(e["valid"] and e["consistent"] == e["consistent_unverified"]
               for e in perfect.values())
    for r in _records(tmp_path / "r"):
        for edit in r["counterfactuals"]["single"]:
            if edit["valid"]:
                same = perfect[(r["index"], edit["concept"])]
                assert (edit["consistent"], edit["faithful"]) == (same["consistent"],
                                                                  same["faithful"])


def test_a_rerun_may_draw_another_judge_subset(finished, world):
    """--judge-inputs changes the bundle, not the records: a rerun into the same directory with
    another value is accepted and re-registers its subset before the explanations."""
    out = finished[0]
    run(world, replace(JOB, judge_inputs=3, rho=None), out / "again", chunk_size=64)
    run(world, replace(JOB, judge_inputs=2, rho=None), out / "again", chunk_size=64)
    registered = json.loads((out / "again" / bundle.SUBSET).read_text())
    assert registered["positions"] == draw_subset(1, 6, 2).tolist()
    # Each run rewrote the records whole: run.json lists both, the second finding the first's.
    listed = json.loads((out / "again" / "run.json").read_text())["sessions"]
    assert [e["records_before"] for e in listed] == [0, len(_records(out / "again"))]
    with pytest.raises(ValueError, match="eps"):  # a setting of the records is still pinned
        run(world, replace(JOB, judge_inputs=2, rho=None, eps=0.2), out / "again",
            chunk_size=64)
