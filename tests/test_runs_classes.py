"""``certify world classes`` (`cbcert.runs.classes`): centroids of f_std's features by class."""

import json

import numpy as np
from click.testing import CliRunner

from cbcert.cli import main
from cbcert.runs.classes import class_distances
from cbcert.runs.pool import pool_latents
from cbcert.worlds.builtin import load_builtin


def test_distances_are_those_of_the_ground_truth_class_centroids():
    world = load_builtin("default")
    result = class_distances(world, samples=60, seed=2)
    z = pool_latents(world, 2, 0, 60)
    params = world.params
    images = world.latent_images(params, z)
    e = np.asarray(world.embed(params["clf"], images), np.float64)
    y = np.asarray(world.true_label(params["gen"], z))
    assert result["labels"] == "ground truth" and result["counts"] == np.bincount(
        y, minlength=world.num_classes).tolist()
    c0, c1 = np.unique(y)[:2]
    expected = np.linalg.norm(e[y == c0].mean(0) - e[y == c1].mean(0))
    # Same float32 features, computed in engine chunks here and in one batch above: equal up to
    # float32 rounding of a few ulps per feature.
    assert abs(result["distances"][c0][c1] - expected) <= 1e-5 * expected
    d = np.array([[np.nan if v is None else v for v in row] for row in result["distances"]])
    np.testing.assert_allclose(d, d.T)
    assert np.all(np.diag(d)[np.isfinite(np.diag(d))] == 0.0)
    assert result["mean_off_diagonal"] > 0


def test_cli_writes_json_csv_and_heatmap(tmp_path):
    out = tmp_path / "classes"
    result = CliRunner().invoke(main, ["world", "classes", "--samples", "40", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "class_distances.json").read_text())
    assert len(data["distances"]) == len(data["class_names"]) == 10
    assert (out / "class_distances.csv").read_text().splitlines()[0].startswith("class,class0")
    assert (out / "class_distances.png").read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(main, ["world", "classes", "--samples", "0", "--out", str(out)])
    assert bad.exit_code == 2 and "--samples" in bad.output


def test_classes_cell_writes_the_summary_once_and_pins_its_settings(tmp_path, monkeypatch):
    import pytest

    from cbcert.runs import classes
    from cbcert.runs.directory import RUN, SUMMARY, RunMismatchError

    world = load_builtin("default")
    out = tmp_path / "classes"
    summary = classes.run(world, classes.ClassesJob(samples=40, seed=1), out)
    assert summary == class_distances(world, samples=40, seed=1)
    assert json.loads((out / SUMMARY).read_text()) == summary
    assert json.loads((out / RUN).read_text())["classes"] == {"samples": 40, "seed": 1}
    assert json.loads((out / RUN).read_text())["kind"] == summary.kind == "classes"
    listed = json.loads((out / RUN).read_text())["sessions"]
    assert len(listed) == 1 and listed[0]["records_before"] == 0
    monkeypatch.setattr(classes, "class_distances", lambda *a, **k: pytest.fail("recomputed"))
    assert classes.run(world, classes.ClassesJob(samples=40, seed=1), out) == summary
    assert json.loads((out / RUN).read_text())["sessions"] == listed  # read, not written
    with pytest.raises(RunMismatchError, match="different settings"):
        classes.run(world, classes.ClassesJob(samples=41, seed=1), out)
