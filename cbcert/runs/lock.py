"""The lock on an output directory: one run per directory at a time.

``hold(out)`` takes an exclusive ``flock`` on ``out/.lock`` for the whole run; a second process
on the same directory is refused, naming the holder (pid, host, command, start). The file is
removed when the run ends; the kernel drops the lock when its process dies (even ``kill -9``),
so the stale file such a death leaves never blocks a resume. In a multi-host job process 0
takes the lock and the others share its outcome (`cbcert.runs.directory.on_coordinator`).
`lock_holder` tells whether a directory's lock is held (``certify sweep --status``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cbcert.runs.directory import LOCK, RunDirError, RunLockedError, _check_writable, on_coordinator
from cbcert.schema import file_kind, shorten

# A lock probe (`lock_holder`) holds a directory's lock for microseconds; `hold` retries this
# often, 20 ms apart, before it calls the directory busy.
_LOCK_TRIES = 5


def _holder() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "command": shorten(" ".join(sys.argv)), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


@contextlib.contextmanager
def hold(out: Path, name: str = LOCK) -> Iterator[Path]:
    """Exclusive lock on ``out/name`` for the duration of the block (creates ``out``).

    In a multi-host job process 0 takes the lock and the others share its outcome.

    Raises:
      RunLockedError: another process holds it; the message names that process.
      RunDirError: ``out`` cannot be created or written.
    """
    with contextlib.ExitStack() as stack:
        on_coordinator(lambda: stack.enter_context(_locked(Path(out), name)) and None)
        yield Path(out)


def _flock(handle) -> OSError | None:
    """Try the exclusive lock a few times (a `lock_holder` probe may hold it briefly)."""
    for attempt in range(_LOCK_TRIES):
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES) or attempt == _LOCK_TRIES - 1:
                return err
            time.sleep(0.02)
    return None


def _open_lock_file(path: Path):
    """``path`` opened read-write (created if absent), refused unless it is our own file.

    The holder truncates and rewrites the lock file, so whatever ``.lock`` names gets
    overwritten: a symbolic link is never followed (``O_NOFOLLOW``), and a directory, FIFO,
    device or a hard link to another file is refused (``O_NONBLOCK``: opening a FIFO does not
    wait for a writer) before anything is written.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if stat.S_ISREG(mode):
            raise RunDirError(f"{path}: cannot open the lock file ({err.strerror})") from None
        raise _not_regular(path, mode) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        if stat.S_ISREG(info.st_mode):
            raise RunDirError(f"{path}: the lock file has {info.st_nlink} links (a hard link to "
                              "another file would be overwritten); remove it") from None
        raise _not_regular(path, info.st_mode)
    return os.fdopen(fd, "r+")


def _not_regular(path: Path, mode: int) -> RunDirError:
    return RunDirError(f"{path}: not a regular file ({file_kind(mode)}); remove it or use "
                       "another --out")


@contextlib.contextmanager
def _locked(out: Path, name: str) -> Iterator[Path]:
    _check_writable(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    handle = _open_lock_file(path)
    locked = False
    try:
        err = _flock(handle)
        if err is not None:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise RunDirError(f"{path}: cannot lock ({err.strerror})") from None
            handle.seek(0)
            holder = shorten(handle.read().strip() or "an unknown process")
            raise RunLockedError(f"{out} is in use by another run ({holder}); wait for it to "
                                 "finish or use another --out") from None
        # The holder removes the file when it is done; a lock taken on a file removed in
        # between would guard nothing, so the path must still name the locked file.
        if not path.exists() or os.stat(path).st_ino != os.fstat(handle.fileno()).st_ino:
            raise RunLockedError(f"{out} was in use by another run that just finished; retry")
        locked = True
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder()) + "\n")
        handle.flush()
        yield out
    finally:
        if locked:
            path.unlink(missing_ok=True)
        handle.close()  # releases the lock


def lock_holder(out: Path, name: str = LOCK) -> dict[str, Any] | None:
    """Who holds ``out/name`` (the holder's pid, host, command, start), or None if nobody.

    Probes with a shared, non-blocking ``flock`` released at once (works wherever `hold`
    does, NFS included); a lock file left by a killed run is not held and gives None.
    """
    path = Path(out) / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None  # `hold` refuses such a lock file: nobody can hold it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                return None
            text = os.read(fd, 4096).decode("utf-8", "replace").strip()
            try:
                holder = json.loads(text)
            except json.JSONDecodeError:
                holder = None
            return holder if isinstance(holder, dict) else {"holder": text or "unknown"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
