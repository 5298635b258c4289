"""CLI progress bars: silent when quiet or off a terminal, a live bar with a rate otherwise."""

import io
import sys

from cbcert.cli import progress


def test_silent_when_quiet_or_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a TTY
    for quiet in (True, False):
        with progress.bar("sampling", quiet) as callback:
            assert callback is None
        with progress.bars(quiet) as for_cell:
            assert for_cell is None
    assert sys.stderr.getvalue() == ""


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_shows_counts_and_rate_on_a_terminal(monkeypatch):
    terminal = _FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress.bar("certify", quiet=False, unit="inputs") as callback:
        callback(50, 100)
        callback(100, 100)
    with progress.bars(quiet=False) as for_cell:
        for_cell("latent-sigma0.1")(3, 3)
    shown = terminal.getvalue()
    assert "certify" in shown and "inputs/s" in shown and "100/100" in shown
    assert "latent-sigma0.1" in shown and "3/3" in shown
