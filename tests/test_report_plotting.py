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


def test_model_colours_are_distinct_fixed_and_not_perturbation_type_colours():
    from matplotlib.colors import to_rgba

    from cbcert.report.plotting import MODEL_COLOURS, TYPE_COLOURS, model_colour

    built_in = [model_colour(m) for m in ("std", "cbm", "cbmh", "proto")]
    assert built_in == [MODEL_COLOURS[m] for m in ("std", "cbm", "cbmh", "proto")]
    rgba = {to_rgba(c) for c in built_in}
    assert len(rgba) == 4
    assert not rgba & {to_rgba(c) for c in TYPE_COLOURS.values()}
    # A library user's own model name: a spare colour, the same on every call, not a role's.
    assert model_colour("resnet50") == model_colour("resnet50")
    assert to_rgba(model_colour("resnet50")) not in rgba | {to_rgba(c) for c in
                                                            TYPE_COLOURS.values()}
