"""Certification runs: records, resumption, determinism across batching, settings checks."""

import json

import numpy as np
import pytest
from spying import spy_world

from cbcert.builtin import untrained_world
from cbcert.certify.runner import (
    RECORDS,
    SUMMARY,
    CertifyJob,
    RunMismatchError,
    agreement_pool,
    pool_latents,
    run,
)
from cbcert.runs.directory import RecordsError, RunLockedError

SMALL = dict(n0=8, n=40, num_inputs=6, alpha=0.01)


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


def _key(record):
    return record["index"], record["model"]


def _strip(record):
    return {k: v for k, v in record.items() if k != "seconds"}


def _untimed(models):
    return {m: {k: v for k, v in s.items() if k != "seconds_per_input"} for m, s in models.items()}


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
    with pytest.raises(ValueError, match="give each model once"):
        CertifyJob(noise="gaussian", scale=0.1, models=("std", "std"))


def test_a_second_run_on_the_same_directory_is_refused_naming_the_holder(world, tmp_path):
    """The lock of a live process refuses the run; once that process is killed, it resumes."""
    import signal
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom cbcert.runs.directory import hold\n"
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
