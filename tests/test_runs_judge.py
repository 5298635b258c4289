"""`certify judge` (`cbcert.runs.judge`): a council's scores read back against a bundle,
checked on a hand-computed case, and bad bundles and score files refused with exit 2. The round
trip from a real explain run is in tests/test_runs_explain.py."""

import json

import pytest
from click.testing import CliRunner

from cbcert import cli
from cbcert.robustness.judges import JudgeScores
from cbcert.runs import bundle
from cbcert.runs.judge import KNOWN_ANSWER, BundleError, known_answer_judge, read_bundle, report

# Two models on three inputs; judge A skips 2-proto. Known answers for the cbm items only.
A = {"0-cbm": 9, "1-cbm": 7, "2-cbm": 5, "0-proto": 3, "1-proto": 1}
B = {"0-cbm": 8, "1-cbm": 7, "2-cbm": 6, "0-proto": 2, "1-proto": 2, "2-proto": 4}
KNOWN = {"0-cbm": 9.0, "1-cbm": 5.0, "2-cbm": 1.0}


def _bundle(folder, answers=True):
    folder.mkdir()
    items = [{"schema": bundle.ITEM_SCHEMA, "id": f"{i}-{m}", "input": i, "model": m}
             for m in ("cbm", "proto") for i in range(3)]
    (folder / bundle.ITEMS).write_text("".join(json.dumps(x) + "\n" for x in items))
    if answers:
        (folder / bundle.ANSWERS).write_text("".join(
            json.dumps({"id": i, "known_answer": s}) + "\n" for i, s in KNOWN.items()))
    (folder / bundle.MANIFEST).write_text(json.dumps({
        "format": bundle.FORMAT, "version": bundle.VERSION, "world": "hand",
        "models": ["cbm", "proto"], "score_range": [1, 9], "items": bundle.ITEMS,
        "answers": bundle.ANSWERS if answers else None}))
    return folder


def _scores(path, judge, scores):
    path.write_text("".join(json.dumps({"judge": judge, "id": i, "score": s}) + "\n"
                            for i, s in scores.items()))
    return path


def test_report_matches_the_hand_computed_case(tmp_path):
    """Hand computation (judges A, B above):

    * pairwise agreement over the 5 items both scored, A = [9, 7, 5, 3, 1], B = [8, 7, 6, 2,
      2]: A is strictly decreasing, B too except its tie 2 = 2 on (0-proto, 1-proto), which
      A orders: 9 of the 10 pairs agree, that one counts half: 9.5 / 10 = 0.95;
    * interval α: pairable units (9, 8), (7, 7), (5, 6), (3, 2), (1, 2) (2-proto has one
      score); observed Σ o_ck δ² = 2 (1 + 0 + 1 + 1 + 1) = 8; the 10 values have mean 5 and
      Σ (v − 5)² = 72, so Σ n_c n_k δ² = 2 · 10 · 72 = 1440; α = 1 − 9 · 8 / 1440 = 0.95;
    * item scores (mean of the judges who scored): cbm 8.5, 7, 5.5 → 7.0; proto 2.5, 1.5, 4
      → 8/3; cbm − proto per input 6, 5.5, 1.5 → mean 13/3; the exact sign-flip test over 3
      inputs: only the identity and the all-minus flip reach |Σ d| = 13: p = 2/8;
    * A against the known answer on the cbm items: [9, 7, 5] vs [9, 5, 1], same order:
      pairwise 1.0; α: values 9, 9, 7, 5, 5, 1 (mean 6, Σ (v − 6)² = 46), observed 2 (0 + 4 +
      16) = 40, α = 1 − 5 · 40 / (2 · 6 · 46) = 44/69.
    """
    folder = _bundle(tmp_path / "b")
    b = read_bundle(folder)
    council = [JudgeScores("A", {k: float(v) for k, v in A.items()}, "a"),
               JudgeScores("B", {k: float(v) for k, v in B.items()}, "b")]
    out = report(b, council, seed=0)
    assert out["agreement"]["pairwise"] == [{"judge_a": "A", "judge_b": "B", "agreement": 0.95,
                                             "items": 5}]
    assert out["agreement"]["krippendorff_alpha"]["interval"] == pytest.approx(0.95, abs=1e-12)
    assert out["models"]["cbm"]["mean"] == pytest.approx(7.0)
    assert out["models"]["proto"]["mean"] == pytest.approx(8 / 3)
    assert out["models"]["cbm"]["items"] == 3
    (test,) = out["comparisons"]
    assert (test["inputs"], test["delta"], test["pvalue"], test["pvalue_holm"]) == (
        3, pytest.approx(13 / 3), pytest.approx(0.25), pytest.approx(0.25))
    assert out["known_answer"]["A"] == {"pairwise": 1.0, "items": 3,
                                        "alpha_interval": pytest.approx(44 / 69, abs=1e-12)}
    assert [j["means"] for j in out["judges"]] == [{"cbm": 7.0, "proto": 2.0},
                                                   {"cbm": 7.0, "proto": pytest.approx(8 / 3)}]


def test_one_judge_has_no_agreement_and_the_known_answer_judges_itself_out(tmp_path):
    b = read_bundle(_bundle(tmp_path / "b"))
    out = report(b, [known_answer_judge(b)])
    assert out["agreement"]["krippendorff_alpha"] == {"interval": None, "ordinal": None}
    assert out["known_answer"] == {}  # its own agreement with itself says nothing
    assert out["models"]["cbm"]["mean"] == pytest.approx(5.0) and out["models"]["proto"] is None
    with pytest.raises(ValueError, match="each name once"):
        report(b, [known_answer_judge(b), known_answer_judge(b)])


def test_cli_reports_and_writes_the_report(tmp_path):
    folder = _bundle(tmp_path / "b")
    a = _scores(tmp_path / "a.jsonl", "A", A)
    result = CliRunner().invoke(cli.main, ["judge", str(folder), str(a), "--known-answer"])
    assert result.exit_code == 0, result.output
    assert "Krippendorff" in result.output and "A vs the known answer" in result.output
    written = json.loads((folder / "judge.json").read_text())
    assert [j["judge"] for j in written["judges"]] == ["A", KNOWN_ANSWER]


@pytest.mark.parametrize("case,hint,message", [
    ("unknown", "SCORES", "a.jsonl:1: unknown item id '7-cbm'"),
    ("range", "SCORES", "a.jsonl:1:"),
    ("twice", "SCORES", "judge 'A' in"),
    ("none", "SCORES", "no judge"),
    ("no-bundle", "BUNDLE", "not a judge bundle"),
    ("no-answers", "--known-answer", "no known answer"),
])
def test_cli_bad_input_exits_2_naming_the_argument(tmp_path, case, hint, message):
    folder = _bundle(tmp_path / "b", answers=case != "no-answers")
    a = tmp_path / "a.jsonl"
    args = ["judge", str(folder), str(a)]
    if case == "unknown":
        _scores(a, "A", {"7-cbm": 3})
    elif case == "range":
        _scores(a, "A", {"0-cbm": 10})
    elif case == "twice":
        _scores(a, "A", A)
        args.append(str(_scores(tmp_path / "a2.jsonl", "A", B)))
    elif case == "none":
        args = ["judge", str(folder)]
    elif case == "no-bundle":
        (folder / bundle.MANIFEST).unlink()
        _scores(a, "A", A)
    else:
        _scores(a, "A", A)
        args.append("--known-answer")
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 2, result.output
    assert hint in result.output and message in result.output
    assert not (folder / "judge.json").exists()


def test_a_bundle_with_a_duplicate_item_is_refused(tmp_path):
    folder = _bundle(tmp_path / "b")
    with (folder / bundle.ITEMS).open("a") as f:
        f.write(json.dumps({"id": "0-cbm", "input": 0, "model": "cbm"}) + "\n")
    with pytest.raises(BundleError, match="item '0-cbm' twice"):
        read_bundle(folder)
    (folder / bundle.ITEMS).write_text("{not json\n")
    with pytest.raises(BundleError, match=r"items.jsonl:1: not JSON"):
        read_bundle(folder)
