"""Tests of cbcert.robustness.judges: Krippendorff's α, judge score files, the score matrix."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re

import numpy as np
import pytest

from cbcert.robustness import judges
from cbcert.robustness.judges import JudgeScores, ScoreFileError, krippendorff_alpha

NAN = np.nan
METRICS = ("nominal", "ordinal", "interval", "ratio")

# Krippendorff (2011), "Computing Krippendorff's Alpha-Reliability", the example with missing
# data: observers A, B, C, D (rows) × units 1..12 (columns).
KRIPPENDORFF_2011 = np.array([
    [1, 2, 3, 3, 2, 1, 4, 1, 2, NAN, NAN, NAN],
    [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, NAN, 3],
    [NAN, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, NAN],
    [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, NAN],
])


def _random_ratings(rng: np.random.Generator, n_judges: int, n_items: int) -> np.ndarray:
    """[J, N] integer scores in 1..9 with about a quarter missing."""
    ratings = rng.integers(1, 10, size=(n_judges, n_items)).astype(np.float64)
    ratings[rng.random(ratings.shape) < 0.25] = NAN
    return ratings


def _reference_alpha(ratings: np.ndarray, metric: str) -> float:
    """α from its pairwise definition, one pair of ratings at a time (no coincidence matrix).

    ``α = 1 − (n − 1) Σ_u Σ_{i≠j ∈ u} δ²(v_i, v_j) / (m_u − 1)  /  Σ_{i≠j} δ²(v_i, v_j)``,
    the second sum over all ordered pairs of pairable values; ordinal ``δ`` counts the pairable
    values between c and k (both included) less half of those equal to c and to k.
    """
    units = [col[~np.isnan(col)] for col in ratings.T]
    units = [u for u in units if len(u) >= 2]
    pooled = np.concatenate(units)

    def delta2(c: float, k: float) -> float:
        if metric == "nominal":
            return float(c != k)
        if metric == "interval":
            return (c - k) ** 2
        if metric == "ratio":
            return ((c - k) / (c + k)) ** 2
        lo, hi = min(c, k), max(c, k)
        between = np.sum((pooled >= lo) & (pooled <= hi))
        return (between - (np.sum(pooled == c) + np.sum(pooled == k)) / 2) ** 2

    observed = sum(delta2(u[i], u[j]) / (len(u) - 1)
                   for u in units for i, j in itertools.permutations(range(len(u)), 2))
    expected = sum(delta2(pooled[i], pooled[j])
                   for i, j in itertools.permutations(range(len(pooled)), 2))
    return 1.0 - (len(pooled) - 1) * observed / expected


# --- Krippendorff's α: known answers ---------------------------------------------------------


@pytest.mark.parametrize("metric, published", [
    ("nominal", 0.743), ("ordinal", 0.815), ("interval", 0.849), ("ratio", 0.797)])
def test_alpha_matches_krippendorff_2011_example(metric, published):
    alpha = krippendorff_alpha(KRIPPENDORFF_2011, metric)
    assert alpha == pytest.approx(published, abs=5e-4)


def test_alpha_interval_hand_computed():
    # Judges (1, 2, 3) and (1, 3, 3): every unit has m_u = 2, weight 1/(m_u − 1) = 1.
    # Coincidences: unit 1 gives o_11 = 2, unit 2 gives o_23 = o_32 = 1, unit 3 gives o_33 = 2.
    # Marginals n_1 = 2, n_2 = 1, n_3 = 3, n = 6.
    # Σ o_ck δ² = o_23·1 + o_32·1 = 2.
    # Σ n_c n_k δ² = 2·(n_1 n_2·1 + n_1 n_3·4 + n_2 n_3·1) = 2·(2 + 24 + 3) = 58.
    # α = 1 − (n − 1)·2/58 = 1 − 10/58 = 24/29.
    ratings = np.array([[1.0, 2.0, 3.0], [1.0, 3.0, 3.0]])
    assert krippendorff_alpha(ratings, "interval") == pytest.approx(24 / 29, abs=1e-12)


def test_alpha_default_metric_is_interval():
    assert krippendorff_alpha(KRIPPENDORFF_2011) == krippendorff_alpha(KRIPPENDORFF_2011,
                                                                        "interval")


# --- Krippendorff's α: reference --------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("seed", range(5))
def test_alpha_matches_pairwise_reference(metric, seed):
    ratings = _random_ratings(np.random.default_rng(seed), n_judges=4, n_items=15)
    assert krippendorff_alpha(ratings, metric) == pytest.approx(
        _reference_alpha(ratings, metric), abs=1e-12)


# --- Krippendorff's α: properties -------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
def test_alpha_perfect_agreement_is_one(metric):
    row = np.array([1.0, 4.0, 9.0, 4.0, 2.0])
    ratings = np.stack([row, row, row])
    ratings[1, 0] = NAN  # missing ratings do not break agreement
    assert krippendorff_alpha(ratings, metric) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("a, b", [(2.0, -3.0), (0.1, 100.0), (7.0, 0.0)])
def test_alpha_interval_invariant_under_affine_map(a, b):
    ratings = _random_ratings(np.random.default_rng(1), n_judges=3, n_items=20)
    assert krippendorff_alpha(a * ratings + b, "interval") == pytest.approx(
        krippendorff_alpha(ratings, "interval"), abs=1e-12)


@pytest.mark.parametrize("metric", METRICS)
def test_alpha_invariant_under_permuting_units_and_judges(metric):
    rng = np.random.default_rng(2)
    ratings = _random_ratings(rng, n_judges=5, n_items=12)
    permuted = ratings[rng.permutation(5)][:, rng.permutation(12)]
    assert krippendorff_alpha(permuted, metric) == pytest.approx(
        krippendorff_alpha(ratings, metric), abs=1e-12)


@pytest.mark.parametrize("metric", METRICS)
def test_alpha_ignores_units_with_one_rating(metric):
    extra = np.array([[NAN], [NAN], [7.0], [NAN]])
    with_single = np.concatenate([KRIPPENDORFF_2011, extra], axis=1)
    assert krippendorff_alpha(with_single, metric) == krippendorff_alpha(KRIPPENDORFF_2011,
                                                                          metric)


@pytest.mark.parametrize("metric", METRICS)
def test_alpha_nan_when_all_ratings_identical(metric):
    assert math.isnan(krippendorff_alpha(np.full((3, 4), 5.0), metric))


@pytest.mark.parametrize("ratings", [
    np.array([[1.0, NAN, 3.0], [NAN, 2.0, NAN]]),  # every unit has one rating: none pairable
    np.array([[1.0, 2.0, 3.0]]),  # a single judge
    np.full((2, 3), NAN),  # nothing rated
    np.empty((2, 0)),  # no units
])
def test_alpha_nan_without_pairable_values(ratings):
    assert math.isnan(krippendorff_alpha(ratings, "interval"))


def test_alpha_nan_when_only_pairable_unit_agrees():
    # One pairable unit whose two ratings agree: no expected disagreement.
    assert math.isnan(krippendorff_alpha(np.array([[4.0, 1.0], [4.0, NAN]]), "interval"))


def test_alpha_below_zero_for_systematic_disagreement():
    ratings = np.array([[1.0, 9.0, 1.0, 9.0], [9.0, 1.0, 9.0, 1.0]])
    assert krippendorff_alpha(ratings, "interval") < 0.0


# --- Krippendorff's α: errors -----------------------------------------------------------------


def test_alpha_rejects_unknown_metric():
    with pytest.raises(ValueError, match=r"metric must be one of .*'nominal'.*'ratio'.*'cosine'"):
        krippendorff_alpha(KRIPPENDORFF_2011, "cosine")


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)])
def test_alpha_rejects_bad_ndim(shape):
    with pytest.raises(ValueError, match=r"\[J, N\].*" + re.escape(str(shape))):
        krippendorff_alpha(np.ones(shape), "interval")


# --- read_scores ------------------------------------------------------------------------------

IDS = ("a", "b", "c")


def _write(tmp_path, lines: list[str] | str, name: str = "judge.jsonl") -> str:
    path = tmp_path / name
    path.write_text(lines if isinstance(lines, str) else "\n".join(lines) + "\n",
                    encoding="utf-8")
    return str(path)


def _line(judge: object = "gpt", item: object = "a", score: object = 5, **extra) -> str:
    return json.dumps({"judge": judge, "id": item, "score": score, **extra})


@contextlib.contextmanager
def _raises(path: str, line: int | None, match: str):
    """pytest.raises for a ScoreFileError at `line` whose message also contains `match`."""
    prefix = f"{path}:{line}: " if line is not None else f"{path}: "
    with pytest.raises(ScoreFileError) as info:
        yield info
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.path, err.line) == (path, line)
    assert str(err).startswith(prefix), str(err)
    assert match in str(err), str(err)


def test_read_scores_round_trip(tmp_path):
    path = _write(tmp_path, ["", _line(item="a", score=1), "   ",
                             _line(item="c", score=8.5, rationale="clear"), ""])
    got = judges.read_scores(path, IDS)
    assert got == JudgeScores(judge="gpt", scores={"a": 1.0, "c": 8.5}, path=path)
    assert all(type(s) is float for s in got.scores.values())


def test_read_scores_accepts_path_objects_and_custom_range(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text(_line(score=0) + "\n" + _line(item="b", score=1), encoding="utf-8")
    got = judges.read_scores(path, {"a", "b"}, low=0.0, high=1.0)
    assert got.scores == {"a": 0.0, "b": 1.0}
    assert got.path == str(path)


def test_read_scores_missing_file(tmp_path):
    path = str(tmp_path / "absent.jsonl")
    with _raises(path, None, "cannot read"):
        judges.read_scores(path, IDS)


def test_read_scores_not_utf8(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"judge": "jos\xe9", "id": "a", "score": 5}\n'.encode("latin-1"))
    with _raises(str(path), None, "cannot read"):
        judges.read_scores(path, IDS)


def test_read_scores_invalid_json(tmp_path):
    path = _write(tmp_path, [_line(), '{"judge": "gpt", "id": "b", "score": 5'])
    with _raises(path, 2, "not valid JSON"):
        judges.read_scores(path, IDS)


@pytest.mark.parametrize("text", ["[1, 2, 3]", '"a"', "5"])
def test_read_scores_line_not_an_object(tmp_path, text):
    path = _write(tmp_path, [_line(), text])
    with _raises(path, 2, "expected a JSON object"):
        judges.read_scores(path, IDS)


@pytest.mark.parametrize("field", ["judge", "id", "score"])
def test_read_scores_missing_field(tmp_path, field):
    record = {"judge": "gpt", "id": "b", "score": 5}
    del record[field]
    path = _write(tmp_path, [_line(), json.dumps(record)])
    with _raises(path, 2, f"missing field '{field}'"):
        judges.read_scores(path, IDS)


@pytest.mark.parametrize("judge", ["", 3, None, ["gpt"]])
def test_read_scores_bad_judge_type(tmp_path, judge):
    path = _write(tmp_path, [_line(judge=judge)])
    with _raises(path, 1, "'judge' must be a non-empty string"):
        judges.read_scores(path, IDS)


@pytest.mark.parametrize("item", [1, None, ["a"]])
def test_read_scores_bad_id_type(tmp_path, item):
    path = _write(tmp_path, [_line(item=item)])
    with _raises(path, 1, "'id' must be a string"):
        judges.read_scores(path, IDS)


@pytest.mark.parametrize("score", ["5", True, None, [5]])
def test_read_scores_bad_score_type(tmp_path, score):
    path = _write(tmp_path, [_line(item="b"), _line(item="c", score=score)])
    with _raises(path, 2, "'score' must be a finite number"):
        judges.read_scores(path, IDS)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_read_scores_non_finite_score(tmp_path, token):
    path = _write(tmp_path, ['{"judge": "gpt", "id": "a", "score": ' + token + "}"])
    with _raises(path, 1, "'score' must be a finite number"):
        judges.read_scores(path, IDS)


def test_read_scores_unknown_id(tmp_path):
    path = _write(tmp_path, [_line(item="a"), _line(item="zebra")])
    with _raises(path, 2, "unknown item id 'zebra'"):
        judges.read_scores(path, IDS)


def test_read_scores_duplicate_id(tmp_path):
    path = _write(tmp_path, [_line(item="b"), "", _line(item="a"), _line(item="b", score=6)])
    with _raises(path, 4, "duplicate item id 'b', first scored on line 1"):
        judges.read_scores(path, IDS)


@pytest.mark.parametrize("score", [0.5, 9.25, -1])
def test_read_scores_score_out_of_range(tmp_path, score):
    path = _write(tmp_path, [_line(item="a", score=9), _line(item="b", score=score)])
    with _raises(path, 2, f"score {float(score)!r} outside the allowed range [1.0, 9.0]"):
        judges.read_scores(path, IDS)


def test_read_scores_judge_changes(tmp_path):
    path = _write(tmp_path, [_line(judge="gpt", item="a"), _line(judge="gpt", item="b"),
                             _line(judge="claude", item="c")])
    with _raises(path, 3, "judge 'claude' differs from 'gpt'"):
        judges.read_scores(path, IDS)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_read_scores_empty_file(tmp_path, text):
    path = _write(tmp_path, text)
    with _raises(path, None, "no scores"):
        judges.read_scores(path, IDS)


def test_read_scores_line_numbers_count_blank_lines_and_crlf(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b"\r\n".join([_line(item="a").encode(), b"", _line(item="q").encode()]))
    with _raises(str(path), 3, "unknown item id 'q'"):
        judges.read_scores(path, IDS)


# --- score_matrix -----------------------------------------------------------------------------


def test_score_matrix_places_nan_where_unscored():
    council = [
        JudgeScores("gpt", {"a": 1.0, "c": 3.0}, "gpt.jsonl"),
        JudgeScores("claude", {"b": 5.0, "c": 6.0, "extra": 9.0}, "claude.jsonl"),
        JudgeScores("mute", {}, "mute.jsonl"),
    ]
    got = judges.score_matrix(council, ["c", "a", "b"])
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [[3.0, 1.0, NAN], [6.0, NAN, 5.0], [NAN, NAN, NAN]])


def test_score_matrix_feeds_alpha(tmp_path):
    ids = [str(n + 1) for n in range(12)]
    council = []
    for name, row in zip("ABCD", KRIPPENDORFF_2011, strict=True):
        lines = [_line(judge=name, item=i, score=s)
                 for i, s in zip(ids, row, strict=True) if not np.isnan(s)]
        council.append(judges.read_scores(_write(tmp_path, lines, f"{name}.jsonl"), ids,
                                          high=5.0))
    np.testing.assert_array_equal(judges.score_matrix(council, ids), KRIPPENDORFF_2011)
    assert krippendorff_alpha(judges.score_matrix(council, ids), "ordinal") == pytest.approx(
        0.815, abs=5e-4)
