"""The run-wide family of hypotheses (`cbcert.report.family`) on the reduced paper run, the
verdict rule, and the ``analysis`` section that fixes its margins before a run."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from statsmodels.stats.multitest import multipletests

from cbcert.report.family import COLUMNS, verdict
from cbcert.runs.config import AnalysisConfig, ExperimentConfig
from cbcert.schema import ConfigError


def _rows(run, name="worlds_hypotheses"):
    with open(run / "report" / f"{name}.csv", newline="") as f:
        return list(csv.DictReader(f))


def _num(text):
    return None if text == "" else float(text)


def test_the_family_adjusts_every_p_of_the_run_together(paper_run):
    rows = _rows(paper_run)
    assert tuple(rows[0]) == COLUMNS
    assert {r["world"] for r in rows} == {"default", "k8", "saturated"}
    tested = [r for r in rows if r["p"] != ""]
    p = np.array([float(r["p"]) for r in tested])
    np.testing.assert_allclose([float(r["p_holm"]) for r in tested],
                               multipletests(p, method="holm")[1], rtol=1e-9)
    np.testing.assert_allclose([float(r["p_bh"]) for r in tested],
                               multipletests(p, method="fdr_bh")[1], rtol=1e-9)
    untested = [r for r in rows if r["p"] == ""]
    assert all(r["p_holm"] == "" and r["verdict"] == "untested" for r in untested)


def test_every_verdict_follows_the_rule_from_its_row(paper_run):
    for r in _rows(paper_run):
        expected = verdict(float(r["delta"]), _num(r["p_holm"]), _num(r["tost_p_holm"]), 0.05)
        assert r["verdict"] == expected.replace("other", r["model_b"]), r


def test_the_summary_counts_the_familys_rows(paper_run):
    rows = _rows(paper_run)
    summary = {r["model_b"]: r for r in _rows(paper_run, "worlds_hypotheses_summary")}
    assert int(summary["all"]["tests"]) == sum(r["p"] != "" for r in rows)
    for model in {r["model_b"] for r in rows}:
        mine = [r for r in rows if r["model_b"] == model]
        assert int(summary[model]["tests"]) == sum(r["p"] != "" for r in mine)
        assert int(summary[model]["inconclusive"]) == sum(r["verdict"] == "inconclusive"
                                                          for r in mine)


def test_a_radius_hypothesis_is_the_mean_radius_of_each_models_correct_inputs(paper_run):
    cell = paper_run / "default" / "latent-sigma0.1"
    records = [json.loads(line) for line in (cell / "records.jsonl").read_text().splitlines()]

    def mean_radius(model):
        radii = [r["radius"] for r in records if r["model"] == model
                 and r["prediction"] == r["label"]]
        return float(np.mean(radii)) if radii else None

    row = next(r for r in _rows(paper_run) if r["world"] == "default"
               and r["cell"] == "latent-sigma0.1" and r["measure"] == "radius"
               and r["model_b"] == "cbm")
    a, b = mean_radius("std"), mean_radius("cbm")
    assert float(row["value_a"]) == pytest.approx(a) and float(row["value_b"]) == pytest.approx(b)
    assert float(row["delta"]) == pytest.approx(a - b)  # larger radius: std's advantage
    assert float(row["margin"]) == pytest.approx(0.05 * a)


def test_a_flip_rate_hypothesis_is_the_share_of_flipped_inputs_with_its_sign(paper_run):
    budget = paper_run / "k8" / "perturb" / "tau2.jsonl"
    records = [json.loads(line) for line in budget.read_text().splitlines()]

    def pfr(model):
        return float(np.mean([np.mean([s["pred"][model] != r["clean"]["pred"][model]
                                       for s in r["samples"]]) for r in records]))

    row = next(r for r in _rows(paper_run) if r["world"] == "k8" and r["measure"] == "pfr"
               and r["budget"] == "tau=2" and r["model_b"] == "cbm")
    assert float(row["value_a"]) == pytest.approx(pfr("std"))
    assert float(row["delta"]) == pytest.approx(pfr("cbm") - pfr("std"))  # flips: b − std
    assert row["type"] == "semantic" and int(row["inputs"]) == len(records)


@pytest.mark.parametrize("delta,p_holm,tost,expected", [
    (0.03, 0.001, 0.9, "std more robust"),
    (-0.03, 0.001, 0.9, "other more robust"),
    (0.0, 0.001, 0.001, "equivalent"),  # a zero difference is never "shown"
    (0.001, 0.6, 0.01, "equivalent"),
    (0.001, 0.6, 0.2, "inconclusive"),
    (0.001, 0.6, None, "inconclusive"),
    (0.0, None, None, "untested"),
])
def test_the_verdict_rule(delta, p_holm, tost, expected):
    assert verdict(delta, p_holm, tost, 0.05) == expected


def test_the_analysis_section_is_run_wide_and_checked():
    config = ExperimentConfig.from_dict({"analysis": {"rate_margin": 0.01}})
    assert config.analysis == AnalysisConfig(rate_margin=0.01)
    assert config.to_dict()["analysis"]["rate_margin"] == 0.01
    assert "analysis" not in ExperimentConfig.from_dict({}).to_dict()  # defaults: as before
    with pytest.raises(ConfigError, match="radius_margin.*allowed range"):
        ExperimentConfig.from_dict({"analysis": {"radius_margin": 1.5}})
    with pytest.raises(ConfigError, match="unknown key 'margin'"):
        ExperimentConfig.from_dict({"analysis": {"margin": 0.1}})
    with pytest.raises(ConfigError, match="analysis.*top level"):
        ExperimentConfig.from_dict({"worlds": [{"preset": "default",
                                                "analysis": {"level": 0.01}}]})


def test_a_damaged_analysis_section_exits_2_naming_the_manifest(tmp_path):
    """The report reads the margins the manifest pinned; an out-of-range one is a damaged file,
    not a traceback."""
    import shutil
    from pathlib import Path

    from click.testing import CliRunner

    from cbcert.cli import main

    reference = Path(__file__).resolve().parents[1] / "results" / "reference"
    run = tmp_path / "run"
    shutil.copytree(reference / "latent-sigma0.1", run / "w" / "latent-sigma0.1")
    manifest = json.loads((reference / "manifest.json").read_text())
    manifest["config"]["analysis"] = {"level": 2}
    manifest["worlds"] = [{"name": "w", "family": ""}]
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert f"{run / 'manifest.json'}:" in output and "level" in output, output
    assert "Traceback" not in result.output
