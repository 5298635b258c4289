"""The comparison with the method's claims (`cbcert.report.claims`): the rule on hand-made
claims and hypotheses, the shipped claims file, the headline aggregation."""

from __future__ import annotations

import math

import pytest

from cbcert.report import claims as claims_module
from cbcert.report.claims import agreement, comparison_table, headline, load_claims
from cbcert.report.family import Hypothesis, run_family
from cbcert.report.method_settings import SETTINGS, UNMAPPED
from cbcert.robustness.pooled import PooledComparison
from cbcert.runs.config import AnalysisConfig

LEVEL = 0.05


@pytest.mark.parametrize("direction,verdict,delta,p,tost_p,expected", [
    ("std", "std more robust", 0.03, 1e-6, 0.9, "agrees"),
    ("other", "other more robust", -0.03, 1e-6, 0.9, "agrees"),
    ("none", "equivalent", 0.001, 0.8, 1e-5, "agrees"),
    ("std", "other more robust", -0.03, 1e-6, 0.9, "no"),
    ("std", "equivalent", 0.001, 0.8, 1e-5, "no"),  # the method's gap unknown
    ("none", "std more robust", 0.03, 1e-6, 0.9, "no"),
    ("none", "std more robust", 0.03, 1e-6, 0.9, "no"),
    ("std", "inconclusive", 0.02, 0.01, 0.5, "partly"),
    ("other", "inconclusive", -0.02, 0.01, 0.5, "partly"),
    ("none", "inconclusive", 0.0, 0.9, 0.01, "partly"),
    ("std", "inconclusive", -0.02, 0.01, 0.5, "inconclusive"),  # raw p, wrong way
    ("std", "inconclusive", 0.02, 0.2, 0.5, "inconclusive"),
    ("none", "inconclusive", 0.0, 0.9, 0.2, "inconclusive"),
    ("std", "untested", 0.0, None, None, "inconclusive"),
])
def test_the_agreement_rule(direction, verdict, delta, p, tost_p, expected):
    assert agreement(direction, verdict, delta, p, tost_p, LEVEL) == expected


@pytest.mark.parametrize("method_gap,expected", [(0.005, "partly"), (0.03, "no"),
                                                 (None, "no")])
def test_equivalence_against_a_claimed_gap_depends_on_the_gaps_size(method_gap, expected):
    """Where the run shows the two models within ±0.02, a claimed gap smaller than that margin
    is consistent with it (partly: the run cannot confirm its direction), a larger one is
    not."""
    assert agreement("std", "equivalent", 0.001, 0.8, 1e-5, LEVEL, method_gap=method_gap,
                     margin=0.02) == expected


@pytest.mark.parametrize("parts,expected", [
    (["agrees", "agrees", "absent"], "agrees"),
    (["agrees", "no"], "no"),
    (["agrees", "inconclusive"], "partly"),
    (["partly", "inconclusive"], "partly"),
    (["inconclusive", "absent"], "inconclusive"),
    (["absent"], "absent"),
    ([], "absent"),
])
def test_a_headline_claim_aggregates_its_budgets(parts, expected):
    assert headline(parts) == expected


def _hypothesis(world, measure, cell, budget, model_b, delta, p, tost_p, value_a=0.5):
    larger = measure != "pfr"
    raw = delta if larger else -delta  # value_a − value_b
    result = PooledComparison(value_a, value_a - raw, raw, raw - 0.01, raw + 0.01, p, tost_p,
                              0.02, "exact McNemar (inputs)", 1000)
    return Hypothesis(world, "", measure, cell, budget, "geometric", "std", model_b, result,
                      None)


CLAIMS = """
claims:
  - {id: a, where: {table: "1", section: "4.1"}, setting: CUB, measure: pfr, noise: null,
     budget: "eps=0.3", models: [std, cbm], values: {std: 74.6, cbm: 80.0}, unit: percent,
     direction: std, statement: "std flips less"}
  - {id: b, where: {table: "3"}, setting: CUB, measure: smoothed_accuracy, noise: gaussian,
     budget: "sigma=0.10", models: [std, cbm], values: {std: 0.8, cbm: 0.8}, unit: fraction,
     direction: none, statement: "same accuracy"}
  - {id: c, where: {figure: "5"}, setting: CUB, measure: robust_accuracy,
     noise: attack-latent-smoothed, budget: "eps=0.03", models: [std, proto], values: null,
     unit: percent, direction: other, statement: "proto resists the smoothed attack"}
  - {id: d, where: {table: "10"}, setting: CUB, backbone: DenseNet-161, measure: pfr,
     budget: "eps=0.3", models: [std, cbm], values: null, unit: percent, direction: std,
     statement: "DenseNet"}
  - {id: e, where: {table: "6"}, setting: "RIVAL-10 +5 similar", measure: pfr,
     budget: "eps=0.8", models: [std, cbm], values: null, unit: percent, direction: std,
     statement: "absent world"}
summary:
  - {id: h, where: {section: "1"}, statement: "CBMs are fragile", claims: [a, b, e]}
"""


def test_claims_are_matched_to_the_runs_hypotheses_and_judged():
    world = SETTINGS["CUB"]
    items = [
        _hypothesis(world, "pfr", "perturb", "eps=0.3", "cbm", 0.05, 1e-9, 0.9),
        _hypothesis(world, "smoothed_accuracy", "latent-sigma0.1", "sigma=0.1", "cbm", 0.001,
                    0.9, 1e-9),
        _hypothesis(world, "robust_accuracy", "attack-latent", "eps=0.03", "proto", -0.2,
                    1e-9, 0.9),  # the vanilla attack: not the claim's cell
        _hypothesis(world, "robust_accuracy", "attack-latent-smoothed-sigma0.1", "eps=0.03",
                    "proto", 0.2, 1e-9, 0.9),
    ]
    family = run_family(items, AnalysisConfig())
    claims, summary = load_claims(CLAIMS)
    table = comparison_table(claims, family)
    rows = {r[0]: dict(zip(table.columns, r, strict=True)) for r in table.rows}
    assert rows["a"]["agreement"] == "agrees"
    assert rows["a"]["method_delta"] == pytest.approx((80.0 - 74.6) / 100)  # PFR: b − std
    assert rows["a"]["run_delta"] == pytest.approx(0.05)
    assert rows["b"]["agreement"] == "agrees"  # "sigma=0.10" is the run's σ = 0.1
    assert rows["c"]["agreement"] == "no" and rows["c"]["run_verdict"] == "std more robust"
    assert rows["d"]["agreement"] == "absent" and "DenseNet-161" in rows["d"]["why_absent"]
    assert rows["e"]["agreement"] == "absent" and "not in this run" in rows["e"]["why_absent"]
    assert "5 claims: 2 agrees, 0 partly, 1 no, 0 inconclusive, 2 absent" in table.title
    heads = claims_module.headline_table(summary, table, claims)
    assert heads.rows[0][-1] == "agrees" and heads.rows[0][3] == 3


@pytest.mark.parametrize("bad,match", [
    ("claims: [{id: x, where: {}, setting: CUB, measure: speed, budget: 'eps=1', "
     "models: [std, cbm], direction: std, statement: s}]", "measure"),
    ("claims: [{id: x, where: {}, setting: CUB, measure: pfr, budget: 'eps=1', "
     "models: [std], direction: std, statement: s}]", "models"),
    ("claims: [{id: x, where: {}, setting: CUB, measure: pfr, budget: 'eps=1', "
     "models: [std, cbm], direction: maybe, statement: s}]", "direction"),
    ("claims: [{id: x, where: {}, setting: CUB, measure: pfr, budget: 'eps=1', "
     "models: [std, cbm], direction: std, statement: s}, {id: x, where: {}, setting: CUB, "
     "measure: pfr, budget: 'eps=1', models: [std, cbm], direction: std, statement: s}]",
     "repeated"),
    ("claims: []\nsummary: [{id: h, statement: s, claims: [nope]}]", "unknown claim"),
])
def test_malformed_claims_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        load_claims(bad)


def test_the_shipped_claims_are_well_formed_and_tied_to_the_method():
    claims, summary = load_claims()
    assert len(claims) >= 24 and summary
    for c in claims:
        assert c.setting in SETTINGS or c.setting in UNMAPPED, c.id
        numbers = [c.where[k] for k in ("table", "figure") if k in c.where]
        assert numbers or c.where.get("section"), c.id  # a claim in words names its section
        for number in numbers:
            digits = str(number).rstrip("abcdef")
            assert digits.isdigit() and 1 <= int(digits) <= 16, c.id
        delta = c.method_delta()
        assert delta is None or math.isfinite(delta)
        if delta is not None and c.direction != "none" and delta != 0:
            # The direction is read from the printed numbers unless a note says otherwise.
            assert (delta > 0) == (c.direction == "std") or c.note, c.id
