"""Summary metrics of smoothed classifiers from per-input certification records.

Inputs are flat arrays over ``N`` inputs: ``labels[N]`` (reference classes, >= 0),
``predictions[N]`` (``cbcert.certify.cohen.ABSTAIN`` = −1 for abstentions), ``radii[N]``
(certified radii, NaN or any value for abstained inputs) and ``seconds[N]``. An abstention is
never correct.

Definitions (N = number of inputs, ``correct_i = 1[prediction_i = label_i]``):

* smoothed accuracy ``= (1/N) Σ correct_i``;
* certified accuracy at radius ``r`` ``= (1/N) Σ correct_i · 1[radius_i >= r]`` (Cohen et al.
  2019, ``analyze.py``); at ``r = 0`` it equals the smoothed accuracy;
* ACR, average certified radius ``= (1/N) Σ correct_i · radius_i``: the mean over *all* inputs,
  wrong and abstained ones contributing 0 (Zhai et al., "MACER", ICLR 2020). It is not the
  mean over the correct inputs only, which would reward abstaining on hard inputs;
* ACR-H: the same with integer Hamming radii;
* abstain rate ``= (1/N) Σ 1[prediction_i = ABSTAIN]``; time per input = mean of ``seconds``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cbcert.certify.cohen import ABSTAIN


def _check_classes(values: np.ndarray, name: str, minimum: int) -> np.ndarray:
    """Validate a non-empty 1-D integer array ``[N]`` with entries ``>= minimum``."""
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{name} has shape {arr.shape} and dtype {arr.dtype}; expected a non-empty "
            "1-D integer array"
        )
    if np.any(arr < minimum):
        raise ValueError(f"{name} contains {arr[arr < minimum][0]}; allowed range is >= {minimum}")
    return arr


def _check_records(labels: np.ndarray, predictions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate ``labels[N] >= 0`` and ``predictions[N] >= ABSTAIN`` (−1) integer arrays."""
    y = _check_classes(labels, "labels", 0)
    pred = _check_classes(predictions, "predictions", ABSTAIN)
    if y.shape != pred.shape:
        raise ValueError(f"labels has shape {y.shape} but predictions has shape {pred.shape}")
    return y, pred


def _correct(labels: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    y, pred = _check_records(labels, predictions)
    return pred == y


def _correct_radii(labels: np.ndarray, predictions: np.ndarray, radii: np.ndarray) -> np.ndarray:
    """``radius_i · 1[correct_i]`` ``[N]``, after checking radii of predicted inputs are >= 0."""
    y, pred = _check_records(labels, predictions)
    r = np.asarray(radii, dtype=np.float64)
    if r.shape != y.shape:
        raise ValueError(f"radii has shape {r.shape} but labels has shape {y.shape}")
    predicted = pred != ABSTAIN
    bad = predicted & ~(r >= 0.0)
    if np.any(bad):
        raise ValueError(
            f"radii contains {r[bad][0]} for a non-abstained input; allowed range is [0, inf]"
        )
    return np.where(pred == y, r, 0.0)


def smoothed_accuracy(labels: np.ndarray, predictions: np.ndarray) -> float:
    """Fraction of inputs whose smoothed prediction equals the label (abstain = wrong)."""
    return float(np.mean(_correct(labels, predictions)))


def abstain_rate(predictions: np.ndarray) -> float:
    """Fraction of inputs with prediction ``ABSTAIN``; ``predictions`` is ``[N]``."""
    return float(np.mean(_check_classes(predictions, "predictions", ABSTAIN) == ABSTAIN))


def certified_accuracy(
    labels: np.ndarray, predictions: np.ndarray, radii: np.ndarray, radius: np.ndarray | float
) -> np.ndarray:
    """Certified accuracy ``(1/N) Σ 1[correct_i] · 1[radius_i >= r]`` at each ``r`` in ``radius``.

    Args:
      labels, predictions, radii: ``[N]`` records.
      radius: a radius ``r`` or a grid ``[G]`` of radii (>= 0) for a certified-accuracy curve;
        ``radius=1`` on Hamming radii gives CA@1.

    Returns:
      float64 array of the shape of ``radius``.

    >>> float(certified_accuracy(np.array([0, 1, 1]), np.array([0, 1, -1]),
    ...                          np.array([0.5, 0.2, np.nan]), 0.3))
    0.3333333333333333
    """
    correct_radii = _correct_radii(labels, predictions, radii)  # [N]
    correct = _correct(labels, predictions)  # [N]
    grid = np.asarray(radius, dtype=np.float64)
    if np.any(~(grid >= 0.0)):
        raise ValueError(
            f"radius={grid[~(grid >= 0.0)].flat[0]} is invalid; allowed range [0, inf]"
        )
    hits = correct[:, None] & (correct_radii[:, None] >= grid.reshape(1, -1))  # [N, G]
    return hits.mean(axis=0).reshape(grid.shape)


def average_certified_radius(
    labels: np.ndarray, predictions: np.ndarray, radii: np.ndarray
) -> float:
    """ACR ``= (1/N) Σ radius_i · 1[prediction_i = label_i]`` over *all* ``N`` inputs (MACER).

    >>> average_certified_radius(np.array([0, 1, 1, 0]), np.array([0, 1, -1, 1]),
    ...                          np.array([1.0, 0.5, np.nan, 2.0]))
    0.375
    """
    return float(np.mean(_correct_radii(labels, predictions, radii)))


def average_certified_hamming_radius(
    labels: np.ndarray, predictions: np.ndarray, radii: np.ndarray
) -> float:
    """ACR-H: :func:`average_certified_radius` for Hamming radii, which must be integers."""
    correct_radii = _correct_radii(labels, predictions, radii)
    if np.any(correct_radii != np.round(correct_radii)):
        bad = correct_radii[correct_radii != np.round(correct_radii)][0]
        raise ValueError(f"radii contains {bad}; Hamming radii must be integers >= 0")
    return float(np.mean(correct_radii))


def mean_radius_of_correct(labels: np.ndarray, predictions: np.ndarray,
                           radii: np.ndarray) -> float:
    """Mean certified radius over the inputs predicted correctly (never abstained), NaN if none.

    The method's second radius average, reported next to ACR (which averages over *all*
    inputs, counting wrong and abstained ones as 0): ``Σ radius_i 1[c_i] / Σ 1[c_i]`` with
    ``c_i = 1[prediction_i = label_i]``.

    >>> mean_radius_of_correct(np.array([0, 1, 1, 0]), np.array([0, 1, -1, 1]),
    ...                        np.array([1.0, 0.5, np.nan, 2.0]))
    0.75
    """
    correct_radii = _correct_radii(labels, predictions, radii)
    y, pred = _check_records(labels, predictions)
    correct = pred == y
    return float(correct_radii[correct].mean()) if correct.any() else float("nan")


def mean_time_per_input(seconds: np.ndarray) -> float:
    """Mean wall-clock seconds per input; ``seconds`` is a non-empty ``[N]`` array of >= 0."""
    s = np.asarray(seconds, dtype=np.float64)
    if s.ndim != 1 or s.size == 0 or np.any(~(s >= 0.0)):
        raise ValueError(f"seconds must be a non-empty 1-D array of values >= 0; got {s!r}")
    return float(np.mean(s))


@dataclass(frozen=True)
class Summary:
    """All metrics of one certification run (see the module docstring for definitions).

    ``certified_accuracy`` is ``[G]`` over ``radius_grid``; ``acr`` is ACR (ACR-H for Hamming);
    ``radius_of_correct`` the mean radius over correct inputs (NaN if none).
    """

    num_inputs: int
    smoothed_accuracy: float
    abstain_rate: float
    acr: float
    radius_grid: np.ndarray
    certified_accuracy: np.ndarray
    seconds_per_input: float
    radius_of_correct: float = float("nan")


def summarize(
    labels: np.ndarray,
    predictions: np.ndarray,
    radii: np.ndarray,
    seconds: np.ndarray,
    radius_grid: np.ndarray,
    *,
    hamming: bool,
) -> Summary:
    """Compute every metric of a run: ``[N]`` records, a ``[G]`` radius grid, Hamming or L2."""
    acr = average_certified_hamming_radius if hamming else average_certified_radius
    grid = np.asarray(radius_grid, dtype=np.float64)
    if np.shape(seconds) != np.shape(labels):
        raise ValueError(
            f"seconds has shape {np.shape(seconds)} but labels has shape {np.shape(labels)}"
        )
    return Summary(
        num_inputs=len(np.asarray(labels)),
        smoothed_accuracy=smoothed_accuracy(labels, predictions),
        abstain_rate=abstain_rate(predictions),
        acr=acr(labels, predictions, radii),
        radius_grid=grid,
        certified_accuracy=certified_accuracy(labels, predictions, radii, grid),
        seconds_per_input=mean_time_per_input(seconds),
        radius_of_correct=mean_radius_of_correct(labels, predictions, radii),
    )
