"""One command over many hosts: the ``--distributed`` options and joining/leaving the JAX job.

Every command that samples or attacks (``latent``, ``concept``, ``predict``, ``perturb``,
``attack``, ``sweep``) takes `distributed_options`:

* ``--distributed auto`` (or ``--distributed`` alone): ``jax.distributed.initialize()`` detects
  the cluster (TPU pod slices, SLURM, Open MPI); explicit values below override what it finds;
* ``--coordinator HOST:PORT --num-processes N --process-id I``: an explicit job (all three, or
  ``--distributed auto`` for the rest); giving them implies ``--distributed``;
* ``--heartbeat-timeout S`` (default 60): a process silent this long counts as lost;
* ``--join-timeout S`` (default 300): how long a process waits for the whole job to join (it
  says what it waits for after 10 s, at most half of S) and, later, for the others to reach
  each settings check; then it gives up with exit status 2.

Each option also reads an environment variable: ``CBCERT_DISTRIBUTED``, ``CBCERT_COORDINATOR``,
``CBCERT_NUM_PROCESSES``, ``CBCERT_PROCESS_ID``, ``CBCERT_HEARTBEAT_TIMEOUT``,
``CBCERT_JOIN_TIMEOUT``. The job is joined before the command does anything else (JAX must not
have started a backend); right after, every process checks that it runs the same command and
cbcert code as process 0, and each run checks its settings and world before sampling
(`cbcert.runs.peers`): a difference stops every process with status 2, naming it. Off process 0
standard output goes to ``/dev/null`` (errors still print on standard error) and the run
directory is left alone
(`cbcert.runs.directory`). On success every process leaves through JAX's shutdown barrier; on an
error a process prints it, tells the others (`cbcert.engine.distributed.fail`) and exits with its
status at once; a lost process makes the others exit with status 3 and one message naming it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import click

from cbcert.cli import common

ENV = {"distributed": "CBCERT_DISTRIBUTED", "coordinator": "CBCERT_COORDINATOR",
       "num_processes": "CBCERT_NUM_PROCESSES", "process_id": "CBCERT_PROCESS_ID",
       "heartbeat_timeout": "CBCERT_HEARTBEAT_TIMEOUT", "join_timeout": "CBCERT_JOIN_TIMEOUT"}
DEFAULT_HEARTBEAT_TIMEOUT = 60.0
DEFAULT_JOIN_TIMEOUT = 300.0


@dataclass(frozen=True)
class JobSettings:
    """Where this process sits in a multi-host job (None fields: detected by JAX)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    heartbeat_timeout: float
    join_timeout: float = DEFAULT_JOIN_TIMEOUT


def job_settings(distributed: str | None, coordinator: str | None, num_processes: int | None,
                 process_id: int | None, heartbeat_timeout: float,
                 join_timeout: float = DEFAULT_JOIN_TIMEOUT) -> JobSettings | None:
    """The job the flags ask for, None for a single-process run; bad values exit 2."""
    explicit = {"--coordinator": coordinator, "--num-processes": num_processes,
                "--process-id": process_id}
    given = [flag for flag, value in explicit.items() if value is not None]
    if distributed is None and not given:
        return None
    if distributed is None and len(given) < len(explicit):
        missing = ", ".join(flag for flag in explicit if flag not in given)
        raise click.UsageError(f"{', '.join(given)} also needs {missing} (or --distributed "
                               "auto to detect the rest from the cluster)")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise click.BadParameter(f"got {coordinator!r}; expected HOST:PORT with a port in "
                                     "[1, 65535]", param_hint="--coordinator")
    if num_processes is not None and num_processes < 1:
        raise click.BadParameter(f"got {num_processes}, allowed range [1, inf)",
                                 param_hint="--num-processes")
    if process_id is not None:
        upper = "inf" if num_processes is None else str(num_processes)
        if process_id < 0 or (num_processes is not None and process_id >= num_processes):
            raise click.BadParameter(f"got {process_id}, allowed range [0, {upper}) "
                                     "(--num-processes)", param_hint="--process-id")
    for flag, seconds in (("--heartbeat-timeout", heartbeat_timeout),
                          ("--join-timeout", join_timeout)):
        if not 0 < seconds < float("inf"):
            raise click.BadParameter(f"got {seconds:g}, allowed range (0, inf) seconds",
                                     param_hint=flag)
    return JobSettings(coordinator, num_processes, process_id, float(heartbeat_timeout),
                       float(join_timeout))


_SPLIT_OPTIONS = ("chunk_size", "max_memory", "batch")


def distributed_options(fn):
    """Adds the multi-host options to a command and runs it inside the job they describe.

    The command itself never sees the options. A command with a ``status`` flag set (``certify
    sweep --status``) only reads files and runs without joining.
    """

    @functools.wraps(fn)
    def command(*args, distributed, coordinator, num_processes, process_id, heartbeat_timeout,
                join_timeout, **kwargs):
        settings = job_settings(distributed, coordinator, num_processes, process_id,
                                heartbeat_timeout, join_timeout)
        if settings is None or kwargs.get("status"):
            return fn(*args, **kwargs)
        # Not pinned in run.json (they never change results), but every process must split the
        # work alike: the chunks of one step are sharded over all processes' devices.
        split = {name: kwargs[name] for name in _SPLIT_OPTIONS if name in kwargs}
        with joined(settings, click.get_current_context().info_name, split):
            return fn(*args, **kwargs)

    options = [
        click.option("--distributed", type=click.Choice(["auto"]), is_flag=False,
                     flag_value="auto", default=None, envvar=ENV["distributed"],
                     help="Run as one process of a multi-host JAX job; 'auto' (also the flag "
                          "alone) lets JAX detect the cluster (TPU pod slice, SLURM, Open MPI)."),
        click.option("--coordinator", metavar="HOST:PORT", default=None,
                     envvar=ENV["coordinator"],
                     help="Address of process 0, reachable from every process (implies "
                          "--distributed; with --num-processes and --process-id)."),
        click.option("--num-processes", type=int, default=None, envvar=ENV["num_processes"],
                     help="Processes in the job (one per host, usually)."),
        click.option("--process-id", type=int, default=None, envvar=ENV["process_id"],
                     help="This process's rank in [0, --num-processes); 0 writes all files."),
        click.option("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT,
                     show_default=True, envvar=ENV["heartbeat_timeout"],
                     help="Seconds without a heartbeat after which a process counts as lost "
                          "and the others stop."),
        click.option("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT,
                     show_default=True, envvar=ENV["join_timeout"],
                     help="Seconds a process waits for every process to join the job (and "
                          "to reach each settings check) before it gives up (exit 2)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@contextlib.contextmanager
def joined(settings: JobSettings, command: str,
           split: dict | None = None) -> Iterator[None]:
    """Join the job, check that every process runs ``command`` with the same code and the same
    work-splitting options ``split`` (``{"chunk_size": …}``), run the block, leave: the shutdown
    barrier on success, at once on error."""
    from cbcert.engine import distributed
    from cbcert.runs import peers

    try:
        distributed.initialize(settings.coordinator, settings.num_processes,
                               settings.process_id, cpu_collectives="gloo",
                               initialization_timeout=settings.join_timeout,
                               timeout=settings.heartbeat_timeout, on_join_timeout=_gave_up)
    except Exception as err:  # noqa: BLE001 - JAX reports a failed join in several types
        where = settings.coordinator or "the detected cluster"
        raise click.ClickException(f"could not join the distributed job at {where}: "
                                   f"{_first_line(err)}") from None
    if not distributed.is_coordinator():
        # Only process 0 prints results; the others keep stderr for errors. Silencing the file
        # descriptor also silences libraries writing to it (gloo's connection notices on CPU).
        common.console.quiet = True
        sys.stdout.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    try:
        try:
            peers.check({"command": command, "code": peers.code_identity(),
                         "options": split or {}})
        except peers.SettingsMismatchError as err:
            raise click.UsageError(str(err)) from None
        yield
    except click.exceptions.Exit as err:
        if err.exit_code != 0:
            _leave(f"exit {err.exit_code}", err.exit_code)
    except BaseException as err:  # noqa: BLE001 - every way out must reach the other processes
        _leave(*_report(err))
    distributed.finish()


def _report(err: BaseException) -> tuple[str, int]:
    """Print ``err`` as the CLI would; its message for the other processes and exit status."""
    import jax

    from cbcert.engine import distributed

    if isinstance(err, jax.errors.JaxRuntimeError):
        # A collective failed: most likely a peer died. The watch thread names it and exits
        # if it can; otherwise report the collective's own error.
        distributed.await_verdict()
        message = (f"a collective operation of the distributed job failed ({_first_line(err)}); "
                   "another process probably stopped")
        click.echo(f"Error: {message}", err=True)
        return message, distributed.LOST_EXIT_CODE
    if isinstance(err, click.ClickException):
        err.show()
        return err.format_message(), err.exit_code
    if isinstance(err, KeyboardInterrupt):
        click.echo("Aborted!", err=True)
        return "interrupted", 130
    if isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int) else 1
        return f"exit {code}", code
    traceback.print_exc()
    return f"{type(err).__name__}: {_first_line(err)}", 1


def _gave_up(message: str) -> None:
    """The job was not joined within --join-timeout: say so and exit 2 (nothing started)."""
    click.echo(f"Error: {message} (or wait longer: --join-timeout)", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(click.UsageError.exit_code)


def _leave(message: str, code: int) -> None:
    """Tell the other processes and exit now, skipping JAX's shutdown barrier."""
    from cbcert.engine import distributed

    distributed.fail(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(err).__name__
