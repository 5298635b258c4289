"""Orbax checkpoints with a hash manifest, so a corrupted or edited checkpoint is refused.

Layout of a checkpoint directory::

    <dir>/params/...        orbax StandardCheckpointer output (a pytree of arrays)
    <dir>/manifest.json     {"format": 1, "config": {...}, "files": {relpath: sha256}, ...}
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from cbcert.runs.directory import shorten

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match its manifest."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _hash_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): _sha256(p) for p in sorted(root.rglob("*")) if p.is_file()
    }


def save(directory: str | Path, params: Any, metadata: dict[str, Any]) -> Path:
    """Write ``params`` (a pytree of arrays) with orbax and a manifest of sha256 hashes.

    ``metadata`` (JSON-serialisable: config, metrics, seed…) is stored in the manifest.
    An existing checkpoint at ``directory`` is replaced.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    host = jax.tree.map(np.asarray, params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", host)
        ckptr.wait_until_finished()
    manifest = {"format": FORMAT, **metadata, "files": _hash_tree(directory / "params")}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return directory


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint, after checking every file against its hash."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST}; not a cbcert checkpoint")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: manifest is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: damaged manifest, expected an object with 'files'")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT}")
    actual = _hash_tree(directory / "params")
    expected = manifest.get("files", {})
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    changed = sorted(f for f in set(expected) & set(actual) if expected[f] != actual[f])
    if missing or extra or changed:
        raise CheckpointError(
            f"{directory}: checkpoint does not match its manifest "
            f"(missing: {missing or '-'}; unexpected: {extra or '-'}; "
            f"corrupted: {changed or '-'}). "
            "Re-create it (for the built-in world: `certify train world`)."
        )
    return manifest


def load(directory: str | Path, target: Any) -> tuple[Any, dict[str, Any]]:
    """Verify hashes, then restore the pytree shaped like ``target`` (arrays or ShapeDtypeStructs).

    Returns ``(params, manifest)``; raises ``CheckpointError`` naming what is wrong.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    manifest = read_manifest(directory)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), target)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(directory / "params", abstract)
    except Exception as err:  # orbax raises many types for structure mismatches
        raise CheckpointError(f"{directory}: cannot restore parameters "
                              f"({type(err).__name__}: {shorten(str(err))})") from None
    return params, manifest
