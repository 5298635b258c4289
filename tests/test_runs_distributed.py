"""Runs over many processes, through the CLI: one JAX job on loopback, and sweep shards.

The multi-process tests start real ``certify`` processes (`processes.start_python`): two CPU
processes with two fake devices each form one ``jax.distributed`` job (gloo collectives), the
way hosts of a TPU pod slice do. Each process gets its own working directory and the same
relative ``--out``, as hosts without a shared disk would: whatever lands in process 1's
directory was written by process 1. A shared compilation cache lets reruns skip compiling.
These tests take 20-60 s each on a loaded 2-core machine (marked slow, never skipped).
"""

import json
import os
import signal
import socket
import time
from pathlib import Path

import processes as testing
import pytest
from click.testing import CliRunner

from cbcert.cli import main
from cbcert.engine import distributed
from cbcert.runs import directory, lock, sweep
from cbcert.runs.config import ConfigError, load_config
from cbcert.runs.directory import RECORDS, SUMMARY

# Seconds without a heartbeat before a process counts as lost. The survivors must stop within
# HEARTBEAT + one beat (0.5 s); MARGIN allows for a machine shared with other jobs.
HEARTBEAT = 5
MARGIN = 10
# n0 = n and batches of 2 inputs: every sampling step (pilot, selection, estimation) has
# chunks of 128 pairs, so each process compiles one step.
COMMON = ["--inputs", "6", "--n", "64", "--n0", "64", "--models", "std", "--batch", "2",
          "--chunk-size", "128"]
LATENT = ["latent", "--sigma", "0.05", *COMMON]
CONCEPT = ["concept", "--rho", "0.05", *COMMON[:1], "3", *COMMON[2:]]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A compilation cache shared by the processes of this module (reruns compile nothing)."""
    path = tmp_path_factory.mktemp("jax-cache")
    return {"JAX_COMPILATION_CACHE_DIR": str(path),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def _certify(args, cwd: Path, env: dict, *, rank: int | None = None, port: int | None = None):
    argv = [*args, "--out", "run", "--heartbeat-timeout", str(HEARTBEAT)]
    if rank is not None:
        argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                 "--process-id", str(rank)]
    code = f"import sys; sys.argv = ['certify', *{argv!r}]; from cbcert.cli import main; main()"
    cwd.mkdir(parents=True, exist_ok=True)
    return testing.start_python(code, num_devices=2, env=env, cwd=cwd)


def _job(args, hosts: list[Path], env: dict):
    """The two processes of one job, process i in ``hosts[i]``."""
    port = testing.free_port()
    return [_certify(args, host, env, rank=rank, port=port) for rank, host in enumerate(hosts)]


def _wait(process, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except Exception:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"process still running after {timeout} s:\n{err}") from None
    return process.returncode, out, err


def _finished(processes) -> list[tuple[int, str, str]]:
    results = [_wait(p) for p in processes]
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"process {rank} exited with {code}:\n{out}\n{err}"
    return results


def _silent(result) -> None:
    """Process 1 printed nothing: no output, no error."""
    code, out, err = result
    assert (out, err) == ("", "")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _untimed_records(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(({k: v for k, v in r.items() if k != "seconds"} for r in records),
                  key=lambda r: (r["index"], r["model"]))


def _untimed(value):
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if "seconds" not in k}
    return value


def _reference(args, out: Path) -> None:
    """The same run as one process (this one), for comparison."""
    result = CliRunner().invoke(main, [*args, "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output


def _wait_for_records(path: Path, processes, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_bytes().count(b"\n") >= 1:
            return
        for rank, process in enumerate(processes):
            assert process.poll() is None, f"process {rank} ended early: {_wait(process)}"
        time.sleep(0.05)
    raise AssertionError(f"no record in {path} after {timeout} s")


def _same_run(host0: Path, reference: Path) -> None:
    assert _untimed_records(host0 / "run" / RECORDS) == _untimed_records(reference / RECORDS)
    ours = json.loads((host0 / "run" / SUMMARY).read_text())
    assert _untimed(ours) == _untimed(json.loads((reference / SUMMARY).read_text()))


@pytest.mark.slow
def test_latent_job_survives_a_lost_process_and_resumes_to_the_single_process_run(
        tmp_path, cache):
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    job = _job(LATENT, hosts, cache)
    _reference(LATENT, tmp_path / "reference")
    records = hosts[0] / "run" / RECORDS
    _wait_for_records(records, job)
    os.kill(job[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    code, out, err = _wait(job[0], timeout=HEARTBEAT + 4 * MARGIN)
    elapsed = time.monotonic() - killed
    assert code == distributed.LOST_EXIT_CODE, err
    assert elapsed < HEARTBEAT + MARGIN, f"took {elapsed:.1f} s"
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"process 1 of 2 on {socket.gethostname()} (pid {job[1].pid})" in errors[0]
    assert "no heartbeat for 5 s" in errors[0]
    job[1].communicate()
    # What process 0 wrote before it stopped is intact: complete lines of the final records.
    written = [json.loads(line) for line in records.read_text().splitlines()]
    reference = _untimed_records(tmp_path / "reference" / RECORDS)
    assert 1 <= len(written) < len(reference)
    assert all({k: v for k, v in r.items() if k != "seconds"} in reference for r in written)
    assert _files(hosts[1]) == []

    results = _finished(_job(LATENT, hosts, cache))
    _same_run(hosts[0], tmp_path / "reference")
    assert "SmAcc" in results[0][1]
    _silent(results[1])
    assert _files(hosts[1]) == []
    assert _files(hosts[0] / "run") == [RECORDS, "run.json", SUMMARY]


@pytest.mark.slow
def test_concept_job_writes_the_single_process_records_from_process_0_only(tmp_path, cache):
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    job = _job(CONCEPT, hosts, cache)
    _reference(CONCEPT, tmp_path / "reference")
    results = _finished(job)
    _same_run(hosts[0], tmp_path / "reference")
    assert "ACR-H" in results[0][1]
    _silent(results[1])
    assert _files(hosts[1]) == []
    run = json.loads((hosts[0] / "run" / "run.json").read_text())
    assert len(run["devices"]) == 4  # the job's global mesh: 2 processes x 2 devices


@pytest.mark.slow
def test_losing_process_0_stops_the_others(tmp_path, cache):
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    job = _job(LATENT, hosts, cache)
    _wait_for_records(hosts[0] / "run" / RECORDS, job)
    os.kill(job[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    code, _, err = _wait(job[1], timeout=HEARTBEAT + 4 * MARGIN)
    assert code != 0
    assert time.monotonic() - killed < HEARTBEAT + MARGIN
    # JAX's coordination service lived in process 0: its client stops this one at once.
    assert "distributed service" in err or "coordinator" in err, err
    job[0].communicate()
    assert _files(hosts[1]) == []


@pytest.mark.slow
def test_processes_with_other_settings_all_exit_2_naming_the_difference(tmp_path, cache):
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    port = testing.free_port()
    other = ["latent", "--sigma", "0.3", *COMMON]
    job = [_certify(args, host, cache, rank=rank, port=port)
           for rank, (args, host) in enumerate(zip((LATENT, other), hosts, strict=True))]
    for rank, process in enumerate(job):
        code, _, err = _wait(process, timeout=120)
        assert code == 2, (rank, err)
        assert "run.job.scale is 0.3 on process 1 of 2 but 0.05 on process 0" in err, err
        assert "Traceback" not in err, err
    # Checked before any sampling: nothing pinned, no record.
    assert _files(hosts[0]) == [] and _files(hosts[1]) == []


@pytest.mark.slow
def test_a_process_without_process_0_says_what_it_waits_for_and_gives_up(tmp_path, cache):
    port = testing.free_port()
    process = _certify([*LATENT, "--join-timeout", "4"], tmp_path / "host1", cache, rank=1,
                       port=port)
    code, out, err = _wait(process, timeout=120)
    assert code == 2, err
    assert (f"process 1 of 2 is waiting for process 0 (the coordinator, at 127.0.0.1:{port})"
            in err), err
    assert "gave up after 4 s" in err and "--join-timeout" in err and "Traceback" not in err
    assert _files(tmp_path / "host1") == []


TWO_SHARDS = """\
preset: smoke
name: shards
world: {seed: 0, num_inputs: 3}
latent: {sigmas: [0.05, 0.1], n0: 4, n: 32, alpha: 0.01, models: [std]}
concept: {rhos: [0.05], flips: [1], n0: 4, n: 32, alpha: 0.01, models: [std]}
"""


def _sweep(config: Path, out: Path, *extra: str):
    code = (f"import sys; sys.argv = ['certify', 'sweep', {str(config)!r}, '--out', "
            f"{str(out)!r}, *{list(extra)!r}]; from cbcert.cli import main; main()")
    return testing.start_python(code, num_devices=1)


def _report_tables(out: Path) -> dict[str, list[list[str]]]:
    """The report's CSV tables without their wall-clock columns."""
    result = CliRunner().invoke(main, ["report", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    tables = {}
    for path in sorted((out / "report").glob("*.csv")):
        rows = [line.split(",") for line in path.read_text().splitlines()]
        keep = [i for i, name in enumerate(rows[0]) if "seconds" not in name]
        tables[path.name] = [[row[i] for i in keep] for row in rows]
    return tables


@pytest.mark.slow
def test_two_shards_at_once_give_the_unsplit_sweep(tmp_path):
    config = tmp_path / "shards.yaml"
    config.write_text(TWO_SHARDS)
    split, whole = tmp_path / "split" / "sweep", tmp_path / "whole" / "sweep"
    shards = [_sweep(config, split, "--shard", f"{i}/2") for i in (0, 1)]
    result = CliRunner().invoke(main, ["sweep", str(config), "--out", str(whole), "--quiet"])
    assert result.exit_code == 0, result.output
    outputs = _finished(shards)
    assert all("shard" in out and "finished" in out for _, out, _ in outputs)

    cells = [c.name for c in sweep.plan_cells(load_config(config),
                                              sweep.sections_in_file(config))]
    assert _files(split) == _files(whole)  # the same cells, files, and no stray lock or temp
    assert sorted(p.name for p in split.iterdir() if p.is_dir()) == sorted(cells)
    for cell in cells:
        assert _untimed_records(split / cell / RECORDS) == _untimed_records(whole / cell / RECORDS)
    manifest = json.loads((split / sweep.MANIFEST).read_text())
    assert [c["name"] for c in manifest["cells"]] == cells
    assert _report_tables(split) == _report_tables(whole)
    status = CliRunner().invoke(main, ["sweep", str(config), "--out", str(split), "--status"])
    assert status.exit_code == 0 and f"{len(cells)} done, 0 running, 0 missing" in status.output


def test_sweep_status_lists_done_running_and_missing_cells(tmp_path):
    config = tmp_path / "shards.yaml"
    config.write_text(TWO_SHARDS)
    out = tmp_path / "sweep"
    (out / "latent-sigma0.05").mkdir(parents=True)
    (out / "latent-sigma0.05" / SUMMARY).write_text("{}")
    (out / "concept-rho0.05").mkdir()
    (out / "concept-rho0.05" / RECORDS).write_text('{"index": 1}\n{"index": 2}\n')
    # A lock file left by a killed run is not a running cell.
    (out / "concept-flips1").mkdir()
    (out / "concept-flips1" / directory.LOCK).write_text('{"pid": 1}\n')
    with lock.hold(out / "latent-sigma0.1"):
        result = CliRunner().invoke(main, ["sweep", str(config), "--out", str(out), "--status"])
        held = lock.lock_holder(out / "latent-sigma0.1")
    assert result.exit_code == 0, result.output
    lines = {line.split()[1]: line for line in result.output.splitlines()
             if line.startswith("│")}
    assert "done" in lines["latent-sigma0.05"]
    assert "running" in lines["latent-sigma0.1"] and socket.gethostname() in lines[
        "latent-sigma0.1"]
    assert "missing" in lines["concept-rho0.05"] and "interrupted, 2" in lines["concept-rho0.05"]
    assert "missing" in lines["concept-flips1"]
    assert "1 done, 1 running, 2 missing" in result.output
    assert held["pid"] == os.getpid()  # the probe left the holder's lock alone
    assert lock.lock_holder(out / "latent-sigma0.1") is None  # released with the block

    shard = CliRunner().invoke(main, ["sweep", str(config), "--out", str(out), "--status",
                                      "--shard", "1/2"])
    assert shard.exit_code == 0, shard.output
    mine = [c.name for c in sweep.shard_cells(
        sweep.plan_cells(load_config(config), sweep.sections_in_file(config)), 1, 2)]
    assert all(name in shard.output for name in mine) and "/2" in shard.output


def test_shards_split_cells_evenly_by_cost_and_deterministically(tmp_path):
    config = tmp_path / "shards.yaml"
    config.write_text(TWO_SHARDS.replace("sigmas: [0.05, 0.1]", "sigmas: [0.05, 0.1, 0.2, 0.3]")
                      .replace("flips: [1]", "flips: [1, 2]"))
    cells = sweep.plan_cells(load_config(config), sweep.sections_in_file(config))
    costs = [sweep.cell_cost(c) for c in cells]
    for count in (1, 2, 3, len(cells), len(cells) + 2):
        shards = sweep.assign_shards(cells, count)
        assert shards == sweep.assign_shards(cells, count)
        parts = [sweep.shard_cells(cells, i, count) for i in range(count)]
        assert sorted(c.name for part in parts for c in part) == sorted(c.name for c in cells)
        loads = [sum(sweep.cell_cost(c) for c in part) for part in parts]
        # Greedy LPT: no shard exceeds the average load by more than the largest cell.
        assert max(loads) <= sum(costs) / count + max(costs)
    assert len(set(costs)) == 1  # equal cells: dealt round-robin, in plan order
    assert sweep.assign_shards(cells, 2) == (0, 1, 0, 1, 0, 1, 0)
    for bad in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ConfigError, match="shard"):
            sweep.shard_cells(cells, *bad)


@pytest.mark.parametrize("args,env,flag", [
    (["--process-id", "1"], {}, "--coordinator, --num-processes"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], {},
     "--coordinator"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], {},
     "--process-id"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "0", "--process-id", "0"], {},
     "--num-processes"),
    ([], {"CBCERT_COORDINATOR": "127.0.0.1:1", "CBCERT_NUM_PROCESSES": "2",
          "CBCERT_PROCESS_ID": "5"}, "--process-id"),
    (["--distributed", "auto", "--heartbeat-timeout", "0"], {}, "--heartbeat-timeout"),
    (["--distributed", "auto", "--join-timeout", "inf"], {}, "--join-timeout"),
    (["--distributed", "always"], {}, "--distributed"),
])
def test_bad_job_flags_exit_2_naming_the_flag(args, env, flag, tmp_path):
    for command in (["latent", "--sigma", "0.1"], ["perturb"], ["attack"],
                    ["sweep", "configs/reference.yaml"]):
        result = CliRunner().invoke(main, [*command, *args, "--out", str(tmp_path / "x")],
                                    env=env)
        assert result.exit_code == 2, (command, result.output)
        assert flag in result.output
    assert not (tmp_path / "x").exists()


def test_bad_shards_exit_2():
    for value in ("2/2", "a/b", "1"):
        result = CliRunner().invoke(main, ["sweep", "configs/reference.yaml", "--status",
                                           "--shard", value])
        assert result.exit_code == 2 and "--shard" in result.output, result.output


class _OtherProcess:
    """Stands in for `cbcert.engine.distributed` on process 1 of a job whose process 0
    reported ``outcome`` (what `directory.on_coordinator` broadcasts)."""

    def __init__(self, outcome: dict):
        self.sent = json.dumps(outcome).encode()

    def is_initialized(self) -> bool:
        return True

    def is_coordinator(self) -> bool:
        return False

    def broadcast_bytes(self, data):
        assert data is None  # process 1 contributes nothing
        return self.sent


def test_off_process_0_nothing_is_written_and_process_0_outcomes_are_shared(
        tmp_path, monkeypatch):
    monkeypatch.setattr(directory, "distributed", _OtherProcess({"result": None}))
    out = tmp_path / "run"
    directory.check_writable(out)
    with lock.hold(out):
        directory.open_run(out, {"job": 1})
        directory.write_json(out / SUMMARY, {"a": 1})
        assert not directory.write_json_once(out / "manifest.json", {"a": 1})
        with directory.append_records(out / RECORDS) as sink:
            sink.write(directory.json_line({"index": 0}))
            sink.flush()
    assert not out.exists()

    monkeypatch.setattr(directory, "distributed", _OtherProcess(
        {"error": "RunLockedError", "message": "run is in use by another run (pid 7)",
         "key": "out", "detail": None}))
    with pytest.raises(directory.RunLockedError, match="pid 7"), lock.hold(out):
        pass
    monkeypatch.setattr(directory, "distributed", _OtherProcess(
        {"error": "OSError", "message": "disk full", "key": None, "detail": None}))
    with pytest.raises(RuntimeError, match="process 0: disk full"):
        directory.open_run(out, {"job": 1})
    assert not out.exists()


def test_write_json_once_writes_exactly_once(tmp_path):
    path = tmp_path / "manifest.json"
    assert directory.write_json_once(path, {"first": 1})
    assert not directory.write_json_once(path, {"second": 2})
    assert json.loads(path.read_text()) == {"first": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_processes_must_agree_on_the_options_that_split_the_work(monkeypatch, tmp_path):
    """--chunk-size, --max-memory and --batch are not pinned in run.json (they never change
    results), but the chunks of one step are sharded over every process: the joining check
    compares them too."""
    from cbcert.cli import distributed as cli_distributed
    from cbcert.engine import distributed as engine
    from cbcert.runs import peers

    seen = []

    def check(settings):
        seen.append(settings)
        raise RuntimeError("stop after the joining check")

    def leave(message, code):
        raise SystemExit(code)

    monkeypatch.setattr(engine, "initialize", lambda *args, **kwargs: None)
    monkeypatch.setattr(engine, "is_coordinator", lambda: True)
    monkeypatch.setattr(peers, "check", check)
    monkeypatch.setattr(cli_distributed, "_leave", leave)
    result = CliRunner().invoke(main, ["latent", "--sigma", "0.1", "--coordinator",
                                       "127.0.0.1:1", "--num-processes", "2", "--process-id",
                                       "0", "--chunk-size", "7", "--max-memory", "123456",
                                       "--batch", "3", "--out", str(tmp_path / "x")])
    assert result.exit_code == 1 and len(seen) == 1, result.output
    assert seen[0]["command"] == "latent"
    assert seen[0]["options"] == {"chunk_size": 7, "max_memory": 123456, "batch": 3}
    other = {**seen[0], "options": {**seen[0]["options"], "chunk_size": 8}}
    assert "options.chunk_size is 8 on process 1 of 2 but 7 on process 0" in \
        peers.first_difference([seen[0], other])
