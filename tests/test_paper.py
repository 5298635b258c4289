"""configs/paper.yaml: the whole method from one command, at reduced sizes, and the README's
table mapping the method's tables and figures to report files, checked both ways: every mapped
file is written, and every file the report writes is mapped."""

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from cbcert.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs" / "paper.yaml"


def reduced(data: dict) -> dict:
    """paper.yaml cut to seconds: every section and cell kept (same σ, ρ, budgets, attack
    sections), sizes shrunk, one world per family."""
    data = dict(data)
    families = {}
    for entry in data["worlds"]:
        families.setdefault(entry.get("family"), entry)
    data["worlds"] = list(families.values())
    data["world"] = {**data["world"], "num_inputs": 6}
    for section in ("latent", "concept"):
        data[section] = {**data[section], "n0": 4, "n": 12, "subsets": 2, "subset_size": 3}
    data["perturb"] = {**data["perturb"], "subsets": 2, "subset_size": 3}
    data["attack"] = [{**a, "iters": 2, "inputs": 2, "eot": 2} for a in data["attack"]]
    data["classes"] = {"samples": 48}
    return data


def mapped_patterns() -> list[str]:
    """The file patterns of the README's paper map (``<world>``, ``<cell>`` placeholders)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- paper-map")[1].split("<!-- /paper-map -->")[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and "---" not in line]
    patterns = [p for row in rows[1:] for p in re.findall(r"`([^`]+)`", row.split(" | ")[1])]
    assert patterns, "the README paper map is empty"
    return [p for p in patterns if "*" not in p]  # the vocabulary row names files by glob


def _regex(pattern: str) -> re.Pattern:
    escaped = re.escape(pattern).replace(re.escape("<world>"), "[^/]+")
    return re.compile(escaped.replace(re.escape("<cell>"), "[^/]+"))


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paper")
    config = tmp / "paper.yaml"
    config.write_text(yaml.safe_dump(reduced(yaml.safe_load(PAPER.read_text())),
                                     allow_unicode=True))
    out = tmp / "run"
    result = CliRunner().invoke(main, ["sweep", str(config), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["report", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def test_paper_config_covers_both_families_on_shipped_weights():
    data = yaml.safe_load(PAPER.read_text())
    families = {e["preset"]: e["family"] for e in data["worlds"]}
    assert families == {"default": "class similarity", "similar5": "class similarity",
                        "dissimilar5": "class similarity", "k8": "vocabulary",
                        "vocab12": "vocabulary", "vocab16": "vocabulary"}
    assert len(reduced(data)["worlds"]) == 2


def test_every_mapped_file_is_written_and_every_written_file_is_mapped(paper_run):
    patterns = mapped_patterns()
    written = sorted(str(p.relative_to(paper_run)) for p in paper_run.rglob("*")
                     if p.is_file() and p.parent.name == "report")
    worlds = sorted(p.name for p in paper_run.iterdir() if (p / "report").is_dir())
    assert worlds == ["default", "k8"]
    for pattern in patterns:
        regex = _regex(pattern)
        hits = [w for w in written if regex.fullmatch(w)]
        assert hits, f"README maps {pattern} but the report wrote no such file"
        if "<world>" in pattern:  # every world writes it
            assert {h.split("/")[0] for h in hits} == set(worlds), pattern
    unmapped = [w for w in written if not any(_regex(p).fullmatch(w) for p in patterns)]
    assert not unmapped, f"report files missing from the README paper map: {unmapped}"


def test_vocabulary_rows_are_in_the_stacked_tables(paper_run):
    text = (paper_run / "report" / "worlds_perturb.csv").read_text()
    assert ",vocabulary," in text and ",class similarity," in text
