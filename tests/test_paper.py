"""configs/paper.yaml: the whole method from one command, at reduced sizes, and docs/paper.md's
table mapping the method's tables and figures to report files, checked both ways: every mapped
file is written, and every file the report writes is mapped."""

import re
from pathlib import Path

import yaml
from conftest import PAPER, reduced_paper

ROOT = Path(__file__).resolve().parents[1]


def map_rows() -> list[str]:
    """The rows of docs/paper.md's paper map, its header left out."""
    text = (ROOT / "docs" / "paper.md").read_text()
    block = text.split("<!-- paper-map")[1].split("<!-- /paper-map -->")[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and "---" not in line]
    return rows[1:]


# A row keyed by one of the method's numbers: "| Fig. 1(b): …", "| Table 12: …".
_NUMBERED = re.compile(r"^\| (?:Fig\. (\d+)(?:\(([a-z])\))?|Table (\d+)):")


def numbered_rows() -> dict[str, str]:
    """The map's rows keyed by the method's number (``fig1b``, ``table12``) → their second
    column."""
    out = {}
    for row in map_rows():
        match = _NUMBERED.match(row)
        if match:
            fig, panel, table = match.groups()
            key = f"fig{fig}{panel or ''}" if fig else f"table{table}"
            assert key not in out, f"the paper map lists {key} twice"
            out[key] = row.split(" | ")[1]
    return out


def test_the_paper_map_is_keyed_by_the_methods_numbers_both_ways():
    """Every figure (1–10, with 1's panels) and table (1–16) of the method has one row: the
    file that regenerates it (`method_outputs.OUTPUTS`), or "absent" with the reason
    (`method_outputs.ABSENT`); and every row keyed by a number is one of them."""
    from cbcert.report.method_outputs import ABSENT, OUTPUTS

    rows = numbered_rows()
    expected = {"fig1a", "fig1b", "fig1c", *(f"fig{i}" for i in range(2, 11)),
                *(f"table{i}" for i in range(1, 17))}
    assert set(rows) == expected == set(OUTPUTS) | set(ABSENT)
    for number, name in OUTPUTS.items():
        assert re.findall(r"`([^`]+)`", rows[number]) == [f"report/{name}"], number
    for number in ABSENT:
        assert rows[number].startswith("absent: ") and "`" not in rows[number], number


def mapped_patterns() -> list[str]:
    """The file patterns of docs/paper.md's paper map (``<world>``, ``<cell>`` placeholders)."""
    rows = map_rows()
    patterns = [p for row in rows for p in re.findall(r"`([^`]+)`", row.split(" | ")[1])]
    assert patterns, "the paper map of docs/paper.md is empty"
    # Paths only: the vocabulary row names a family value and files by glob.
    return [p for p in patterns if "/" in p and "*" not in p]


def _regex(pattern: str) -> re.Pattern:
    escaped = re.escape(pattern).replace(re.escape("<world>"), "[^/]+")
    return re.compile(escaped.replace(re.escape("<cell>"), "[^/]+"))


def test_paper_config_covers_both_families_on_shipped_weights():
    data = yaml.safe_load(PAPER.read_text())
    families = {e["preset"]: e["family"] for e in data["worlds"]}
    assert families == {"default": "class similarity", "similar5": "class similarity",
                        "dissimilar5": "class similarity", "similar10": "class similarity",
                        "dissimilar10": "class similarity", "k8": "vocabulary",
                        "vocab12": "vocabulary", "vocab16": "vocabulary",
                        "saturated": "saturated"}
    assert len(reduced_paper(data)["worlds"]) == 3


def test_paper_config_is_the_methods_protocol():
    """The settings of the method's protocol (docs/paper.md, "The protocol"), not the
    project's stricter defaults."""
    data = yaml.safe_load(PAPER.read_text())
    for space in ("latent", "concept"):
        assert data[space]["two_class"] is True and data[space]["alpha"] == 0.05
    assert data["concept"]["rhos"] == [0.05, 0.1, 0.2]
    assert data["concept"]["flips"] == [1, 2, 4]
    assert data["perturb"]["sigma"] == [0.05, 0.1] and data["perturb"]["rho"] == [0.1, 0.2]
    assert {a["inputs"] for a in data["attack"]} == {200}


def test_every_mapped_file_is_written_and_every_written_file_is_mapped(paper_run):
    patterns = mapped_patterns()
    written = sorted(str(p.relative_to(paper_run)) for p in paper_run.rglob("*")
                     if p.is_file() and p.parent.name == "report")
    worlds = sorted(p.name for p in paper_run.iterdir() if (p / "report").is_dir())
    assert worlds == ["default", "k8", "saturated"]
    from cbcert.report.method_outputs import OUTPUTS

    # The reduced run has one world per family: the method's outputs of the settings it lacks
    # (class structure, K = 27 vs 36) are skipped there; every one is written on the full
    # run (tests/test_report_method.py).
    by_number = {f"report/{name}" for name in OUTPUTS.values()}
    for pattern in patterns:
        regex = _regex(pattern)
        hits = [w for w in written if regex.fullmatch(w)]
        if pattern in by_number:
            continue
        assert hits, f"docs/paper.md maps {pattern} but the report wrote no such file"
        if "<world>" in pattern:  # every world writes it
            assert {h.split("/")[0] for h in hits} == set(worlds), pattern
    unmapped = [w for w in written if not any(_regex(p).fullmatch(w) for p in patterns)]
    assert not unmapped, f"report files missing from the paper map of docs/paper.md: {unmapped}"


def test_vocabulary_rows_are_in_the_stacked_tables(paper_run):
    text = (paper_run / "report" / "worlds_perturb.csv").read_text()
    assert ",vocabulary," in text and ",class similarity," in text


def test_paper_real_config_is_the_same_protocol_on_world_directories():
    """configs/paper-real.yaml (docs/real-data.md, step 8) runs paper.yaml's protocol, section
    for section, on CUB world directories at 18/27/36 PCBM concepts and a RIVAL-10 one; it
    loads as a sweep config."""
    from cbcert.runs.config import load_config

    real = yaml.safe_load((ROOT / "configs" / "paper-real.yaml").read_text())
    paper = yaml.safe_load(PAPER.read_text())
    assert ({k: v for k, v in real.items() if k not in ("name", "worlds")}
            == {k: v for k, v in paper.items() if k not in ("name", "worlds")})
    assert {e["preset"]: e["family"] for e in real["worlds"]} == {
        "worlds/cub-k18": "vocabulary", "worlds/cub-k27": "vocabulary",
        "worlds/cub-k36": "vocabulary", "worlds/rival10": "saturated"}
    config = load_config(ROOT / "configs" / "paper-real.yaml")
    assert [w.name for w in config.worlds] == ["cub-k18", "cub-k27", "cub-k36", "rival10"]
