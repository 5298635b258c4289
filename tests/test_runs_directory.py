"""Run directories: writability checked first, exclusive lock, checked records, strict JSON."""

import json
import math

import pytest

from cbcert.runs import directory
from cbcert.runs.directory import (
    KINDS,
    RecordsError,
    RunDirError,
    RunMismatchError,
    RunSummary,
    check_writable,
    open_run,
    read_records,
    run_kind,
    write_json,
)
from cbcert.schema import value_name


def test_out_under_a_file_or_read_only_is_refused_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match="is under the file"):
        check_writable(tmp_path / "f" / "a" / "b")
    with pytest.raises(RunDirError, match="is a file"):
        check_writable(tmp_path / "f")
    check_writable(tmp_path / "new" / "deeper")  # creatable
    # Root may write anywhere, so a read-only directory is simulated through os.access.
    monkeypatch.setattr(directory.os, "access", lambda path, mode: False)
    with pytest.raises(RunDirError, match="not writable"):
        check_writable(tmp_path / "new")


def _write(path, *records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_read_records_drops_a_torn_line_and_keys_records(tmp_path):
    path = tmp_path / "r.jsonl"
    a, b = {"index": 1, "v": 2, "seconds": 0.5}, {"index": 2, "v": 3, "seconds": 0.1}
    _write(path, a, b, {**a, "seconds": 9.0}, tail='{"index": 3, "v"')
    records = read_records(path, key=lambda r: r["index"])
    assert records == [a, b]  # the re-timed copy of a collapses, the torn line is gone
    assert path.read_text().endswith("}\n")
    _write(path, a, {**a, "v": 7})
    with pytest.raises(RecordsError, match="line 2: conflicts with line 1"):
        read_records(path, key=lambda r: r["index"])
    _write(path, a, ["not", "an", "object"])
    with pytest.raises(RecordsError, match="line 2: expected a JSON object"):
        read_records(path, key=lambda r: r["index"])
    _write(path, {"v": 1})
    with pytest.raises(RecordsError, match="line 1: record lacks the field 'index'"):
        read_records(path, key=lambda r: r["index"])


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_read_records_refuses_a_bare_nan_or_infinity_token(tmp_path, token):
    """Records are strict JSON (`json_line`): a line with such a token is damaged, as a
    malformed line is, not a record with a float."""
    path = tmp_path / "r.jsonl"
    path.write_text(f'{{"index": 1, "v": 2}}\n{{"index": 2, "v": {token}}}\n')
    with pytest.raises(RecordsError, match=f"line 2: not a JSON record .*{token}"):
        read_records(path, key=lambda r: r["index"])


def test_a_rerun_with_other_settings_names_the_first_difference(tmp_path):
    meta = {"job": {"n": 200, "models": ["std", "cbm"], "schedule": "sequential"},
            "world": "builtin:default"}
    open_run(tmp_path, meta)
    open_run(tmp_path, json.loads(json.dumps(meta)))  # the same settings resume
    changes = [({"job": {**meta["job"], "n": 100}}, "job.n = 200 there, 100 now"),
               ({"world": "k8"}, "world = 'builtin:default' there, 'k8' now"),
               ({"job": {"n": 200, "models": ["std", "cbm"]}},
                "job.schedule = 'sequential' there, absent now")]
    for change, named in changes:
        with pytest.raises(RunMismatchError) as err:
            open_run(tmp_path, {**meta, **change})
        assert named in str(err.value) and "'std'" not in str(err.value), str(err.value)


def test_settings_left_free_are_recorded_but_not_compared(tmp_path):
    meta = {"job": {"n": 200, "batch": 10}, "world": "w"}
    open_run(tmp_path, meta, free=("job.batch",))
    open_run(tmp_path, {**meta, "job": {"n": 200, "batch": 3}}, free=("job.batch",))
    assert json.loads((tmp_path / "run.json").read_text()) == meta
    with pytest.raises(RunMismatchError, match="job.n = 200 there, 201 now"):
        open_run(tmp_path, {**meta, "job": {"n": 201, "batch": 3}}, free=("job.batch",))


def test_run_json_names_its_kind_first_and_a_rerun_of_another_kind_is_refused(tmp_path):
    meta = {"job": {"n": 200}, "world": "w"}
    open_run(tmp_path, meta, {"versions": {}}, kind="attack")
    written = json.loads((tmp_path / "run.json").read_text())
    assert list(written) == ["kind", "job", "world", "versions"]
    assert written["kind"] == "attack" and run_kind(written) == "attack"
    open_run(tmp_path, meta, kind="attack")  # the same kind and settings resume
    with pytest.raises(RunMismatchError, match="holds a 'attack' run, not a certify run"):
        open_run(tmp_path, meta, kind="certify")


def test_a_directory_from_before_run_json_named_its_kind_still_resumes(tmp_path):
    meta = {"job": {"noise": "gaussian", "n": 200}, "world": "w"}
    (tmp_path / "run.json").write_text(json.dumps(meta))
    open_run(tmp_path, meta, kind="certify")  # no "kind" there: its settings decide
    assert json.loads((tmp_path / "run.json").read_text()) == meta  # left as it was
    with pytest.raises(RunMismatchError, match="job.n = 200 there, 100 now"):
        open_run(tmp_path, {"job": {"noise": "gaussian", "n": 100}, "world": "w"},
                 kind="certify")


def test_the_kind_is_read_from_run_json_or_told_by_an_old_layout():
    for kind in KINDS:  # the kind written wins over any layout
        assert run_kind({"kind": kind, "settings": {}}) == kind
    old = {"explain": {"explain": {}}, "perturb": {"settings": {}}, "classes": {"classes": {}},
           "certify": {"job": {"noise": "gaussian"}},
           "attack": {"job": {"eps": [0.1], "space": "latent"}}}
    for kind, run in old.items():
        assert run_kind({**run, "world": "w"}) == kind
    with pytest.raises(ValueError, match="unknown kind 'sample'"):
        run_kind({"kind": "sample"})
    with pytest.raises(ValueError, match="unknown layout"):
        run_kind({"job": [1]})


def test_a_run_summary_reads_as_the_summary_it_wrote():
    result = RunSummary("perturb", {"budgets": [], "pool": {}}, {"rows": ()})
    assert result == {"budgets": [], "pool": {}} and dict(result) == result.summary
    assert result["budgets"] == [] and "pool" in result and len(result) == 2
    assert result.kind == "perturb" and result.extras["rows"] == ()
    assert RunSummary("classes", {"a": 1}).extras == {}


def test_strict_json_refuses_nan_and_infinity(tmp_path):
    write_json(tmp_path / "ok.json", {"a": None})
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            write_json(tmp_path / "s.json", {"t": bad})
    assert not (tmp_path / "s.json").exists()


def test_value_names_are_exact():
    assert [value_name(v) for v in (0.1, 0.05, 2.0, 5, 1e-05)] == ["0.1", "0.05", "2", "5",
                                                                   "1e-05"]
    assert value_name(0.1000001) == "0.1000001" and value_name(0.30000000000000004) != "0.3"


def test_read_json_names_a_file_nested_too_deeply(tmp_path):
    (tmp_path / "run.json").write_text("[" * 100_000)
    with pytest.raises(RecordsError, match="run.json: damaged, arrays or objects nested too "
                                           "deeply to read; delete the directory"):
        directory.read_json(tmp_path / "run.json")
