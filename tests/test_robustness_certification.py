"""Certification over random subsets (`cbcert.robustness.certification`): reductions by hand,
the paired tests and their Holm correction, and the record-level entry point."""

import numpy as np
import pytest

from cbcert.robustness import certification, protocol, stats


def _data():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, 40)
    good = np.where(rng.uniform(size=40) < 0.8, labels, -1)  # mostly right, some abstain
    poor = np.where(rng.uniform(size=40) < 0.4, labels, (labels + 1) % 3)
    radii = {"good": np.where(good >= 0, rng.uniform(0, 1, 40), np.nan),
             "poor": rng.uniform(0, 1, 40)}
    return labels, {"good": good, "poor": poor}, radii


def test_subset_means_and_tests_match_a_manual_reduction():
    labels, predictions, radii = _data()
    subsets = protocol.draw_subsets(40, num_subsets=4, subset_size=15, seed=1)
    out = certification.subset_summary(labels, predictions, radii, subsets, [("good", "poor")])
    assert (out["num_subsets"], out["subset_size"]) == (4, 15)
    correct = predictions["good"] == labels
    acr_input = np.where(correct, np.nan_to_num(radii["good"]), 0.0)
    smacc = [correct[s].mean() for s in subsets]
    acr = [acr_input[s].mean() for s in subsets]
    rbar = [acr_input[s][correct[s]].mean() for s in subsets]
    good = out["models"]["good"]
    assert good["smoothed_accuracy"]["mean"] == pytest.approx(np.mean(smacc), abs=1e-12)
    assert good["acr"]["sd"] == pytest.approx(np.std(acr, ddof=1), abs=1e-12)
    assert good["radius_of_correct"]["mean"] == pytest.approx(np.mean(rbar), abs=1e-12)
    tests = {t["metric"]: t for t in out["comparisons"]}
    assert set(tests) == {"smoothed_accuracy", "acr"}
    inputs = np.unique(subsets)
    poor_correct = (predictions["poor"] == labels).astype(float)
    expected = stats.paired_permutation_test(correct[inputs].astype(float),
                                             poor_correct[inputs])
    assert tests["smoothed_accuracy"]["p"] == expected.pvalue
    assert tests["smoothed_accuracy"]["inputs"] == len(inputs)
    holm = stats.holm(np.array([tests["smoothed_accuracy"]["p"], tests["acr"]["p"]]))
    assert [tests["smoothed_accuracy"]["p_holm"], tests["acr"]["p_holm"]] == holm.tolist()
    # 0.8 vs 0.4 accuracy over ~30 inputs: far beyond chance (sign-flip p ~ 1e-4 here).
    assert tests["smoothed_accuracy"]["p_holm"] < 0.01


def test_records_entry_point_orders_by_index_and_names_the_inputs():
    labels, predictions, radii = _data()
    records = [{"index": 100 + i, "model": m, "label": int(labels[i]),
                "prediction": int(predictions[m][i]),
                "radius": None if np.isnan(radii[m][i]) else float(radii[m][i])}
               for m in ("poor", "good") for i in reversed(range(40))]
    out = certification.records_subset_summary(records, ("good", "poor"), num_subsets=3,
                                               subset_size=10, seed=(0, 5))
    subsets = protocol.draw_subsets(40, num_subsets=3, subset_size=10, seed=(0, 5))
    assert out["indices"] == (100 + subsets).tolist()
    direct = certification.subset_summary(labels, predictions, radii, subsets,
                                          [("good", "poor")])
    assert out["models"] == direct["models"] and out["comparisons"] == direct["comparisons"]


def test_a_subset_without_correct_inputs_is_skipped_for_the_radius():
    labels = np.zeros(6, np.int64)
    predictions = {"a": np.array([0, 0, 0, 1, 1, 1]), "b": np.ones(6, np.int64)}
    radii = {"a": np.ones(6), "b": np.ones(6)}
    subsets = np.array([[0, 1], [3, 4], [1, 2]])
    out = certification.subset_summary(labels, predictions, radii, subsets, [("a", "b")])
    assert out["models"]["a"]["radius_of_correct"] == {"mean": 1.0, "sd": 0.0}
    assert out["models"]["b"]["radius_of_correct"] == {"mean": None, "sd": None}


def test_radius_tests_match_a_hand_computation():
    """ΔR̄ per subset, paired t-test over the usable subsets, Holm across the cells of a pair.
    Cell a: d = (0.5, 1, 0.5): mean 2/3, sd √(1/12), t = 4, df = 2, p = 1 − 4/√18. Cell b:
    subset 1 has no correct std input, d = (0, 0.5): t = 1, df = 1, p = 1/2. Holm over the
    two: (2·0.0572, max(0.1144, 0.5)). Cell c: one usable subset, no test, outside Holm."""
    nan = float("nan")
    cells = [("a", {"std": np.array([1.0, 2.0, 3.0]), "cbm": np.array([0.5, 1.0, 2.5])}),
             ("b", {"std": np.array([1.0, nan, 2.0]), "cbm": np.array([1.0, 1.0, 1.5])}),
             ("c", {"std": np.array([nan, nan, 2.0]), "cbm": np.array([1.0, 1.0, 1.5])})]
    rows = certification.radius_tests(cells, [("std", "cbm")])
    assert [(r["cell"], r["subsets"], r["df"]) for r in rows] == [("a", 3, 2), ("b", 2, 1),
                                                                  ("c", 1, None)]
    p_a = 1 - 4 / np.sqrt(18)
    np.testing.assert_allclose([rows[0]["delta"]["mean"], rows[0]["delta"]["sd"], rows[0]["t"],
                                rows[0]["p"], rows[0]["p_holm"]],
                               [2 / 3, np.sqrt(1 / 12), 4.0, p_a, 2 * p_a], rtol=1e-12)
    np.testing.assert_allclose([rows[1]["t"], rows[1]["p"], rows[1]["p_holm"]],
                               [1.0, 0.5, 0.5], rtol=1e-12)
    assert rows[2]["p"] is None and rows[2]["p_holm"] is None and rows[2]["t"] is None


def test_radius_of_correct_by_subset_reads_correct_inputs_only():
    records = [{"index": i, "model": "std", "label": 0, "prediction": p, "radius": r}
               for i, p, r in ((0, 0, 1.0), (1, 0, 3.0), (2, 1, 5.0), (3, -1, None))]
    got = certification.radius_of_correct_by_subset(records, "std", [[0, 1], [2, 3], [1, 2]])
    np.testing.assert_array_equal(got, [2.0, np.nan, 3.0])  # wrong and abstained: left out
    with pytest.raises(ValueError, match="model 'std': no record of input 7"):
        certification.radius_of_correct_by_subset(records, "std", [[7]])
