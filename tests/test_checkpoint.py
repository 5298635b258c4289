"""Orbax checkpoints with hash manifests: round trip, and refusal of damaged checkpoints."""

import json

import numpy as np
import pytest

from cbcert import checkpoint


@pytest.fixture()
def saved(tmp_path):
    params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": {"c": np.ones(4, np.int32)}}
    path = checkpoint.save(tmp_path / "ckpt", params, {"kind": "test", "note": 1})
    return path, params


def test_round_trip(saved):
    path, params = saved
    loaded, manifest = checkpoint.load(path, params)
    np.testing.assert_array_equal(loaded["a"], params["a"])
    np.testing.assert_array_equal(loaded["b"]["c"], params["b"]["c"])
    assert manifest["kind"] == "test" and manifest["note"] == 1
    assert manifest["files"], "the manifest lists hashed files"


def test_corrupted_file_is_refused(saved):
    path, params = saved
    victim = max((p for p in (path / "params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="corrupted: \\['.+'\\]"):
        checkpoint.load(path, params)


def test_missing_and_unexpected_files_are_refused(saved, tmp_path):
    path, params = saved
    (path / "params" / "stray.bin").write_bytes(b"x")
    with pytest.raises(checkpoint.CheckpointError, match="unexpected: \\['stray.bin'\\]"):
        checkpoint.load(path, params)
    (path / "params" / "stray.bin").unlink()
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    manifest["files"]["ghost.bin"] = "0" * 64
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="missing: \\['ghost.bin'\\]"):
        checkpoint.load(path, params)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no manifest.json"):
        checkpoint.load(tmp_path, {})
