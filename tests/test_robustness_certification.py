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
