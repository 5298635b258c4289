"""Multi-host start-up: one ``jax.distributed`` job over several processes (TPU pod slice, GPUs
on several hosts, or CPU processes for testing), and what its processes share.

Call ``initialize`` once per process before any other JAX call; afterwards ``jax.devices()``
lists the devices of every process, the sampler's default mesh spans all of them, and each
process passes the same inputs and key and receives the same counts. Process 0 is the
*coordinator*: it hosts JAX's coordination service, and it is the one process that reads and
writes files (`broadcast_bytes` hands what it read to the others).

A process that dies must not leave the others waiting forever in a collective. JAX's
coordination service declares a process dead when its heartbeats stop (``heartbeat_timeout``)
and then aborts every other process with a C++ stack trace. ``initialize`` sets that limit to
twice ``timeout`` and starts a *watch* thread on every process that beats through the same
service's key-value store every ``period(timeout)`` seconds (at most 2 s) and reads everyone
else's beats: a process whose beat has not changed for ``timeout`` seconds, or that announced an
error (`fail`), is reported by ``on_lost(message)`` naming its index, host and pid (the default
prints the message and exits with `LOST_EXIT_CODE`). So the survivors stop within ``timeout``
plus one period of a death, with one message. When process 0 itself dies the service goes with
it and JAX aborts the others at once with its own message ("the JAX distributed service detected
fatal errors … Socket closed"); process 0 is the coordinator address the job was started with.

Joining is bounded too: a process that cannot join says what it waits for after `notice_after`
seconds and gives up after ``initialization_timeout`` (default: exit `JOIN_EXIT_CODE`), before
JAX would abort it. `gather_text` hands every process each process's text (the settings they
must share, `cbcert.runs.peers`); `stop_together` precedes an error all processes found.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

# Exit status of a process that stops because another process of its job was lost.
LOST_EXIT_CODE = 3
# Exit status of a process that gave up joining its job (bad usage: no such job).
JOIN_EXIT_CODE = 2
DEFAULT_TIMEOUT = 60.0
# Seconds of joining after which a process says what it waits for (at most half the timeout).
NOTICE_AFTER = 10.0
_PREFIX = "cbcert/"
_BEAT = _PREFIX + "beat/"
_HOST = _PREFIX + "host/"
_GATHER = _PREFIX + "gather/"
_STOP = _PREFIX + "stop/"
_DONE = "done"
_FAILED = "failed:"


def period(timeout: float) -> float:
    """Seconds between two beats of the watch thread: ``timeout / 10`` within [0.1, 2]."""
    return min(max(timeout / 10.0, 0.1), 2.0)


def notice_after(initialization_timeout: float) -> float:
    """Seconds of joining after which a process says what it waits for: ``NOTICE_AFTER``, at
    most half of ``initialization_timeout`` (a normal start joins well within either)."""
    return min(NOTICE_AFTER, initialization_timeout / 2.0)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    cpu_collectives: str | None = None,
    initialization_timeout: float = 300,
    timeout: float = DEFAULT_TIMEOUT,
    on_lost: Callable[[str], None] | None = None,
    on_waiting: Callable[[str], None] | None = None,
    on_join_timeout: Callable[[str], None] | None = None,
) -> None:
    """Joins this process to a multi-host JAX job (wraps ``jax.distributed.initialize``).

    On TPU pods and SLURM/Open MPI clusters all addressing arguments can stay None
    (auto-detected by JAX).

    Args:
      coordinator_address: ``"host:port"`` of process 0, reachable by every process.
      num_processes: number of processes in the job, ``>= 1``.
      process_id: rank of this process in ``[0, num_processes)``.
      local_device_ids: devices of this host the process owns (default: all).
      cpu_collectives: for CPU-only jobs, the cross-process collectives implementation
        (``"gloo"``); this sets the global ``jax_cpu_collectives_implementation`` option,
        which must happen before the CPU backend starts.
      initialization_timeout: seconds to wait for every process to join, and for every
        process to reach a `gather_text` (JAX's own join limit is set later, as a backstop).
      timeout: seconds without a heartbeat after which another process counts as lost
        (JAX's own heartbeat limit is set to ``2 · timeout``, ≥ 10 s, as a backstop).
      on_lost: ``on_lost(message)`` when another process is lost or failed; it must not
        return normally to the caller's work (default: print and ``os._exit(LOST_EXIT_CODE)``).
      on_waiting: ``on_waiting(message)`` once, if joining takes `notice_after` seconds:
        what this process waits for (default: print it on standard error).
      on_join_timeout: ``on_join_timeout(message)`` if the job is not joined within
        ``initialization_timeout``; it must not return (default: print and
        ``os._exit(JOIN_EXIT_CODE)``).
    """
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if process_id is not None and num_processes is not None and not (
        0 <= process_id < num_processes
    ):
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds")
    if not 0 < initialization_timeout < float("inf"):
        raise ValueError(f"initialization_timeout={initialization_timeout} must be in "
                         "(0, inf) seconds")
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    backstop = max(int(2 * timeout + 0.999), 10)
    # JAX aborts the process (a C++ check failure) when its join limit passes, so ours must
    # come first: JAX gets twice the time, plus a margin.
    joining = _Joining(_awaited(coordinator_address, num_processes, process_id),
                       float(initialization_timeout),
                       on_waiting or functools.partial(print, file=sys.stderr, flush=True),
                       on_join_timeout or functools.partial(_exit_with, JOIN_EXIT_CODE))
    joining.start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=int(2 * initialization_timeout) + 10,
            heartbeat_timeout_seconds=backstop,
            shutdown_timeout_seconds=backstop,
        )
    finally:
        joining.stop()
    global _WATCH, _JOIN_TIMEOUT
    _JOIN_TIMEOUT = float(initialization_timeout)
    _WATCH = _start_watch(float(timeout), on_lost or functools.partial(_exit_with, LOST_EXIT_CODE),
                          _JOIN_TIMEOUT)


def is_initialized() -> bool:
    """Whether this process is part of a ``jax.distributed`` job (never starts a backend)."""
    return jax.distributed.is_initialized()


def is_coordinator() -> bool:
    """True on process 0, the one that reads and writes result files and prints.

    Outside a distributed job this is True without starting JAX's backend.
    """
    return not is_initialized() or jax.process_index() == 0


def finish() -> None:
    """Leaves the job after success: announce it, stop watching, ``jax.distributed.shutdown``.

    Waits (JAX's shutdown barrier, at most ``2 · timeout``) until every process is done.
    """
    if _WATCH is not None:
        _WATCH.announce(_DONE)
        _WATCH.stop()
    jax.distributed.shutdown()


def fail(message: str) -> None:
    """Announces that this process stops with an error, so the others stop within a beat.

    Process 0 hosts the key-value store the others read, so it waits (at most three beats)
    until every other process has stopped or announced its own end. Call it right before
    exiting; the process must then exit without ``jax.distributed.shutdown`` (``os._exit``),
    whose barrier would wait for the processes that just stopped.
    """
    watch = _WATCH
    if watch is None:
        return
    watch.stop()
    watch.announce(_FAILED + " ".join(message.split())[:2000])
    if watch.me == 0:
        watch.wait_for_others(3 * watch.period)


def await_verdict() -> None:
    """After a failed collective: give the watch thread time to name the lost process.

    Returns after ``timeout`` plus two beats if no process was found lost (the caller then
    reports the collective's own error).
    """
    watch = _WATCH
    if watch is not None and watch.is_alive():
        watch.join(watch.timeout + 2 * watch.period)


def broadcast_bytes(data: bytes | None) -> bytes:
    """The bytes process 0 passes, on every process (``data`` is ignored off process 0).

    Two collectives over the global mesh (``multihost_utils.broadcast_one_to_all``): the
    length, then the bytes padded to a power of two ≥ 1 KiB so that a few compilations serve
    every size. Outside a distributed job this returns ``data``.
    """
    if not is_initialized() or jax.process_count() == 1:
        return data if data is not None else b""
    from jax.experimental import multihost_utils

    source = jax.process_index() == 0
    if source and data is None:
        raise ValueError("process 0 must pass the bytes to broadcast")
    size = np.asarray([len(data) if source else 0], np.int32)
    size = int(multihost_utils.broadcast_one_to_all(size)[0])
    bucket = max(1024, 1 << max(size - 1, 0).bit_length())
    buffer = np.zeros(bucket, np.uint8)
    if source:
        buffer[:size] = np.frombuffer(data, np.uint8)
    buffer = multihost_utils.broadcast_one_to_all(buffer)
    return np.asarray(buffer[:size], np.uint8).tobytes()


def gather_text(text: str) -> list[str]:
    """Every process's ``text``, in process order, on every process (``[text]`` outside a job).

    Through the coordination service's key-value store, not a collective: each process sets
    its text and reads the others', waiting for a process that has not got there yet at most
    the join timeout (``initialization_timeout``), then raises TimeoutError naming it. Calls
    are numbered: every process must make the same sequence of `gather_text` and
    `stop_together` calls.
    """
    if not is_initialized() or jax.process_count() == 1:
        return [text]
    client, call = _client(), _next_call()
    me, count = jax.process_index(), jax.process_count()
    client.key_value_set(f"{_GATHER}{call}/{me}", text)
    texts = [text] * count
    for process in (p for p in range(count) if p != me):
        try:
            texts[process] = client.blocking_key_value_get(f"{_GATHER}{call}/{process}",
                                                           int(_JOIN_TIMEOUT * 1000))
        except Exception as err:  # noqa: BLE001 - JAX reports a deadline in several types
            raise TimeoutError(f"process {process} of {count} did not reach the settings check "
                               f"within {_JOIN_TIMEOUT:g} s ({' '.join(str(err).split())[:200]})"
                               "; is it running the same command?") from None
    return texts


def stop_together() -> None:
    """Before every process raises the same error (one that all of them found, e.g. in what
    `gather_text` returned): stop watching, then wait until every process has.

    Without it a process could see another announce that error (`fail`) and stop with
    `LOST_EXIT_CODE` before reaching its own. Every process must call it.
    """
    if not is_initialized() or jax.process_count() == 1:
        return
    if _WATCH is not None:
        _WATCH.stop()
    _client().wait_at_barrier(f"{_STOP}{_next_call()}", int(_JOIN_TIMEOUT * 1000))


def shutdown() -> None:
    """Leaves the multi-host job (``jax.distributed.shutdown``) without announcing anything."""
    if _WATCH is not None:
        _WATCH.stop()
    jax.distributed.shutdown()


def _exit_with(code: int, message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    os._exit(code)


def _awaited(coordinator: str | None, count: int | None, me: int | None) -> tuple[str, str]:
    """Who is joining and what it waits for, in words."""
    if me is None or count is None:
        where = f"at {coordinator}" if coordinator else "that the cluster environment names"
        return "this process", f"the processes of the distributed job {where} to join"
    if me == 0:
        others = count - 1
        return (f"process 0 of {count} (the coordinator, at {coordinator})",
                f"the other {others} process{'es' if others != 1 else ''} to join")
    return (f"process {me} of {count}",
            f"process 0 (the coordinator, at {coordinator}) and the other processes to join")


class _Joining(threading.Thread):
    """While ``jax.distributed.initialize`` blocks: say what it waits for, then give up."""

    def __init__(self, awaited: tuple[str, str], timeout: float,
                 on_waiting: Callable[[str], None], on_timeout: Callable[[str], None]):
        super().__init__(name="cbcert-distributed-join", daemon=True)
        self.awaited, self.timeout = awaited, timeout
        self.on_waiting, self.on_timeout = on_waiting, on_timeout
        self._joined = threading.Event()

    def stop(self) -> None:
        self._joined.set()

    def run(self) -> None:
        who, what = self.awaited
        notice = notice_after(self.timeout)
        if self._joined.wait(notice):
            return
        self.on_waiting(f"{who} is waiting for {what} (giving up after {self.timeout:g} s)")
        if not self._joined.wait(self.timeout - notice):
            self.on_timeout(f"{who} gave up after {self.timeout:g} s waiting for {what}; start "
                            "every process with the same coordinator address and number of "
                            "processes, process 0 on the coordinator's host")


class _Watch(threading.Thread):
    """Beats through the coordination service's key-value store and watches the others'."""

    def __init__(self, client, me: int, count: int, hosts: dict[int, str], timeout: float,
                 on_lost: Callable[[str], None]):
        super().__init__(name="cbcert-distributed-watch", daemon=True)
        self.client, self.me, self.count, self.hosts = client, me, count, hosts
        self.timeout, self.period, self.on_lost = timeout, period(timeout), on_lost
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def announce(self, value: str) -> None:
        try:
            self.client.key_value_set(f"{_BEAT}{self.me}", value, allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service is gone: nobody is left to tell
            pass

    def _describe(self, process: int) -> str:
        return f"process {process} of {self.count} on {self.hosts.get(process, '?')}"

    def wait_for_others(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                beats = dict(self.client.key_value_dir_get(_BEAT))
            except Exception:  # noqa: BLE001
                return
            if all(_ended(beats.get(f"{_BEAT}{p}")) for p in range(self.count) if p != self.me):
                return
            time.sleep(self.period / 4)

    def run(self) -> None:
        beat, last_value, last_change = 0, {}, {}
        last_contact = time.monotonic()
        while not self._halt.wait(self.period):
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(f"{_BEAT}{self.me}", str(beat), allow_overwrite=True)
                beats = dict(self.client.key_value_dir_get(_BEAT))
                last_contact = now
            except Exception as err:  # noqa: BLE001 - the service (process 0) is unreachable
                if not self._halt.is_set() and now - last_contact > self.timeout:
                    self._lost(f"lost contact with the coordinator, {self._describe(0)}, for "
                               f"{self.timeout:g} s ({' '.join(str(err).split())[:300]})")
                continue
            for process in range(self.count):
                if process == self.me:
                    continue
                value = beats.get(f"{_BEAT}{process}")
                if value == _DONE:
                    continue
                if value is not None and value.startswith(_FAILED):
                    self._lost(f"{self._describe(process)} stopped with an error: "
                               f"{value[len(_FAILED):]}")
                    return
                if value != last_value.get(process, ()):
                    last_value[process], last_change[process] = value, now
                elif now - last_change[process] > self.timeout:
                    self._lost(f"{self._describe(process)} stopped responding: no heartbeat for "
                               f"{self.timeout:g} s; the job stops (results written so far are "
                               "intact: restart every process to resume)")
                    return

    def _lost(self, message: str) -> None:
        if not self._halt.is_set():
            self._halt.set()
            self.on_lost(message)


def _ended(value: str | None) -> bool:
    return value is not None and (value == _DONE or value.startswith(_FAILED))


_WATCH: _Watch | None = None
_JOIN_TIMEOUT = 300.0
_CALLS = itertools.count()


def _next_call() -> int:
    return next(_CALLS)


def _client():
    # The coordination service's client: JAX keeps it in this module-level state (the same
    # object `jax.experimental.multihost_utils` uses).
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def _start_watch(timeout: float, on_lost: Callable[[str], None],
                 initialization_timeout: float) -> _Watch | None:
    """Publishes this process's host, reads everyone's, starts the watch thread."""
    client = _client()  # without it there is nothing to watch
    me, count = jax.process_index(), jax.process_count()
    if client is None or count == 1:
        return None
    client.key_value_set(f"{_HOST}{me}", f"{socket.gethostname()} (pid {os.getpid()})")
    client.wait_at_barrier("cbcert/hosts", int(initialization_timeout * 1000))
    hosts = {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(_HOST)}
    watch = _Watch(client, me, count, hosts, timeout, on_lost)
    watch.start()
    return watch
