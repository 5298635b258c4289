"""Session-wide test settings: a private, empty user data directory.

`certify train world` writes to the user's data directory and runners prefer weights found
there over the shipped ones (`cbcert.worlds.builtin.weights_path`). Pointing ``CBCERT_HOME`` at
a fresh directory for the session keeps the suite hermetic: weights a developer trained on this
machine never replace the shipped ones under test, and no test writes into the real home.
Subprocesses inherit the setting.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_HOME = tempfile.mkdtemp(prefix="cbcert-test-home-")
os.environ["CBCERT_HOME"] = _HOME


def pytest_sessionfinish(session, exitstatus):
    del session, exitstatus
    shutil.rmtree(_HOME, ignore_errors=True)
