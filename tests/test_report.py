"""Reports: tables equal what the records give, figures are PNGs, absent data are skipped."""

import csv
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import jax
import matplotlib
import numpy as np
import pytest
import scipy
from click.testing import CliRunner

import cbcert
from cbcert.cli import main
from cbcert.report import cells, figures, tables
from cbcert.report import write as report
from cbcert.robustness import stats
from cbcert.runs import attack as attack_runner
from cbcert.runs import machine, provenance, sessions, sweep
from cbcert.runs.config import load_config
from cbcert.runs.directory import RECORDS
from cbcert.worlds.builtin import untrained_world

TINY = """\
preset: smoke
name: tiny
world: {seed: 1, num_inputs: 8}
latent: {sigmas: [0.25, 0.5], n0: 4, n: 16, alpha: 0.1}
# No τ budget: semantic perturbations compile separately (slow) and use the same code path.
perturb: {eps: [0.8], tau: [], subsets: 3, subset_size: 4}
"""
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny sweep (two σ cells, one perturb cell) plus an attack cell summarised from
    hand-written records (APGD itself is tested in test_attacks_runner)."""
    root = tmp_path_factory.mktemp("report")
    path = root / "tiny.yaml"
    path.write_text(TINY)
    cfg = load_config(path)
    world = untrained_world("default", seed=0)
    out = root / "run"
    sweep.run_sweep(cfg, out, sections=sweep.sections_in_file(path),
                    load_world=lambda preset: world)
    _fake_attack_cell(out / "attack-latent", world.name)
    return out


def _fake_attack_cell(out, world_name):
    job = attack_runner.AttackJob(eps=(0.01, 0.03), models=("std", "cbm"), num_inputs=4)
    rng = np.random.default_rng(0)
    records = []
    for model in job.models:
        for eps in job.eps:
            for i in range(job.num_inputs):
                clean, adv = int(rng.integers(2)), int(rng.integers(2))
                records.append({"index": i, "model": model, "eps": eps, "label": 1,
                                "clean_prediction": clean, "adversarial_prediction": adv,
                                "loss": 0.0, "perturbation_norm": eps, "attack_fooled": adv != 1,
                                "robust": clean == 1 and adv == 1, "seconds": 0.1})
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"job": asdict(job), "world": world_name}))
    (out / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = attack_runner.summarize_records(records, job)
    (out / "summary.json").write_text(json.dumps(summary))


@pytest.fixture(scope="module")
def written(run_dir):
    notes = []
    paths = report.write_report(run_dir, log=notes.append)
    return paths, notes


def _csv(run_dir, name):
    with open(run_dir / report.REPORT_DIR / f"{name}.csv") as f:
        return list(csv.DictReader(f))


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cells_take_their_kind_from_run_json_and_old_cells_by_their_layout(run_dir):
    found = {c.name: c.kind for c in cells.find_cells(run_dir, log=lambda s: None)}
    assert found == {"latent-sigma0.25": "certify", "latent-sigma0.5": "certify",
                     "perturb": "perturb", "attack-latent": "attack"}
    # The runners name the kind; the attack cell was written as before run.json named it.
    kinds = {name: json.loads((run_dir / name / "run.json").read_text()).get("kind")
             for name in found}
    assert kinds == {**found, "attack-latent": None}


def test_the_kind_written_in_run_json_decides_over_the_layout(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"kind": "classes", "job": {"noise": "x"}}))
    (tmp_path / "summary.json").write_text("{}")
    (cell,) = cells.find_cells(tmp_path, log=lambda s: None)
    assert cell.kind == "classes"
    (tmp_path / "run.json").write_text(json.dumps({"kind": "sample"}))
    with pytest.raises(cells.DamagedFileError, match="run.json: unknown kind 'sample'"):
        cells.find_cells(tmp_path, log=lambda s: None)


def test_certification_table_matches_records(run_dir, written):
    rows = _csv(run_dir, "certification_latent")
    assert [(r["cell"], r["model"]) for r in rows] == [
        (f"latent-sigma{s}", m) for s in ("0.25", "0.5") for m in ("std", "cbm", "proto")]
    for sigma in (0.25, 0.5):
        records = [r for r in _records(run_dir / f"latent-sigma{sigma:g}" / RECORDS)
                   if r["model"] == "std"]
        (row,) = [r for r in rows if r["cell"] == f"latent-sigma{sigma:g}" and r["model"] == "std"]
        correct = np.array([r["prediction"] == r["label"] for r in records])
        radius = np.array([r["radius"] or 0.0 for r in records])
        assert float(row["smoothed_accuracy"]) == pytest.approx(correct.mean(), abs=1e-12)
        assert float(row["acr"]) == pytest.approx((radius * correct).mean(), abs=1e-12)
        ca = (correct & (radius >= sigma)).mean()
        assert float(row["ca_at_sigma"]) == pytest.approx(ca, abs=1e-12)
        assert int(row["inputs"]) == len(records) == 8
        if correct.any():
            assert float(row["radius_of_correct"]) == pytest.approx(radius[correct].mean(),
                                                                    abs=1e-12)
        else:
            assert row["radius_of_correct"] == ""
        # Each cell's settings: α, n0, n, the bound and the schedule (from its run.json).
        assert (row["alpha"], row["n0"], row["n"], row["bound"], row["schedule"]) == (
            "0.1", "4", "16", "one-class CP", "fixed")


def test_perturb_table_matches_records_and_subsets(run_dir, written):
    summary = json.loads((run_dir / "perturb" / "summary.json").read_text())
    rows = {r["budget"]: r for r in _csv(run_dir, "perturb")}
    assert set(rows) == {"eps0.8"}
    budget = "eps0.8"
    by_index = {r["index"]: r for r in _records(run_dir / "perturb" / f"{budget}.jsonl")}
    dfs, pfr = [], []
    for subset in summary["subsets"]:
        members = [by_index[i] for i in subset]
        dfs.append(np.mean([np.mean([s["dfs"] for s in r["samples"]]) for r in members]))
        pfr.append(np.mean([np.mean([s["pred"]["std"] != r["clean"]["pred"]["std"]
                                     for s in r["samples"]]) for r in members]))
    assert float(rows[budget]["dfs_cbm_mean"]) == pytest.approx(np.mean(dfs), abs=1e-12)
    assert float(rows[budget]["dfs_cbm_sd"]) == pytest.approx(np.std(dfs, ddof=1), abs=1e-12)
    assert float(rows[budget]["pfr_std_mean"]) == pytest.approx(np.mean(pfr), abs=1e-12)
    tests = _csv(run_dir, "perturb_tests")
    assert [(t["budget"], t["model_b"]) for t in tests] == [
        ("eps0.8", m) for m in ("cbm", "proto")]
    assert all(float(t["p_holm"]) >= float(t["p"]) for t in tests)
    # p comes from the permutation test over the subsets' distinct inputs, which is named.
    inputs = len({i for subset in summary["subsets"] for i in subset})
    assert all(int(t["inputs"]) == inputs for t in tests)
    comparison = summary["budgets"][0]["comparisons"][0]
    assert comparison["test"] == "paired sign-flip permutation test over inputs"


def test_attack_table_matches_records(run_dir, written):
    records = _records(run_dir / "attack-latent" / RECORDS)
    rows = _csv(run_dir, "attack")
    assert len(rows) == 4
    for row in rows:
        mine = [r for r in records if r["model"] == row["model"] and r["eps"] == float(row["eps"])]
        assert float(row["robust_accuracy"]) == np.mean([r["robust"] for r in mine])
        assert float(row["clean_accuracy"]) == np.mean(
            [r["clean_prediction"] == r["label"] for r in records
             if r["model"] == row["model"] and r["eps"] == 0.01])


def test_attack_tests_pair_each_input_of_the_records(run_dir, written):
    records = _records(run_dir / "attack-latent" / RECORDS)
    rows = _csv(run_dir, "attack_tests")
    assert [(r["eps"], r["model_a"], r["model_b"]) for r in rows] == [("0.01", "std", "cbm"),
                                                                       ("0.03", "std", "cbm")]
    for row in rows:
        eps = float(row["eps"])
        robust = {m: np.array([r["robust"] for r in sorted(records, key=lambda r: r["index"])
                               if r["model"] == m and r["eps"] == eps]) for m in ("std", "cbm")}
        test = stats.mcnemar_test(robust["std"], robust["cbm"])
        assert int(row["inputs"]) == 4
        assert float(row["robust_a"]) == robust["std"].mean()
        assert float(row["delta_mean"]) == robust["std"].mean() - robust["cbm"].mean()
        assert (int(row["a_only"]), int(row["b_only"])) == (test.a_only, test.b_only)
        assert float(row["p"]) == test.pvalue
        clean = {m: np.array([r["clean_prediction"] == r["label"]
                              for r in sorted(records, key=lambda r: r["index"])
                              if r["model"] == m and r["eps"] == eps]) for m in ("std", "cbm")}
        both = clean["std"] & clean["cbm"]
        assert int(row["clean_both"]) == both.sum()
        if both.any():
            assert float(row["robust_a_clean"]) == robust["std"][both].mean()
            assert float(row["p_clean"]) == stats.mcnemar_test(robust["std"][both],
                                                               robust["cbm"][both]).pvalue
    assert [float(r["p_holm"]) for r in rows] == list(stats.holm([float(r["p"]) for r in rows]))


def _attack_cell(tmp_path, outcomes):
    """An attack cell of std and proto at one ε from ``{index: (std (clean ok, robust), proto
    (clean ok, robust))}``; label 0, a wrong prediction is 1."""
    records = []
    for index, pair in outcomes.items():
        for model, (clean_ok, robust) in zip(("std", "proto"), pair, strict=True):
            records.append({"index": index, "model": model, "eps": 0.03, "label": 0,
                            "clean_prediction": 0 if clean_ok else 1,
                            "adversarial_prediction": 0 if robust else 1, "robust": robust})
    (tmp_path / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"models": {m: {"budgets": [{"eps": 0.03}]} for m in ("std", "proto")}}
    return cells.CellResult("attack-concept", "attack", {}, summary, tmp_path)


def test_attack_tests_on_clean_inputs_leave_out_what_either_model_gets_wrong_unattacked(tmp_path):
    # 6 inputs: proto misclassifies 0-2 unattacked (so never robust there); on 3-5 both are
    # clean-correct and the attack fools std on 3, proto on 4 and 5.
    outcomes = {0: ((True, True), (False, False)), 1: ((True, True), (False, False)),
                2: ((True, True), (False, False)), 3: ((True, False), (True, True)),
                4: ((True, True), (True, False)), 5: ((True, True), (True, False))}
    (table,) = tables.attack_test_tables([_attack_cell(tmp_path, outcomes)])
    (row,) = [dict(zip(table.columns, r, strict=True)) for r in table.rows]
    # Over all inputs: std robust on 5 of 6, proto on 1 (input 3), all 6 discordant.
    assert (row["inputs"], row["robust_a"], row["robust_b"]) == (6, 5 / 6, 1 / 6)
    assert (row["a_only"], row["b_only"]) == (5, 1)
    # On the 3 clean-for-both inputs: std survives 2, proto 1; discordant 2 against 1.
    assert (row["clean_both"], row["robust_a_clean"], row["robust_b_clean"]) == (3, 2 / 3, 1 / 3)
    assert (row["a_only_clean"], row["b_only_clean"]) == (2, 1)
    test = stats.mcnemar_test(np.array([False, True, True]), np.array([True, False, False]))
    assert row["delta_clean_mean"] == pytest.approx(1 / 3) and row["p_clean"] == test.pvalue
    assert row["p_holm_clean"] == test.pvalue  # one conditional test in the cell


def test_attack_tests_on_clean_inputs_are_empty_where_no_input_is_clean_for_both(tmp_path):
    outcomes = {0: ((True, True), (False, False)), 1: ((False, False), (True, True))}
    (table,) = tables.attack_test_tables([_attack_cell(tmp_path, outcomes)])
    (row,) = [dict(zip(table.columns, r, strict=True)) for r in table.rows]
    assert row["clean_both"] == 0 and row["p"] == 1.0
    assert all(row[c] is None for c in table.columns[table.columns.index("clean_both") + 1:])


def test_figures_are_pngs_and_absent_data_are_noted(run_dir, written):
    paths, notes = written
    figures = {p.name for p in paths if p.suffix == ".png"}
    assert figures == {
        "pfr_vs_eps.png", "cfr_dfs_vs_pfr.png",
        "certified_accuracy_latent-sigma0.25.png", "certified_accuracy_latent-sigma0.5.png",
        "smacc_acr_vs_sigma.png", "robustness_gap.png", "attacks.png"}
    for name in figures:
        assert (run_dir / report.REPORT_DIR / name).read_bytes()[:8] == PNG_MAGIC
    for absent in ("smacc_acr_vs_rho.png", "pfr_vs_tau.png"):
        assert any(absent in n for n in notes)
    markdown = (run_dir / report.REPORT_DIR / "report.md").read_text()
    assert "Config `tiny`" in markdown and "![robustness_gap](robustness_gap.png)" in markdown
    # The sweep's one session, its revision and its machine (sessions.jsonl).
    start = json.loads((run_dir / sessions.SESSIONS).read_text().splitlines()[0])
    assert (f"Sessions (sessions.jsonl): 1 started; revisions `{str(start['git_revision'])[:7]}`;"
            f" machines {start['machine']['cpu']} (" in markdown)
    # Its three cells (two σ, perturb) ran under this sweep: each has a time (records or its
    # `cell` line).
    cells = json.loads((run_dir / "manifest.json").read_text())["cells"]
    wall = re.search(r"Wall time of the finished cells: \d+ (s|min) over (\d+) cells\.",
                     markdown)
    assert wall is not None and int(wall.group(2)) == len(cells) == 3, markdown[:2000]


def test_subset_tables_list_each_model_and_test():
    sd = {"mean": 0.5, "sd": 0.1}
    subsets = {"num_subsets": 5, "subset_size": 200,
               "models": {m: {"smoothed_accuracy": sd, "acr": sd,
                              "radius_of_correct": {"mean": None, "sd": None}}
                          for m in ("std", "cbm")},
               "comparisons": [{"metric": "acr", "model_a": "std", "model_b": "cbm",
                                "delta": sd, "test": "t", "inputs": 300, "p": 0.01,
                                "p_holm": 0.02}]}
    cell = cells.CellResult("latent-sigma0.1", "certify", {"job": {}}, {"subsets": subsets})
    rows, tests = tables.subset_tables([cell])
    assert [r[:4] for r in rows.rows] == [("latent-sigma0.1", m, 5, 200) for m in ("std", "cbm")]
    assert rows.rows[0][-2:] == (None, None)
    assert tests.rows == (("latent-sigma0.1", "acr", "std", "cbm", 0.5, 0.1, 300, 0.01, 0.02),)
    assert tables.subset_tables([cells.CellResult("x", "certify", {}, {})]) == []


def test_attack_figure_groups_vanilla_and_smoothed_cells(tmp_path):
    def attack(name, smoothed, robust):
        summary = {"space": "latent", "norm": "linf", "loss": "ce", "smoothed": smoothed,
                   "sigma": 0.25 if smoothed else None, "eps": [0.03],
                   "models": {m: {"clean_accuracy": 0.9, "budgets": [
                       {"eps": 0.03, "num_inputs": 4, "robust_accuracy": robust}]}
                       for m in ("std", "cbm")}}
        return cells.CellResult(name, "attack", {"job": {}}, summary)

    found = [attack("attack-latent", False, 0.2), attack("attack-latent-smoothed", True, 0.6)]
    path = figures.figure_attacks(found, tmp_path / "attacks.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert figures._attack_label(found[1]) == "latent linf\nsmoothed σ=0.25"
    assert figures.figure_attacks([], tmp_path / "none.png") is None


def test_robustness_gap_sign_is_positive_when_cbm_is_more_robust(run_dir):
    found = cells.find_cells(run_dir, log=lambda _: None)
    rows, columns, values = figures.robustness_gaps(found)
    attack = json.loads((run_dir / "attack-latent" / "summary.json").read_text())["models"]
    i = rows.index("ε=0.03 (attack-latent)")
    expected = attack["cbm"]["budgets"][1]["robust_accuracy"] - \
        attack["std"]["budgets"][1]["robust_accuracy"]
    assert values[i][columns.index("ΔRobAcc (cbm−std)")] == pytest.approx(expected)


def test_single_runner_directory_and_cli(run_dir, tmp_path):
    result = CliRunner().invoke(main, ["report", str(run_dir / "latent-sigma0.5")])
    assert result.exit_code == 0, result.output
    assert "skipped pfr_vs_eps" in result.output.replace("\n", " ")
    out = run_dir / "latent-sigma0.5" / report.REPORT_DIR
    assert sorted(p.name for p in out.glob("*.csv")) == ["certification_latent.csv",
                                                          "provenance.csv"]
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(main, ["report", str(empty)])
    assert result.exit_code == 2 and "no finished runner directory" in result.output


def _never(*args, **kwargs):
    raise AssertionError("the report read or rendered cells")


def _report_is_a_file(run):
    (run / "report").write_text("x")
    return run / "report", "is a file"


def _read_only(run, monkeypatch):
    access = os.access
    # Root may write anywhere, so a read-only directory is simulated through os.access.
    monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and not (
        mode & os.W_OK and str(path) == str(run)))
    return run, "not writable"


def _world_report_is_a_file(run):
    (run / "manifest.json").write_text(json.dumps({"worlds": [{"name": "a"}, {"name": "b"}]}))
    (run / "a").mkdir()
    (run / "a" / "report").write_text("x")
    return run / "a" / "report", "is a file"


@pytest.mark.parametrize("make", ["report_is_a_file", "read_only", "world_report_is_a_file"])
def test_unwritable_report_folder_exits_2_naming_it_before_any_cell_is_read(
        make, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    path, problem = (_read_only(run, monkeypatch) if make == "read_only"
                     else globals()[f"_{make}"](run))
    monkeypatch.setattr(report, "find_cells", _never)
    monkeypatch.setattr(report, "world_cells", _never)
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "RUN_DIR" in result.output and str(path) in result.output
    assert problem in result.output
    with pytest.raises(report.ReportError, match=problem):
        report.write_report(run, log=_never)


def test_markdown_merges_mean_and_sd_columns():
    table = tables.Table("t", "T", ("budget", "pfr_mean", "pfr_sd", "p"),
                         (("eps0.1", 0.123456, 0.01, None),))
    assert table.to_markdown().splitlines()[2:] == [
        "| budget | pfr | p |", "|---|---|---|", "| eps0.1 | 0.1235 ± 0.01 | – |"]
    assert table.to_csv() == "budget,pfr_mean,pfr_sd,p\neps0.1,0.123456,0.01,\n"


def test_perturb_explanation_table_and_figure(tmp_path):
    """A perturb cell run with ``explain``: one table row per budget and explaining model (the
    comparison against the first model on the other models' rows), and a figure with a column
    per budget kind; cells without explanations give neither."""
    from cbcert.report.explain import figure_perturb_explanations

    def budget(kind, value, proto_overlap):
        stat = {"mean": 0.8, "sd": 0.05}
        return {"kind": kind, "value": value,
                "overlap": {"cbm": stat, "proto": {"mean": proto_overlap, "sd": 0.1}},
                "kendall": {"cbm": stat, "proto": {"mean": None, "sd": None}},
                "comparisons": [{"model_a": "cbm", "model_b": "proto", "metric": "overlap",
                                 "delta": 0.8 - proto_overlap, "pvalue": 0.01,
                                 "pvalue_holm": 0.03}]}

    summary = {"explanations": [budget("eps", 0.1, 0.6), budget("eps", 0.5, 0.4),
                                budget("tau", 1, 0.5)]}
    cell = cells.CellResult("perturb", "perturb", {}, summary)
    (table,) = tables.explain_tables([cell])
    assert table.name == "perturb_explanations"
    assert len(table.rows) == 6
    proto = [r for r in table.rows if r[2] == "proto"]
    assert [r[7:] for r in proto] == [(pytest.approx(0.2), 0.01, 0.03),
                                      (pytest.approx(0.4), 0.01, 0.03),
                                      (pytest.approx(0.3), 0.01, 0.03)]
    assert all(r[7:] == (None, None, None) for r in table.rows if r[2] == "cbm")
    path = figure_perturb_explanations(summary, tmp_path / "stability.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert figure_perturb_explanations({}, tmp_path / "none.png") is None
    assert tables.explain_tables([cells.CellResult("p", "perturb", {}, {})]) == []


REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference"


def _reference_sweep(root):
    """A copy of the reference sweep's manifest and one of its certification cells."""
    root.mkdir()
    shutil.copy(REFERENCE / "manifest.json", root / "manifest.json")
    shutil.copytree(REFERENCE / "latent-sigma0.1", root / "latent-sigma0.1")
    return root


def test_report_where_it_cannot_write_exits_2_before_reading(tmp_path, monkeypatch):
    cell = _reference_sweep(tmp_path / "run") / "latent-sigma0.1"
    (cell / report.REPORT_DIR).write_text("not a directory")
    result = CliRunner().invoke(main, ["report", str(cell)])
    assert result.exit_code == 2, result.output
    assert f"{cell / report.REPORT_DIR} is a file" in " ".join(result.output.split())
    (cell / report.REPORT_DIR).unlink()
    # Root may write anywhere, so a read-only run is simulated through os.access.
    readable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: False if
                        mode & os.W_OK else readable(path, mode, **kwargs))
    result = CliRunner().invoke(main, ["report", str(cell)])
    assert result.exit_code == 2, result.output
    assert "is not writable" in result.output and not (cell / report.REPORT_DIR).exists()


@pytest.mark.parametrize(("where", "text", "message"), [
    ("latent-sigma0.1/summary.json", "[]", "expected a JSON object, found a list"),
    ("latent-sigma0.1/summary.json", '{"mode": "certify"}', "unexpected content (KeyError"),
    ("latent-sigma0.1/summary.json", "[" * 100_000, "nested too deeply"),
    ("latent-sigma0.1/run.json", "{", "damaged, not valid JSON"),
    ("latent-sigma0.1/run.json", '{"job": [1]}', "unknown layout"),
    ("manifest.json", "[]", "expected a JSON object, found a list"),
    ("manifest.json", '{"cells": [{"kind": "certify"}]}', "'cells' must be a list of objects"),
    ("manifest.json", '{"cells": [], "worlds": [{"name": "../elsewhere"}]}',
     "'worlds' must be a list of objects"),
])
def test_report_on_damaged_files_exits_2_naming_the_file(tmp_path, where, text, message):
    run = _reference_sweep(tmp_path / "run")
    (run / where).write_text(text)
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert f"{run / where}:" in output and message in output, output
    assert not list((run / report.REPORT_DIR).glob("*"))


def test_radius_tests_are_recomputed_from_the_records_at_the_summary_subsets(tmp_path):
    """certification_radius_tests.csv of the reference run's three latent cells equals an
    independent reduction of their records: R̄ per subset over correct inputs, scipy's paired
    t-test, Holm across the three σ for each pair; damaged records exit 2 naming the file."""
    import csv

    from scipy.stats import ttest_rel

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(REFERENCE / "manifest.json", run / "manifest.json")
    cells_ = ("latent-sigma0.05", "latent-sigma0.1", "latent-sigma0.3")
    for name in cells_:
        shutil.copytree(REFERENCE / name, run / name)
    assert CliRunner().invoke(main, ["report", str(run), "--quiet"]).exit_code == 0
    with open(run / report.REPORT_DIR / "certification_radius_tests.csv") as f:
        rows = list(csv.DictReader(f))
    expected = {}
    for pair in (("std", "cbm"), ("std", "proto")):
        ps = {}
        for name in cells_:
            summary = json.loads((run / name / "summary.json").read_text())
            records = [json.loads(line) for line in (run / name / "records.jsonl").open()]
            rbar = {}
            for m in pair:
                mine = {r["index"]: r for r in records if r["model"] == m}
                rbar[m] = np.array([np.mean([mine[i]["radius"] for i in s
                                             if mine[i]["prediction"] == mine[i]["label"]]
                                            or [np.nan]) for s in summary["subsets"]["indices"]])
            ok = np.isfinite(rbar[pair[0]]) & np.isfinite(rbar[pair[1]])
            d = rbar[pair[0]][ok] - rbar[pair[1]][ok]
            if ok.sum() >= 2:  # identical radii: no evidence, p = 1 (scipy gives NaN there)
                ps[name] = 1.0 if np.all(d == 0) else ttest_rel(rbar[pair[0]][ok],
                                                                  rbar[pair[1]][ok]).pvalue
        # Holm over the cells with a p (a cell with fewer than 2 usable subsets has none).
        names = sorted(ps, key=ps.get)
        holm = np.maximum.accumulate([min(1.0, (len(names) - k) * ps[n])
                                      for k, n in enumerate(names)])
        for name in cells_:
            expected[(name, *pair)] = (ps.get(name), dict(zip(names, holm, strict=True)).get(name))
    assert len(rows) == 6 and sum(e[0] is not None for e in expected.values()) >= 4
    for row in rows:
        p, p_holm = expected[(row["cell"], row["model_a"], row["model_b"])]
        if p is None:
            assert row["p"] == "" and row["p_holm"] == ""
            continue
        assert float(row["p"]) == pytest.approx(p, rel=1e-9)
        assert float(row["p_holm"]) == pytest.approx(p_holm, rel=1e-9)
    (run / "latent-sigma0.1" / "records.jsonl").write_text('{"index": 0}\n')
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 2, result.output
    assert "records.jsonl" in " ".join(result.output.split())


def test_sessions_line_counts_revisions_and_machines_and_skips_a_torn_line(tmp_path):
    from cbcert.report.write import _sessions_line

    assert _sessions_line(tmp_path, []) is None
    intel = {"cpu": "Xeon", "isa": ["avx2", "avx512f"]}
    amd = {"cpu": "EPYC", "isa": ["avx2"]}
    lines = [{"event": "start", "git_revision": "a" * 40, "machine": intel},
             {"event": "end", "finished": []},
             {"event": "start", "git_revision": "a" * 40, "machine": intel},
             {"event": "start", "git_revision": "b" * 40, "machine": amd}]
    (tmp_path / sessions.SESSIONS).write_text(
        "".join(json.dumps(e) + "\n" for e in lines) + '{"event": "sta')
    assert _sessions_line(tmp_path, []) == (
        "Sessions (sessions.jsonl): 3 started; revisions `aaaaaaa` ×2, `bbbbbbb`; machines "
        "Xeon (avx2 avx512f) ×2, EPYC (avx2).")


def test_sessions_line_sums_the_finished_cells_wall_time(tmp_path):
    """Certification from its records (an input's share repeats on each model's record: 2
    models × 2 inputs at 30 s = 60 s), perturbation from its `cell` lines (40 + 20 s), an
    unfinished cell not at all, a finished perturbation cell without lines unmeasured."""
    from cbcert.report.write import _sessions_line

    def cell(name, kind, records=None):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps(
            {"kind": kind, "job": {"models": ["std", "cbm"]}}))
        if records is not None:
            (tmp_path / name / "records.jsonl").write_text("".join(
                json.dumps({"index": i // 2, "seconds": 30.0}) + "\n" for i in range(records)))

    cell("latent-sigma0.1", "certify", records=4)
    cell("latent-sigma0.2", "certify", records=2)  # unfinished: no summary
    cell("perturb", "perturb")
    cell("old", "perturb")
    for name in ("latent-sigma0.1", "perturb", "old"):
        (tmp_path / name / "summary.json").write_text("{}")
    log = [{"event": "start", "git_revision": "a" * 40, "machine": {"cpu": "Xeon"}},
           {"event": "cell", "cell": "perturb", "state": "stopped", "seconds": 40.0},
           {"event": "cell", "cell": "perturb", "state": "done", "seconds": 20.0}]
    (tmp_path / sessions.SESSIONS).write_text("".join(json.dumps(e) + "\n" for e in log))
    manifest = [{"name": n, "kind": k} for n, k in (("latent-sigma0.1", "certify"),
                                                     ("latent-sigma0.2", "certify"),
                                                     ("perturb", "perturb"),
                                                     ("old", "perturb"))]
    assert _sessions_line(tmp_path, manifest).endswith(
        " Wall time of the finished cells: 2 min over 2 cells (1 more without a recorded "
        "time).")


def test_the_header_names_the_reports_own_revision_and_versions_and_no_time(run_dir, written):
    own = report.report_provenance()
    assert own == {"git_revision": machine.git_revision(), "versions": {
        "cbcert": cbcert.__version__, "jax": jax.__version__, "numpy": np.__version__,
        "scipy": scipy.__version__, "matplotlib": matplotlib.__version__}}
    assert json.loads((run_dir / report.REPORT_DIR / report.PROVENANCE).read_text()) == own
    markdown = (run_dir / report.REPORT_DIR / "report.md").read_text()
    where = f"git `{own['git_revision']}`" if own["git_revision"] else "a tree outside git"
    versions = ", ".join(f"{k} {v}" for k, v in own["versions"].items())
    assert f"Written by cbcert at {where}" in markdown and versions in markdown
    assert not re.search(r"\d\d:\d\d:\d\d", markdown)  # no time of day: reproducible


def test_provenance_table_lists_each_cells_writers(run_dir, written):
    """The sweep's cells list the one session that wrote them in run.json; the attack cell,
    written by hand without a list or a cell line, is unknown."""
    rows = {r["cell"]: r for r in _csv(run_dir, "provenance")}
    start = json.loads((run_dir / sessions.SESSIONS).read_text().splitlines()[0])
    for name in ("latent-sigma0.25", "latent-sigma0.5", "perturb"):
        assert rows[name]["sessions"] == "1" and rows[name]["mixed"] == "no"
        assert rows[name]["source"] == "run.json" and rows[name]["note"] == ""
        assert rows[name]["revisions"] == (start["git_revision"] or "no git")[:7]
        assert rows[name]["machines"] == provenance.machine_label(start["machine"])
    assert {k: rows["attack-latent"][k] for k in ("sessions", "revisions", "mixed", "source")} \
        == {"sessions": "", "revisions": "unknown", "mixed": "unknown", "source": "unknown"}
    markdown = (run_dir / report.REPORT_DIR / "report.md").read_text()
    assert ("Provenance (table `provenance`): 0 of 4 cells written by more than one git "
            "revision or machine, 1 whose writers are not all known.") in markdown


def test_a_cell_written_at_two_revisions_is_mixed(tmp_path):
    """Its run.json lists both sessions: the row names both revisions and says mixed."""
    cell = cells.CellResult("cell", "classes", {"sessions": [
        {"time": "2026-01-01T00:00:00+00:00", "git_revision": "a" * 40,
         "machine": {"cpu": "Xeon", "isa": ["avx2"]}, "records_before": 0},
        {"time": "2026-01-02T00:00:00+00:00", "git_revision": "b" * 40,
         "machine": {"cpu": "Xeon", "isa": ["avx2"]}, "records_before": 5}]}, {},
        tmp_path / "cell")
    (table,) = tables.provenance_table([cell])
    assert table.rows == (("cell", 2, "aaaaaaa, bbbbbbb", "Xeon (avx2)", "yes", "run.json",
                           None),)


def test_rewriting_the_report_of_a_run_gives_the_same_bytes(run_dir, written, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / report.REPORT_DIR)
    report.write_report(copy, log=lambda _: None)
    first = {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    report.write_report(copy, log=lambda _: None)
    again = {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    assert again == first
    assert any(p.name == report.PROVENANCE for p in first)
