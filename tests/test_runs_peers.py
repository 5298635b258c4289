"""Settings the processes of a multi-host job must share (`cbcert.runs.peers`), in one process:
the comparison, what every process raises, and the code and world identities. Whole jobs whose
processes disagree run in test_runs_distributed."""

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import jax
import pytest

import cbcert
from cbcert.runs import peers
from cbcert.worlds.builtin import untrained_world

SETTINGS = {"run": {"job": {"scale": 0.1, "models": ["std", "cbm"], "alpha": math.nan}},
            "command": "latent"}


def _with(**job):
    return {**SETTINGS, "run": {"job": {**SETTINGS["run"]["job"], **job}}}


def test_first_difference_names_the_process_the_key_and_both_values():
    echoed = json.loads(json.dumps(SETTINGS))  # NaN and lists survive the trip as equal
    assert peers.first_difference([SETTINGS, echoed, echoed]) is None
    message = peers.first_difference([SETTINGS, echoed, _with(scale=0.3)])
    assert "run.job.scale is 0.3 on process 2 of 3 but 0.1 on process 0" in message
    job = {k: v for k, v in SETTINGS["run"]["job"].items() if k != "models"}
    message = peers.first_difference([SETTINGS, {**SETTINGS, "run": {"job": job}}])
    assert 'run.job.models is (absent) on process 1 of 2 but ["std", "cbm"] on process 0' in \
        message


class _Job:
    """Stands in for `cbcert.engine.distributed` in a job whose process 0 passed ``first``."""

    def __init__(self, first: dict | None):
        self.first, self.stopped = json.dumps(first, sort_keys=True), False

    def gather_text(self, text: str) -> list[str]:
        if self.first == "null":
            raise TimeoutError("process 0 of 2 did not reach the settings check within 1 s")
        return [self.first, text]

    def stop_together(self) -> None:
        self.stopped = True


def test_every_process_raises_the_same_error_after_stopping_together(monkeypatch):
    job = _Job(SETTINGS)
    monkeypatch.setattr(peers, "distributed", job)
    monkeypatch.setattr(peers, "in_job", lambda: True)
    peers.check(json.loads(json.dumps(SETTINGS)))
    assert not job.stopped
    with pytest.raises(peers.SettingsMismatchError, match="run.job.scale is 0.3 on process 1"):
        peers.check(_with(scale=0.3))
    assert job.stopped
    monkeypatch.setattr(peers, "distributed", _Job(None))
    with pytest.raises(peers.SettingsMismatchError, match="did not reach the settings check"):
        peers.check(SETTINGS)


class _Alone:
    """`cbcert.engine.distributed` outside a job: gathering would be a bug."""

    def is_initialized(self) -> bool:
        return False

    def gather_text(self, text: str) -> list[str]:
        raise AssertionError("gathered outside a job")


def test_outside_a_job_nothing_is_gathered(monkeypatch):
    assert not peers.in_job()  # this test process joined no job
    monkeypatch.setattr(peers, "distributed", _Alone())
    assert not peers.in_job()
    peers.check(SETTINGS)


def test_code_identity_names_each_source_file_and_world_identity_each_parameter_group():
    code = peers.code_identity()
    root = Path(cbcert.__file__).parent
    assert code["cbcert"] == cbcert.__version__ and code["jax"] == jax.__version__
    assert code["files"]["runs/peers.py"] == hashlib.sha256(
        (root / "runs" / "peers.py").read_bytes()).hexdigest()[:16]
    assert len(code["files"]) == len(list(root.rglob("*.py")))

    world = untrained_world("default", seed=0)
    identity = peers.world_identity(world)
    assert set(identity) == {"gen", "clf"} and identity == peers.world_identity(world)
    leaves, tree = jax.tree_util.tree_flatten(world.classifier_params)
    changed = dataclasses.replace(world, classifier_params=jax.tree_util.tree_unflatten(
        tree, [leaves[0] + 1, *leaves[1:]]))
    other = peers.world_identity(changed)
    assert other["gen"] == identity["gen"] and other["clf"] != identity["clf"]
