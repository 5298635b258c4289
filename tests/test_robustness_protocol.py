"""Tests of cbcert.robustness.protocol: subsets and table rows."""

import json

import numpy as np
import pytest
import scipy.stats
from statsmodels.stats.multitest import multipletests

from cbcert.robustness import protocol, stats


def test_subsets_reproducible_distinct_and_without_repeats():
    first = protocol.draw_subsets(250, num_subsets=5, subset_size=200, seed=(7, 3))
    again = protocol.draw_subsets(250, num_subsets=5, subset_size=200, seed=(7, 3))
    other = protocol.draw_subsets(250, num_subsets=5, subset_size=200, seed=(8, 3))
    assert first.shape == (5, 200) and first.dtype == np.int64
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    for subset in first:
        assert len(np.unique(subset)) == 200
        assert subset.min() >= 0 and subset.max() < 250
    # Subsets are independent draws, not a partition: with n/M = 0.8 they overlap.
    assert len(np.intersect1d(first[0], first[1])) > 0
    # Different subsets of one draw differ (P[two equal 200-subsets of 250] is ~1e-53).
    assert not np.array_equal(first[0], first[1])


def test_subsets_error_when_agreement_set_too_small():
    message = "agreement set has 150 inputs, fewer than subset_size=200"
    with pytest.raises(ValueError, match=message):
        protocol.draw_subsets(150, num_subsets=5, subset_size=200, seed=0)
    with pytest.raises(ValueError, match="seed: expected a non-negative int"):
        protocol.draw_subsets(300, num_subsets=5, subset_size=200, seed=-1)
    with pytest.raises(ValueError, match="num_subsets: must be >= 2"):
        protocol.draw_subsets(150, num_subsets=1, subset_size=20, seed=0)


def _measurement(rng, kind, value, num_agree, p_std, p_cbm, num_concepts=6, samples=2):
    return protocol.BudgetMeasurement(
        kind=kind,
        value=value,
        prediction_flips={
            "std": rng.uniform(size=(num_agree, samples)) < p_std,
            "cbm": rng.uniform(size=(num_agree, samples)) < p_cbm,
        },
        concept_flips=rng.integers(0, num_concepts + 1, size=(num_agree, samples)),
        num_concepts=num_concepts,
        decision_shifts={"cbm": rng.exponential(size=(num_agree, samples))},
    )


def test_build_table_matches_manual_reduction():
    rng = np.random.default_rng(5)
    num_agree = 120
    subsets = protocol.draw_subsets(num_agree, num_subsets=5, subset_size=40, seed=2)
    measurements = [
        _measurement(rng, "eps", 0.1, num_agree, 0.2, 0.2),
        _measurement(rng, "eps", 0.5, num_agree, 0.8, 0.05),
        _measurement(rng, "tau", 2, num_agree, 0.3, 0.25),
    ]
    rows = protocol.build_table(measurements, subsets)
    assert [(r.kind, r.value) for r in rows] == [("eps", 0.1), ("eps", 0.5), ("tau", 2.0)]

    pvalues = []
    for m, row in zip(measurements, rows, strict=True):
        per_input = {k: v.mean(axis=1) for k, v in m.prediction_flips.items()}  # [M]
        std_sub = per_input["std"][subsets].mean(axis=1)  # [k]
        cbm_sub = per_input["cbm"][subsets].mean(axis=1)
        assert row.pfr["std"].mean == pytest.approx(std_sub.mean(), rel=1e-12)
        assert row.pfr["cbm"].sd == pytest.approx(cbm_sub.std(ddof=1), rel=1e-12)
        reference = scipy.stats.ttest_rel(std_sub, cbm_sub)
        (comparison,) = row.comparisons
        assert comparison.pvalue_t == pytest.approx(reference.pvalue, rel=1e-12)
        assert comparison.delta.mean == pytest.approx((std_sub - cbm_sub).mean(), rel=1e-12)
        inputs = np.unique(subsets)  # the permutation test runs over these inputs
        permutation = stats.paired_permutation_test(per_input["std"][inputs],
                                                    per_input["cbm"][inputs])
        assert comparison.num_inputs == len(inputs) > 40
        assert comparison.pvalue == permutation.pvalue
        pvalues.append(permutation.pvalue)

        counts = m.concept_flips.mean(axis=1)[subsets].mean(axis=1)  # [k]
        assert row.cfr_count.mean == pytest.approx(counts.mean(), rel=1e-12)
        assert row.cfr.mean == pytest.approx(counts.mean() / 6, rel=1e-12)
        assert len(row.cfr_histogram) == 7 and sum(row.cfr_histogram) == pytest.approx(1.0)
        pooled = m.decision_shifts["cbm"][subsets].ravel()
        quantiles = dict(row.dfs["cbm"].quantiles)
        assert quantiles[0.5] == pytest.approx(np.median(pooled), rel=1e-12)

    holm = multipletests(pvalues, method="holm")[1]
    np.testing.assert_allclose([r.comparisons[0].pvalue_holm for r in rows], holm, rtol=1e-12)
    # ε = 0.5 has PFR 0.8 vs 0.05 over ~80 distinct inputs × 2 samples: the per-input
    # differences are positive for almost every input, so all 9 999 sign vectors fall short and
    # p = 1/10000; p_Holm = 3e-4 < 0.01 fails only if ~100 of them reach |Σ d| (probability
    # far below 1e-6 for a sum of ~80 mean-0.75 differences); the seeds here are fixed.
    assert rows[1].comparisons[0].pvalue_holm < 0.01


def test_build_table_identical_models_zero_delta_and_p_one():
    flips = np.random.default_rng(3).uniform(size=(60, 1)) < 0.3
    measurement = protocol.BudgetMeasurement(
        kind="eps", value=0.3, prediction_flips={"std": flips, "cbm": flips.copy()}
    )
    subsets = protocol.draw_subsets(60, num_subsets=5, subset_size=20, seed=0)
    (row,) = protocol.build_table([measurement], subsets)
    (comparison,) = row.comparisons
    assert (comparison.delta.mean, comparison.pvalue, comparison.pvalue_holm) == (0.0, 1.0, 1.0)
    assert row.cfr is None and row.cfr_histogram is None and row.dfs == {}


def test_build_table_rows_serialise_to_json_and_cells():
    rng = np.random.default_rng(9)
    subsets = protocol.draw_subsets(50, num_subsets=3, subset_size=10, seed=4)
    rows = protocol.build_table(
        [_measurement(rng, "eps", 0.05, 50, 0.1, 0.1), _measurement(rng, "tau", 1, 50, 0.4, 0.1)],
        subsets,
    )
    decoded = json.loads(json.dumps([row.to_dict() for row in rows]))
    assert decoded[1]["comparisons"][0]["model_a"] == "std"
    assert decoded[0]["dfs"]["cbm"]["quantiles"].keys() == {"0.05", "0.25", "0.5", "0.75", "0.95"}
    headers, body = protocol.table_cells(rows)
    assert headers[:4] == ("budget", "CFR", "#flipped", "PFR std")
    assert body[1][0] == "τ=1" and len(body[0]) == len(headers)


def test_build_table_rejects_misaligned_or_unknown_models():
    rng = np.random.default_rng(0)
    subsets = protocol.draw_subsets(30, num_subsets=2, subset_size=10, seed=0)
    good = _measurement(rng, "eps", 0.1, 30, 0.1, 0.1)
    short = _measurement(rng, "eps", 0.3, 29, 0.1, 0.1)
    with pytest.raises(ValueError, match=r"must have shape \[M\] or \[M, S\] with M=30"):
        protocol.build_table([good, short], subsets)
    with pytest.raises(ValueError, match="comparison model 'proto' has no prediction_flips"):
        protocol.build_table([good], subsets, comparisons=(("std", "proto"),))
    with pytest.raises(ValueError, match="appears twice"):
        protocol.build_table([good, good], subsets)
    bad_kind = protocol.BudgetMeasurement("delta", 0.1, good.prediction_flips)
    with pytest.raises(ValueError, match="kind: must be one of"):
        protocol.build_table([bad_kind], subsets)


def test_subset_means_equal_the_stats_reduction():
    # The table reduces via stats.subset_means; guard that the two agree on drawn subsets.
    subsets = protocol.draw_subsets(240, num_subsets=3, subset_size=30, seed=0)
    values = np.arange(240, dtype=float)
    np.testing.assert_array_equal(
        stats.subset_means(values, subsets), values[subsets].mean(axis=1)
    )
