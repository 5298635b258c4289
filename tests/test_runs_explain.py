"""`certify explain` (`cbcert.runs.explain`): records, certificate families, known answer,
counterfactuals, export and bad input, on the shipped built-in world at small sizes."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from cbcert import cli
from cbcert.concepts import concept_state
from cbcert.generators.concept_world import label_of
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
    return out, run(world, JOB, out, chunk_size=64)


def _records(out):
    return [json.loads(line) for line in (out / RECORDS).read_text().splitlines()]


def test_records_cover_every_input_and_model(finished, world):
    out, summary = finished
    records = _records(out)
    assert [(r["model"], r["index"]) for r in records] == [
        (m, i) for m in JOB.models for i in agreement_pool(world, 1, 6).indices.tolist()]
    assert (out / FIGURE).stat().st_size > 0
    assert set(summary["models"]) == {"cbm", "cbmh"}
    assert "all_cited_certified_flips" in summary["models"]["cbm"]
    for r in records:
        cited = [c["concept"] for c in r["cited"]]
        assert 1 <= len(cited) <= 5
        assert sum(abs(c["share"]) for c in r["cited"]) <= 1 + 1e-9
        # Each certificate's family is exactly the cited concepts.
        for suffix in ("", "_flips"):
            assert [c["concept"] for c in r[f"certified{suffix}"]] == cited
            assert r[f"all_certified{suffix}"] == all(
                c["stable_at_radius"] for c in r[f"certified{suffix}"])
        assert all(c["radius"] == int(c["radius"]) for c in r["certified_flips"])  # Hamming
        for view in ("eps", "tau"):
            assert 0.0 <= r[view]["overlap"] <= 1.0
        for c in r["certified"]:
            assert c["sign"] in (-1, 1) and c["radius"] >= 0


def test_known_answer_and_counterfactuals_follow_the_class_rule(finished, world):
    """Precision/recall against the class-defining concepts present, recomputed from the
    world's patterns; every edit verifies on the built-in world (E(D(c)) = c), and
    ``should_change`` is the class rule on the edited concepts."""
    out, _ = finished
    pool = agreement_pool(world, 1, 6)
    patterns = np.asarray(world.generator.params["patterns"], bool)
    c = world.generator.concepts(world.params["gen"], jnp.asarray(pool.latents))
    state = np.asarray(concept_state(c, world.generator.num_concepts))
    for r in _records(out):
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


def test_export_is_the_documented_format(finished, world, tmp_path):
    out, _ = finished
    count = export(out, world, tmp_path / "judge.json")
    data = json.loads((tmp_path / "judge.json").read_text())
    assert (data["format"], data["version"], count) == (EXPORT_FORMAT, 1, 12)
    assert data["concept_names"] == list(world.generator.concept_names)
    first = data["explanations"][0]
    assert set(first) == {"id", "index", "model", "prediction", "label", "concepts"}
    assert first["prediction"] in data["class_names"]
    assert all(c["name"] in data["concept_names"] for c in first["concepts"])


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
