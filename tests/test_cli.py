"""The certify CLI: bad input exits 2 naming the flag; small real runs write records."""

import json

import pytest
from click.testing import CliRunner

from cbcert import cli
from cbcert.builtin import untrained_world


@pytest.fixture()
def runner(monkeypatch):
    world = untrained_world("default", seed=0)
    monkeypatch.setattr(cli, "_load_world", lambda name: world)
    return CliRunner()


@pytest.mark.parametrize(
    "args,flag,allowed",
    [
        (["latent", "--sigma", "0"], "--sigma", "(0, inf)"),
        (["latent", "--sigma", "-0.1"], "--sigma", "(0, inf)"),
        (["concept", "--rho", "0.5"], "--rho", "(0, 0.5)"),
        (["concept", "--rho", "0"], "--rho", "(0, 0.5)"),
        (["latent", "--sigma", "0.1", "--alpha", "1"], "--alpha", "(0, 1)"),
        (["latent", "--sigma", "0.1", "--alpha", "0"], "--alpha", "(0, 1)"),
        (["latent", "--sigma", "0.1", "--n", "0"], "--n", "[1, inf)"),
        (["latent", "--sigma", "0.1", "--n0", "200", "--n", "100"], "--n0", "--n"),
        (["latent", "--sigma", "0.1", "--inputs", "0"], "--inputs", "[1, inf)"),
        (["latent", "--sigma", "0.1", "--models", "std,vit"], "--models", "allowed: std"),
        (["concept", "--flips", "0"], "--flips", "[1, inf)"),
        (["predict", "--sigma", "-1"], "--sigma", "(0, inf)"),
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
    again = runner.invoke(cli.main, args)
    assert again.exit_code == 0
    assert (out / "records.jsonl").read_text().splitlines() == records
    assert json.loads((out / "summary.json").read_text())["models"]["std"]["acr"] == \
        summary["models"]["std"]["acr"]
    changed = runner.invoke(cli.main, [*args[:2], "0.5", *args[3:]])
    assert changed.exit_code == 2 and "--out" in changed.output


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
