"""Class similarity as the method measures it: centroid distances in a classifier's features.

For embeddings ``e_i ∈ R^D`` (the standard classifier's penultimate features of images) with
class labels ``y_i``, the centroid of class c is ``μ_c = mean_{i : y_i = c} e_i`` and the
class-distance matrix is ``D[c, c'] = ‖μ_c − μ_c'‖₂``: small off-diagonal entries mark classes
the classifier finds alike (the class-similarity axis of the method's worlds). Float64 numpy.
"""

from __future__ import annotations

import numpy as np


def class_centroids(embeddings: np.ndarray, labels: np.ndarray,
                    num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-class mean embedding and count.

    Args:
      embeddings: ``[N, D]`` features. labels: ``[N]`` ints in ``[0, num_classes)``.

    Returns:
      ``(centroids[C, D], counts[C])``; a class without samples has a NaN centroid row.
    """
    e = np.asarray(embeddings, np.float64)
    y = np.asarray(labels)
    if e.ndim != 2 or y.shape != (e.shape[0],):
        raise ValueError(f"embeddings {e.shape} and labels {y.shape}: expected [N, D] and [N]")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]")
    counts = np.bincount(y, minlength=num_classes).astype(np.int64)
    sums = np.zeros((num_classes, e.shape[1]))
    np.add.at(sums, y, e)
    with np.errstate(invalid="ignore", divide="ignore"):
        centroids = sums / counts[:, None]
    centroids[counts == 0] = np.nan
    return centroids, counts


def centroid_distances(centroids: np.ndarray) -> np.ndarray:
    """``D[c, c'] = ‖μ_c − μ_c'‖₂``: ``[C, D] -> [C, C]`` (NaN rows/columns for absent classes)."""
    mu = np.asarray(centroids, np.float64)
    return np.sqrt(np.sum((mu[:, None, :] - mu[None, :, :]) ** 2, axis=-1))


def nearest_classes(distances: np.ndarray) -> list[tuple[int, float]]:
    """For every class, the closest other class and its distance (``(-1, nan)`` if none)."""
    d = np.array(distances, np.float64)
    np.fill_diagonal(d, np.inf)
    out = []
    for row in d:
        finite = np.isfinite(row)
        if not finite.any():
            out.append((-1, float("nan")))
            continue
        j = int(np.argmin(np.where(finite, row, np.inf)))
        out.append((j, float(row[j])))
    return out


def mean_off_diagonal(distances: np.ndarray) -> float:
    """Mean of ``D[c, c']`` over pairs ``c ≠ c'`` of present classes (NaN if fewer than two)."""
    d = np.asarray(distances, np.float64)
    mask = ~np.eye(len(d), dtype=bool) & np.isfinite(d)
    return float(d[mask].mean()) if mask.any() else float("nan")


__all__ = ["centroid_distances", "class_centroids", "mean_off_diagonal", "nearest_classes"]
