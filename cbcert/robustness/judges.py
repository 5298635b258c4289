"""The council of judges: score files read back from disk, and how far the judges agree (SPEC §8).

Pure numpy in float64, on host, like `cbcert.robustness.stats`. Each judge (a person or a
model) scores explanations on the ``[1, 9]`` scale of `cbcert.robustness.explain.JUDGE_RANGE`
and writes one JSONL file; `read_scores` checks it line by line, `score_matrix` lines the judges
up on a common list of items, and `krippendorff_alpha` measures their reliability.

Array conventions: ``J`` judges (Krippendorff's coders/observers), ``N`` items (units); NaN
marks an item a judge did not score.

Score file format, one JSON object per line (blank lines ignored)::

    {"judge": "<name>", "id": "<item id>", "score": <number>}

Other keys on a line (a judge's rationale, say) are allowed and ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from os import PathLike

import numpy as np

METRICS = ("nominal", "ordinal", "interval", "ratio")


def _delta2(values: np.ndarray, n_c: np.ndarray, metric: str) -> np.ndarray:
    """``[V, V]`` squared difference ``δ²_ck`` between the sorted distinct values ``[V]``."""
    c, k = values[:, None], values[None, :]
    if metric == "nominal":
        return (c != k).astype(np.float64)
    if metric == "interval":
        return (c - k) ** 2
    if metric == "ratio":
        total = c + k
        with np.errstate(invalid="ignore", divide="ignore"):
            d = np.where(total == 0.0, 0.0, (c - k) / total)
        return d**2
    # ordinal: the rank distance Σ_{g=c..k} n_g − (n_c + n_k)/2, with n_g the value marginals.
    cum = np.concatenate([[0.0], np.cumsum(n_c)])  # cum[i] = Σ_{g<i} n_g
    i = np.arange(len(values))
    lo, hi = np.minimum(i[:, None], i[None, :]), np.maximum(i[:, None], i[None, :])
    between = cum[hi + 1] - cum[lo]
    return (between - (n_c[:, None] + n_c[None, :]) / 2.0) ** 2


def krippendorff_alpha(ratings: np.ndarray, metric: str = "interval") -> float:
    """Krippendorff's α, the chance-corrected agreement of ``J`` judges on ``N`` items.

    The coincidence-matrix formulation of Krippendorff (2011), "Computing Krippendorff's
    Alpha-Reliability". Units with fewer than two ratings are not pairable and are dropped. A
    unit ``u`` with ``m_u`` ratings contributes every ordered pair of its ratings (from distinct
    judges) to the coincidences, weighted ``1 / (m_u − 1)``::

        o_ck = Σ_u  #{ordered pairs (c, k) in u} / (m_u − 1),   n_c = Σ_k o_ck,   n = Σ_c n_c
        α    = 1 − (n − 1) · Σ_ck o_ck δ²_ck / Σ_ck n_c n_k δ²_ck

    with ``δ²_ck`` by metric: nominal ``1[c ≠ k]``; ordinal
    ``(Σ_{g=c..k} n_g − (n_c + n_k)/2)²`` over the ordered distinct values; interval
    ``(c − k)²``; ratio ``((c − k) / (c + k))²``.

    Args:
      ratings: [J, N] float, NaN where a judge did not rate an item.
      metric: one of "nominal", "ordinal", "interval", "ratio".

    Returns:
      α as a float: 1 for perfect agreement, 0 for agreement at chance level, negative below.
      NaN when undefined: fewer than two pairable values, or no expected disagreement (every
      pairable value identical).
    """
    if metric not in METRICS:
        raise ValueError(f"krippendorff_alpha: metric must be one of {METRICS}, got {metric!r}")
    ratings = np.asarray(ratings, dtype=np.float64)
    if ratings.ndim != 2:
        raise ValueError(f"krippendorff_alpha: ratings must be [J, N] (judges × items), "
                         f"got shape {ratings.shape}")
    present = ~np.isnan(ratings)  # [J, N]
    m_u = present.sum(axis=0)  # [N]
    pairable = m_u >= 2
    ratings, present, m_u = ratings[:, pairable], present[:, pairable], m_u[pairable]
    if m_u.sum() < 2:
        return math.nan
    values = np.unique(ratings[present])  # [V] sorted
    index = np.searchsorted(values, np.where(present, ratings, values[0]))  # [J, N]
    counts = np.zeros((ratings.shape[1], len(values)))  # [N, V] n_uc
    unit = np.broadcast_to(np.arange(ratings.shape[1]), ratings.shape)
    np.add.at(counts, (unit[present], index[present]), 1.0)
    weight = 1.0 / (m_u - 1.0)  # [N]
    o = np.einsum("u,uc,uk->ck", weight, counts, counts)  # [V, V]
    o -= np.diag(weight @ counts)  # a rating is not paired with itself
    n_c = o.sum(axis=1)  # [V]
    n = n_c.sum()
    delta2 = _delta2(values, n_c, metric)
    expected = n_c @ delta2 @ n_c
    if expected == 0.0:
        return math.nan
    return float(1.0 - (n - 1.0) * np.sum(o * delta2) / expected)


class ScoreFileError(ValueError):
    """A judge's score file that cannot be used; the message starts with ``path:line: ``.

    Attributes:
      path: the file, as given.
      line: 1-based line number of the problem, or None for a problem of the whole file (then
        the message starts with ``path: ``).
    """

    def __init__(self, path: str, line: int | None, message: str):
        self.path = path
        self.line = line
        where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


@dataclass(frozen=True)
class JudgeScores:
    """One judge's scores: ``scores[item id] = score``, as read from `path`."""

    judge: str
    scores: dict[str, float]
    path: str


def _check_line(path: str, number: int, record: object) -> tuple[str, str, float]:
    """Return ``(judge, id, score)`` of one parsed line; ScoreFileError on a bad shape or type."""
    if not isinstance(record, dict):
        raise ScoreFileError(path, number, f"expected a JSON object, got {type(record).__name__}")
    for key in ("judge", "id", "score"):
        if key not in record:
            raise ScoreFileError(path, number, f"missing field {key!r}; each line needs "
                                 f'{{"judge": str, "id": str, "score": number}}')
    judge, item, score = record["judge"], record["id"], record["score"]
    if not isinstance(judge, str) or not judge:
        raise ScoreFileError(path, number, f"field 'judge' must be a non-empty string, "
                             f"got {judge!r}")
    if not isinstance(item, str):
        raise ScoreFileError(path, number, f"field 'id' must be a string, got {item!r}")
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        raise ScoreFileError(path, number, f"field 'score' must be a finite number, "
                             f"got {score!r}")
    return judge, item, float(score)


def read_scores(path: str | PathLike[str], ids: Collection[str], *, low: float = 1.0,
                high: float = 9.0) -> JudgeScores:
    """Read and check one judge's JSONL score file.

    Args:
      path: the file; one ``{"judge": str, "id": str, "score": number}`` object per line,
        blank lines ignored.
      ids: the valid item ids; a judge may score any subset of them.
      low, high: the allowed score range, inclusive.

    Returns:
      the judge's name (the same on every line) and its scores by item id.

    Raises:
      ScoreFileError: the file is unreadable or not UTF-8, a line is not a JSON object with the
        three fields of the right types, an id is unknown or repeated, a score is outside
        ``[low, high]``, the judge's name changes, or the file holds no scores at all.
    """
    path = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ScoreFileError(path, None, f"cannot read score file: {e}") from e
    valid = ids if isinstance(ids, set | frozenset | dict) else frozenset(ids)
    judge_name: str | None = None
    scores: dict[str, float] = {}
    first_line: dict[str, int] = {}
    # split on "\n" only: str.splitlines also breaks at \x1c, \u2028 etc. and would misnumber.
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ScoreFileError(path, number, f"not valid JSON ({e.msg})") from e
        judge, item, score = _check_line(path, number, record)
        if judge_name is None:
            judge_name = judge
        elif judge != judge_name:
            raise ScoreFileError(path, number, f"judge {judge!r} differs from {judge_name!r} "
                                 f"on the first line; one file holds one judge")
        if item not in valid:
            raise ScoreFileError(path, number, f"unknown item id {item!r}")
        if item in scores:
            raise ScoreFileError(path, number, f"duplicate item id {item!r}, first scored on "
                                 f"line {first_line[item]}")
        if not low <= score <= high:
            raise ScoreFileError(path, number, f"score {score!r} outside the allowed range "
                                 f"[{low}, {high}]")
        scores[item] = score
        first_line[item] = number
    if judge_name is None:
        raise ScoreFileError(path, None, "no scores in file")
    return JudgeScores(judge=judge_name, scores=scores, path=path)


def score_matrix(judges: Sequence[JudgeScores], ids: Sequence[str]) -> np.ndarray:
    """``[J, N]`` float64 scores, ``out[j, n] = judges[j].scores[ids[n]]``, NaN where unscored.

    Scores of items not in `ids` are left out; the result feeds `krippendorff_alpha`.
    """
    out = np.full((len(judges), len(ids)), np.nan)
    for j, judge in enumerate(judges):
        for n, item in enumerate(ids):
            if item in judge.scores:
                out[j, n] = judge.scores[item]
    return out


__all__ = ["METRICS", "JudgeScores", "ScoreFileError", "krippendorff_alpha", "read_scores",
           "score_matrix"]
