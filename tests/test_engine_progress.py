import io
import sys

from cbcert.engine import progress


def test_silent_when_disabled_or_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # not a TTY
    for enabled in (True, False):
        with progress.rich_callback("sampling", enabled=enabled) as callback:
            callback(10, 100)
            callback(100, 100)
    assert sys.stdout.getvalue() == ""


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_shows_samples_per_second_on_a_terminal(monkeypatch):
    terminal = _FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    with progress.rich_callback("certify", enabled=True) as callback:
        callback(500, 1000)
        callback(1000, 1000)
    shown = terminal.getvalue()
    assert "certify" in shown and "samples/s" in shown and "1000/1000" in shown
