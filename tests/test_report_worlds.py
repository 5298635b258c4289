"""Cross-world report of a multi-world sweep (`cbcert.report.worlds`): stacked tables, the gap
table per world, figures, per-world reports and the links between them."""

import csv
import io
import json
import math
import re

import pytest
from conftest import LATE_WORLD

from cbcert.report import worlds as report_worlds
from cbcert.report.cells import find_cells
from cbcert.report.figures import robustness_gaps
from cbcert.report.write import REPORT_DIR
from cbcert.runs import sweep

WORLDS = ("default", "k8", "saturated")
FAMILIES = {"default": "class similarity", "k8": "vocabulary", "saturated": "saturated"}


@pytest.fixture(scope="module")
def run_dir(paper_run):
    """The reduced paper run (default, k8, saturated), reported with a fourth world the sweep
    has not reached yet (``late``, e.g. another shard's: listed in the manifest, no directory)."""
    return paper_run


@pytest.fixture(scope="module")
def notes(paper_report_output):
    """The report's notes, as ``certify report`` printed them."""
    return paper_report_output.splitlines()


def _budget(label):
    for suffix in (" (perturb)", " (certify)"):
        label = label.removesuffix(suffix)
    return label.replace(" (", " ").removesuffix(")")


def _csv(path):
    return list(csv.DictReader(io.StringIO(path.read_text())))


def test_every_world_gets_its_own_report_and_is_linked(run_dir, notes):
    assert any(f"world {LATE_WORLD} has no finished cell" in n for n in notes)
    markdown = (run_dir / REPORT_DIR / "report.md").read_text()
    for name in WORLDS:
        assert (run_dir / name / REPORT_DIR / "report.md").is_file()
        assert f"[{name}](../{name}/{REPORT_DIR}/report.md)" in markdown
    assert f"[{LATE_WORLD}]" not in markdown


def test_stacked_tables_hold_each_worlds_rows_under_its_name(run_dir, notes):
    for table in ("certification_latent", "certification_concept", "perturb", "attack",
                  "provenance"):
        rows = _csv(run_dir / REPORT_DIR / f"worlds_{table}.csv")
        for name in WORLDS:
            own = _csv(run_dir / name / REPORT_DIR / f"{table}.csv")
            mine = [{k: v for k, v in r.items() if k not in ("world", "family")}
                    for r in rows if r["world"] == name]
            assert mine == own, table
        assert all(r["family"] == FAMILIES[r["world"]] for r in rows)
    assert {r["world"] for r in _csv(run_dir / REPORT_DIR / "worlds_perturb_tests.csv")} == \
        set(WORLDS)
    similarity = _csv(run_dir / REPORT_DIR / "worlds_class_similarity.csv")
    assert [r["world"] for r in similarity] == list(WORLDS)
    assert [int(r["classes"]) for r in similarity] == [10, 10, 10]
    assert all(float(r["min_distance"]) <= float(r["mean_distance"]) for r in similarity)


def test_gap_table_row_of_a_world_is_its_own_gaps(run_dir, notes):
    table = _csv(run_dir / REPORT_DIR / "worlds_gap.csv")
    assert [r["world"] for r in table] == list(WORLDS)
    for row in table:
        labels, columns, values = robustness_gaps(find_cells(run_dir / row["world"], print))
        # Labels as README documents them: "ΔPFR ε=0.1", "ΔRobAcc ε=0.03 attack-latent".
        own = {f"{c.split(' ')[0]} {_budget(r)}": v
               for r, vs in zip(labels, values, strict=True)
               for c, v in zip(columns, vs, strict=True) if not math.isnan(v)}
        assert {k: float(v) for k, v in row.items()
                if k not in ("world", "family") and v != ""} == own
    assert "ΔPFR ε=0.8" in table[0] and "ΔACR σ=0.1" in table[0] and "ΔPFR τ=10" in table[0]
    assert table[1]["ΔPFR τ=10"] == ""  # k8 has no τ = 10 (K = 8): NaN, an empty cell


def test_cross_world_figures_are_written_or_noted(run_dir, notes):
    for name in ("robustness_gap_worlds", "pfr_worlds_eps", "pfr_worlds_tau", "pfr_worlds_sigma",
                 "pfr_worlds_rho", "radius_worlds", "delta_pfr_worlds", "class_distances_worlds",
                 "attacks_worlds", "pfr_models_worlds", "dfs_cfr_worlds"):
        assert (run_dir / REPORT_DIR / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    # Only the method's outputs of settings this run lacks (class structure, K = 27 vs 36) may
    # be skipped (tests/test_report_method.py); every cbcert figure is drawn.
    from cbcert.report.method_outputs import OUTPUTS

    skipped = [n for n in notes if "skipped" in n]
    assert all(any(name in n for name in OUTPUTS.values()) for n in skipped), skipped
    assert (run_dir / "default" / REPORT_DIR / "class_distances.png").is_file()


def test_gap_columns_mark_missing_budgets_nan():
    def perturb(eps, delta):
        budget = {"kind": "eps", "value": eps, "pfr": {"std": {"mean": delta}, "cbm": {
            "mean": 0.0}}}
        summary = {"settings": {"models": ["std", "cbm"]}, "budgets": [budget]}
        return report_worlds.CellResult("perturb", "perturb", {}, summary)

    columns, values = report_worlds.gap_columns([("a", "", (perturb(0.1, 0.25),)),
                                                 ("b", "", (perturb(0.3, -0.5),))])
    assert columns == ["ΔPFR ε=0.1", "ΔPFR ε=0.3"]
    assert values[0, 0] == 0.25 and values[1, 1] == -0.5
    assert math.isnan(values[0, 1]) and math.isnan(values[1, 0])


def test_cli_report_of_a_multi_world_sweep(run_dir, notes):
    """The CLI notes the unreached world, says how many files it wrote, and the manifest still names
    the late world (the report reads the manifest, never rewrites it)."""
    assert any(f"world {LATE_WORLD} has no finished cell" in n for n in notes)
    assert re.search(r"wrote \d+ files to", " ".join(" ".join(notes).split()))
    assert json.loads((run_dir / sweep.MANIFEST).read_text())["worlds"][-1]["name"] == LATE_WORLD


def test_class_distance_figure_keeps_its_whole_title(tmp_path):
    """`figure_class_distances_worlds` with one world: its panel is narrower than the title,
    which a plain savefig cut off at both ends (results/paper, 2026-12-06). The image is
    cropped to what is drawn, so it is at least as wide as the title rendered at its 120 dpi."""
    import matplotlib.image

    from cbcert.report.cells import CellResult
    from cbcert.report.plotting import pyplot

    summary = {"distances": [[0.0, 2.0], [2.0, None]], "class_names": ["a", "b"],
               "mean_off_diagonal": 2.0}
    path = report_worlds.figure_class_distances_worlds(
        [("saturated", "f", (CellResult("classes", "classes", {}, summary),))],
        tmp_path / "c.png")
    width = matplotlib.image.imread(path).shape[1]
    plt = pyplot()
    probe = plt.figure(dpi=120)
    title = probe.suptitle(report_worlds.CLASS_DISTANCE_TITLE)
    probe.canvas.draw()
    needed = title.get_window_extent().width
    plt.close(probe)
    assert width >= needed > 500, (width, needed)


def test_a_model_keeps_its_colour_across_figures(kept_figures):
    """proto was red in `radius_worlds.png` (fourth of std, cbm, cbmh, proto) and green in
    `attacks_worlds.png` (third of std, cbm, proto): colours followed each figure's model
    order (results/paper, 2026-12-06). Now each model's bars are its `model_colour` in both."""
    from matplotlib.colors import to_rgba

    from cbcert.report.cells import CellResult
    from cbcert.report.plotting import model_colour

    certify = CellResult("latent-sigma0.1", "certify", {}, {
        "mode": "certify", "noise": "gaussian", "scale": 0.1,
        "models": {m: {"acr": 0.1, "radius_of_correct": 0.2}
                   for m in ("std", "cbm", "cbmh", "proto")}})
    attack = CellResult("attack-latent", "attack", {}, {"models": {
        m: {"clean_accuracy": 0.9, "budgets": [{"eps": 0.03, "robust_accuracy": 0.5}]}
        for m in ("std", "cbm", "proto")}})
    figures = kept_figures(report_worlds)
    report_worlds.figure_radius_worlds([("a", "f", (certify,))], None)
    report_worlds.figure_attacks_worlds([("a", "f", (attack,))], None)
    radius, attacks = figures

    def solid_colours(figure):
        """Each legend entry's model → the face colour of its bars."""
        ax = figure.axes[0]
        return {c.get_label(): c.patches[0].get_facecolor() for c in ax.containers
                if c.get_label() and not c.get_label().startswith("_")}

    in_radius, in_attacks = solid_colours(radius), solid_colours(attacks)
    assert set(in_radius) == {"std", "cbm", "cbmh", "proto"}
    assert set(in_attacks) == {"std", "cbm", "proto"}
    for model, colour in in_attacks.items():
        assert colour == in_radius[model] == to_rgba(model_colour(model)), model
    assert len(set(in_radius.values())) == 4  # four models, four colours
