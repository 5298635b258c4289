"""Tests of cbcert.certify.metrics on hand-computed records."""

import doctest

import numpy as np
import pytest

import cbcert.certify.metrics
from cbcert.certify.cohen import ABSTAIN
from cbcert.certify.metrics import (
    abstain_rate,
    average_certified_hamming_radius,
    average_certified_radius,
    certified_accuracy,
    mean_time_per_input,
    smoothed_accuracy,
    summarize,
)

LABELS = np.array([0, 1, 2, 1, 0, 2])
PREDICTIONS = np.array([0, 1, ABSTAIN, 0, 0, 2])
RADII = np.array([0.5, 1.5, np.nan, 2.0, 0.0, 0.25])  # input 3 is wrong with a large radius


def test_smoothed_accuracy_counts_abstain_as_wrong():
    assert smoothed_accuracy(LABELS, PREDICTIONS) == pytest.approx(4 / 6)
    assert abstain_rate(PREDICTIONS) == pytest.approx(1 / 6)


def test_acr_is_mean_over_all_inputs_of_radius_times_correct():
    # (0.5 + 1.5 + 0 + 0.25) / 6: wrong and abstained inputs count as 0, and the denominator
    # is every input, not the 4 correct ones (MACER's definition).
    assert average_certified_radius(LABELS, PREDICTIONS, RADII) == pytest.approx(2.25 / 6)


def test_certified_accuracy_curve():
    grid = np.array([0.0, 0.25, 0.3, 1.5, 1.6])
    curve = certified_accuracy(LABELS, PREDICTIONS, RADII, grid)
    np.testing.assert_allclose(curve, np.array([4, 3, 2, 1, 0]) / 6)
    assert curve[0] == smoothed_accuracy(LABELS, PREDICTIONS)  # radius 0 includes radius-0 inputs
    assert float(certified_accuracy(LABELS, PREDICTIONS, RADII, 0.25)) == pytest.approx(3 / 6)


def test_hamming_acr_and_ca_at_one():
    radii = np.array([2.0, 0.0, np.nan, 5.0, 1.0, 3.0])
    assert average_certified_hamming_radius(LABELS, PREDICTIONS, radii) == pytest.approx(1.0)
    assert float(certified_accuracy(LABELS, PREDICTIONS, radii, 1)) == pytest.approx(3 / 6)
    with pytest.raises(ValueError, match="integers"):
        average_certified_hamming_radius(LABELS, PREDICTIONS, RADII)


def test_time_and_summary():
    seconds = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert mean_time_per_input(seconds) == 3.5
    summary = summarize(LABELS, PREDICTIONS, RADII, seconds, [0.0, 0.5], hamming=False)
    assert summary.num_inputs == 6 and summary.seconds_per_input == 3.5
    assert summary.acr == pytest.approx(2.25 / 6)
    np.testing.assert_allclose(summary.certified_accuracy, [4 / 6, 2 / 6])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: smoothed_accuracy(LABELS, PREDICTIONS[:3]), "shape"),
        (lambda: smoothed_accuracy(np.array([-1, 0]), np.array([0, 0])), "labels contains -1"),
        (lambda: smoothed_accuracy(LABELS, np.array([0, 1, -2, 0, 0, 2])), "contains -2"),
        (lambda: smoothed_accuracy(LABELS.astype(float), PREDICTIONS), "integer"),
        (lambda: average_certified_radius(LABELS, PREDICTIONS, np.full(6, np.nan)), "nan"),
        (lambda: certified_accuracy(LABELS, PREDICTIONS, RADII, -0.5), "radius=-0.5"),
        (lambda: mean_time_per_input(np.array([-1.0])), "seconds"),
    ],
)
def test_bad_input_names_parameter_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_docstring_examples():
    result = doctest.testmod(cbcert.certify.metrics)
    assert result.attempted > 0 and result.failed == 0
