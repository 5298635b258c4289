"""Empirical robustness runs: PFR/CFR/DFS records, protocol, resumption, and `certify perturb`.

One small run on the untrained world (std and cbm identical by construction) is shared by most
tests; only the resumption test samples again.
"""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

from cbcert import cli
from cbcert.cli import common as cli_common
from cbcert.concepts import concept_state
from cbcert.engine.keys import Stream, sample_key, stream_key
from cbcert.engine.noise import SphereShift
from cbcert.robustness import protocol
from cbcert.runs.directory import RUN, SUMMARY, RunMismatchError
from cbcert.runs.perturb import (
    PerturbJob,
    observer,
    run,
    summarize,
)
from cbcert.runs.pool import pool_latents
from cbcert.worlds.builtin import untrained_world

JOB = PerturbJob(eps=(1e-6, 0.5), tau=(1, 3), models=("std", "cbm", "proto"), seed=3, samples=2,
                 num_subsets=3, subset_size=8, num_inputs=12, batch=6)
CHUNK = 16  # fixed engine chunk: skips the memory probe's extra compilation


@pytest.fixture(scope="module")
def world():
    return untrained_world("default", seed=0)


@pytest.fixture(scope="module")
def finished(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("perturb") / "run"
    return out, run(world, JOB, out, chunk_size=CHUNK)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _row(result, kind, value):
    (row,) = [r for r in result.extras["rows"] if (r.kind, r.value) == (kind, value)]
    return row


def test_tiny_eps_flips_no_prediction(finished):
    out, result = finished
    row = _row(result, "eps", 1e-6)
    assert all(pfr.mean == 0.0 and pfr.sd == 0.0 for pfr in row.pfr.values())
    for record in _lines(out / "eps1e-06.jsonl"):
        for sample in record["samples"]:
            assert sample["pred"] == record["clean"]["pred"]
            assert sample["dfs"] < 1e-3


def test_identical_models_have_zero_differences(finished):
    # std and cbm of the untrained world are the same function, so their flips coincide.
    out, result = finished
    assert len(result.extras["rows"]) == 4
    for row in result.extras["rows"]:
        assert row.pfr["std"] == row.pfr["cbm"]
        (std_cbm,) = [c for c in row.comparisons if c.model_b == "cbm"]
        assert (std_cbm.delta.mean, std_cbm.delta.sd, std_cbm.pvalue, std_cbm.pvalue_holm) == (
            0.0, 0.0, 1.0, 1.0)
    eps = _row(result, "eps", 0.5)
    assert eps.pfr["std"].mean > 0.0  # the large budget does move predictions


@pytest.mark.parametrize("tau", [1, 3])
def test_semantic_flips_change_exactly_tau_concepts(finished, world, tau):
    out, result = finished
    k = world.generator.num_concepts
    row = _row(result, "tau", tau)
    assert row.cfr.mean == tau / k and row.cfr.sd == 0.0
    assert row.cfr_count.mean == tau
    assert row.cfr_histogram[tau] == 1.0
    for record in _lines(out / f"tau{tau}.jsonl"):
        clean = np.array(list(record["clean"]["concepts"]))
        for sample in record["samples"]:
            assert sample["concept_flips"] == tau
            assert np.sum(np.array(list(sample["concepts"])) != clean) == tau


def test_geometric_records_follow_the_engine_keys(finished, world):
    """Sample j of input i is g(z_i + ε u), u from sample_key(fold_in(root, GEOMETRIC), i, j)."""
    out, _ = finished
    records = _lines(out / "eps0.5.jsonl")
    # The untrained world's std and cbm always agree: the agreement set is the pool's prefix.
    assert [r["index"] for r in records] == list(range(JOB.num_inputs))
    assert [r["label"] for r in records] == [r["clean"]["pred"]["std"] for r in records]
    n, j = 4, 1
    key = sample_key(stream_key(jax.random.key(JOB.seed), Stream.GEOMETRIC), n, j)
    z = pool_latents(world, JOB.seed, n, 1)[0]
    z_tilde = SphereShift().perturb(key, z, 0.5)
    np.testing.assert_allclose(np.linalg.norm(z_tilde - z), 0.5, rtol=1e-5)
    observe = jax.jit(observer(world, "latent", JOB.models, scores=False))
    seen = observe(world.params, np.stack([z, z_tilde]))
    pred = [dict(zip(JOB.models, p, strict=True)) for p in seen["pred"].tolist()]
    assert records[n]["clean"]["pred"] == pred[0]
    assert records[n]["samples"][j]["pred"] == pred[1]
    state = np.asarray(concept_state(world.encode_latents(world.params, z_tilde[None]), 12))[0]
    assert records[n]["samples"][j]["concepts"] == "".join("1" if s else "0" for s in state)


def test_subsets_are_reproducible_from_the_seed(finished):
    out, result = finished
    indices = np.arange(JOB.num_inputs)  # the untrained world's std and cbm always agree
    expected = protocol.draw_subsets(JOB.num_inputs, num_subsets=3, subset_size=8,
                                     seed=(JOB.seed, int(Stream.SUBSETS)))
    assert result.summary["subsets"] == indices[expected].tolist()
    again = summarize(out, JOB, indices, 12)
    assert again.summary["subsets"] == result.summary["subsets"]
    assert again.summary["budgets"] == result.summary["budgets"]
    other = summarize(out, dataclasses.replace(JOB, seed=4), indices, 12)
    assert other.summary["subsets"] != result.summary["subsets"]


def test_summary_file_matches_rows(finished):
    out, result = finished
    summary = json.loads((out / SUMMARY).read_text())
    assert summary == result.summary
    assert summary["budgets"] == [row.to_dict() for row in result.extras["rows"]]
    assert summary["pool"] == {"agreement_inputs": 12, "pool_size": 256}
    assert summary["settings"]["eps"] == [1e-6, 0.5]


def test_resume_after_interruption_gives_identical_records_and_summary(world, finished, tmp_path):
    full, result = finished
    part = tmp_path / "part"
    shutil.copytree(full, part)
    lines = (full / "eps0.5.jsonl").read_text().splitlines(keepends=True)
    # Killed in the second batch of eps=0.5, mid-line, before tau=3 and the summary.
    (part / "eps0.5.jsonl").write_text("".join(lines[:7]) + lines[7][:20])
    (part / "tau3.jsonl").unlink()
    (part / SUMMARY).unlink()
    kept = sum(len(f.read_text().splitlines()) for f in part.glob("*.jsonl")) - 1  # torn: not one
    resumed = run(world, JOB, part, chunk_size=CHUNK)
    assert resumed.summary == result.summary
    # The resuming session is appended to run.json's sessions, counting every budget's lines.
    listed = json.loads((part / RUN).read_text())["sessions"]
    assert listed[0] == json.loads((full / RUN).read_text())["sessions"][0]
    assert [e["records_before"] for e in listed] == [0, kept]
    assert json.loads((part / SUMMARY).read_text()) == result.summary
    for name in ("eps0.5.jsonl", "tau3.jsonl"):
        key = lambda r: r["index"]  # noqa: E731
        assert sorted(_lines(part / name), key=key) == sorted(_lines(full / name), key=key)


def test_rerun_with_other_settings_is_refused(world, finished):
    out, _ = finished
    with pytest.raises(RunMismatchError, match="different settings"):
        run(world, dataclasses.replace(JOB, samples=3), out)


def test_rerun_with_another_batch_resumes(world, finished, tmp_path):
    """--batch never changes records: pinned in run.json as before, but not compared."""
    full, result = finished
    out = tmp_path / "again"
    shutil.copytree(full, out)
    again = run(world, dataclasses.replace(JOB, batch=5), out, chunk_size=CHUNK)
    assert again.summary["budgets"] == result.summary["budgets"]
    assert (out / RUN).read_text() == (full / RUN).read_text()


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"eps": (0.0,)}, r"key 'eps': got 0\.0, allowed range \[1e-30"),
        ({"tau": (0,)}, r"key 'tau': got 0, allowed range integer in \[1, inf\)"),
        ({"eps": (), "tau": ()}, "at least one budget"),
        ({"models": ("std",)}, "at least 2 distinct models"),
        ({"num_inputs": 7}, r"num_inputs=7: .*subset_size=8"),
        ({"num_subsets": 1}, "key 'num_subsets': got 1"),
    ],
)
def test_job_rejects_bad_settings(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(JOB, **changes)


def test_default_pool_is_twice_the_subset_size():
    assert PerturbJob().num_inputs == 400
    assert PerturbJob(subset_size=30).num_inputs == 60


def test_tau_above_the_number_of_concepts_is_rejected(world, tmp_path):
    with pytest.raises(ValueError, match=r"tau=13: .*K=12"):
        run(world, dataclasses.replace(JOB, tau=(13,)), tmp_path)
    assert not (tmp_path / RUN).exists()


@pytest.mark.parametrize(
    "args,flag,message",
    [
        (["--eps", "0.1,-0.2"], "--eps", "allowed range [1e-30, 1e+30]"),
        (["--eps", "0.1,abc"], "--eps", "comma-separated numbers"),
        (["--tau", "0"], "--tau", "allowed range integer in [1, inf)"),
        (["--subsets", "1"], "--subsets", "[2, inf)"),
        (["--pool", "10", "--subset-size", "20"], "--pool", "[subset_size=20, inf)"),
        (["--pool", "0", "--subset-size", "20"], "--pool", "got 0, allowed range [subset_size=20"),
        (["--models", "std"], "--models", "at least 2 distinct models"),
    ],
)
def test_cli_rejects_bad_values_before_loading(monkeypatch, args, flag, message):
    def no_world(preset, **_):
        raise AssertionError("the world must not be loaded for invalid flags")

    monkeypatch.setattr(cli_common, "load_world", no_world)
    result = CliRunner().invoke(cli.main, ["perturb", *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output and message in result.output


def test_cli_checks_tau_against_the_world(monkeypatch, world, tmp_path):
    monkeypatch.setattr(cli_common, "load_world", lambda preset, **_: world)
    result = CliRunner().invoke(cli.main, ["perturb", "--tau", "2,13", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "--tau" in result.output and "[1, K=12]" in result.output


def test_cli_rerun_of_a_finished_run_prints_the_table(monkeypatch, world, finished, tmp_path):
    full, result = finished
    out = tmp_path / "again"
    shutil.copytree(full, out)
    monkeypatch.setattr(cli_common, "load_world", lambda preset, **_: world)
    monkeypatch.setattr(cli_common, "console", Console(width=250))
    args = ["perturb", "--eps", "1e-6,0.5", "--tau", "1,3", "--seed", "3", "--samples", "2",
            "--subsets", "3", "--subset-size", "8", "--pool", "12", "--batch", "6",
            "--out", str(out)]
    invoked = CliRunner().invoke(cli.main, args)
    assert invoked.exit_code == 0, invoked.output
    assert json.loads((out / SUMMARY).read_text()) == result.summary
    for text in ("PFR std", "PFR proto", "DFS cbm", "Δ std−cbm", "p_Holm", "ε=0.5", "τ=3",
                 "0.250 ± 0.000", "Holm over 8 tests"):
        assert text in invoked.output


def test_every_generator_call_respects_the_chunk_size(world, finished, tmp_path):
    """Pool, encoding, clean observations and perturbations reach the generator in chunks of at
    most ``chunk_size``; the records equal those of a run with larger chunks."""
    from spying import spy_world

    spied, seen = spy_world(world)
    run(spied, JOB, tmp_path / "small", chunk_size=4)
    assert seen and max(batch for _, batch in seen) <= 4, sorted(set(seen))
    out, _ = finished
    for kind, value in JOB.budgets:
        name = f"{kind}{value:g}.jsonl"
        assert _lines(tmp_path / "small" / name) == _lines(out / name), name


def test_foreign_records_are_refused(world, finished, tmp_path):
    from cbcert.runs.directory import RecordsError

    out, _ = finished
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    path = copy / "tau1.jsonl"
    record = json.loads(path.read_text().splitlines()[0])
    path.write_text(path.read_text() + json.dumps({**record, "index": 10**7}) + "\n")
    with pytest.raises(RecordsError, match="index=10000000 is not an input of this run"):
        run(world, JOB, copy, chunk_size=CHUNK)


def test_smoothing_budgets_flip_exactly_the_certificates_estimation_samples(world, tmp_path):
    """σ and ρ budgets draw `certify latent` / `certify concept`'s estimation noise: an input's
    flips are the estimation samples whose label differs from its clean prediction."""
    import cbcert
    from cbcert.runs.pool import agreement_pool, space_inputs

    job = PerturbJob(eps=(), tau=(), sigma=(0.5,), rho=(0.3,), models=("std", "cbm"), seed=4,
                     samples=6, num_subsets=2, subset_size=4, num_inputs=5, batch=5)
    result = run(world, job, tmp_path / "run", chunk_size=CHUNK)
    assert [(r.kind, r.value) for r in result.extras["rows"]] == [("sigma", 0.5), ("rho", 0.3)]
    summary = json.loads((tmp_path / "run" / SUMMARY).read_text())
    assert summary["settings"]["sigma"] == [0.5] and summary["settings"]["rho"] == [0.3]
    pool = agreement_pool(world, 4, 5)
    root = jax.random.key(4)
    for kind, name, noise in (("latent", "sigma0.5", cbcert.gaussian(0.5)),
                              ("concept", "rho0.3",
                               cbcert.bernoulli(0.3, world.generator.num_concepts))):
        smoothed = cbcert.smooth(world.apply(kind, ("std",)), world.params, noise)
        counts = smoothed.counts(space_inputs(world, pool.latents, kind), root, 6,
                                 indices=pool.indices)[:, 0]  # [5, C]
        records = sorted(_lines(tmp_path / "run" / f"{name}.jsonl"), key=lambda r: r["index"])
        for record, row in zip(records, counts, strict=True):
            clean = record["clean"]["pred"]["std"]
            flipped = sum(s["pred"]["std"] != clean for s in record["samples"])
            assert flipped == 6 - row[clean]
        assert any(sum(s["pred"]["std"] != r["clean"]["pred"]["std"] for s in r["samples"])
                   for r in records)  # the noise does move predictions


def test_smoothing_budgets_are_checked():
    with pytest.raises(ValueError, match="rho"):
        PerturbJob(eps=(), tau=(), rho=(0.6,))
    with pytest.raises(ValueError, match="sigma"):
        PerturbJob(eps=(), tau=(), sigma=(-0.1,))
    with pytest.raises(ValueError, match="at least one budget"):
        PerturbJob(eps=(), tau=())


def test_explanations_are_recorded_and_summarised(world, tmp_path):
    """``explain``: each record's clean explanation is the world's own (contributions r·W[y]
    of the image's concept scores and prediction), a tiny shift keeps every explanation
    (overlap 1, τ 1), and the summary reports overlap and τ per budget with the paired test of
    cbm against cbmh (the same function in the untrained world: Δ = 0, p = 1)."""
    from cbcert.robustness import explain as ex
    from cbcert.runs import explanations
    from cbcert.schema import ConfigError

    job = dataclasses.replace(JOB, tau=(1,), models=("std", "cbm", "cbmh", "proto"),
                              explain=True)
    result = run(world, job, tmp_path, chunk_size=CHUNK)
    tiny = _lines(tmp_path / "eps1e-06.jsonl")
    z = np.concatenate([pool_latents(world, job.seed, r["index"], 1) for r in tiny[:4]])
    params = world.params
    images = world.latent_images(params, z)
    r = np.asarray(world.concept_scores(params["clf"], images))
    pred = np.asarray(world.classify(params["clf"], images, ("cbm",)))[:, 0].argmax(axis=1)
    w, _ = world.concept_head(params["clf"])
    expected = ex.explain(ex.contributions(r, np.asarray(w), pred))
    for record, concepts, shares in zip(tiny, expected.concepts, expected.shares, strict=False):
        cited = record["clean"]["explain"]["cbm"]
        assert [c for c, _ in cited] == [int(c) for c in concepts if c >= 0]
        np.testing.assert_allclose([s for _, s in cited], shares[concepts >= 0], atol=1e-5)
    s = np.asarray(world.prototypes(params["clf"], images))  # proto cites its prototypes
    pred = np.asarray(world.classify(params["clf"], images, ("proto",)))[:, 0].argmax(axis=1)
    expected = ex.explain(ex.contributions(s, np.asarray(world.prototype_head(params["clf"])[0]),
                                           pred))
    for record, units in zip(tiny, expected.concepts, strict=False):
        assert [u for u, _ in record["clean"]["explain"]["proto"]] == [
            int(u) for u in units if u >= 0]
    for record in tiny:
        for sample in record["samples"]:
            for m in ("cbm", "cbmh", "proto"):
                assert sample["explain"][m]["overlap"] == 1.0
                kendall = sample["explain"][m]["kendall"]  # 1 up to scipy's float rounding
                assert kendall is None or kendall == pytest.approx(1.0, abs=1e-12)
    rows = {(row["kind"], row["value"]): row for row in result.summary["explanations"]}
    assert set(rows) == {("eps", 1e-6), ("eps", 0.5), ("tau", 1)}
    assert rows[("eps", 1e-6)]["overlap"]["cbm"] == {"mean": 1.0, "sd": 0.0}
    assert rows[("eps", 0.5)]["overlap"]["cbm"]["mean"] < 1.0  # the large shift moves some
    test, proto = rows[("eps", 0.5)]["comparisons"]
    assert (test["model_b"], test["delta"], test["pvalue"], test["pvalue_holm"]) == (
        "cbmh", 0.0, 1.0, 1.0)
    assert proto["model_b"] == "proto" and 0.0 <= proto["pvalue_holm"] <= 1.0
    assert result.summary["settings"]["explain"] is True
    assert "explain" not in JOB.settings()  # runs without it pin what they always pinned
    assert job.settings()["explained_models"] == ["cbm", "cbmh", "proto"]
    with pytest.raises(ConfigError, match=r"explain: models \['std', 'std'\] name no model"):
        explanations.check(world, ("std", "std"))
    headless = dataclasses.replace(world, concept_head=None)
    with pytest.raises(ConfigError, match="does not expose its CBM's concept head"):
        run(headless, dataclasses.replace(JOB, models=("std", "cbm"), explain=True),
            tmp_path / "other", chunk_size=CHUNK)
