"""Class-centroid distances (`cbcert.robustness.classes`) against hand-computed answers."""

import numpy as np
import pytest

from cbcert.robustness import classes


def test_centroids_and_distances_of_known_points():
    # Class 0 around (0, 0), class 1 around (3, 4), class 2 absent.
    e = np.array([[1.0, 0.0], [-1.0, 0.0], [3.0, 3.0], [3.0, 5.0]])
    y = np.array([0, 0, 1, 1])
    centroids, counts = classes.class_centroids(e, y, 3)
    np.testing.assert_array_equal(counts, [2, 2, 0])
    np.testing.assert_allclose(centroids[:2], [[0.0, 0.0], [3.0, 4.0]])
    assert np.isnan(centroids[2]).all()
    d = classes.centroid_distances(centroids)
    assert d[0, 1] == d[1, 0] == 5.0 and d[0, 0] == 0.0 and np.isnan(d[2, 0])
    assert classes.mean_off_diagonal(d) == 5.0
    assert classes.nearest_classes(d) == [(1, 5.0), (0, 5.0), (-1, pytest.approx(np.nan,
                                                                                  nan_ok=True))]


def test_bad_labels_are_refused():
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        classes.class_centroids(np.zeros((2, 3)), np.array([0, 2]), 2)
    with pytest.raises(ValueError, match="expected"):
        classes.class_centroids(np.zeros((2, 3)), np.array([0]), 2)
