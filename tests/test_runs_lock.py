"""The lock on an output directory: exclusive, names its holder, removed when the run ends."""

import json

import pytest

from cbcert.runs.directory import RunLockedError
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
