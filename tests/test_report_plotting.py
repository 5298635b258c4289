"""`cbcert.report.plotting.save`: figures are written whole, the suptitle clear of every panel."""

import pytest

from cbcert.report.plotting import pyplot, save


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
