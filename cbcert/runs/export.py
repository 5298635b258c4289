"""Exports of a certification run's records to other tools' formats.

``cohen``: the TSV that locuslab/smoothing's ``certify.py`` (and ``predict.py``) write, one file
per model, so their analysis scripts (and anyone used to them) read cbcert's results::

    idx	label	predict	radius	correct	time          (certify)
    idx	label	predict	correct	time                  (predict)

``idx`` is the input's index (the dataset index for a pixels world, the pool index for a
generated one), ``label`` the reference label, ``predict`` the smoothed prediction (−1 =
abstain), ``radius`` the certified radius (0.0 when abstaining, as the reference writes; full
float precision, where the reference rounds to 3 significant digits), ``correct`` 1 or 0,
``time`` the input's wall time as ``H:MM:SS.ffffff`` (``str(datetime.timedelta)``, as the
reference).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cbcert.runs.directory import is_writer

FORMATS = ("cohen",)


def cohen_rows(records: list[dict], model: str, mode: str) -> list[str]:
    """The TSV lines (header first) of one model's records, sorted by input index."""
    rows = sorted((r for r in records if r["model"] == model), key=lambda r: r["index"])
    header = ["idx", "label", "predict", *(["radius"] if mode == "certify" else []),
              "correct", "time"]
    lines = ["\t".join(header)]
    for r in rows:
        fields = [str(r["index"]), str(r["label"]), str(r["prediction"])]
        if mode == "certify":
            fields.append(repr(float(r["radius"])) if r["radius"] is not None else "0.0")
        fields += [str(int(r["correct"])), str(datetime.timedelta(seconds=r["seconds"]))]
        lines.append("\t".join(fields))
    return lines


def write_cohen(out: Path, records: list[dict], models: tuple[str, ...],
                mode: str) -> list[Path]:
    """Write ``out/cohen-<model>.tsv`` for every model (process 0 only); return the paths."""
    paths = []
    for model in models:
        path = Path(out) / f"cohen-{model}.tsv"
        if is_writer():
            text = "\n".join(cohen_rows(records, model, mode)) + "\n"
            tmp = path.with_suffix(".tsv.tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        paths.append(path)
    return paths


__all__ = ["FORMATS", "cohen_rows", "write_cohen"]
