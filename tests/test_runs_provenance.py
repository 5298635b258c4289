"""Who wrote each cell (`cbcert.runs.provenance`): run.json's list of sessions, appended by every
session that writes records, and the derivation from an older sweep's sessions.jsonl."""

import json

import pytest

from cbcert.runs import machine, provenance, sessions
from cbcert.runs.directory import MANIFEST, RUN, RecordsError, RunMismatchError, json_line
from cbcert.runs.session import session


class _World:
    """What a session needs of a world: its name and metadata."""

    name = "w"
    metadata: dict = {}


def _run(out, meta, *records):
    """One session on ``out`` writing ``records`` (none: a rerun that finds its work done)."""
    with session(out, "certify", meta, _World(), free=("job.batch",)) as run, \
            run.append() as sink:
        for record in records:
            sink.write(json_line(record))


def _listed(out):
    return json.loads((out / RUN).read_text())["sessions"]


def test_each_session_that_writes_appends_its_entry_and_a_resume_keeps_the_first(tmp_path):
    meta = {"job": {"n": 10, "batch": 2}, "world": "w"}
    _run(tmp_path, meta, {"index": 0}, {"index": 1})
    first = _listed(tmp_path)
    assert len(first) == 1 and first[0]["records_before"] == 0
    own = machine.provenance()
    assert {k: first[0][k] for k in own} == own  # what sessions.jsonl's start line records
    assert set(first[0]) == {"time", "git_revision", "versions", "machine", "records_before"}
    # A resume (a free setting changed) appends, counting complete lines only.
    with (tmp_path / "records.jsonl").open("a") as f:
        f.write('{"index": 2, "mo')
    _run(tmp_path, {**meta, "job": {"n": 10, "batch": 5}}, {"index": 2})
    second = _listed(tmp_path)
    assert second[0] == first[0] and len(second) == 2 and second[1]["records_before"] == 2
    # A session that writes nothing leaves run.json as it was.
    before = (tmp_path / RUN).read_bytes()
    _run(tmp_path, meta)
    assert (tmp_path / RUN).read_bytes() == before


def test_the_settings_comparison_ignores_the_list(tmp_path):
    meta = {"job": {"n": 10}, "world": "w"}
    _run(tmp_path, meta, {"index": 0})
    pinned = json.loads((tmp_path / RUN).read_text())
    assert {k: v for k, v in pinned.items() if k != "sessions"} == {
        "kind": "certify", **meta, "versions": pinned["versions"], "devices": pinned["devices"]}
    _run(tmp_path, meta, {"index": 1})  # resumes although run.json now lists a session
    with pytest.raises(RunMismatchError, match=r"job.n = 10 there, 11 now"):
        _run(tmp_path, {"job": {"n": 11}, "world": "w"}, {"index": 2})
    assert len(_listed(tmp_path)) == 2


def test_a_damaged_list_is_refused_naming_run_json(tmp_path):
    _run(tmp_path, {"job": {"n": 1}, "world": "w"}, {"index": 0})
    pinned = json.loads((tmp_path / RUN).read_text())
    (tmp_path / RUN).write_text(json.dumps({**pinned, "sessions": {"not": "a list"}}))
    with pytest.raises(RecordsError, match=r"run.json: damaged.*'sessions' is a list"):
        _run(tmp_path, {"job": {"n": 1}, "world": "w"}, {"index": 1})


def _entry(revision, cpu="Xeon", before=0, time="2026-01-01T12:00:00+00:00"):
    return {"time": time, "git_revision": revision, "machine": {"cpu": cpu, "isa": ["avx2"]},
            "records_before": before}


@pytest.mark.parametrize("entries,mixed", [
    ([_entry("a" * 40)], "no"),
    ([_entry("a" * 40), _entry("a" * 40, before=3)], "no"),
    ([_entry("a" * 40), _entry("b" * 40, before=3)], "yes"),
    ([_entry("a" * 40), _entry("a" * 40, cpu="EPYC", before=3)], "yes"),
])
def test_a_listed_cell_is_mixed_when_two_revisions_or_machines_wrote_into_it(
        tmp_path, entries, mixed):
    found = provenance.cell_provenance(tmp_path / "cell", {"sessions": entries})
    assert found.mixed == mixed and found.complete and found.source == "run.json"
    assert found.sessions == len(entries) and found.machines[0] == "Xeon (avx2)"


def test_a_list_that_starts_after_records_and_no_log_is_incomplete(tmp_path):
    found = provenance.cell_provenance(tmp_path / "cell", {"sessions": [_entry("a" * 40,
                                                                               before=5)]})
    assert found.mixed == "unknown" and not found.complete
    assert "5 record lines predate the first session it lists" in found.note
    bare = provenance.cell_provenance(tmp_path / "cell", {})
    assert (bare.sessions, bare.source, bare.mixed) == (None, "unknown", "unknown")
    with pytest.raises(ValueError, match="'sessions' must be a list of objects"):
        provenance.cell_provenance(tmp_path / "cell", {"sessions": ["x"]})


def _t(minutes):
    return f"2026-01-01T{minutes // 60:02d}:{minutes % 60:02d}:00+00:00"


def _start(minutes, revision, cells, only=None, cpu="Xeon", shard=None):
    return {"event": "start", "time": _t(minutes), "git_revision": revision * 40,
            "versions": {}, "machine": {"cpu": cpu, "isa": ["avx2"]}, "shard": shard,
            "cells": cells, **({"only": only} if only else {})}


def _cell(minutes, name, seconds, state="done"):
    return {"event": "cell", "time": _t(minutes), "cell": name, "state": state,
            "seconds": seconds}


def _close(minutes, finished, event="end"):
    return {"event": event, "time": _t(minutes), "finished": finished}


def _sweep(root, cells, lines):
    root.mkdir(exist_ok=True)
    (root / MANIFEST).write_text(json.dumps({"cells": [{"name": c} for c in cells]}))
    (root / sessions.SESSIONS).write_text("".join(json.dumps(e) + "\n" for e in lines))
    return root


def test_derivation_follows_concurrent_sessions_and_flags_mixed_cells(tmp_path):
    """Two worlds swept side by side (same revision and machine), stopped in their second
    cells, resumed at a new revision, one world on another machine; a start line copied from
    another directory's sweep (7 cells) is left out."""
    cells = ["a/x", "a/y", "b/x", "b/y"]
    root = _sweep(tmp_path / "run", cells, [
        _start(0, "9", 7),
        _start(0, "1", 2, ["a/*"]), _start(0, "1", 2, ["b/*"]),
        _cell(10, "a/x", 600), _cell(12, "b/x", 700),
        _cell(20, "a/y", 500, "stopped"), _close(20, ["a/x"], "stopped"),
        _cell(20, "b/y", 460, "stopped"), _close(20, ["b/x"], "stopped"),
        _start(30, "2", 2, ["a/*"]), _start(30, "2", 2, ["b/*"], cpu="EPYC"),
        _cell(40, "a/y", 590), _close(40, ["a/x", "a/y"]),
        _cell(41, "b/y", 650), _close(41, ["b/x", "b/y"]),
    ])
    found = {c: provenance.cell_provenance(root / c, {}) for c in cells}
    assert all(p.complete and p.source == "sessions.jsonl" for p in found.values())
    assert {c: p.mixed for c, p in found.items()} == {"a/x": "no", "a/y": "yes", "b/x": "no",
                                                      "b/y": "yes"}
    assert found["a/y"].revisions == ("1" * 40, "2" * 40) and found["a/y"].sessions == 2
    assert found["b/y"].machines == ("Xeon (avx2)", "EPYC (avx2)")
    # run.json's list, begun after the log's lines, adds its sessions to those the log gives.
    later = provenance.cell_provenance(root / "a/y", {"sessions": [
        _entry("3" * 40, before=7, time=_t(50))]})
    assert later.source == "run.json + sessions.jsonl" and later.complete
    assert later.revisions == ("1" * 40, "2" * 40, "3" * 40) and later.sessions == 3


def test_derivation_says_unknown_where_an_older_session_may_have_written(tmp_path):
    """Revision 0 logged no cell line and was killed outright; revision 1 superseded it. It may
    have begun x (first in its order) but cannot have reached y: x had no summary until after
    it was gone."""
    root = _sweep(tmp_path / "run", ["x", "y", "z"], [
        _start(0, "0", 3),
        _start(30, "1", 3), _cell(40, "x", 500), _cell(50, "y", 550), _close(50, ["x", "y"],
                                                                             "stopped"),
    ])
    x, y, z = (provenance.cell_provenance(root / c, {}) for c in ("x", "y", "z"))
    assert (x.mixed, x.complete, x.revisions) == ("unknown", False, ("1" * 40,))
    assert "revisions 0000000" in x.note
    assert (y.mixed, y.complete) == ("no", True)
    assert (z.sessions, z.source, z.mixed) == (None, "unknown", "unknown")  # no cell line


def test_a_cell_line_two_revisions_explain_is_not_given_to_either(tmp_path):
    """Shards at two revisions at once: the log does not say which shard holds a cell."""
    root = _sweep(tmp_path / "run", ["x", "y"], [
        _start(0, "1", 1, shard=[0, 2]), _start(0, "2", 1, shard=[1, 2]),
        _cell(10, "x", 500), _close(10, ["x"]),
    ])
    x = provenance.cell_provenance(root / "x", {})
    assert (x.sessions, x.mixed, x.complete) == (None, "unknown", False)
    assert "1 of its 1 cell lines fit sessions of several revisions" in x.note


def test_record_lines_count_complete_lines_of_every_jsonl_file(tmp_path):
    (tmp_path / "eps0.1.jsonl").write_text('{"index": 0}\n{"index": 1}\n{"ind')
    (tmp_path / "tau1.jsonl").write_text('{"index": 0}\n')
    (tmp_path / "summary.json").write_text("{}\n")
    assert provenance.record_lines(tmp_path) == 3
