"""`cbcert.report.plotting`: figures are written whole, the suptitle clear of every panel; the
perturbation type of a budget label."""

import pytest

from cbcert.report.plotting import budget_type, pyplot, save


@pytest.mark.parametrize("rows", [1, 9])
def test_the_suptitle_covers_no_panel_on_short_or_tall_figures(tmp_path, monkeypatch, rows):
    """Without the second layout the 9-row figure's suptitle lies on its first row's titles."""
    plt = pyplot()
    fig, axes = plt.subplots(rows, 1, figsize=(4, 0.6 + 2.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.set_title("a panel title that must stay readable")
    fig.suptitle("A figure title")
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda f: None)  # keep the laid-out figure to inspect
    path = save(fig, tmp_path / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    assert not any(title.overlaps(ax.get_tightbbox(renderer)) for ax in fig.axes)
    assert title.y1 <= fig.bbox.y1 + 1  # still on the figure
    close(fig)


@pytest.mark.parametrize("label, expected", [
    ("ε=0.05", "geometric"), ("σ=0.1", "geometric"), ("σ", "geometric"),
    ("τ=1", "semantic"), ("ρ=0.05", "semantic"), ("m=2", "semantic"),
    ("ε=0.03 attack-latent", "geometric"), ("ε=0.03 attack-concept", "semantic")])
def test_budget_type_is_semantic_exactly_for_concept_budgets(label, expected):
    # τ, ρ (concept flips) and m (fixed flips) move concepts; ε, σ move the latent code.
    assert budget_type(label) == expected
