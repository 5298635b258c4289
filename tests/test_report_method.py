"""The method's figures and tables by number (`cbcert.report.method_outputs`, from the
`method_tables`, `method_figures` and `method_setting_figures` modules): every number is
written or said absent, the layouts are the method's, the numbers are the records' — on a small
hand-made run of every world the method's settings name, and on the reduced paper run — and the
cross-world radius, attack and gap figures (`cbcert.report.worlds`) read at a glance."""

import csv
import io
import json
import math
import struct

import numpy as np
import pytest
import scipy.stats
from statsmodels.stats.multitest import multipletests

from cbcert.certify.smoothing import SMOOTHINGS
from cbcert.report import figures as report_figures
from cbcert.report import method_figures, method_setting_figures
from cbcert.report import worlds as report_worlds
from cbcert.report.cells import CellResult, find_cells, read_manifest
from cbcert.report.method_outputs import ABSENT, OUTPUTS, method_tables, write_method_outputs
from cbcert.report.method_settings import SETTINGS
from cbcert.report.plotting import TYPE_COLOURS, model_colour
from cbcert.report.tables import Table, attack_tables, perturb_tables
from cbcert.robustness.certification import subset_summary
from cbcert.runs.directory import RECORDS

MODELS = ("std", "cbm", "proto")
INPUTS, SUBSETS, SUBSET_SIZE = 8, 3, 5
EPS = (0.05, 0.1, 0.3, 0.5, 0.8)
TAU = (1.0, 2.0, 5.0, 7.0, 10.0)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_every_figure_and_table_of_the_method_is_written_or_absent_exactly_once():
    numbers = {"fig1a", "fig1b", "fig1c", *(f"fig{i}" for i in range(2, 11)),
               *(f"table{i}" for i in range(1, 17))}
    assert not set(OUTPUTS) & set(ABSENT)
    assert set(OUTPUTS) | set(ABSENT) == numbers
    for number, name in OUTPUTS.items():
        assert name.startswith(f"{number}_")
        assert name.endswith(".png" if number.startswith("fig") else ".csv"), name
    assert len(set(OUTPUTS.values())) == len(OUTPUTS)
    assert all(len(why) > 20 for why in ABSENT.values())
    assert "DenseNet-161" in ABSENT["table10"] and "schematic" in ABSENT["fig8"]


# --- A small hand-made run: every world of the method's settings ---------------------------------


def _certify_cell(root, world, noise, scale, rng):
    """A certification cell of 8 inputs with random records and the summary the runner
    writes for them (`subset_summary` at 3 subsets of 5, their input indices)."""
    name = SMOOTHINGS[noise].name(scale)
    labels = rng.integers(0, 3, INPUTS)
    predictions, radii, records = {}, {}, []
    for model in MODELS:
        draw = rng.random(INPUTS)
        pred = np.where(draw < 0.7, labels, np.where(draw < 0.85, (labels + 1) % 3, -1))
        radius = (rng.random(INPUTS) * 0.2 if noise == "gaussian"
                  else rng.integers(0, 3, INPUTS).astype(np.float64))
        radius = np.where(pred == -1, np.nan, radius)
        predictions[model], radii[model] = pred, radius
        records += [{"index": i, "model": model, "label": int(labels[i]),
                     "prediction": int(pred[i]),
                     "radius": None if np.isnan(radius[i]) else float(radius[i]),
                     "correct": bool(pred[i] == labels[i])} for i in range(INPUTS)]
    subsets = np.array([np.sort(rng.choice(INPUTS, SUBSET_SIZE, replace=False))
                        for _ in range(SUBSETS)])
    summary_subsets = subset_summary(labels, predictions, radii, subsets,
                                     [("std", "cbm"), ("std", "proto")])
    summary_subsets["indices"] = subsets.tolist()
    models = {}
    for model in MODELS:
        correct = predictions[model] == labels
        radius = np.nan_to_num(radii[model])
        models[model] = {"num_inputs": INPUTS, "smoothed_accuracy": float(correct.mean()),
                         "acr": float((radius * correct).mean()),
                         "radius_of_correct": float(radius[correct].mean())}
    path = root / world / name
    path.mkdir(parents=True)
    (path / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"mode": "certify", "noise": noise, "scale": scale, "models": models,
               "subsets": summary_subsets}
    return CellResult(name, "certify", {"job": {}}, summary, path)


def _perturb_cell(rng, taus):
    budgets = []
    for kind, values in (("eps", EPS), ("tau", taus), ("sigma", (0.05, 0.1)),
                         ("rho", (0.1, 0.2))):
        for value in values:
            pfr = {m: {"mean": float(rng.random()), "sd": float(rng.random() / 10)}
                   for m in MODELS}
            count = {"mean": value if kind == "tau" else float(rng.random() * 3),
                     "sd": 0.0 if kind == "tau" else float(rng.random() / 10)}
            budgets.append({
                "kind": kind, "value": value, "num_subsets": SUBSETS, "subset_size": SUBSET_SIZE,
                "pfr": pfr, "cfr": {"mean": count["mean"] / 12, "sd": count["sd"] / 12},
                "cfr_count": count, "dfs": {"cbm": {"mean": float(rng.random() * 5),
                                                    "sd": float(rng.random() / 10)}},
                "comparisons": [{"model_a": "std", "model_b": "cbm", "delta": {
                    "mean": pfr["std"]["mean"] - pfr["cbm"]["mean"],
                    "sd": float(rng.random() / 10)}, "t": 1.0, "df": SUBSETS - 1,
                    "p_t": float(rng.random()), "inputs": 12, "p": 0.5, "p_holm": 1.0}]})
    summary = {"settings": {"models": list(MODELS)}, "budgets": budgets}
    return CellResult("perturb", "perturb", {}, summary)


def _attack_cells(rng):
    cells = []
    for space, smoothed, scale in (("latent", False, None), ("concept", False, None),
                                   ("latent", True, 0.1), ("concept", True, 0.2)):
        models = {m: {"clean_accuracy": float(rng.random()), "budgets": [
            {"eps": eps, "num_inputs": 10, "robust_accuracy": float(rng.random()),
             "adversarial_abstain_rate": 0.0} for eps in (0.01, 0.03)]} for m in MODELS}
        name = f"attack-{space}" + (f"-smoothed-{scale}" if smoothed else "")
        cells.append(CellResult(name, "attack", {"job": {"scale": scale}}, {
            "space": space, "norm": "linf", "loss": "ce", "smoothed": smoothed,
            "models": models}))
    return cells


def _classes_cell(rng, classes):
    distances = rng.random((classes, classes)) * 5
    distances = (distances + distances.T) / 2
    np.fill_diagonal(distances, 0.0)
    return CellResult("classes", "classes", {}, {
        "class_names": [f"class{i}" for i in range(classes)], "distances": distances.tolist()})


def _stacked(worlds) -> list[Table]:
    """The cross-world perturb-test and attack tables, stacked as `cross_world_tables` does."""
    parts: dict[str, tuple[tuple, list]] = {}
    for name, family, cells in worlds:
        for table in (*perturb_tables(cells), *attack_tables(cells)):
            parts.setdefault(table.name, (table.columns, []))[1].extend(
                (name, family, *row) for row in table.rows)
    return [Table(f"worlds_{name}", name, ("world", "family", *columns), tuple(rows))
            for name, (columns, rows) in parts.items()]


@pytest.fixture(scope="module")
def hand_run(tmp_path_factory):
    """Every world the method's settings name, each with σ, ρ and m certification cells (8
    inputs, 3 subsets of 5, random records), a perturb summary (k8 without τ = 10), the four
    attacks and the class distances (the +10 worlds have 20 classes)."""
    root = tmp_path_factory.mktemp("method")
    rng = np.random.default_rng(0)
    worlds = []
    for world in dict.fromkeys(SETTINGS.values()):
        cells = [_certify_cell(root, world, noise, scale, rng)
                 for noise, scales in (("gaussian", (0.01, 0.05, 0.1, 0.3)),
                                       ("bernoulli", (0.05, 0.1, 0.2)), ("fixed", (1, 2, 4)))
                 for scale in scales]
        cells += [_perturb_cell(rng, TAU[:-1] if world == "k8" else TAU),
                  *_attack_cells(rng), _classes_cell(rng, 20 if "10" in world else 10)]
        worlds.append((world, "family", tuple(cells)))
    return worlds, _stacked(worlds)


@pytest.fixture(scope="module")
def written(hand_run, tmp_path_factory):
    worlds, tables = hand_run
    out = tmp_path_factory.mktemp("method_report")
    notes = []
    paths = write_method_outputs(worlds, tables, out, notes.append)
    return out, paths, notes


def _csv(path) -> list[dict]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    return struct.unpack(">II", data[16:24])


def _world(worlds, name):
    return next(cells for w, _, cells in worlds if w == name)


def _cell(cells, name):
    return next(c for c in cells if c.name == name)


def test_every_output_is_written_where_the_run_has_every_setting(written):
    out, paths, notes = written
    assert sorted(p.name for p in paths) == sorted(OUTPUTS.values())
    assert not notes
    for name in OUTPUTS.values():
        if name.endswith(".png"):
            width, height = _png_size(out / name)
            # Readable at a glance: no strip, no poster.
            assert max(width, height) <= 2400 and 1 / 4 <= width / height <= 4.5, (name, width,
                                                                                  height)


def test_table1_is_the_perturb_summaries_in_the_methods_layout(hand_run, written):
    worlds, _ = hand_run
    out, _, _ = written
    rows = _csv(out / OUTPUTS["table1"])
    blocks = ("CUB [default]", "RIVAL-10 [saturated]")
    metrics = ("CFR", "PFR f_std (%)", "PFR f_cbm (%)", "DFS")
    assert list(rows[0]) == ["type", "budget"] + [f"{b} {m}_{p}" for b in blocks
                                                  for m in metrics for p in ("mean", "sd")]
    # The method's budgets: ε, then τ = 1, 2, 5, 10 (its Table 1 has no τ = 7).
    assert [(r["type"], r["budget"]) for r in rows] == (
        [("Geo.", f"ε={e:g}") for e in EPS] + [("Sem.", f"τ={t:g}") for t in (1, 2, 5, 10)])
    for block, world in zip(blocks, ("default", "saturated"), strict=True):
        budgets = _cell(_world(worlds, world), "perturb").summary["budgets"]
        for row, budget in zip(rows, [b for b in budgets if b["kind"] == "eps"], strict=False):
            assert float(row[f"{block} PFR f_std (%)_mean"]) == pytest.approx(
                100 * budget["pfr"]["std"]["mean"])
            assert float(row[f"{block} PFR f_cbm (%)_sd"]) == pytest.approx(
                100 * budget["pfr"]["cbm"]["sd"])
            assert float(row[f"{block} CFR_mean"]) == pytest.approx(budget["cfr_count"]["mean"])
            assert float(row[f"{block} DFS_mean"]) == pytest.approx(budget["dfs"]["cbm"]["mean"])
    assert rows[-1]["CUB [default] CFR_mean"] == "10.0"  # τ flips: CFR = τ


def test_table2_holm_runs_over_the_nine_budgets_of_the_table(hand_run, written):
    worlds, _ = hand_run
    out, _, _ = written
    rows = _csv(out / OUTPUTS["table2"])
    assert list(rows[0]) == ["type", "budget", "Δ (pp)_mean", "Δ (pp)_sd", "p", "p_Holm"]
    budgets = {f"{'ε' if b['kind'] == 'eps' else 'τ'}={b['value']:g}": b["comparisons"][0]
               for b in _cell(_world(worlds, "default"), "perturb").summary["budgets"]
               if b["kind"] == "eps" or b["value"] in (1, 2, 5, 10)}
    assert [r["budget"] for r in rows] == list(budgets)
    raw = [budgets[r["budget"]]["p_t"] for r in rows]
    holm = multipletests(raw, method="holm")[1]
    for row, p, adjusted in zip(rows, raw, holm, strict=True):
        test = budgets[row["budget"]]
        assert float(row["Δ (pp)_mean"]) == pytest.approx(100 * test["delta"]["mean"])
        assert float(row["Δ (pp)_sd"]) == pytest.approx(100 * test["delta"]["sd"])
        assert float(row["p"]) == pytest.approx(p) and float(row["p_Holm"]) == pytest.approx(
            adjusted)


def _by_hand(cell, model):
    """Per-subset SmAcc, R̄ over correct inputs and CA@1 of ``model``, from the records."""
    records = {r["index"]: r for r in map(json.loads, (cell.path / RECORDS).read_text()
                                          .splitlines()) if r["model"] == model}
    smacc, radius, ca1 = [], [], []
    for subset in cell.summary["subsets"]["indices"]:
        rows = [records[i] for i in subset]
        correct = [r for r in rows if r["prediction"] == r["label"]]
        smacc.append(len(correct) / len(rows))
        radius.append(np.mean([r["radius"] for r in correct]) if correct else np.nan)
        ca1.append(sum(r["radius"] >= 1 for r in correct) / len(rows))
    return np.array(smacc), np.array(radius), np.array(ca1)


def test_table4_is_the_paired_t_test_over_subsets_with_holm_over_all_eight(hand_run, written):
    worlds, _ = hand_run
    out, _, _ = written
    rows = _csv(out / OUTPUTS["table4"])
    assert list(rows[0]) == ["σ", "ΔSmAcc (pp)_mean", "ΔSmAcc (pp)_sd", "p (SmAcc)",
                             "p_Holm (SmAcc)", "ΔR_mean", "ΔR_sd", "p (R)", "p_Holm (R)"]
    assert [r["σ"] for r in rows] == ["0.01", "0.05", "0.1", "0.3"]
    expected, raw = [], []
    for sigma in (0.01, 0.05, 0.1, 0.3):
        cell = _cell(_world(worlds, "default"), SMOOTHINGS["gaussian"].name(sigma))
        (acc_s, r_s, _), (acc_c, r_c, _) = _by_hand(cell, "std"), _by_hand(cell, "cbm")
        ok = np.isfinite(r_s) & np.isfinite(r_c)
        for a, b, factor in ((acc_s, acc_c, 100), (r_s[ok], r_c[ok], 1)):
            d = a - b
            expected.append((factor * d.mean(), factor * d.std(ddof=1)))
            raw.append(scipy.stats.ttest_rel(a, b).pvalue)
    holm = multipletests(raw, method="holm")[1]
    got = [(row[f"Δ{m}_mean"], row[f"Δ{m}_sd"], row[f"p ({k})"], row[f"p_Holm ({k})"])
           for row in rows for m, k in (("SmAcc (pp)", "SmAcc"), ("R", "R"))]
    for (mean, sd, p, adjusted), (m, s), p_raw, p_holm in zip(got, expected, raw, holm,
                                                              strict=True):
        assert float(mean) == pytest.approx(m) and float(sd) == pytest.approx(s)
        assert float(p) == pytest.approx(p_raw) and float(adjusted) == pytest.approx(p_holm)


def test_table3_reads_r_over_correct_inputs_from_the_subsets(hand_run, written):
    worlds, _ = hand_run
    out, _, _ = written
    rows = _csv(out / OUTPUTS["table3"])
    assert list(rows[0])[:3] == ["type", "budget", "model"]
    assert [(r["type"], r["budget"], r["model"]) for r in rows[:2]] == [
        ("Latent", "σ=0.01", "f_std"), ("Latent", "σ=0.01", "f_cbm")]
    assert len(rows) == 2 * (4 + 3)  # f_std, f_cbm at every σ and ρ; the m cells are Table 5's
    cell = _cell(_world(worlds, "saturated"), SMOOTHINGS["bernoulli"].name(0.1))
    row = next(r for r in rows if r["budget"] == "ρ=0.1" and r["model"] == "f_cbm")
    _, radius, _ = _by_hand(cell, "cbm")
    radius = radius[np.isfinite(radius)]
    assert float(row["RIVAL-10 [saturated] R/Δ_mean"]) == pytest.approx(radius.mean())
    assert float(row["RIVAL-10 [saturated] R/Δ_sd"]) == pytest.approx(radius.std(ddof=1))
    smacc = cell.summary["subsets"]["models"]["cbm"]["smoothed_accuracy"]
    assert float(row["RIVAL-10 [saturated] SmAcc (%)_mean"]) == pytest.approx(
        100 * smacc["mean"])


def test_table6_gives_the_standard_error_the_method_states(hand_run, written):
    worlds, _ = hand_run
    out, _, _ = written
    rows = _csv(out / OUTPUTS["table6"])
    first = list(rows[0])[2:6]
    assert first == ["RIVAL-10 +5 dissimilar [dissimilar5] CFR_mean",
                     "RIVAL-10 +5 dissimilar [dissimilar5] CFR_se",
                     "RIVAL-10 +5 dissimilar [dissimilar5] PFR f_std (%)_mean",
                     "RIVAL-10 +5 dissimilar [dissimilar5] PFR f_std (%)_se"]
    assert [r["budget"] for r in rows][-5:] == ["τ=1", "τ=2", "τ=5", "τ=7", "τ=10"]
    budget = _cell(_world(worlds, "dissimilar5"), "perturb").summary["budgets"][2]
    assert float(rows[2][first[3]]) == pytest.approx(
        100 * budget["pfr"]["std"]["sd"] / math.sqrt(SUBSETS))


def test_table16_ca_at_1_counts_every_input_and_acr_h_only_correct_ones(hand_run, written):
    worlds, _ = hand_run
    out, _, _ = written
    table = next(t for t in method_tables(*hand_run, log=lambda _: None)
                 if t.name == "table16_prototype_concept_certified")
    assert "ρ=0.3" in table.title  # the method's fourth ρ is not in the run, said so
    rows = _csv(out / OUTPUTS["table16"])
    assert [r["ρ"] for r in rows] == ["0.05", "0.1", "0.2"]
    cell = _cell(_world(worlds, "default"), SMOOTHINGS["bernoulli"].name(0.2))
    _, radius, ca1 = _by_hand(cell, "proto")
    radius = radius[np.isfinite(radius)]
    assert float(rows[2]["ACR-H PixPNet_mean"]) == pytest.approx(radius.mean())
    assert float(rows[2]["CA@1 (%) PixPNet_mean"]) == pytest.approx(100 * ca1.mean())
    assert float(rows[2]["CA@1 (%) PixPNet_sd"]) == pytest.approx(100 * ca1.std(ddof=1))


def test_table12_lists_vanilla_and_smoothed_models_at_both_attack_eps(written):
    out, _, _ = written
    rows = _csv(out / OUTPUTS["table12"])
    assert [(r["attack ε"], r["attack space"], r["model"]) for r in rows[:4]] == [
        ("0.03", "latent z", "f_std"), ("0.03", "latent z", "f̂_std (smoothed, σ=0.1)"),
        ("0.03", "latent z", "f_cbm"), ("0.03", "latent z", "f̂_cbm (smoothed, σ=0.1)")]
    assert len(rows) == 2 * 2 * 4


def test_figures_have_the_methods_panels_and_colours(hand_run, kept_figures, tmp_path):
    # Each figure module saves its own figures, in number order.
    figures = kept_figures(method_figures)
    setting_figures = kept_figures(method_setting_figures)
    write_method_outputs(*hand_run, tmp_path, log=lambda _: None)
    in_settings = [n.replace("figure", "fig") for n in method_setting_figures.__all__]
    drawn = dict(zip([n for n in OUTPUTS if n.startswith("fig") and n not in in_settings],
                     figures, strict=True))
    drawn |= dict(zip(in_settings, setting_figures, strict=True))

    def panels(number):
        return [ax for ax in drawn[number].axes if ax.get_label() != "<colorbar>"]

    # Fig. 1(b): the four representative budgets, three units, one colour bar each.
    assert len(panels("fig1b")) == 3 and len(drawn["fig1b"].axes) == 6
    ticks = [t.get_text() for ax in panels("fig1b") for t in ax.get_xticklabels()]
    assert [t.split("\n")[0] for t in ticks] == ["ε = 0.3", "τ = 5", "σ = 0.1", "ρ = 0.1"]
    assert len(panels("fig1b")[0].get_yticklabels()) == len(set(SETTINGS.values()))
    # Fig. 2: ε and τ, each with CUB (left axis) and RIVAL-10 (right axis); colour by model.
    assert len(drawn["fig2"].axes) == 4
    colours = {line.get_color() for ax in drawn["fig2"].axes for line in ax.get_lines()
               if line.get_label() and not line.get_label().startswith("_")}
    assert colours <= {model_colour("std"), model_colour("cbm")}
    # Figs. 3 and 9: two panels, lines coloured by perturbation type.
    for number in ("fig3", "fig9"):
        assert len(panels(number)) == 2
        colours = {line.get_color() for ax in panels(number) for line in ax.get_lines()
                   if line.get_xdata().size}
        assert colours == set(TYPE_COLOURS.values()), number
    assert len(panels("fig4")) == 4 and len(panels("fig7")) == 4
    assert [ax.get_title() for ax in panels("fig5")] == ["(a) ε = 0.03", "(b) ε = 0.01"]
    assert len(panels("fig6")) == 3
    bars = {tuple(p.get_facecolor()[:3]) for p in panels("fig6")[2].patches}
    from matplotlib.colors import to_rgb

    assert bars == {to_rgb(c) for c in TYPE_COLOURS.values()}  # (c): colour by type
    assert len(panels("fig10")) == 2  # similar and dissimilar, one shared colour bar
    assert len(drawn["fig10"].axes) == 3


def test_absent_settings_are_left_out_and_said_so(hand_run, tmp_path):
    worlds, tables = hand_run
    only_cub = [w for w in worlds if w[0] == "default"]
    notes = []
    paths = write_method_outputs(only_cub, tables, tmp_path, notes.append)
    names = {p.name for p in paths}
    for number in ("fig6", "fig7", "fig10", "table6", "table7", "table8", "table9"):
        assert OUTPUTS[number] not in names
        assert any(OUTPUTS[number] in n and "skipped" in n for n in notes), number
    for number in ("fig1b", "fig2", "fig3", "table1", "table2", "table4", "table12"):
        assert OUTPUTS[number] in names
    table1 = next(t for t in method_tables(only_cub, tables, lambda _: None)
                  if t.name == "table1_empirical")
    assert "RIVAL-10 (world saturated)" in table1.title
    assert not any("saturated" in c for c in table1.columns)


def test_damaged_records_name_the_file(hand_run, tmp_path):
    from cbcert.report.cells import DamagedFileError

    worlds, tables = hand_run
    cell = _cell(_world(worlds, "default"), SMOOTHINGS["gaussian"].name(0.01))
    broken = tmp_path / cell.name
    broken.mkdir()
    (broken / RECORDS).write_text(json.dumps({"index": 0, "model": "std"}) + "\n")
    cells = tuple(CellResult(c.name, c.kind, c.run, c.summary, broken) if c is cell else c
                  for c in _world(worlds, "default"))
    with pytest.raises(DamagedFileError, match=str(broken / RECORDS)):
        method_tables([("default", "", cells)], tables, lambda _: None)


# --- The reduced paper run: the real cells ------------------------------------------------------


def test_reduced_paper_run_writes_what_its_worlds_hold(paper_run, tmp_path):
    """configs/paper.yaml at reduced sizes (default, k8, saturated; the first attack only):
    the CUB and RIVAL-10 outputs are written, the class-structure ones noted as skipped, and
    Table 1's PFR is the perturb summary's."""
    entries = [e for e in read_manifest(paper_run)["worlds"] if (paper_run / e["name"]).is_dir()]
    worlds = report_worlds.world_cells(paper_run, entries, lambda _: None)
    tables = report_worlds.cross_world_tables(worlds)
    notes = []
    names = {p.name for p in write_method_outputs(worlds, tables, tmp_path, notes.append)}
    for number in ("fig1b", "fig2", "fig3", "fig4", "fig5", "fig9", "table1", "table2",
                   "table3", "table4", "table5", "table8", "table12", "table13", "table14",
                   "table15", "table16"):
        assert OUTPUTS[number] in names, number
    for number in ("fig6", "fig10", "table6", "table7", "table9"):
        assert any(OUTPUTS[number] in n for n in notes), number
    perturb = next(c for c in find_cells(paper_run / "default", lambda _: None)
                   if c.kind == "perturb")
    rows = _csv(tmp_path / OUTPUTS["table1"])
    for row, budget in zip(rows, [b for b in perturb.summary["budgets"] if b["kind"] == "eps"],
                           strict=False):
        assert float(row["CUB [default] PFR f_cbm (%)_mean"]) == pytest.approx(
            100 * budget["pfr"]["cbm"]["mean"])
    assert [r["model"] for r in _csv(tmp_path / OUTPUTS["table12"])] == ["f_std", "f_cbm"] * 2


# --- The cross-world figures of `cbcert.report.worlds` and the per-world R̄ ----------------------


def test_radius_figure_shows_r_over_correct_inputs_beside_acr_without_the_m_cells(
        hand_run, kept_figures):
    worlds, _ = hand_run
    figures = kept_figures(report_worlds)
    report_worlds.figure_radius_worlds(worlds, None)
    (figure,) = figures
    axes = np.array(figure.axes).reshape(4, 4)  # σ R̄, σ ACR, ρ R̄, ρ ACR × the 4 σ
    labels = [ax.get_ylabel() for ax in axes[:, 0]]
    assert [label.split("\n")[0] for label in labels] == [
        "R̄ over correct inputs", "ACR over all inputs"] * 2
    titles = [ax.get_title() for row in axes for ax in row if ax.axison]
    assert not any(t.startswith("m =") for t in titles)
    assert titles[:4] == ["σ = 0.01", "σ = 0.05", "σ = 0.1", "σ = 0.3"]
    assert not axes[2, 3].axison  # three ρ
    cell = _cell(_world(worlds, "default"), SMOOTHINGS["gaussian"].name(0.1))
    heights = [p.get_height() for p in axes[0, 2].patches]
    assert cell.summary["models"]["std"]["radius_of_correct"] in heights
    assert cell.summary["models"]["std"]["acr"] in [p.get_height() for p in axes[1, 2].patches]


def test_attack_figure_is_a_grid_of_cells_by_eps_with_the_legend_outside(hand_run,
                                                                         kept_figures):
    worlds, _ = hand_run
    figures = kept_figures(report_worlds)
    report_worlds.figure_attacks_worlds(worlds, None)
    (figure,) = figures
    assert len(figure.axes) == 8
    titles = [ax.get_title() for ax in figure.axes]
    assert titles[:2] == ["attack-latent, ε = 0.01", "attack-latent, ε = 0.03"]
    with_legend = [i for i, ax in enumerate(figure.axes) if ax.get_legend() is not None]
    assert with_legend == [1]
    assert figure.axes[1].get_legend().get_bbox_to_anchor().x0 > figure.axes[1].bbox.x1
    width, height = figure.get_size_inches()
    assert width / height < 2


def test_gap_figure_marks_missing_budgets_na(hand_run, kept_figures):
    worlds, _ = hand_run
    figures = kept_figures(report_worlds)
    report_worlds.figure_gap_worlds(worlds, None)
    (figure,) = figures
    texts = [t.get_text() for ax in figure.axes for t in ax.texts]
    assert texts.count("n/a") >= 1  # k8 has no τ = 10
    hamming = next(ax for ax in figure.axes if ax.get_title(loc="left").startswith("ΔACR-H"))
    assert [t.get_text() for t in hamming.get_xticklabels()] == ["ρ=0.05", "ρ=0.1", "ρ=0.2"]


def test_per_world_smoothing_figure_plots_r_over_correct_inputs(hand_run, kept_figures):
    worlds, _ = hand_run
    figures = kept_figures(report_figures)
    report_figures.figure_vs_scale(_world(worlds, "default"), SMOOTHINGS["gaussian"], None)
    (figure,) = figures
    assert [ax.get_title() for ax in figure.axes] == [
        "SmAcc vs σ", "R̄ over correct inputs vs σ", "ACR over all inputs vs σ"]
    line = next(ln for ln in figure.axes[1].get_lines() if ln.get_label() == "std")
    cells = sorted((c for c in _world(worlds, "default") if c.kind == "certify"
                    and c.summary["noise"] == "gaussian"), key=lambda c: c.summary["scale"])
    assert list(line.get_ydata()) == [c.summary["models"]["std"]["radius_of_correct"]
                                      for c in cells]
