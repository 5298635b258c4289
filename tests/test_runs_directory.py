"""Run directories: writability checked first, exclusive lock, checked records, strict JSON."""

import json
import math

import pytest

from cbcert.runs import directory
from cbcert.runs.directory import (
    RecordsError,
    RunDirError,
    check_writable,
    read_records,
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
