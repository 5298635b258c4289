"""The certify CLI: bad input exits 2 naming the flag; small real runs write records."""

import json

import pytest
from click.testing import CliRunner

from cbcert import cli
from cbcert.cli import common as cli_common
from cbcert.worlds.builtin import untrained_world


@pytest.fixture()
def runner(monkeypatch):
    world = untrained_world("default", seed=0)
    monkeypatch.setattr(cli_common, "load_world", lambda name, **_: world)
    return CliRunner()


@pytest.fixture()
def worldless(monkeypatch):
    """A runner for flags refused before any world is loaded (or built: that takes seconds)."""
    def no_world(name, **_):
        raise AssertionError("the world must not be loaded for invalid flags")

    monkeypatch.setattr(cli_common, "load_world", no_world)
    return CliRunner()


@pytest.mark.parametrize(
    "args,flag,allowed",
    [
        (["latent", "--sigma", "0"], "--sigma", "[1e-30, 1e+30]"),
        (["latent", "--sigma", "-0.1"], "--sigma", "[1e-30, 1e+30]"),
        (["latent", "--sigma", "1e308"], "--sigma", "[1e-30, 1e+30]"),
        (["concept", "--rho", "0.5"], "--rho", "(0, 0.5)"),
        (["concept", "--rho", "0"], "--rho", "(0, 0.5)"),
        (["latent", "--sigma", "0.1", "--alpha", "1"], "--alpha", "(0, 1)"),
        (["latent", "--sigma", "0.1", "--alpha", "0"], "--alpha", "(0, 1)"),
        (["latent", "--sigma", "0.1", "--n", "0"], "--n", "[1, 2147483647]"),
        (["latent", "--sigma", "0.1", "--n", str(2**31)], "--n", "[1, 2147483647]"),
        (["latent", "--sigma", "0.1", "--n0", "200", "--n", "100"], "--n0", "--n"),
        (["latent", "--sigma", "0.1", "--inputs", "0"], "--inputs", "[1, inf)"),
        (["latent", "--sigma", "0.1", "--models", "std,vit"], "--models", "allowed: std"),
        (["concept", "--flips", "0"], "--flips", "[1, inf)"),
        (["predict", "--sigma", "-1"], "--sigma", "[1e-30, 1e+30]"),
    ],
)
def test_bad_values_exit_2_naming_flag_and_range(runner, tmp_path, args, flag, allowed):
    result = runner.invoke(cli.main, [*args, "--out", str(tmp_path / "x"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert flag in result.output and allowed in result.output
    assert not (tmp_path / "x" / "records.jsonl").exists()


def test_concept_needs_exactly_one_noise(runner):
    for args in (["concept"], ["concept", "--rho", "0.1", "--flips", "2"]):
        result = runner.invoke(cli.main, args)
        assert result.exit_code == 2 and "exactly one of --rho" in result.output


def test_latent_run_prints_table_writes_records_and_resumes(runner, tmp_path):
    out = tmp_path / "run"
    args = ["latent", "--sigma", "0.25", "--inputs", "3", "--n", "30", "--n0", "10",
            "--models", "std,proto", "--out", str(out)]
    first = runner.invoke(cli.main, args)
    assert first.exit_code == 0, first.output
    assert "SmAcc" in first.output and "ACR" in first.output and "proto" in first.output
    records = (out / "records.jsonl").read_text().splitlines()
    assert len(records) == 6
    summary = json.loads((out / "summary.json").read_text())
    pinned = (out / "run.json").read_text()
    # --batch never changes records: run.json records it, but a rerun may change it.
    again = runner.invoke(cli.main, [*args, "--batch", "1"])
    assert again.exit_code == 0, again.output
    assert (out / "records.jsonl").read_text().splitlines() == records
    assert (out / "run.json").read_text() == pinned
    assert json.loads((out / "summary.json").read_text())["models"]["std"]["acr"] == \
        summary["models"]["std"]["acr"]
    changed = runner.invoke(cli.main, [*args[:2], "0.5", *args[3:]])
    assert changed.exit_code == 2 and "--out" in changed.output
    assert "(job.scale = 0.25 there, 0.5 now)" in changed.output, changed.output


def test_concept_run_reports_hamming(runner, tmp_path):
    result = runner.invoke(cli.main, ["concept", "--rho", "0.2", "--inputs", "2", "--n", "30",
                                      "--n0", "10", "--models", "std", "--out",
                                      str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "ACR-H" in result.output and "Hamming" in result.output


def test_world_show_writes_png(tmp_path):
    out = tmp_path / "grid.png"
    result = CliRunner().invoke(cli.main, ["world", "show", "--n", "4", "--flip", "2",
                                           "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = CliRunner().invoke(cli.main, ["world", "show", "--flip", "12", "--out", str(out)])
    assert bad.exit_code == 2 and "--flip" in bad.output and "[0, 11]" in bad.output


def test_world_show_refuses_an_unsupported_format_before_rendering(tmp_path, monkeypatch):
    from cbcert.generators import concept_world
    from cbcert.report import world_grid

    def never(*args, **kwargs):
        raise AssertionError("the world was built or rendered")

    monkeypatch.setattr(concept_world, "make_world", never)
    monkeypatch.setattr(world_grid, "world_grid", never)
    for name in ("g.txt", "grid"):
        result = CliRunner().invoke(cli.main, ["world", "show", "--out", str(tmp_path / name)])
        assert result.exit_code == 2, (result.output, result.exception)
        assert "--out" in result.output and name in result.output
        assert ".png" in result.output and ".pdf" in result.output
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"\.txt.*allowed.*\.png"):
        world_grid.world_grid(None, n=1, seed=0, flip=None, out=tmp_path / "g.txt")


def _finished_run(tmp_path, runner):
    out = tmp_path / "done"
    args = ["latent", "--sigma", "0.25", "--inputs", "2", "--n", "20", "--n0", "5",
            "--models", "std", "--out", str(out), "--quiet"]
    assert runner.invoke(cli.main, args).exit_code == 0
    return out, args


def _bad_records(tmp_path, runner):
    out, args = _finished_run(tmp_path, runner)
    (out / "records.jsonl").write_text('{"index": 0, "model": \n' +
                                       (out / "records.jsonl").read_text())
    return args, "records.jsonl, line 1"


def _bad_run_json(tmp_path, runner):
    out, args = _finished_run(tmp_path, runner)
    (out / "run.json").write_bytes(b"\xff\xfe")
    return args, "run.json: damaged"


def _under_a_file(tmp_path, runner):
    (tmp_path / "file").write_text("x")
    return ["latent", "--sigma", "0.1", "--out", str(tmp_path / "file" / "run")], "under the file"


def _sweep_config(text: bytes):
    def make(tmp_path, runner):
        path = tmp_path / "c.yaml"
        path.write_bytes(text)
        return ["sweep", str(path), "--out", str(tmp_path / "s")], "c.yaml"
    return make


@pytest.mark.parametrize(
    "make",
    [
        lambda t, r: (["latent", "--sigma", "1e308"], "--sigma"),
        lambda t, r: (["latent", "--sigma", "0.1", "--n", str(2**31)], "--n"),
        lambda t, r: (["latent", "--sigma", "0.1", "--models", "std,std"], "--models"),
        lambda t, r: (["predict", "--sigma", "0.1", "--two-class"], "--two-class"),
        lambda t, r: (["concept", "--flips", "13"], "K=12"),
        lambda t, r: (["perturb", "--eps", "0.1,0.1", "--tau", ""], "each budget once"),
        lambda t, r: (["perturb", "--tau", "2,2"], "each budget once"),
        lambda t, r: (["attack", "--eps", "0.1,0.1"], "--eps"),
        lambda t, r: (["attack", "--eot", str(2**31), "--smoothed", "--sigma", "0.1"], "--eot"),
        lambda t, r: (["world", "show", "--out", str(t / "missing" / "g.png")], "does not exist"),
        _under_a_file,
        _bad_records,
        _bad_run_json,
        _sweep_config(b"latent: {sigmas: [0.1]}\n\xff\n"),
        _sweep_config(b"latent: [1,\n"),
        _sweep_config(b"latent: {sigmas: [0.1], n: 1.0e+40}\n"),
    ],
)
def test_bad_input_exits_2_with_a_message_never_a_traceback(runner, tmp_path, make):
    args, expected = make(tmp_path, runner)
    if "--out" not in args and args[0] not in ("world", "sweep"):
        args = [*args, "--out", str(tmp_path / "x")]
    result = runner.invoke(cli.main, [*args, "--quiet"] if args[0] != "world" else args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output and expected in result.output, result.output


def test_chunk_size_beyond_the_run_is_capped(runner, tmp_path):
    """--chunk-size 10^9 once tried to allocate 12 GiB; records equal the default run's."""
    base = ["latent", "--sigma", "0.25", "--inputs", "2", "--n", "20", "--n0", "5",
            "--models", "std", "--quiet"]
    assert runner.invoke(cli.main, [*base, "--out", str(tmp_path / "a")]).exit_code == 0
    big = runner.invoke(cli.main, [*base, "--out", str(tmp_path / "b"), "--chunk-size",
                                   str(10**9)])
    assert big.exit_code == 0, big.output
    untimed = [{k: v for k, v in json.loads(line).items() if k != "seconds"}
               for d in "ab" for line in (tmp_path / d / "records.jsonl").read_text().splitlines()]
    assert untimed[: len(untimed) // 2] == untimed[len(untimed) // 2:]


_SMALL_CERTIFY = ["--inputs", "1", "--n", "16", "--n0", "4"]


@pytest.mark.parametrize("command", [
    ["latent", "--sigma", "0.1", *_SMALL_CERTIFY],
    ["concept", "--rho", "0.2", *_SMALL_CERTIFY],
    ["perturb", "--eps", "0.1", "--tau", ""],
    ["attack", "--eps", "0.1", "--iters", "1"],
    ["explain", "--inputs", "1", "--n", "10", "--n0", "5", "--figure-inputs", "0"],
])
@pytest.mark.parametrize("models,shown", [("cbm,cbm", "'cbm,cbm'"), ("", "''")])
def test_models_named_twice_or_none_are_refused(worldless, tmp_path, command, models, shown):
    """`explain --models cbm,cbm` wrote every record twice; `latent --models ''` ran the
    defaults."""
    out = tmp_path / "x"
    result = worldless.invoke(cli.main, [*command, "--models", models, "--out", str(out),
                                         "--quiet"])
    assert result.exit_code == 2, result.output
    assert "--models" in result.output and shown in result.output, result.output
    assert not out.exists()


def test_explain_flip_radius_beyond_the_concepts_is_refused_before_the_run(runner, tmp_path):
    out = tmp_path / "x"
    result = runner.invoke(cli.main, ["explain", "--rho", "0.1", "--flip-radius", "13",
                                      "--inputs", "1", "--n", "10", "--n0", "5",
                                      "--figure-inputs", "0", "--out", str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "--flip-radius" in result.output and "got 13" in result.output
    assert "K=12" in result.output and not out.exists()


def test_first_checkpoint_beyond_n_is_refused(worldless, tmp_path):
    """It once became the fixed schedule without a word."""
    out = tmp_path / "x"
    result = worldless.invoke(cli.main, ["latent", "--sigma", "0.25", "--schedule",
                                         "sequential", "--first-checkpoint", "64", "--n", "32",
                                         "--n0", "4", "--inputs", "1", "--models", "std",
                                         "--out", str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "--first-checkpoint" in result.output and "got 64" in result.output
    assert "n=32" in result.output and not out.exists()


@pytest.mark.parametrize("command", [["concept", "--flips", "1"],
                                     ["predict", "--space", "concept", "--flips", "1"]])
def test_fixed_count_flips_refuse_the_sequential_schedule(worldless, tmp_path, command):
    out = tmp_path / "x"
    result = worldless.invoke(cli.main, [*command, "--schedule", "sequential", "--inputs", "1",
                                         "--n", "16", "--n0", "4", "--models", "std",
                                         "--out", str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "--schedule" in result.output and "'sequential'" in result.output
    assert "fixed-count flips" in result.output and not out.exists()


@pytest.mark.parametrize("kind,args,flag", [
    ("pcbm", ["--backbone", "resnet18"], "--backbone-path"),
    ("pcbm", ["--backbone-path", "CHECKPOINT"], "--backbone"),
    ("pixpnet", [], "--config"),
])
def test_convert_names_the_missing_flag(tmp_path, kind, args, flag):
    checkpoint = tmp_path / "model.ckpt"
    checkpoint.write_bytes(b"not read")
    args = [str(checkpoint) if a == "CHECKPOINT" else a for a in args]
    result = CliRunner().invoke(cli.main, ["convert", kind, str(checkpoint),
                                           str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    assert f"for {flag}: not given" in result.output and kind in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_check_at_least_names_the_first_flag_below_its_bound():
    """The training commands' integer bounds: every value at or above its bound passes; the
    first one below raises click's usage error (exit 2) naming flag, value and range."""
    import click

    cli_common.check_at_least(("--save-every", 1, 1), ("--image-size", 16, 16))
    with pytest.raises(click.BadParameter) as err:
        cli_common.check_at_least(("--save-every", 3, 1), ("--image-size", 15, 16),
                                  ("--prototype-dim", 0, 1))
    assert err.value.param_hint == "--image-size" and err.value.exit_code == 2
    assert "got 15, allowed range [16, ∞)" in err.value.format_message()
