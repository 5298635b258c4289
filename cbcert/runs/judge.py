"""`certify judge`: a council's scores of a judge bundle read back into a report.

A bundle (`cbcert.runs.bundle`) lists items, one per judged input and explained model; each
judge scores items 1–9 in a JSONL file of its own (`cbcert.robustness.judges.read_scores`;
any number of judges, each scoring any subset). The built-in **known-answer scorer** (`1 + 8 ·
F1` of the cited concepts against the class-defining concepts present, the bundle's
``answers.jsonl``) can sit on the council as judge ``known-answer``. The report:

* ``models``: per model, the mean item score (an item's score is the mean of the judges who
  scored it) with a percentile bootstrap 95 % interval over items (2,000 resamples, ``seed``);
* ``judges``: per judge, its file, the items it scored and its mean per model;
* ``agreement``: Krippendorff's α over the whole council (interval and ordinal metrics, items
  with fewer than two scores left out; null with fewer than two judges or where α is
  undefined), and per pair of judges the pairwise ranking agreement over the items both
  scored (`cbcert.robustness.explain.pairwise_agreement`: the share of item pairs the two order
  alike, a tie by exactly one counting half);
* ``known_answer`` (bundles with answers): per judge (but the scorer itself), its pairwise
  agreement and interval α
  with the known-answer scores over the items both have — how far a judge can be trusted where
  nobody knows the answer;
* ``comparisons``: per pair of models, over the inputs where both have an item score, the mean
  difference and the paired sign-flip permutation test (`cbcert.robustness.stats`), Holm over
  the pairs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from cbcert.robustness import judges as jd
from cbcert.robustness import stats
from cbcert.robustness.explain import bootstrap_ci, pairwise_agreement
from cbcert.runs.bundle import FORMAT, MANIFEST, VERSION

KNOWN_ANSWER = "known-answer"
REPORT = "judge.json"


class BundleError(ValueError):
    """A bundle directory that cannot be read: names the file (and line)."""


@dataclass(frozen=True)
class Bundle:
    """A bundle read back: ``manifest`` (``bundle.json``), ``items`` (``items.jsonl``),
    ``answers`` (item id → known-answer score; empty without) and its ``path``."""

    manifest: dict[str, Any]
    items: list[dict[str, Any]]
    answers: dict[str, float]
    path: Path

    @property
    def ids(self) -> list[str]:
        return [item["id"] for item in self.items]


def _jsonl(path: Path) -> list[dict]:
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError as err:
                raise BundleError(f"{path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                raise BundleError(f"{path}:{number}: expected an object with a string \"id\"")
            out.append(record)
    return out


def read_bundle(path: str | Path) -> Bundle:
    """Read a bundle directory; `BundleError` naming the file (and line) when it is not one
    (no manifest, another format or version, unreadable or duplicate items)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BundleError(f"{manifest_path}: not a judge bundle's manifest ({err})") from None
    if not isinstance(manifest, dict) or (manifest.get("format"), manifest.get("version")) != (
            FORMAT, VERSION):
        raise BundleError(f"{manifest_path}: expected format {FORMAT!r} version {VERSION}")
    try:
        items = _jsonl(path / manifest["items"])
        answers = _jsonl(path / manifest["answers"]) if manifest.get("answers") else []
    except OSError as err:
        raise BundleError(f"{path}: {err}") from None
    seen: dict[str, int] = {}
    for number, item in enumerate(items, 1):
        if item["id"] in seen:
            raise BundleError(f"{path / manifest['items']}: item {item['id']!r} twice")
        seen[item["id"]] = number
    return Bundle(manifest, items, {a["id"]: float(a["known_answer"]) for a in answers}, path)


def known_answer_judge(bundle: Bundle) -> jd.JudgeScores:
    """The known-answer scorer as a judge (its scores: the bundle's answers)."""
    if not bundle.answers:
        raise BundleError(f"{bundle.path}: the bundle has no known answer (its world has no "
                          "class rule)")
    return jd.JudgeScores(KNOWN_ANSWER, dict(bundle.answers),
                          str(bundle.path / bundle.manifest["answers"]))


def _interval(values: np.ndarray, seed: int) -> dict[str, float] | None:
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    mean, low, high = bootstrap_ci(values, seed=seed, resamples=2000)
    return {"mean": mean, "low": low, "high": high, "items": int(len(values))}


def _alpha(matrix: np.ndarray, metric: str) -> float | None:
    value = jd.krippendorff_alpha(matrix, metric) if len(matrix) >= 2 else float("nan")
    return None if np.isnan(value) else float(value)


def _pairwise(a: np.ndarray, b: np.ndarray) -> tuple[float | None, int]:
    both = ~np.isnan(a) & ~np.isnan(b)
    value = pairwise_agreement(a[both], b[both])
    return (None if np.isnan(value) else value), int(both.sum())


def _plain_mean(values: np.ndarray) -> float | None:
    values = values[~np.isnan(values)]
    return float(values.mean()) if len(values) else None


def _mean(rows: np.ndarray) -> np.ndarray:
    """Column means over the non-NaN entries of ``rows[J, N]`` (NaN where none)."""
    count = (~np.isnan(rows)).sum(axis=0)
    total = np.nansum(rows, axis=0)
    return np.divide(total, count, out=np.full(rows.shape[1], np.nan), where=count > 0)


def report(bundle: Bundle, council: list[jd.JudgeScores], *, seed: int = 0) -> dict[str, Any]:
    """The report of ``council``'s scores on ``bundle`` (module docstring); ValueError for
    no judge or two judges of one name."""
    names = [j.judge for j in council]
    if not council or len(set(names)) != len(names):
        raise ValueError(f"judges {names}: need at least one judge, each name once")
    ids, models = bundle.ids, list(bundle.manifest["models"])
    model_of = np.array([item["model"] for item in bundle.items])
    input_of = np.array([item["input"] for item in bundle.items])
    matrix = jd.score_matrix(council, ids)  # [J, N]
    item_score = _mean(matrix)
    out: dict[str, Any] = {
        "bundle": str(bundle.path), "world": bundle.manifest["world"], "items": len(ids),
        "models": {m: _interval(item_score[model_of == m], seed) for m in models},
        "judges": [{"judge": j.judge, "path": j.path, "scored": len(j.scores),
                    "means": {m: _plain_mean(row[model_of == m]) for m in models}}
                   for j, row in zip(council, matrix, strict=True)],
        "agreement": {"krippendorff_alpha": {metric: _alpha(matrix, metric)
                                             for metric in ("interval", "ordinal")},
                      "pairwise": []},
        "known_answer": None, "comparisons": []}
    for (a, ra), (b, rb) in combinations(zip(names, matrix, strict=True), 2):
        value, count = _pairwise(ra, rb)
        out["agreement"]["pairwise"].append({"judge_a": a, "judge_b": b, "agreement": value,
                                             "items": count})
    if bundle.answers:
        known = np.array([bundle.answers.get(i, np.nan) for i in ids])
        out["known_answer"] = {}
        for name, row in zip(names, matrix, strict=True):
            if name == KNOWN_ANSWER:  # the scorer itself: agreement 1 by construction
                continue
            value, count = _pairwise(row, known)
            out["known_answer"][name] = {"pairwise": value, "items": count,
                                         "alpha_interval": _alpha(np.stack([row, known]),
                                                                  "interval")}
    out["comparisons"] = _comparisons(models, model_of, input_of, item_score)
    return out


def _comparisons(models, model_of, input_of, item_score) -> list[dict[str, Any]]:
    """Paired permutation tests of every model pair over the inputs both have scores for."""
    rows = []
    for a, b in combinations(models, 2):
        score_a = {int(i): s for i, s in zip(input_of[model_of == a], item_score[model_of == a],
                                             strict=True) if not np.isnan(s)}
        score_b = {int(i): s for i, s in zip(input_of[model_of == b], item_score[model_of == b],
                                             strict=True) if not np.isnan(s)}
        shared = sorted(set(score_a) & set(score_b))
        if not shared:
            continue
        x, y = np.array([score_a[i] for i in shared]), np.array([score_b[i] for i in shared])
        test = stats.paired_permutation_test(x, y)
        rows.append({"model_a": a, "model_b": b, "inputs": len(shared),
                     "delta": float(np.mean(x - y)), "pvalue": float(test.pvalue)})
    if rows:
        for row, adjusted in zip(rows, stats.holm(np.array([r["pvalue"] for r in rows])),
                                 strict=True):
            row["pvalue_holm"] = float(adjusted)
    return rows


__all__ = ["KNOWN_ANSWER", "REPORT", "Bundle", "BundleError", "known_answer_judge",
           "read_bundle", "report"]
