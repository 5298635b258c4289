"""Exports of run records (`cbcert.runs.export`): locuslab/smoothing's TSV columns."""

from cbcert.runs.export import cohen_rows, write_cohen

RECORDS = [
    {"index": 7, "model": "std", "label": 2, "prediction": 2, "radius": 0.123456789012,
     "correct": True, "seconds": 1.5, "p_value": 0.001},
    {"index": 3, "model": "std", "label": 1, "prediction": -1, "radius": None,
     "correct": False, "seconds": 62.25, "p_value": 0.5},
    {"index": 3, "model": "cbm", "label": 1, "prediction": 0, "radius": 0.5,
     "correct": False, "seconds": 62.25, "p_value": 0.01},
]


def test_certify_columns_sorted_by_index_abstain_as_reference():
    lines = cohen_rows(RECORDS, "std", "certify")
    assert lines == ["idx\tlabel\tpredict\tradius\tcorrect\ttime",
                     "3\t1\t-1\t0.0\t0\t0:01:02.250000",
                     "7\t2\t2\t0.123456789012\t1\t0:00:01.500000"]


def test_predict_columns_have_no_radius():
    assert cohen_rows(RECORDS, "cbm", "predict") == ["idx\tlabel\tpredict\tcorrect\ttime",
                                                     "3\t1\t0\t0\t0:01:02.250000"]


def test_one_file_per_model(tmp_path):
    paths = write_cohen(tmp_path, RECORDS, ("std", "cbm"), "certify")
    assert [p.name for p in paths] == ["cohen-std.tsv", "cohen-cbm.tsv"]
    assert paths[1].read_text().splitlines()[1] == "3\t1\t0\t0.5\t0\t0:01:02.250000"
    assert not list(tmp_path.glob("*.tmp"))
