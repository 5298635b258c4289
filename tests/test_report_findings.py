"""The findings table (`cbcert.report.findings`): intervals, verdicts and rows from the report's
own test tables. Pure functions on hand-made tables; the reduced paper run checks that the
cross-world report writes it (`tests/test_paper.py`, the paper map)."""

import math

import pytest
import scipy.stats

from cbcert.report.findings import (
    CLEAN_ATTACK,
    COLUMNS,
    findings_table,
    more_robust,
    t_interval,
)
from cbcert.report.tables import Table


@pytest.mark.parametrize("mean, sd, df", [(0.003, 0.0027, 4), (-1.5, 2.0, 1), (0.0, 0.0, 9)])
def test_t_interval_is_scipys_interval_of_the_mean(mean, sd, df):
    low, high = t_interval(mean, sd, df)
    expected = scipy.stats.t.interval(0.95, df, loc=mean, scale=sd / math.sqrt(df + 1)) \
        if sd > 0 else (mean, mean)
    assert low == pytest.approx(expected[0], rel=1e-12, abs=1e-15)
    assert high == pytest.approx(expected[1], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("mean, sd, df", [(None, 1.0, 4), (1.0, None, 4), (1.0, 1.0, None),
                                          (1.0, 1.0, 0), (1.0, math.inf, 4)])
def test_t_interval_is_empty_without_a_sample_variance(mean, sd, df):
    assert t_interval(mean, sd, df) == (None, None)


def test_more_robust_reads_the_sign_by_measure_and_needs_holm_below_the_level():
    # Radii: larger is more robust; Δ = R̄_std − R̄_cbm > 0 favours std.
    assert more_robust(0.2, 0.01, "std", "cbm", larger_is_robust=True) == "std"
    assert more_robust(-0.2, 0.01, "std", "cbm", larger_is_robust=True) == "cbm"
    # Flip rates: Δ = PFR_std − PFR_cbm > 0 means std flips more, cbm is more robust.
    assert more_robust(0.2, 0.01, "std", "cbm", larger_is_robust=False) == "cbm"
    assert more_robust(-0.2, 0.01, "std", "cbm", larger_is_robust=False) == "std"
    assert more_robust(0.2, 0.05, "std", "cbm", larger_is_robust=True) == "none shown"
    assert more_robust(0.0, 0.0, "std", "cbm", larger_is_robust=True) == "none shown"
    assert more_robust(0.2, None, "std", "cbm", larger_is_robust=True) == "untested"


def _tables():
    radius = Table("worlds_certification_radius_tests", "",
                   ("world", "family", "cell", "noise", "scale", "model_a", "model_b", "subsets",
                    "delta_mean", "delta_sd", "t", "df", "p", "p_holm"),
                   (("w", "f", "concept-flips2", "fixed", 2, "std", "cbm", 5, -0.5, 0.1, -11.2,
                     4, 0.0004, 0.0008),
                    ("w", "f", "latent-sigma0.1", "gaussian", 0.1, "std", "cbm", 5, 0.01, 0.02,
                     1.1, 4, 0.3, 0.6),
                    ("w", "f", "concept-rho0.05", "bernoulli", 0.05, "std", "cbm", 1, None,
                     None, None, None, None, None)))
    subsets = Table("worlds_certification_subsets", "",
                    ("world", "family", "cell", "model", "subsets", "smoothed_accuracy_mean",
                     "radius_of_correct_mean"),
                    (("w", "f", "latent-sigma0.1", "std", 5, 0.9, 0.08),
                     ("w", "f", "concept-flips2", "std", 5, 0.75, 1.25)))
    # Smoothed accuracy: only the fixed-flip cell's row is a finding (σ has radii; ACR is not).
    certification_tests = Table("worlds_certification_tests", "",
                                ("world", "family", "cell", "metric", "model_a", "model_b",
                                 "delta_mean", "delta_sd", "inputs", "p", "p_holm"),
                                (("w", "f", "latent-sigma0.1", "smoothed_accuracy", "std", "cbm",
                                  0.01, 0.01, 662, 0.5, 1.0),
                                 ("w", "f", "concept-flips2", "acr", "std", "cbm", 0.0, 0.0, 662,
                                  1.0, 1.0),
                                 ("w", "f", "concept-flips2", "smoothed_accuracy", "std", "cbm",
                                  -0.05, 0.02, 662, 0.003, 0.0165)))
    perturb_tests = Table("worlds_perturb_tests", "",
                          ("world", "family", "cell", "budget", "model_a", "model_b",
                           "delta_mean", "delta_sd", "df", "p", "p_holm"),
                          (("w", "f", "perturb", "tau1", "std", "proto", -0.3, 0.05, 4, 0.001,
                            0.002),
                           ("w", "f", "perturb", "eps0.3", "std", "cbm", 0.04, 0.01, 4, 0.001,
                            0.01)))
    perturb = Table("worlds_perturb", "",
                    ("world", "family", "cell", "budget", "kind", "value", "pfr_std_mean"),
                    (("w", "f", "perturb", "tau1", "tau", 1.0, 0.4),
                     ("w", "f", "perturb", "eps0.3", "eps", 0.3, 0.25)))
    attack_tests = Table("worlds_attack_tests", "",
                         ("world", "family", "cell", "eps", "model_a", "model_b", "inputs",
                          "robust_a", "robust_b", "delta_mean", "delta_sd", "a_only", "b_only",
                          "p", "p_holm", "clean_both", "robust_a_clean", "robust_b_clean",
                          "delta_clean_mean", "delta_clean_sd", "a_only_clean", "b_only_clean",
                          "p_clean", "p_holm_clean"),
                         (("w", "f", "attack-concept", 0.03, "std", "proto", 200, 0.94, 0.47,
                           0.47, 0.53, 97, 3, 2.6e-25, 1.1e-24, 100, 0.96, 0.90, 0.06, 0.31, 8,
                           2, 0.11, 0.11),))
    return [radius, subsets, certification_tests, perturb_tests, perturb, attack_tests]


def test_findings_rows_come_from_the_reports_tests_in_reading_order():
    table = findings_table(_tables())
    assert table.name == "worlds_findings" and table.columns == COLUMNS
    rows = [dict(zip(COLUMNS, r, strict=True)) for r in table.rows]
    assert [(r["measure"], r["budget"], r["type"]) for r in rows] == [
        ("certified radius R̄", "σ=0.1", "geometric"),
        ("certified radius R̄", "ρ=0.05", "semantic"),
        ("certified radius R̄", "m=2", "semantic"),
        ("smoothed accuracy SmAcc", "m=2", "semantic"),
        ("flip rate PFR", "ε=0.3", "geometric"),
        ("flip rate PFR", "τ=1", "semantic"),
        ("robust accuracy RobAcc", "ε=0.03 attack-concept", "semantic"),
        (CLEAN_ATTACK, "ε=0.03 attack-concept", "semantic")]
    sigma, rho, flips, accuracy, eps, tau, attack, clean = rows
    assert sigma["value_a"] == 0.08 and sigma["relative"] == pytest.approx(0.01 / 0.08)
    assert (sigma["ci_low"], sigma["ci_high"]) == pytest.approx(t_interval(0.01, 0.02, 4))
    assert sigma["ci_low"] < 0 < sigma["ci_high"] and sigma["more_robust"] == "none shown"
    assert rho["delta"] is None and rho["ci_low"] is None and rho["more_robust"] == "untested"
    assert flips["more_robust"] == "cbm" and flips["subsets"] == 5  # Δ < 0: cbm's radius larger
    # Under m flips: Δ = SmAcc_std − SmAcc_cbm < 0, cbm keeps more accuracy; t over 5 subsets.
    assert accuracy["more_robust"] == "cbm" and accuracy["value_a"] == 0.75
    assert (accuracy["ci_low"], accuracy["ci_high"]) == pytest.approx(t_interval(-0.05, 0.02, 4))
    assert accuracy["subsets"] == 5 and accuracy["test"] == "permutation (inputs)"
    assert eps["more_robust"] == "cbm" and eps["value_a"] == 0.25  # std flips more
    assert tau["more_robust"] == "std" and tau["model_b"] == "proto"  # proto flips more
    # Robust accuracy: Δ > 0, std robust on more inputs; the interval is over the 200 inputs.
    assert attack["more_robust"] == "std" and attack["value_a"] == 0.94
    assert (attack["ci_low"], attack["ci_high"]) == pytest.approx(t_interval(0.47, 0.53, 199))
    assert attack["relative"] == pytest.approx(0.47 / 0.94) and attack["subsets"] == 200
    # On the 100 inputs both classify correctly unattacked the attack alone decides: no
    # difference shown (Holm over the cell's conditional tests), interval over those inputs.
    assert clean["value_a"] == 0.96 and clean["delta"] == 0.06 and clean["subsets"] == 100
    assert (clean["ci_low"], clean["ci_high"]) == pytest.approx(t_interval(0.06, 0.31, 99))
    assert clean["p_holm"] == 0.11 and clean["more_robust"] == "none shown"


def test_no_findings_without_any_test():
    assert findings_table([Table("worlds_gap", "", ("world",), (("w",),))]) is None


def test_findings_figure_has_a_panel_per_unit_and_fills_what_holm_shows(tmp_path, kept_figures):
    from cbcert.report import findings as findings_module

    figures = kept_figures(findings_module)
    assert findings_module.figure_findings(findings_table(_tables()), tmp_path / "f.png")
    (figure,) = figures
    axes = figure.axes
    assert [ax.get_title() for ax in axes] == ["L2 radius: certified radius R̄",
                                               "Hamming radius: certified radius R̄",
                                               "accuracy under m flips: smoothed accuracy SmAcc",
                                               "flip rate: flip rate PFR",
                                               "attack: robust accuracy RobAcc",
                                               f"attack: {CLEAN_ATTACK}"]
    ticks = [[t.get_text() for t in ax.get_yticklabels()] for ax in axes]
    # ρ = 0.05 has no Δ (one usable subset): left out of the figure, kept in the table.
    assert ticks == [["w  σ=0.1"], ["w  m=2"], ["w  m=2"], ["w  ε=0.3", "w  τ=1"],
                     ["w  ε=0.03 attack-concept"], ["w  ε=0.03 attack-concept"]]
    # Tick colour: the row's perturbation type (geometric blue, semantic orange).
    assert [[t.get_color() for t in ax.get_yticklabels()] for ax in axes] == [
        ["tab:blue"], ["tab:orange"], ["tab:orange"], ["tab:blue", "tab:orange"], ["tab:orange"],
        ["tab:orange"]]

    def markers(ax):  # (x, filled) of each model's point; interval lines have no marker
        return [(round(line.get_xdata()[0], 6), line.get_markerfacecolor() != "white")
                for line in ax.get_lines() if line.get_marker() not in ("None", None, "")]

    # Radii relative to std's radius (%); accuracies and flip rates in percentage points.
    assert markers(axes[0]) == [(round(100 * 0.01 / 0.08, 6), False)]
    assert markers(axes[1]) == [(round(100 * -0.5 / 1.25, 6), True)]
    assert markers(axes[2]) == [(-5.0, True)]
    assert sorted(markers(axes[3])) == [(-30.0, True), (4.0, True)]
    assert markers(axes[4]) == [(47.0, True)]
    assert markers(axes[5]) == [(6.0, False)]
    assert [ax.get_xlabel() for ax in axes] == [
        "Δ / std's value (%); > 0 favours std", "Δ / std's value (%); > 0 favours std",
        "Δ (percentage points); > 0 favours std",
        "Δ (percentage points); > 0 favours the other model",
        "Δ (percentage points); > 0 favours std", "Δ (percentage points); > 0 favours std"]

    def intervals(ax):  # the interval lines: two points, no marker
        return [x for line in ax.get_lines()
                if line.get_marker() in ("None", None, "") and len(line.get_xdata()) == 2
                and line.get_xdata()[0] != line.get_xdata()[1] for x in line.get_xdata()]

    assert intervals(axes[0]) == pytest.approx(
        [100 * v / 0.08 for v in t_interval(0.01, 0.02, 4)])
    assert intervals(axes[2]) == pytest.approx([100 * v for v in t_interval(-0.05, 0.02, 4)])


def test_no_findings_figure_without_a_relative_size(tmp_path):
    from cbcert.report.findings import figure_findings

    assert figure_findings(None, tmp_path / "f.png") is None
    table = findings_table(_tables()[:1])  # radius tests without the subsets: no std value
    assert table is not None and figure_findings(table, tmp_path / "f.png") is None


def test_flip_rates_are_drawn_in_points_even_where_std_never_flips(tmp_path, kept_figures):
    """A flip rate of 0 for std has no relative size but a Δ in points: drawn, not dropped."""
    from cbcert.report import findings as findings_module

    tables = _tables()
    perturb = tables[4]
    tables[4] = Table(perturb.name, "", perturb.columns,
                      tuple((*r[:-1], 0.0) for r in perturb.rows))
    figures = kept_figures(findings_module)
    assert findings_module.figure_findings(findings_table(tables), tmp_path / "f.png")
    (figure,) = figures
    (flip,) = [ax for ax in figure.axes if ax.get_title().startswith("flip rate")]
    assert [t.get_text() for t in flip.get_yticklabels()] == ["w  ε=0.3", "w  τ=1"]
