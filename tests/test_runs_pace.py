"""Sweep pace: finished cells' measured wall times, the estimate of the work left, the log."""

import json
from pathlib import Path

import pytest

from cbcert.runs import pace, sessions, sweep
from cbcert.runs.config import load_config
from cbcert.runs.directory import RECORDS, RUN

CONFIG = """\
preset: smoke
name: paced
world: {seed: 3, num_inputs: 4}
latent: {sigmas: [0.1, 0.2, 0.3, 0.4], n0: 4, n: 16, alpha: 0.1, models: [std, cbm]}
perturb: {eps: [0.1], tau: [1], subsets: 2, subset_size: 2}
attack: [{space: latent, eps: [0.01, 0.03], iters: 2, inputs: 4}]
"""


@pytest.fixture
def cells(tmp_path):
    path = tmp_path / "paced.yaml"
    path.write_text(CONFIG)
    planned = sweep.plan_cells(load_config(path), sweep.sections_in_file(path))
    return {c.name: c for c in planned}


def _records(out: Path, name: str, seconds: list[float], torn: bool = False) -> None:
    where = out / name
    where.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"index": i, "seconds": s}) + "\n" for i, s in enumerate(seconds))
    (where / RECORDS).write_text(text + ('{"index": 99, "seconds": 5' if torn else ""))


def test_measured_seconds_from_records_and_from_the_sessions_cell_lines(cells, tmp_path):
    """Certification: records' seconds summed over inputs (each model's record repeats its
    input's share); attacks: every record's; a torn last line is no record. Perturbation: the
    session log's cell lines, summed over sessions, only once one says done."""
    out = tmp_path
    # 2 models × 3 inputs, each input's share 0.5 s on both its records: 1.5 s.
    _records(out, "latent-sigma0.1", [0.5] * 6, torn=True)
    assert pace.measured_seconds(out, cells["latent-sigma0.1"]) == pytest.approx(1.5)
    _records(out, "attack-latent", [0.25, 0.25, 1.0, 2.0])
    assert pace.measured_seconds(out, cells["attack-latent"]) == pytest.approx(3.5)
    assert pace.measured_seconds(out, cells["latent-sigma0.2"]) is None  # no records
    assert pace.measured_seconds(out, cells["perturb"]) is None  # no log
    sessions.log(out, "cell", cell="perturb", state="stopped", seconds=10.0)
    assert pace.measured_seconds(out, cells["perturb"]) is None  # not finished
    sessions.log(out, "cell", cell="latent-sigma0.1", state="done", seconds=99.0)  # not read
    (out / sessions.SESSIONS).open("a").write('{"event": "cell", "cell": "perturb", "sta\n')
    sessions.log(out, "cell", cell="perturb", state="done", seconds=4.5)
    assert pace.measured_seconds(out, cells["perturb"]) == pytest.approx(14.5)
    assert pace.measured_seconds(out, cells["latent-sigma0.1"]) == pytest.approx(1.5)


def test_time_left_prices_each_kind_at_its_median_pace_less_what_records_hold(cells, tmp_path):
    out = tmp_path
    cost = {name: sweep.cell_cost(cell) for name, cell in cells.items()}
    # Three finished certification cells at paces 1, 2 and 4 s per unit (median 2).
    for name, rate in (("latent-sigma0.1", 1.0), ("latent-sigma0.2", 2.0),
                       ("latent-sigma0.3", 4.0)):
        _records(out, name, [rate * cost[name] / 4] * 8)  # 4 inputs × 2 models
    # The fourth has 1 of its 4 inputs (two records); perturb and attack have no finished cell
    # of their kind, so they go at the median over every measured finished cell (2 again).
    _records(out, "latent-sigma0.4", [100.0, 100.0])
    finished = {"latent-sigma0.1", "latent-sigma0.2", "latent-sigma0.3"}
    left = pace.time_left(out, list(cells.values()), finished)
    assert left.pace == {"certify": pytest.approx(2.0)} and left.measured == 3
    assert left.unfinished == 3
    expected = 2.0 * (cost["latent-sigma0.4"] * 0.75 + cost["perturb"] + cost["attack-latent"])
    assert left.seconds == pytest.approx(expected)
    # Priced: a selection of the unfinished cells, at the whole sweep's pace.
    only = pace.time_left(out, list(cells.values()), finished, priced={"attack-latent",
                                                                       "latent-sigma0.1"})
    assert only.unfinished == 1 and only.seconds == pytest.approx(2.0 * cost["attack-latent"])
    # A finished attack cell gives attacks their own pace, 3 s per unit; perturb goes at the
    # median of all four measured cells (1, 2, 3, 4: 2.5).
    _records(out, "attack-latent", [3.0 * cost["attack-latent"] / 16] * 16)
    both = pace.time_left(out, list(cells.values()), finished | {"attack-latent"})
    assert both.pace == {"certify": pytest.approx(2.0), "attack": pytest.approx(3.0)}
    assert both.seconds == pytest.approx(2.0 * cost["latent-sigma0.4"] * 0.75
                                         + 2.5 * cost["perturb"])


def test_time_left_is_unknown_before_a_measured_cell_and_zero_when_all_are_done(cells,
                                                                                tmp_path):
    names = set(cells)
    unknown = pace.time_left(tmp_path, list(cells.values()), set())
    assert unknown.seconds is None and unknown.unfinished == len(cells)
    # Finished but unmeasured (a perturb cell from before the log) sets no pace.
    assert pace.time_left(tmp_path, list(cells.values()), {"perturb"}).seconds is None
    done = pace.time_left(tmp_path, list(cells.values()), names)
    assert done.seconds == 0.0 and done.unfinished == 0


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (40.4, "40 s"), (59.4, "59 s"),
                                           (60, "1 min"), (7 * 60 + 20, "7 min"),
                                           (3600, "1 h 0 min"),
                                           (23 * 3600 + 10 * 60 + 29, "23 h 10 min")])
def test_duration_reads_as_hours_and_minutes(seconds, text):
    assert pace.duration(seconds) == text


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_duration_refuses_what_is_no_duration(bad):
    with pytest.raises(ValueError, match="duration"):
        pace.duration(bad)


def test_timed_logs_a_cell_done_or_stopped_with_its_wall_time(tmp_path):
    with sessions.timed(tmp_path, "a"):
        pass
    with pytest.raises(KeyboardInterrupt), sessions.timed(tmp_path, "b"):
        raise KeyboardInterrupt
    with sessions.timed(tmp_path, "c", logged=False):
        pass
    log = pace.cell_lines(tmp_path)
    assert set(log) == {"a", "b"}
    assert [e["state"] for e in log["a"]] == ["done"]
    assert [e["state"] for e in log["b"]] == ["stopped"]
    assert all(0 <= e["seconds"] < 60 for e in (*log["a"], *log["b"]))


def test_the_committed_paper_run_is_done_and_prices_cells_made_unfinished(tmp_path):
    """On `results/paper` (committed, complete): every finished certification and attack cell
    is measured from its records and nothing is left to price. In a copy where one
    certification cell is gone and one attack cell holds half its records, the estimate is
    the sum over those two, the whole one at its kind's price and the half-done one at the
    rest of its price (`time_left`'s formula), so strictly between the one and both whole."""
    root = Path(__file__).resolve().parent.parent
    out = root / "results" / "paper"
    planned = sweep.plan_cells(load_config(root / "configs" / "paper.yaml"))
    finished = {s.name for s in sweep.sweep_status(out, planned) if s.state == "done"}
    assert finished == {c.name for c in planned}
    timed = [c for c in planned if c.kind in pace.TIMED_RECORDS]
    assert len(timed) >= 12
    assert all(pace.measured_seconds(out, c) > 0 for c in timed)
    left = pace.time_left(out, planned, finished)
    assert (left.seconds, left.unfinished) == (0.0, 0) and left.measured >= len(timed)

    by_name = {c.name: c for c in planned}
    gone = by_name["default/latent-sigma0.1"]
    half = by_name["vocab12/attack-latent-smoothed-sigma0.1"]
    assert (gone.kind, half.kind) == ("certify", "attack")
    copy = tmp_path / "paper"
    copy.mkdir()
    (copy / sessions.SESSIONS).write_bytes((out / sessions.SESSIONS).read_bytes())
    for cell in planned:
        (copy / cell.name).parent.mkdir(parents=True, exist_ok=True)
        if cell not in (gone, half):
            (copy / cell.name).symlink_to(out / cell.name, target_is_directory=True)
    (copy / half.name).mkdir()
    (copy / half.name / RUN).write_bytes((out / half.name / RUN).read_bytes())
    lines = (out / half.name / RECORDS).read_text().splitlines(keepends=True)
    (copy / half.name / RECORDS).write_text("".join(lines[: len(lines) // 2]))
    still = {s.name for s in sweep.sweep_status(copy, planned) if s.state == "done"}
    assert still == finished - {gone.name, half.name}
    share = pace.done_fraction(copy, half)
    assert 0.45 < share < 0.55
    left = pace.time_left(copy, planned, still)
    price = {c.name: sweep.cell_cost(c) * left.pace[c.kind] for c in (gone, half)}
    assert left.unfinished == 2
    assert left.seconds == pytest.approx(price[gone.name] + price[half.name] * (1 - share))
    assert price[gone.name] < left.seconds < price[gone.name] + price[half.name]
