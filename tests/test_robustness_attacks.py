"""Paired tests of robust accuracy (`cbcert.robustness.attacks`): against the exact McNemar
test and Holm of `cbcert.robustness.stats`, computed here on hand-made outcomes."""

import numpy as np
import pytest

from cbcert.robustness import stats
from cbcert.robustness.attacks import FIELDS, paired_attack_tests

T, F = True, False


def _budgets():
    # 6 inputs. proto misclassifies inputs 0-2 unattacked; cbm is always clean.
    clean = {"std": [T] * 6, "cbm": [T] * 6, "proto": [F, F, F, T, T, T]}
    small = {"std": [T, T, T, F, T, T], "cbm": [T, T, F, T, T, T], "proto": [F, F, F, T, F, F]}
    large = {"std": [T, F, T, F, F, T], "cbm": [F, F, F, F, F, T], "proto": [F] * 6}
    return [(0.01, small, clean), (0.03, large, clean)]


def test_each_pair_and_budget_is_mcnemar_over_all_inputs_and_over_the_clean_ones():
    rows = paired_attack_tests(_budgets(), ["std", "cbm", "proto"])
    assert [(r["eps"], r["model_b"]) for r in rows] == [(0.01, "cbm"), (0.01, "proto"),
                                                       (0.03, "cbm"), (0.03, "proto")]
    assert all(tuple(r) == FIELDS for r in rows)
    for (eps, robust, clean), pair in zip(_budgets(), (rows[:2], rows[2:]), strict=True):
        for r in pair:
            assert r["eps"] == eps
            a, b = np.array(robust["std"]), np.array(robust[r["model_b"]])
            test = stats.mcnemar_test(a, b)
            assert (r["inputs"], r["robust_a"], r["robust_b"]) == (6, a.mean(), b.mean())
            assert (r["delta_mean"], r["a_only"], r["b_only"], r["p"]) == (
                test.mean, test.a_only, test.b_only, test.pvalue)
            both = np.array(clean["std"]) & np.array(clean[r["model_b"]])
            given = stats.mcnemar_test(a[both], b[both])
            assert r["clean_both"] == both.sum() == (6 if r["model_b"] == "cbm" else 3)
            assert (r["robust_a_clean"], r["delta_clean_mean"], r["p_clean"]) == (
                a[both].mean(), given.mean, given.pvalue)
    # Holm over the cell's four tests, each family on its own.
    assert [r["p_holm"] for r in rows] == pytest.approx(list(stats.holm([r["p"] for r in rows])))
    assert [r["p_holm_clean"] for r in rows] == pytest.approx(
        list(stats.holm([r["p_clean"] for r in rows])))


def test_a_pair_with_no_clean_input_in_common_has_no_clean_test_and_leaves_holm_alone():
    budgets = [(0.03, {"std": [T, T], "cbm": [T, F], "proto": [F, F]},
                {"std": [T, T], "cbm": [T, T], "proto": [F, F]})]
    rows = paired_attack_tests(budgets, ["std", "cbm", "proto"])
    cbm, proto = rows
    assert proto["clean_both"] == 0 and proto["p"] is not None
    assert all(proto[k] is None for k in FIELDS[FIELDS.index("robust_a_clean"):])
    # The clean family holds one test (cbm's): its Holm p is its own p.
    assert cbm["clean_both"] == 2 and cbm["p_holm_clean"] == cbm["p_clean"]
    assert [r["p_holm"] for r in rows] == pytest.approx(list(stats.holm([r["p"] for r in rows])))
