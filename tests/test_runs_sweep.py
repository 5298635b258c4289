"""Sweeps: config → cells, manifest, resumption after an interrupted cell, config errors."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cbcert.cli import main
from cbcert.runs import sessions, sweep
from cbcert.runs.config import ConfigError, ExperimentConfig, load_config
from cbcert.runs.directory import RECORDS, SUMMARY, RunMismatchError
from cbcert.worlds.builtin import untrained_world

# Preset smoke: its perturb subset_size (8) must fit in world.num_inputs even when unswept.
TINY = """\
preset: smoke
name: tiny
world: {seed: 3, num_inputs: 8}
latent: {sigmas: [0.25, 0.5], n0: 4, n: 16, alpha: 0.1, models: [std, cbm]}
"""


@pytest.fixture(scope="module")
def world():
    return untrained_world("default", seed=0)


def _config(tmp_path, text=TINY):
    path = tmp_path / "tiny.yaml"
    path.write_text(text)
    return path, load_config(path)


def _without_wall_clock(value):
    if isinstance(value, dict):
        return {k: _without_wall_clock(v) for k, v in value.items() if "seconds" not in k}
    return value


def _summaries(out, cells):
    return {c: _without_wall_clock(json.loads((out / c / SUMMARY).read_text())) for c in cells}


def test_plan_cells_expands_every_section():
    cfg = ExperimentConfig.from_preset_name("smoke")
    cells = sweep.plan_cells(cfg)
    assert [c.name for c in cells] == [
        "latent-sigma0.1", "concept-rho0.2", "concept-flips1", "perturb", "attack-latent"]
    latent, rho, flips, perturb, attack = (c.job for c in cells)
    assert (latent.noise, latent.scale, latent.n0, latent.n) == ("gaussian", 0.1, 10, 100)
    assert (rho.noise, flips.noise, flips.scale) == ("bernoulli", "fixed", 1)
    assert latent.num_inputs == rho.num_inputs == perturb.num_inputs == cfg.world.num_inputs
    assert (perturb.eps, perturb.tau, perturb.subset_size) == ((0.1, 0.5), (1, 2), 8)
    assert (attack.iters, attack.num_inputs, attack.smoothed, attack.scale) == (10, 64, False, None)
    assert [c.name for c in sweep.plan_cells(cfg, ("perturb",))] == ["perturb"]
    with pytest.raises(ConfigError, match=r"sections \['certify'\]"):
        sweep.plan_cells(cfg, ("certify",))


def test_smoothed_attack_cell_takes_scale_and_predict_settings(tmp_path):
    _, cfg = _config(tmp_path, "latent: {n: 300}\nattack: {smoothed: true, sigma: 0.5}\n")
    (cell,) = sweep.plan_cells(cfg, ("attack",))
    assert cell.name == "attack-latent-smoothed-sigma0.5"
    assert (cell.job.scale, cell.job.n, cell.job.alpha) == (0.5, 300, cfg.latent.alpha)
    _, cfg = _config(tmp_path, "attack: {space: concept, smoothed: true, rho: 0.1}\n")
    assert sweep.plan_cells(cfg, ("attack",))[0].name == "attack-concept-smoothed-rho0.1"


def test_several_attack_sections_make_one_cell_each(tmp_path):
    """Vanilla and smoothed × latent and concept from one config (the attack figure's cells)."""
    text = ("preset: smoke\nattack:\n  - {space: latent}\n  - {space: concept}\n"
            "  - {space: latent, smoothed: true, sigma: 0.25}\n"
            "  - {space: concept, smoothed: true, rho: 0.2, iters: 3}\n")
    _, cfg = _config(tmp_path, text)
    cells = sweep.plan_cells(cfg, ("attack",))
    assert [c.name for c in cells] == ["attack-latent", "attack-concept",
                                       "attack-latent-smoothed-sigma0.25",
                                       "attack-concept-smoothed-rho0.2"]
    assert [c.job.iters for c in cells] == [10, 10, 10, 3]  # each over the preset's defaults
    assert ExperimentConfig.from_dict(cfg.to_dict()) == cfg  # the manifest round-trips
    twice = "preset: smoke\nattack: [{norm: linf}, {norm: l2}]\n"
    _, cfg = _config(tmp_path, twice)
    with pytest.raises(ConfigError, match="cell 'attack-latent' is already taken"):
        sweep.plan_cells(cfg, ("attack",))
    _, cfg = _config(tmp_path, "preset: smoke\nattack: [{norm: linf}, {norm: l2, name: l2}]\n")
    assert [c.name for c in sweep.plan_cells(cfg, ("attack",))] == ["attack-latent", "l2"]
    with pytest.raises(ConfigError, match="key 'name'"):
        _config(tmp_path, "attack: {name: ../x}\n")
    # One section stays a mapping in the manifest, as before lists were allowed.
    _, cfg = _config(tmp_path, "attack: {space: concept}\n")
    assert isinstance(cfg.to_dict()["attack"], dict) and "name" not in cfg.to_dict()["attack"]


def test_sections_in_file(tmp_path):
    path, _ = _config(tmp_path)
    assert sweep.sections_in_file(path) == ("latent",)
    path.write_text("preset: smoke\n")
    assert sweep.sections_in_file(path) == sweep.DEFAULT_SECTIONS
    path.write_text("preset: smoke\nclasses: {samples: 8}\nworlds: [{preset: k8, perturb: {}}]\n")
    assert sweep.sections_in_file(path) == ("perturb", "classes")


def test_resume_after_interrupted_cell_gives_identical_summaries(world, tmp_path, monkeypatch):
    path, cfg = _config(tmp_path)
    sections = sweep.sections_in_file(path)
    out = tmp_path / "run"
    monkeypatch.setattr("cbcert.cli.sweep._sweep_world", lambda preset: world)
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "latent-sigma0.5: done" in result.output
    cells = ["latent-sigma0.25", "latent-sigma0.5"]
    full = _summaries(out, cells)

    manifest = json.loads((out / sweep.MANIFEST).read_text())
    assert manifest["config"] == cfg.to_dict() and manifest["seed"] == 3
    assert manifest["cells"] == [{"name": c, "kind": "certify"} for c in cells]
    assert set(manifest["versions"]) == {"cbcert", "jax", "flax", "numpy"}
    assert manifest["devices"] and manifest["world"] == world.name
    assert manifest["git_revision"] is None or len(manifest["git_revision"]) == 40

    # Simulate kill -9 inside the first cell: two finished records, a torn third, no summary.
    records = out / cells[0] / RECORDS
    lines = records.read_text().splitlines(keepends=True)
    records.write_text("".join(lines[:2]) + lines[2][:15])
    (out / cells[0] / SUMMARY).unlink()
    untouched = (out / cells[1] / RECORDS).read_text()
    sweep.run_sweep(cfg, out, sections=sections, load_world=lambda preset: world)
    assert _summaries(out, cells) == full
    # The finished cell was re-entered but redid nothing; the torn cell kept its two records.
    assert (out / cells[1] / RECORDS).read_text() == untouched
    assert records.read_text().splitlines(keepends=True)[:2] == lines[:2]
    assert len(records.read_text().splitlines()) == len(lines)

    # Both sessions logged: start (revision, versions, machine), the wall time of each cell
    # the session worked on (the second resumed the torn cell only), end (the cells finished).
    log = [json.loads(line) for line in (out / sessions.SESSIONS).read_text().splitlines()]
    assert [e["event"] for e in log] == ["start", "cell", "cell", "end", "start", "cell", "end"]
    assert [(e["cell"], e["state"]) for e in log if e["event"] == "cell"] == [
        (cells[0], "done"), (cells[1], "done"), (cells[0], "done")]
    assert all(e["seconds"] >= 0 for e in log if e["event"] == "cell")
    for start, end in ((log[0], log[3]), (log[4], log[6])):
        assert start["git_revision"] == manifest["git_revision"] and start["cells"] == 2
        assert start["versions"] == manifest["versions"] and start["shard"] is None
        assert start["machine"]["cpu"] and start["machine"]["logical_cpus"] >= 1
        assert end["finished"] == cells and end["time"] >= start["time"]


def test_a_stopped_sweep_logs_what_it_finished(world, tmp_path, monkeypatch):
    """Ctrl-C in the second cell: the session's last line says it stopped, why, and that the
    first cell was finished; the error still reaches the caller."""
    path, cfg = _config(tmp_path)
    out = tmp_path / "run"
    calls = []

    def run(world_, job, cell_out, progress=None):
        calls.append(cell_out.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(world_, job, cell_out, progress=progress)

    real = sweep.certify_runner.run
    monkeypatch.setattr(sweep.certify_runner, "run", run)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(cfg, out, sections=sweep.sections_in_file(path),
                        load_world=lambda preset: world)
    log = [json.loads(line) for line in (out / sessions.SESSIONS).read_text().splitlines()]
    assert [e["event"] for e in log] == ["start", "cell", "cell", "stopped"]
    assert [(e["cell"], e["state"]) for e in log[1:3]] == [("latent-sigma0.25", "done"),
                                                            ("latent-sigma0.5", "stopped")]
    assert log[3]["reason"] == "KeyboardInterrupt"
    assert log[3]["finished"] == ["latent-sigma0.25"]


def test_cli_sweep_stopped_by_sigterm_logs_it_keeps_the_cells_and_resumes(world, tmp_path,
                                                                          monkeypatch):
    """SIGTERM (kill, a scheduler's preemption) in the second cell: exit 143 with a message,
    `stopped` logged with the reason and the finished cell, the directory's lock released (the
    rerun is not refused), the rerun finishing the sweep; the old handler is back after."""
    import os
    import signal

    path, _ = _config(tmp_path)
    out = tmp_path / "run"
    monkeypatch.setattr("cbcert.cli.sweep._sweep_world", lambda preset: world)
    calls = []
    real = sweep.certify_runner.run

    def run(world_, job, cell_out, progress=None):
        calls.append(cell_out.name)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(world_, job, cell_out, progress=progress)

    monkeypatch.setattr(sweep.certify_runner, "run", run)
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--quiet"])
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert "Stopped by SIGTERM" in result.output and "rerun the same command" in result.output
    assert signal.getsignal(signal.SIGTERM) is before
    log = [json.loads(line) for line in (out / sessions.SESSIONS).read_text().splitlines()]
    assert [e["event"] for e in log] == ["start", "cell", "cell", "stopped"]
    assert log[2]["cell"] == "latent-sigma0.5" and log[2]["state"] == "stopped"
    assert log[3]["reason"] == "Terminated" and log[3]["finished"] == ["latent-sigma0.25"]
    assert (out / "latent-sigma0.25" / SUMMARY).is_file()
    assert not (out / "latent-sigma0.5" / SUMMARY).exists()
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert (out / "latent-sigma0.5" / SUMMARY).is_file()


def test_other_config_into_same_out_is_refused(world, tmp_path):
    _, cfg = _config(tmp_path, TINY.replace("sigmas: [0.25, 0.5]", "sigmas: [0.5]"))
    out = tmp_path / "run"
    out.mkdir()
    meta = sweep.manifest(cfg, sweep.plan_cells(cfg, ("latent",)), world)
    (out / sweep.MANIFEST).write_text(json.dumps(meta))
    _, other = _config(tmp_path)
    with pytest.raises(RunMismatchError, match="another config"):
        sweep.run_sweep(other, out, sections=("latent",), load_world=lambda preset: world)
    assert sorted(p.name for p in out.iterdir()) == [sweep.MANIFEST]


def test_cells_are_checked_against_the_world_before_running(world, tmp_path):
    _, cfg = _config(tmp_path, "perturb: {tau: [1, 40]}\n")
    with pytest.raises(ConfigError, match="section 'perturb', key 'tau': tau=40"):
        sweep.check_cells(sweep.plan_cells(cfg), world)
    _, cfg = _config(tmp_path, "latent: {models: [std, vit]}\n")
    with pytest.raises(ConfigError, match="section 'latent', key 'models': .*vit"):
        sweep.check_cells(sweep.plan_cells(cfg), world)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("latent: {sigmas: [0.1, -1.0]}\n", "key 'sigmas[1]'"),
        ("attack: {rho: 0.7}\n", "key 'rho'"),
        ("perturb: {epsilon: [0.1]}\n", "unknown key 'epsilon'"),
    ],
)
def test_cli_config_errors_exit_2_naming_the_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert key in result.output and "bad.yaml" in result.output
    assert not (tmp_path / "o").exists()


def test_cli_sweep_refuses_mismatched_out_with_exit_2(world, tmp_path, monkeypatch):
    path, cfg = _config(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / sweep.MANIFEST).write_text(json.dumps({"config": {"name": "other"}}))
    monkeypatch.setattr("cbcert.cli.sweep._sweep_world", lambda preset: world)
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--quiet"])
    assert result.exit_code == 2 and "--out" in result.output


def test_cli_world_flag_overrides_the_config_preset(world, tmp_path, monkeypatch):
    path, _ = _config(tmp_path)
    asked = []
    monkeypatch.setattr("cbcert.cli.sweep._sweep_world", lambda preset: pytest.fail("preset used"))
    monkeypatch.setattr("cbcert.cli.common.load_world", lambda name: asked.append(name) or world)
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--world",
                                       "my/world", "--quiet"])
    assert result.exit_code == 0, result.output
    assert asked == ["my/world"]
    assert json.loads((out / sweep.MANIFEST).read_text())["world"] == world.name


@pytest.mark.parametrize("path", sorted(Path(__file__).parent.parent.glob("configs/*.yaml")),
                         ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_plans_cells(path):
    from cbcert.runs.config import load_config

    cells = sweep.plan_cells(load_config(path), sweep.sections_in_file(path))
    assert cells and len({c.name for c in cells}) == len(cells)


def test_cells_are_named_by_exact_value():
    """σ = 0.1 and 0.1000001 once shared latent-sigma0.1 (and ε = 0.1000001 reused ε = 0.1's
    records); names keep the short form only where it reads back as the same number."""
    cfg = ExperimentConfig.from_dict({
        "preset": "smoke", "latent": {"sigmas": [0.1, 0.1000001, 2.0]},
        "perturb": {"eps": [0.1, 0.1000001], "tau": []}})
    names = [c.name for c in sweep.plan_cells(cfg, ("latent", "perturb"))]
    assert names[:3] == ["latent-sigma0.1", "latent-sigma0.1000001", "latent-sigma2"]
    from cbcert.runs.perturb import budget_name

    assert budget_name("eps", 0.1000001) != budget_name("eps", 0.1) == "eps0.1"


def test_attack_only_config_is_not_checked_against_perturb_defaults(world, tmp_path):
    path, cfg = _config(tmp_path, "world: {num_inputs: 4}\nattack: {eps: [0.03], iters: 2, "
                                  "inputs: 4}\n")
    sections = sweep.sections_in_file(path)
    assert sections == ("attack",)
    cells = sweep.plan_cells(cfg, sections)
    assert [c.name for c in cells] == ["attack-latent"]


def test_a_second_sweep_into_the_same_directory_is_refused(world, tmp_path):
    from cbcert.runs.directory import RunLockedError
    from cbcert.runs.lock import hold

    _, cfg = _config(tmp_path)
    out = tmp_path / "run"
    with hold(out), pytest.raises(RunLockedError, match="in use by another run"):
        sweep.run_sweep(cfg, out, sections=("latent",), load_world=lambda preset: world)


MULTI = TINY + """\
classes: {samples: 32}
worlds:
  - {preset: default, family: similarity}
  - {preset: other, name: b, latent: {sigmas: [0.5]}}
"""


def test_multi_world_sweep_runs_every_world_into_its_own_directory(world, tmp_path):
    """Cells ``<world>/<cell>``; each world directory is the single-world sweep of its entry
    (same manifest, same records), so it can be reported or resumed on its own."""
    path, cfg = _config(tmp_path, MULTI)
    sections = sweep.sections_in_file(path)
    assert sections == ("latent", "classes")
    cells = sweep.plan_cells(cfg, sections)
    assert [(c.name, c.world) for c in cells] == [
        ("default/latent-sigma0.25", "default"), ("default/latent-sigma0.5", "default"),
        ("default/classes", "default"), ("b/latent-sigma0.5", "b"), ("b/classes", "b")]
    asked = []
    out = tmp_path / "run"
    summaries = sweep.run_sweep(cfg, out, sections=sections,
                                load_world=lambda preset: asked.append(preset) or world)
    assert asked == ["default", "other"] and set(summaries) == {c.name for c in cells}
    top = json.loads((out / sweep.MANIFEST).read_text())
    assert top["worlds"] == [{"name": "default", "family": "similarity"},
                             {"name": "b", "family": ""}]
    assert top["world"] == {"default": world.name, "b": world.name}
    assert [c["name"] for c in top["cells"]] == [c.name for c in cells]

    single_cfg = cfg.for_world(cfg.worlds[0])
    single = tmp_path / "single"
    sweep.run_sweep(single_cfg, single, sections=sections, load_world=lambda preset: world)
    own = json.loads((out / "default" / sweep.MANIFEST).read_text())
    alone = json.loads((single / sweep.MANIFEST).read_text())
    assert {k: own[k] for k in ("config", "cells", "world")} == \
        {k: alone[k] for k in ("config", "cells", "world")}
    names = ["latent-sigma0.25", "latent-sigma0.5", "classes"]
    assert _summaries(out / "default", names) == _summaries(single, names)
    # Rerunning resumes: a lost summary is rebuilt identically, the others are kept.
    before = _summaries(out / "b", ["latent-sigma0.5", "classes"])
    (out / "b" / "latent-sigma0.5" / SUMMARY).unlink()
    sweep.run_sweep(cfg, out, sections=sections, load_world=lambda preset: world)
    assert _summaries(out / "b", ["latent-sigma0.5", "classes"]) == before
    # Shards deal the cells of every world; their union is the whole sweep.
    dealt = [c.name for i in range(3) for c in sweep.shard_cells(cells, i, 3)]
    assert sorted(dealt) == sorted(c.name for c in cells)


def test_cli_multi_world_loads_each_world_and_refuses_world_flag(world, tmp_path, monkeypatch):
    path, _ = _config(tmp_path, MULTI)
    asked = []
    monkeypatch.setattr("cbcert.cli.common.load_world",
                        lambda name, **_: asked.append(name) or world)
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--world", "x"])
    assert result.exit_code == 2 and "--world" in result.output and "2 worlds" in result.output
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--status"])
    assert result.exit_code == 0 and "b/classes" in result.output and "5 missing" in result.output
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert asked == ["default", "other"]
    assert (out / "b" / "classes" / SUMMARY).is_file()


def test_select_cells_matches_shell_patterns_in_plan_order(tmp_path):
    path, cfg = _config(tmp_path, MULTI)
    cells = sweep.plan_cells(cfg, sweep.sections_in_file(path))
    names = lambda picked: [c.name for c in picked]  # noqa: E731
    assert names(sweep.select_cells(cells, ())) == names(cells)
    assert names(sweep.select_cells(cells, ("b/*",))) == ["b/latent-sigma0.5", "b/classes"]
    # Several patterns: their union, in the plan's order, each cell once.
    assert names(sweep.select_cells(cells, ("*/classes", "default/*"))) == [
        "default/latent-sigma0.25", "default/latent-sigma0.5", "default/classes", "b/classes"]
    with pytest.raises(ConfigError, match="'B/\\*': matches no cell") as err:
        sweep.select_cells(cells, ("default/*", "B/*"))  # case-sensitive
    assert err.value.key == "cells" and "default/latent-sigma0.25" in err.value.detail


def test_only_runs_the_selected_cells_and_a_full_run_resumes_the_rest(world, tmp_path):
    """``only``: one world first, into the sweep's own directory and manifest; the whole
    sweep later skips those cells and runs the others, with the summaries a plain sweep
    writes."""
    path, cfg = _config(tmp_path, MULTI)
    sections = sweep.sections_in_file(path)
    cells = sweep.plan_cells(cfg, sections)
    out = tmp_path / "run"
    first = sweep.run_sweep(cfg, out, sections=sections, load_world=lambda preset: world,
                            only=("b/*",))
    assert set(first) == {"b/latent-sigma0.5", "b/classes"}
    states = {s.name: s.state for s in sweep.sweep_status(out, cells)}
    assert states == {c.name: "done" if c.world == "b" else "missing" for c in cells}
    assert [c["name"] for c in json.loads((out / sweep.MANIFEST).read_text())["cells"]] == \
        [c.name for c in cells]
    start = sessions.starts(out)
    assert start[-1]["only"] == ["b/*"] and start[-1]["cells"] == 2
    rest = sweep.run_sweep(cfg, out, sections=sections, load_world=lambda preset: world)
    plain = tmp_path / "plain"
    sweep.run_sweep(cfg, plain, sections=sections, load_world=lambda preset: world)
    names = [c.name for c in cells]
    assert set(rest) == set(names)  # the b cells resume as finished: nothing sampled again
    assert _summaries(out, names) == _summaries(plain, names)


def test_cli_cells_flag_selects_runs_and_status_and_names_a_bad_pattern(world, tmp_path,
                                                                       monkeypatch):
    path, _ = _config(tmp_path, MULTI)
    monkeypatch.setattr("cbcert.cli.common.load_world", lambda name, **_: world)
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--cells", "c/*"])
    assert result.exit_code == 2 and "--cells" in result.output
    assert "'c/*' matches no cell" in result.output and not out.exists()
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--cells",
                                       "*/classes"])
    assert result.exit_code == 0, result.output
    assert "--cells */classes finished (2 of 5 cells)" in " ".join(result.output.split())
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(out), "--status",
                                       "--cells", "default/*"])
    assert result.exit_code == 0 and "b/classes" not in result.output
    assert "1 done, 0 running, 2 missing" in result.output
    # The two classes cells logged their times: the selection's two others are priced.
    assert re.search(r"work left: about \d+ (s|min) for one process, at the pace of the 2 "
                     r"measured finished cells", " ".join(result.output.split())), result.output


EXPLAIN = """\
preset: smoke
name: ex
world: {seed: 3, num_inputs: 8}
explain: {inputs: 4, n0: 8, n: 16, figure_inputs: 0}
"""


def test_explain_section_runs_a_cell_and_reports_a_table(world, tmp_path):
    """An ``explain:`` section is one ``explain`` cell; the report writes its table (every
    model × measure); configs without the section pin what they always pinned."""
    from cbcert.report.tables import EXPLAIN_MEASURES
    from cbcert.report.write import write_report

    path, cfg = _config(tmp_path, EXPLAIN)
    assert sweep.sections_in_file(path) == ("explain",)
    (cell,) = sweep.plan_cells(cfg, ("explain",))
    assert (cell.name, cell.kind, cell.job.num_inputs, cell.job.seed) == ("explain", "explain",
                                                                           4, 3)
    assert sweep.cell_cost(cell) > 0
    out = tmp_path / "run"
    sweep.run_sweep(cfg, out, sections=("explain",), load_world=lambda preset: world)
    assert json.loads((out / sweep.MANIFEST).read_text())["config"]["explain"]["inputs"] == 4
    assert "explain" not in ExperimentConfig().to_dict()
    write_report(out, log=lambda _: None)
    assert (out / "report" / "explanations_explain.png").stat().st_size > 0
    rows = (out / "report" / "explanations.csv").read_text().splitlines()
    latent_only = [key for key, _ in EXPLAIN_MEASURES if not key.endswith("_flips")]  # no rho
    # proto: stability and certificates only (no known answer, no concept counterfactuals)
    proto = [k for k in latent_only if k.startswith(("eps_", "tau_", "all_cited", "mean_cert"))]
    assert len(proto) == 6
    concept = [k for k in latent_only if k != "residual_share"]  # cbmh alone has a residual
    assert len(rows) == 1 + 2 * len(concept) + 1 + len(proto)
    _, bad = _config(tmp_path, EXPLAIN.replace("n: 16,", "n: 16, tau: 13,"))
    with pytest.raises(ConfigError, match=r"section 'explain': tau=13: allowed range \[1, K=12\]"):
        sweep.check_cells(sweep.plan_cells(bad, ("explain",)), world)


def test_attack_section_records_explanations_when_asked(world, tmp_path):
    """``attack.explain: true`` reaches the attack job; configs without it pin what they always
    pinned; a world without the explaining heads is refused before any cell runs, naming the
    section and key."""
    import dataclasses

    text = "preset: smoke\nname: ax\nattack: {eps: [0.01], explain: true}\n"
    _, cfg = _config(tmp_path, text)
    (cell,) = sweep.plan_cells(cfg, ("attack",))
    assert cell.job.explain and cell.job.explained == ("cbm", "proto")
    assert "explain" not in ExperimentConfig().to_dict()["attack"]
    assert cfg.to_dict()["attack"]["explain"] is True
    sweep.check_cells([cell], world)  # the built-in world exposes both heads
    headless = dataclasses.replace(world, prototypes=None)
    with pytest.raises(ConfigError, match="section 'attack', key 'explain'.*prototype network"):
        sweep.check_cells([cell], headless)
    _, smoothed = _config(tmp_path, text.replace("explain: true", "explain: true, smoothed: true"))
    with pytest.raises(ConfigError, match="base attacks only"):
        sweep.plan_cells(smoothed, ("attack",))


def test_nan_logits_stop_a_sweep_with_exit_2_naming_its_world(world, tmp_path, monkeypatch):
    """A world whose models return NaN logits: the sweep exits 2 naming CONFIG's world and the
    cause (no traceback), like `certify latent` does."""
    import dataclasses

    import jax.numpy as jnp

    from cbcert.worlds.world import World

    class NaNWorld(World):
        def apply(self, space, models):
            inner = super().apply(space, models)
            return lambda params, z: inner(params, z) * jnp.nan

    broken = NaNWorld(**{f.name: getattr(world, f.name) for f in dataclasses.fields(World)})
    path, _ = _config(tmp_path)
    monkeypatch.setattr("cbcert.cli.sweep._sweep_world", lambda preset: broken)
    result = CliRunner().invoke(main, ["sweep", str(path), "--out", str(tmp_path / "run"),
                                       "--quiet"])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "CONFIG" in output and "NaN or inf logits" in output, output
    assert (tmp_path / "run" / sweep.MANIFEST).exists()


def test_cell_costs_track_the_committed_paper_runs_times():
    """`cell_cost` against the wall time the committed full-size paper run measured per cell
    (`results/paper/default`, the records' ``seconds``: per input for certification, per input,
    model and ε for attacks): every kind's time relative to the certification cells' is its cost
    ratio within a factor 2, so `--shard` deals work, not counts. Before attacks were priced
    at `APGD_STEP_PASSES` = 9 a vanilla attack cell cost 3× too little."""
    root = Path(__file__).resolve().parent.parent
    cells = {c.name: c for c in sweep.plan_cells(load_config(root / "configs" / "paper.yaml"))}

    def seconds(name):  # the cell's measured seconds, scaled to all its records if unfinished
        path = root / "results" / "paper" / name / "records.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if cells[name].kind == "certify":
            first = records[0]["model"]
            return sum(r["seconds"] for r in records if r["model"] == first)
        job = cells[name].job
        expected = job.num_inputs * len(job.models) * len(job.eps)
        return sum(r["seconds"] for r in records) * expected / len(records)

    # The median over all ten: a few cells shared the machine with test runs (up to 6× slower).
    certify = [n for n in cells if n.startswith("default/") and cells[n].kind == "certify"]
    assert len(certify) == 10
    unit = np.median([seconds(n) / sweep.cell_cost(cells[n]) for n in certify])
    for name in ("default/attack-latent", "default/attack-concept",
                 "default/attack-latent-smoothed-sigma0.1"):
        ratio = seconds(name) / sweep.cell_cost(cells[name]) / unit
        assert 0.5 < ratio < 2, f"{name}: measured/cost is {ratio:.2f}× the certification's"
