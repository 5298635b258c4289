"""The README and docs/: a README that fits on a screen or two with the two set-up commands first,
every docs page reachable from the index, every relative link and anchor resolving, and no text
written twice. (The doctests of the API examples are in test_api.py, the paper map in
test_paper.py.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"
CI = ROOT / ".ci" / "run"

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(path: Path) -> list[str]:
    """The lines of a Markdown file outside code fences."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    return {_slug(line) for line in _prose(path) if line.startswith("#")}


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_readme_is_short_and_starts_with_the_two_set_up_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    assert [lang for lang, _ in blocks[:2]] == ["bash", "bash"]
    main_job, tests = (body.strip() for _, body in blocks[:2])
    assert main_job.endswith("pip install -e . && certify latent --sigma 0.1")
    assert tests in CI.read_text().splitlines()  # .ci/run runs the README's command verbatim


def test_every_docs_page_is_reachable_from_the_index():
    linked = {(INDEX.parent / m.split("#")[0]).resolve()
              for m in LINK.findall(INDEX.read_text()) if not m.startswith(("http", "#"))}
    pages = {p.resolve() for p in DOCS.glob("*.md") if p != INDEX}
    assert pages <= linked, sorted(p.name for p in pages - linked)
    assert "docs/README.md" in README.read_text()  # and the index from the README


def test_relative_links_and_anchors_resolve():
    for page in _pages():
        for target in LINK.findall("\n".join(_prose(page))):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.relative_to(ROOT)}: {target}"
            if anchor:
                assert resolved.suffix == ".md", f"{page.relative_to(ROOT)}: {target}"
                assert anchor in _anchors(resolved), f"{page.relative_to(ROOT)}: {target}"


def test_no_text_is_written_both_in_the_readme_and_in_docs():
    docs = "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    shared = [line for line in _prose(README)
              if len(line.strip()) >= 40 and not line.startswith("|") and line.strip() in docs]
    assert not shared, shared
