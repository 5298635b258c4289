"""The lock on an output directory: exclusive, names its holder, removed when the run ends."""

import json
import os

import pytest
from click.testing import CliRunner

from cbcert import cli
from cbcert.runs.directory import RunDirError, RunLockedError
from cbcert.runs.lock import hold, lock_holder


def test_lock_is_exclusive_names_the_holder_and_is_removed(tmp_path):
    with hold(tmp_path):
        holder = json.loads((tmp_path / ".lock").read_text())
        with pytest.raises(RunLockedError, match=f'"pid": {holder["pid"]}'):
            with hold(tmp_path):
                pass
    assert not (tmp_path / ".lock").exists()
    with hold(tmp_path):  # free again
        pass


def test_lock_holder_reports_the_holder_only_while_held(tmp_path):
    assert lock_holder(tmp_path) is None
    with hold(tmp_path):
        assert lock_holder(tmp_path)["pid"] == json.loads((tmp_path / ".lock").read_text())["pid"]
    (tmp_path / ".lock").write_text('{"pid": 1}\n')  # left by a killed run: not held
    assert lock_holder(tmp_path) is None


def test_lock_never_follows_a_symlink_and_leaves_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    with pytest.raises(RunDirError, match=r"\.lock: not a regular file \(a symbolic link\)"):
        with hold(out):
            pass
    assert victim.read_text() == "precious\n"
    assert (out / ".lock").is_symlink()
    assert lock_holder(out) is None


def test_lock_refuses_a_hard_link_to_another_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    os.link(victim, out / ".lock")
    with pytest.raises(RunDirError, match="has 2 links"):
        with hold(out):
            pass
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_lock_refuses_what_is_not_a_regular_file_without_blocking(tmp_path, kind):
    lock = tmp_path / ".lock"
    lock.mkdir() if kind == "directory" else os.mkfifo(lock)
    with pytest.raises(RunDirError, match=rf"\.lock: not a regular file \(a {kind}\); remove it"):
        with hold(tmp_path):
            pass
    assert lock_holder(tmp_path) is None  # a FIFO opened for reading would block here


def test_certify_refuses_a_lock_directory_with_exit_2(tmp_path):
    (tmp_path / ".lock").mkdir()
    # A valid job (n = 10 is the least that can certify at α = 0.001: an invalid one is refused
    # by the pure checks before the directory is touched); the lock refuses it before sampling.
    result = CliRunner().invoke(cli.main, ["latent", "--sigma", "0.1", "--n0", "1", "--n", "10",
                                           "--inputs", "1", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "--out" in result.output and "not a regular file (a directory)" in result.output
