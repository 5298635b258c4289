"""Certification runs: records, resumption, determinism across batching, settings checks."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from spying import spy_world

from cbcert.runs.certify import CertifyJob, run
from cbcert.runs.directory import RECORDS, SUMMARY, RecordsError, RunLockedError, RunMismatchError
from cbcert.runs.pool import agreement_pool, pool_latents
from cbcert.worlds.builtin import untrained_world
from cbcert.worlds.world import World

SMALL = dict(n0=8, n=40, num_inputs=6, alpha=0.01)
# A sequential Bernoulli run whose inputs stop at several checkpoints (two tests share it).
SEQUENTIAL_FLIPS = CertifyJob(noise="bernoulli", scale=0.2, schedule="sequential",
                              first_checkpoint=8, target_radius=1.0, models=("std", "proto"),
                              **SMALL)


@pytest.fixture(scope="module")
def world():
    return untrained_world("default", seed=0)


def _lines(path):
    return [json.loads(line) for line in (path / RECORDS).read_text().splitlines()]


def test_pool_is_prefix_stable(world):
    a = pool_latents(world, seed=3, start=0, count=10)
    b = pool_latents(world, seed=3, start=4, count=3)
    np.testing.assert_array_equal(a[4:7], b)
    assert not np.array_equal(a, pool_latents(world, seed=4, start=0, count=10))


def test_agreement_pool_labels_are_the_shared_clean_prediction(world):
    pool = agreement_pool(world, seed=0, num_inputs=5)
    x = world.latent_images(world.params, pool.latents)
    logits = world.classify(world.params["clf"], x, ("std", "cbm"))
    pred = np.asarray(np.argmax(logits, -1))
    np.testing.assert_array_equal(pred[:, 0], pred[:, 1])
    np.testing.assert_array_equal(pred[:, 0], pool.labels)
    np.testing.assert_array_equal(pool.true_labels, world.true_label(world.params["gen"],
                                                                     pool.latents))


@pytest.mark.parametrize("noise,scale", [("gaussian", 0.25), ("bernoulli", 0.2)])
def test_resume_gives_identical_records_and_summary(world, tmp_path, noise, scale):
    job = CertifyJob(noise=noise, scale=scale, batch=4, **SMALL)
    full = run(world, job, tmp_path / "full")
    # Interrupted run: first batch only, then a torn line, then resume with another batch size.
    part = tmp_path / "part"
    run(world, CertifyJob(noise=noise, scale=scale, batch=4, **{**SMALL, "num_inputs": 4}),
        tmp_path / "first")
    part.mkdir()
    (part / "run.json").write_text((tmp_path / "full" / "run.json").read_text())
    first = (tmp_path / "first" / RECORDS).read_text()
    (part / RECORDS).write_text(first + '{"index": 99, "mod')
    resumed = run(world, job, part)
    # Everything but wall-clock time is identical.
    assert _untimed(resumed["models"]) == _untimed(full["models"])
    assert _untimed(json.loads((part / SUMMARY).read_text())["models"]) == _untimed(
        full["models"])
    assert sorted(map(_strip, _lines(part)), key=_key) == sorted(
        map(_strip, _lines(tmp_path / "full")), key=_key)
    # run.json keeps the sessions listed before and appends the resuming one, which found the
    # interrupted run's complete lines (not the torn one).
    listed = json.loads((tmp_path / "full" / "run.json").read_text())["sessions"]
    appended = json.loads((part / "run.json").read_text())["sessions"]
    assert [e["records_before"] for e in listed] == [0] and appended[0] == listed[0]
    assert [e["records_before"] for e in appended] == [
        0, len((tmp_path / "first" / RECORDS).read_text().splitlines())]


def _key(record):
    return record["index"], record["model"]


def _strip(record):
    return {k: v for k, v in record.items() if k != "seconds"}


def _untimed(models):
    return {m: {k: v for k, v in s.items() if k != "seconds_per_input"} for m, s in models.items()}


@pytest.mark.parametrize("mode", ["certify", "predict"])
def test_batches_at_once_write_the_same_records_in_the_same_order(world, tmp_path, mode):
    """Batches of the fixed schedule one at a time, two (the CPU default) and three at once:
    the same records line for line (time aside) and the same summary."""
    job = CertifyJob(noise="gaussian", scale=0.25, mode=mode, batch=2, **SMALL)
    results = {u: run(world, job, tmp_path / str(u), units=u) for u in (1, None, 3)}
    lines = {u: [_strip(r) for r in _lines(tmp_path / str(u))] for u in results}
    assert len(lines[1]) == 3 * SMALL["num_inputs"]
    assert lines[None] == lines[1] and lines[3] == lines[1]
    assert _untimed(results[None]["models"]) == _untimed(results[1]["models"]) == _untimed(
        results[3]["models"])
    assert all(r["seconds"] >= 0 for r in _lines(tmp_path / "3"))


def test_records_have_the_documented_fields(world, tmp_path):
    run(world, CertifyJob(noise="gaussian", scale=0.1, models=("std", "proto"), **SMALL), tmp_path)
    records = _lines(tmp_path)
    assert len(records) == 2 * SMALL["num_inputs"]
    for r in records:
        assert set(r) == {"index", "model", "label", "true_label", "prediction", "count_top",
                          "count_runner_up", "p_lower", "p_upper", "radius", "correct",
                          "seconds"}
        assert r["count_top"] + r["count_runner_up"] <= SMALL["n"]
        assert (r["radius"] is None) == (r["prediction"] == -1)


def test_predict_mode(world, tmp_path):
    summary = run(world, CertifyJob(noise="gaussian", scale=0.1, mode="predict", **SMALL), tmp_path)
    assert set(summary["models"]) == {"std", "cbm", "proto"}
    assert all("p_value" in r for r in _lines(tmp_path))


def test_other_settings_in_the_same_directory_are_refused(world, tmp_path):
    run(world, CertifyJob(noise="gaussian", scale=0.1, **SMALL), tmp_path)
    with pytest.raises(RunMismatchError, match="different settings"):
        run(world, CertifyJob(noise="gaussian", scale=0.2, **SMALL), tmp_path)


def test_identical_models_get_identical_certificates(world, tmp_path):
    """In the untrained world the PCBM reproduces f_std exactly: same noise, same certificates."""
    run(world, CertifyJob(noise="gaussian", scale=0.5, models=("std", "cbm"), **SMALL), tmp_path)
    rows = _lines(tmp_path)
    std = {r["index"]: r for r in rows if r["model"] == "std"}
    for r in rows:
        if r["model"] == "cbm":
            assert r["count_top"] == std[r["index"]]["count_top"]
            assert r["prediction"] == std[r["index"]]["prediction"]


def test_unknown_model_is_rejected(world, tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        run(world, CertifyJob(noise="gaussian", scale=0.1, models=("std", "vit"), **SMALL),
            tmp_path)



def test_duplicated_record_lines_are_counted_once(world, tmp_path):
    """A copied line once made 8 inputs read as 9 (SmAcc 0.333 instead of 0.375)."""
    job = CertifyJob(noise="gaussian", scale=0.25, **SMALL)
    clean = run(world, job, tmp_path)
    lines = (tmp_path / RECORDS).read_text().splitlines(keepends=True)
    (tmp_path / RECORDS).write_text("".join(lines + lines[:3]))
    again = run(world, job, tmp_path)
    assert _untimed(again["models"]) == _untimed(clean["models"])
    assert again["models"]["std"]["num_inputs"] == SMALL["num_inputs"]


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda r: {**r, "prediction": (r["prediction"] + 1) % 10}, "conflicts with line 1"),
        (lambda r: {**r, "index": 10**6}, "index=1000000 is not an input of this run"),
        (lambda r: {**r, "model": "cbmh"}, "model='cbmh' is not one of the run's models"),
        (lambda r: {**r, "radius": "big"}, "field 'radius'"),
    ],
)
def test_untrustworthy_records_are_refused_naming_file_and_line(world, tmp_path, edit, message):
    job = CertifyJob(noise="gaussian", scale=0.25, **SMALL)
    run(world, job, tmp_path)
    text = (tmp_path / RECORDS).read_text()
    first = json.loads(text.splitlines()[0])
    (tmp_path / RECORDS).write_text(text + json.dumps(edit(first)) + "\n")
    line = len(text.splitlines()) + 1
    with pytest.raises(RecordsError, match=f"records.jsonl, line {line}: .*{message}"):
        run(world, job, tmp_path)


def test_malformed_complete_line_and_damaged_run_json_are_named(world, tmp_path):
    job = CertifyJob(noise="gaussian", scale=0.25, **SMALL)
    run(world, job, tmp_path / "a")
    path = tmp_path / "a" / RECORDS
    path.write_text('{"index": 1, oops}\n' + path.read_text())
    with pytest.raises(RecordsError, match="records.jsonl, line 1: not a JSON record"):
        run(world, job, tmp_path / "a")
    run(world, job, tmp_path / "b")
    (tmp_path / "b" / "run.json").write_text('{"job": ')
    with pytest.raises(RecordsError, match="run.json: damaged"):
        run(world, job, tmp_path / "b")


def test_repeated_models_are_refused():
    with pytest.raises(ValueError, match="name each model once"):
        CertifyJob(noise="gaussian", scale=0.1, models=("std", "std"))


def test_a_second_run_on_the_same_directory_is_refused_naming_the_holder(world, tmp_path):
    """The lock of a live process refuses the run; once that process is killed, it resumes."""
    import signal
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom cbcert.runs.lock import hold\n"
         f"with hold({str(tmp_path)!r}):\n    print('held', flush=True)\n    time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        job = CertifyJob(noise="gaussian", scale=0.25, **SMALL)
        with pytest.raises(RunLockedError, match=f"in use by another run .*{holder.pid}"):
            run(world, job, tmp_path)
        assert not (tmp_path / RECORDS).exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / ".lock").exists()  # left by the killed holder; no longer locked
    run(world, job, tmp_path)
    assert not (tmp_path / ".lock").exists()


def test_every_generator_call_respects_the_chunk_size(world, tmp_path):
    """Pool search, true labels, concept encoding and sampling all reach the generator in
    chunks of at most ``chunk_size`` (a 256-px world once asked for 82 GB rendering its
    whole pool block at once). The spy records the batch of every traced call."""
    other, seen = spy_world(world)
    for noise, scale in (("gaussian", 0.25), ("bernoulli", 0.2)):
        job = CertifyJob(noise=noise, scale=scale, **SMALL)
        run(other, job, tmp_path / noise, chunk_size=8)
    assert seen and max(batch for _, batch in seen) <= 8, sorted(set(seen))


# --- the sequential schedule ------------------------------------------------------------------

SEQUENTIAL_FIELDS = {"samples", "certified_samples", "stop_reason"}


def _fixed_fields(record):
    return {k: v for k, v in _strip(record).items() if k not in SEQUENTIAL_FIELDS}


@pytest.mark.parametrize("noise,scale,mode,two_class", [
    ("gaussian", 0.25, "certify", False), ("bernoulli", 0.2, "certify", True),
    ("gaussian", 0.25, "predict", False),
])
def test_sequential_with_the_single_checkpoint_n_equals_the_fixed_schedule(
        world, tmp_path, noise, scale, mode, two_class):
    common = dict(noise=noise, scale=scale, mode=mode, two_class=two_class, **SMALL)
    fixed = run(world, CertifyJob(**common), tmp_path / "fixed")
    seq = run(world, CertifyJob(schedule="sequential", first_checkpoint=SMALL["n"], **common),
              tmp_path / "seq")
    assert sorted(map(_fixed_fields, _lines(tmp_path / "seq")), key=_key) == sorted(
        map(_fixed_fields, _lines(tmp_path / "fixed")), key=_key)
    assert all(r["samples"] == SMALL["n"] for r in _lines(tmp_path / "seq"))
    for model, entry in fixed["models"].items():
        assert {k: v for k, v in _untimed({model: seq["models"][model]})[model].items()
                if k not in ("samples_total", "samples_per_input", "stop_reasons")} == \
            _untimed({model: entry})[model]


def test_sequential_records_are_identical_across_chunk_sizes_and_resumption(world, tmp_path):
    job = CertifyJob(noise="gaussian", scale=0.25, schedule="sequential", first_checkpoint=8,
                     **{**SMALL, "n": 120})
    full = run(world, job, tmp_path / "full")
    first = CertifyJob(**{**job.__dict__, "num_inputs": 3})
    run(world, first, tmp_path / "first", chunk_size=8)  # the automatic chunk on CPU
    part = tmp_path / "part"
    part.mkdir()
    (part / "run.json").write_text((tmp_path / "full" / "run.json").read_text())
    (part / RECORDS).write_text((tmp_path / "first" / RECORDS).read_text() + '{"index": 9, "mo')
    resumed = run(world, job, part, chunk_size=5)
    assert sorted(map(_strip, _lines(part)), key=_key) == sorted(
        map(_strip, _lines(tmp_path / "full")), key=_key)
    # run.json keeps the sessions listed before and appends the resuming one, which found the
    # interrupted run's complete lines (not the torn one).
    listed = json.loads((tmp_path / "full" / "run.json").read_text())["sessions"]
    appended = json.loads((part / "run.json").read_text())["sessions"]
    assert [e["records_before"] for e in listed] == [0] and appended[0] == listed[0]
    assert [e["records_before"] for e in appended] == [
        0, len((tmp_path / "first" / RECORDS).read_text().splitlines())]
    assert _untimed(resumed["models"]) == _untimed(full["models"])
    assert {k: v for k, v in resumed["samples"].items() if k != "per_second"} == {
        k: v for k, v in full["samples"].items() if k != "per_second"}
    reasons = {r["stop_reason"] for r in _lines(part)}
    assert reasons - {"n"}, "the run must stop some input early to test anything"


def test_sequential_chunks_holding_two_checkpoints(world, tmp_path):
    # Chunks of 16 hold inputs at checkpoint 8 beside inputs at 16; this run once stopped with
    # "checkpoint 1 needs 16 samples per input; got [8, 16]" (cbcert.engine.continuous).
    job = SEQUENTIAL_FLIPS
    for chunk in (8, 16):
        run(world, job, tmp_path / str(chunk), chunk_size=chunk)
    eight, sixteen = (sorted(map(_strip, _lines(tmp_path / d)), key=_key) for d in ("8", "16"))
    assert sixteen == eight
    assert len({r["samples"] for r in eight}) > 1, "inputs must stop at several checkpoints"


def test_sequential_records_and_summary_have_the_documented_fields(world, tmp_path):
    job = SEQUENTIAL_FLIPS
    summary = run(world, job, tmp_path)
    for r in _lines(tmp_path):
        assert set(r) == {"index", "model", "label", "true_label", "prediction", "count_top",
                          "count_runner_up", "p_lower", "p_upper", "radius", "correct",
                          "seconds", "samples", "certified_samples", "stop_reason"}
        assert r["certified_samples"] <= r["samples"] <= SMALL["n"]
        assert r["count_top"] + r["count_runner_up"] <= r["certified_samples"]
        assert r["stop_reason"] in {"success", "futility", "precision", "n"}
    for model in job.models:
        entry = summary["models"][model]
        used = [r["samples"] for r in _lines(tmp_path) if r["model"] == model]
        assert entry["samples_total"] == sum(used)
        assert sum(entry["stop_reasons"].values()) == SMALL["num_inputs"]
    drawn = summary["samples"]
    assert drawn["fixed_schedule_per_input"] == SMALL["n0"] + SMALL["n"]
    assert drawn["total"] == drawn["per_input"] * SMALL["num_inputs"] and drawn["per_second"] > 0
    pinned = json.loads((tmp_path / "run.json").read_text())["job"]
    assert pinned["schedule"] == "sequential" and pinned["target_radius"] == 1.0


def test_fixed_runs_pin_the_settings_they_always_pinned(world, tmp_path):
    run(world, CertifyJob(noise="gaussian", scale=0.25, **SMALL), tmp_path)
    pinned = json.loads((tmp_path / "run.json").read_text())["job"]
    assert set(pinned) == {"noise", "scale", "mode", "n0", "n", "alpha", "two_class", "models",
                           "seed", "num_inputs", "batch", "dtype"}
    assert "samples" not in _lines(tmp_path)[0]


def test_preflight_refuses_hopeless_settings_before_sampling(world, tmp_path):
    from cbcert.runs.sequential import check_certifiable
    from cbcert.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        check_certifiable(CertifyJob(noise="gaussian", scale=0.1, n0=2, n=9), 12)
    assert err.value.key == "n" and "n >= 10 needed" in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_certifiable(CertifyJob(noise="gaussian", scale=0.1, schedule="sequential",
                                     target_radius=0.3), 12)
    assert err.value.key == "target_radius" and "certifies at most 0.2429" in str(err.value)
    # The untrained std model is at chance: a pilot shows nothing can be certified at this n.
    job = CertifyJob(noise="gaussian", scale=0.25, schedule="sequential", models=("std",),
                     **SMALL)
    with pytest.raises(ConfigError) as err:
        run(world, job, tmp_path, preflight=True)
    assert err.value.key == "sigma" and "every model abstains" in str(err.value)
    assert not (tmp_path / RECORDS).exists()


def test_sequential_cli_flags(world, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from cbcert import cli
    from cbcert.cli import common as cli_common

    monkeypatch.setattr(cli_common, "load_world", lambda name, **_: world)
    base = ["latent", "--sigma", "0.25", "--quiet", "--out", str(tmp_path / "x")]
    for extra, flag in ((["--target-radius", "0.1"], "--target-radius"),
                        (["--schedule", "sequential", "--checkpoint-ratio", "1"],
                         "--checkpoint-ratio"),
                        (["--schedule", "sequential", "--target-radius", "1"],
                         "--target-radius")):
        result = CliRunner().invoke(cli.main, [*base, *extra])
        assert result.exit_code == 2 and flag in result.output, result.output
    ok = CliRunner().invoke(cli.main, ["latent", "--sigma", "0.25", "--inputs", "3", "--n", "60",
                                       "--n0", "8", "--models", "std,proto", "--schedule",
                                       "sequential", "--first-checkpoint", "8", "--out",
                                       str(tmp_path / "ok")])
    assert ok.exit_code == 0, ok.output
    assert "samples/input" in ok.output and "samples drawn per input" in ok.output


def test_anytime_records_keep_the_sequential_fields_and_ignore_the_chunk_size(world, tmp_path):
    job = dataclasses.replace(SEQUENTIAL_FLIPS, schedule="anytime", first_checkpoint=4,
                              checkpoint_ratio=1.5)
    summary = run(world, job, tmp_path / "8", chunk_size=8)
    run(world, job, tmp_path / "16", chunk_size=16)
    eight, sixteen = (sorted(map(_strip, _lines(tmp_path / d)), key=_key) for d in ("8", "16"))
    assert sixteen == eight
    for r in _lines(tmp_path / "8"):
        assert SEQUENTIAL_FIELDS <= set(r) and r["certified_samples"] <= r["samples"]
    assert set(summary["samples"]) == {"total", "per_input", "per_second",
                                       "fixed_schedule_per_input"}
    assert {"samples_total", "samples_per_input", "stop_reasons"} <= set(summary["models"]["std"])
    assert json.loads((tmp_path / "8" / "run.json").read_text())["job"]["schedule"] == "anytime"


def test_randomized_bound_certifies_at_least_as_much_from_the_same_votes(world, tmp_path):
    common = dict(noise="gaussian", scale=0.25, **SMALL)
    run(world, CertifyJob(**common), tmp_path / "cp")
    run(world, CertifyJob(bound="randomized", **common), tmp_path / "rand")
    cp, rand = (sorted(_lines(tmp_path / d), key=_key) for d in ("cp", "rand"))
    for a, b in zip(cp, rand, strict=True):
        assert (a["count_top"], a["count_runner_up"]) == (b["count_top"], b["count_runner_up"])
        assert b["p_lower"] >= a["p_lower"]
    assert any(b["p_lower"] > a["p_lower"] for a, b in zip(cp, rand, strict=True))
    assert json.loads((tmp_path / "rand" / "run.json").read_text())["job"]["bound"] == \
        "randomized"
    assert "bound" not in json.loads((tmp_path / "cp" / "run.json").read_text())["job"]


def test_anytime_cli_refuses_what_it_cannot_do(world, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from cbcert import cli
    from cbcert.cli import common as cli_common

    monkeypatch.setattr(cli_common, "load_world", lambda name, **_: world)
    out = ["--quiet", "--out", str(tmp_path / "x"), "--schedule", "anytime"]
    for args, flag in ((["latent", "--sigma", "0.25", "--final-alpha-share", "0.5"],
                        "--final-alpha-share"),
                       (["predict", "--sigma", "0.25"], "--schedule"),
                       (["latent", "--sigma", "0.25", "--target-radius", "5"],
                        "--target-radius"),
                       (["latent", "--sigma", "0.25", "--bound", "randomized"], "--bound")):
        result = CliRunner().invoke(cli.main, [*args, *out])
        assert result.exit_code == 2 and flag in result.output, result.output


class _FarOutIsNaN(World):
    """The world whose models' logits are NaN for latents with z0 > 50 (far outside the prior)."""

    def apply(self, space, models):
        inner = super().apply(space, models)
        return lambda params, z: jnp.where(z[:, :1, None] > 50, jnp.nan, inner(params, z))


def test_non_finite_logits_exit_2_naming_the_models_and_keep_finished_records(
        world, tmp_path, monkeypatch):
    """Issue 30.2 in the CLI: NaN logits on the third input stop the run with exit 2 naming
    --world, the models and the input; the records of the two inputs finished before stay."""
    from click.testing import CliRunner

    import cbcert.runs.certify as runs_certify
    from cbcert import cli
    from cbcert.cli import common as cli_common

    broken = _FarOutIsNaN(**{f.name: getattr(world, f.name) for f in dataclasses.fields(World)})
    monkeypatch.setattr(cli_common, "load_world", lambda name, **_: broken)
    latents = runs_certify.space_inputs

    def third_far_out(*args, **kwargs):
        inputs = np.array(latents(*args, **kwargs))
        inputs[2, 0] = 100.0  # σ = 0.25 never brings it back below 50
        return inputs

    monkeypatch.setattr(runs_certify, "space_inputs", third_far_out)
    out = tmp_path / "run"
    result = CliRunner().invoke(cli.main, [
        "latent", "--sigma", "0.25", "--inputs", "3", "--batch", "1", "--n0", "8", "--n", "40",
        "--models", "std,cbm", "--out", str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    pool = agreement_pool(world, 0, 3)
    output = " ".join(result.output.split())
    assert "--world" in output and "NaN or inf logits" in output
    assert f"inputs [{pool.indices[2]}], models std, cbm" in output
    assert "the records of finished inputs are kept" in output
    kept = {(r["index"], r["model"]) for r in _lines(out)}
    assert kept == {(int(i), m) for i in pool.indices[:2] for m in ("std", "cbm")}
    assert not (out / SUMMARY).exists()


def test_subsets_are_analysis_only_and_summarised(world, tmp_path):
    """--subsets adds mean ± sd over subsets and paired tests to the summary; the records and
    run.json do not depend on it, so a finished run can be re-summarised with other subsets."""
    plain = run(world, CertifyJob(noise="gaussian", scale=0.25, **SMALL), tmp_path / "run")
    assert "subsets" not in plain
    job = CertifyJob(noise="gaussian", scale=0.25, num_subsets=3, subset_size=4, **SMALL)
    summary = run(world, job, tmp_path / "run")  # same directory: nothing is sampled again
    assert _untimed(summary["models"]) == _untimed(plain["models"])
    subsets = summary["subsets"]
    assert (subsets["num_subsets"], subsets["subset_size"]) == (3, 4)
    assert [(c["model_a"], c["model_b"], c["metric"]) for c in subsets["comparisons"]] == [
        ("std", m, metric) for m in ("cbm", "proto") for metric in ("smoothed_accuracy", "acr")]
    records = _lines(tmp_path / "run")
    by_index = {(r["index"], r["model"]): r for r in records}
    smacc = [np.mean([by_index[(i, "std")]["correct"] for i in subset])
             for subset in subsets["indices"]]
    assert subsets["models"]["std"]["smoothed_accuracy"]["mean"] == pytest.approx(np.mean(smacc))
    with pytest.raises(ValueError, match="subset_size"):
        CertifyJob(noise="gaussian", scale=0.25, num_subsets=3, subset_size=7, **SMALL)
    with pytest.raises(ValueError, match="subsets"):
        CertifyJob(noise="gaussian", scale=0.25, num_subsets=1, subset_size=2, **SMALL)


def test_bfloat16_runs_certify_from_integer_counts_in_float64(world, tmp_path):
    """``--dtype bfloat16`` computes generator and classifiers in bf16, but certificates come
    from integer counts in float64: each record's p_lower and radius equal the float64
    Clopper–Pearson bound of its own count and the L2 radius of that bound, to the last bit
    (a bf16 number has 8 significant bits, so a bf16 certificate would differ from the third
    digit on). The spy checks that the noisy latents really reached the generator in bf16."""
    from cbcert.certify.bounds import clopper_pearson_lower

    spied, seen = spy_world(world, record=lambda x: x.dtype)
    job = CertifyJob(noise="gaussian", scale=0.1, dtype="bfloat16", **SMALL)
    run(spied, job, tmp_path)
    assert ("g1", np.dtype("bfloat16")) in {(name, np.dtype(d)) for name, d in seen}
    rule = job.smoothing.radius_rule(job.scale, world.generator.num_concepts)
    records = _lines(tmp_path)
    assert any(r["radius"] is not None for r in records)
    for r in records:
        p_lower = clopper_pearson_lower(r["count_top"], SMALL["n"], SMALL["alpha"])
        assert r["p_lower"] == float(p_lower)
        if r["radius"] is not None:
            assert r["radius"] == float(rule.radius(p_lower, None))


def _count_calls(monkeypatch, owner, name: str) -> list:
    """Record every call of ``owner.name`` (still calling it) in the returned list."""
    calls: list = []
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


@pytest.mark.parametrize("flags, schedule", [
    (["latent", "--sigma", "0.25"], "fixed"),
    (["concept", "--flips", "2"], "fixed"),
    (["predict", "--space", "concept", "--rho", "0.2"], "fixed"),
    (["latent", "--sigma", "0.25", "--schedule", "sequential", "--first-checkpoint", "8"],
     "sequential"),
])
def test_the_scale_rule_runs_once_at_the_edge_and_is_trusted_inside(world, tmp_path, monkeypatch,
                                                                    flags, schedule):
    """One certify command over two batches: the user rule on σ/ρ/m (`Smoothing.check`, the
    schema's range) runs once, when the job is built; its world-dependent part (m ≤ K) once,
    at the runner's entry; the API's `Noise`, the radius rules and the engine below do not run
    it again. The radius rule comes from the table once for the sampling of the run, whatever
    its batches and schedule (the CLI's preflight feasibility check builds its own before the
    inputs, hence their dtype, are known; PREDICT needs none)."""
    from click.testing import CliRunner

    from cbcert import cli
    from cbcert.certify import smoothing
    from cbcert.cli import common as cli_common

    monkeypatch.setattr(cli_common, "load_world", lambda name, **_: world)
    rules = _count_calls(monkeypatch, smoothing, "validate")  # the schema's range rule
    checks = _count_calls(monkeypatch, smoothing.Smoothing, "check")
    bounds = _count_calls(monkeypatch, smoothing.Smoothing, "check_concepts")
    built = _count_calls(monkeypatch, smoothing.Smoothing, "radius_rule")
    result = CliRunner().invoke(cli.main, [*flags, "--inputs", "4", "--batch", "2", "--n", "60",
                                           "--n0", "8", "--models", "std,proto", "--quiet",
                                           "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert len(_lines(tmp_path / "run")) == 8
    assert (len(rules), len(checks), len(bounds)) == (1, 1, 1)
    assert len(built) == (0 if flags[0] == "predict" else 2)  # preflight + the run's own
