"""The run-wide findings figures (`cbcert.report.findings`): one per compared model, drawn from
a hand-made family."""

from __future__ import annotations

from cbcert.report import findings
from cbcert.report.family import Hypothesis, run_family
from cbcert.report.findings import figure_findings
from cbcert.robustness.pooled import PooledComparison
from cbcert.runs.config import AnalysisConfig


def _hypothesis(world, measure, budget, model_b, delta, p, kind="geometric", value_a=0.4):
    result = PooledComparison(value_a, value_a - delta, delta, delta - 0.02, delta + 0.02, p,
                              0.5, 0.02, "exact McNemar (inputs)", 500)
    return Hypothesis(world, "", measure, "cell", budget, kind, "std", model_b, result, None)


def _family():
    items = [
        _hypothesis("w1", "pfr", "eps=0.3", "cbm", 0.01, 0.2),
        _hypothesis("w1", "smoothed_accuracy", "rho=0.1", "cbm", 0.0, 1.0, "semantic"),
        _hypothesis("w1", "radius", "sigma=0.1", "cbm", 0.002, 0.3, value_a=0.05),
        _hypothesis("w1", "radius", "rho=0.1", "cbm", 0.0, None, "semantic", value_a=0.0),
        _hypothesis("w2", "robust_accuracy", "eps=0.03", "proto", 0.4, 1e-12),
    ]
    return run_family(items, AnalysisConfig())


def test_one_figure_per_compared_model_with_the_models_own_hypotheses(tmp_path, kept_figures):
    family = _family()
    path = figure_findings(family, "cbm", tmp_path / "findings_cbm.png")
    assert path is not None and path.stat().st_size > 0
    figures = kept_figures(findings)
    assert figure_findings(family, "cbm", tmp_path / "kept.png") is not None
    rates, radii = figures[0].axes  # two panels: rates in points, radii in % of std's R̄
    assert [t.get_text() for t in rates.get_yticklabels()] == ["w1 · PFR", "w1 · SmAcc"]
    assert [t.get_text() for t in radii.get_yticklabels()] == ["w1 · R̄"]  # ρ: no size
    assert "points" in rates.get_xlabel() and "std's R̄" in radii.get_xlabel()
    assert figure_findings(family, "proto", tmp_path / "p.png") is not None
    assert figure_findings(family, "cbmh", tmp_path / "none.png") is None
    assert figure_findings(None, "cbm", tmp_path / "none.png") is None


def test_a_radius_without_a_relative_size_is_left_out_of_the_figure(tmp_path):
    """std's R̄ = 0 has no relative size: a family of only such radii draws nothing."""
    items = [_hypothesis("w", "radius", "rho=0.1", "cbm", 0.0, None, "semantic", value_a=0.0)]
    assert figure_findings(run_family(items, AnalysisConfig()), "cbm", tmp_path / "f.png") is None
