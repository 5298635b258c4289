"""The one checkpoint format of cbcert: an orbax ``params/`` directory and a ``manifest.json``.

Every saved model uses it: converted PyTorch classifiers and generators (``certify convert``),
trained CB-AEs (``certify train cbae``, also its resumable progress), the built-in world's
classifiers (``certify train world``, the shipped weights)::

    <dir>/params/...        orbax StandardCheckpointer output (a pytree of host arrays)
    <dir>/manifest.json     {"format_version": 2, "kind": "...", "config": {...},
                             "params_sha256": "<hex>", "files": {relpath: "<hex>"}, ...metadata}

* ``kind`` names what the params are (``cbcert.io.registry`` maps a model kind to its config
  dataclass and module class); ``config`` is that config as a JSON object.
* ``files``: sha256 of every file under ``params/``, checked *before* orbax reads anything, so
  a truncated, edited, missing or stray file is refused with the file's name.
* ``params_sha256``: sha256 of the restored arrays (``params_sha256``), checked after the
  restore: it identifies the weights independently of orbax's file layout.
* anything else is free metadata (``sources``, ``metrics``, ``identity``, ``world_config``…).

Directories written by earlier cbcert releases stay readable: converted models
(``"format_version": 1``: ``params_sha256``, no ``files``) and the built-in weights / CB-AE
progress (``"format": 1``: ``files``, no ``params_sha256``); each is checked with what it has.
Every failure is a ``CheckpointError`` naming the directory and what is wrong, with bounded
quotes of the values found.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from cbcert.schema import shorten

MANIFEST = "manifest.json"
PARAMS = "params"
FORMAT_VERSION = 2
LEGACY_CONVERTED = 1  # "format_version": 1, written by `certify convert` / `train cbae` before
LEGACY_FILES = 1  # "format": 1, written for the built-in weights and CB-AE progress before
_RESERVED = ("format_version", "format", "params_sha256", "files")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_LISTED = 5  # file names quoted per category in a mismatch message; the count is always given
_RECREATE = ("re-create it with the command that wrote it (`certify convert`, "
             "`certify train world` or `certify train cbae`)")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, damaged or does not match its manifest."""


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _key_part(entry: Any) -> Any:
    """One step of a pytree path as the plain key (dict key, sequence index, attribute name)."""
    for attribute in ("key", "idx", "name"):
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    return str(entry)


def params_sha256(tree: Any) -> str:
    """Hex sha256 of a params pytree, independent of how it is stored.

    For every leaf in order of ``str(path)`` (``path`` the tuple of dict keys / indices, e.g.
    ``('encoder', 0, 'linear', 'kernel')``) the digest takes ``"{path}|{dtype.str}|{shape}|"``
    and the leaf's C-order bytes. An ``nnx.Module`` or ``nnx.State`` hashes as its pure dict,
    so the value equals the ``params_sha256`` earlier releases wrote for converted models.
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(_host_tree(tree))
    digest = hashlib.sha256()
    keyed = [(str(tuple(_key_part(p) for p in path)), leaf) for path, leaf in leaves]
    for path, leaf in sorted(keyed, key=lambda item: item[0]):
        array = np.asarray(leaf)
        digest.update(f"{path}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _host_tree(params: Any) -> Any:
    """``params`` (a module, an ``nnx.State`` or a pytree of arrays) as a pytree of numpy arrays."""
    if isinstance(params, nnx.Module):
        params = nnx.split(params)[1]
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    return jax.tree.map(np.asarray, params)


def _hash_files(root: Path) -> dict[str, str]:
    """``relpath -> sha256`` of every regular file under ``root``; a symbolic link maps to
    ``"symlink"`` (never followed, never in a manifest, so always refused)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            found[path.relative_to(root).as_posix()] = "symlink"
        elif path.is_file():
            found[path.relative_to(root).as_posix()] = sha256_file(path)
    return found


def save(directory: str | Path, params: Any, manifest: dict[str, Any], *,
         replace: bool = False) -> dict[str, Any]:
    """Write ``params`` with orbax under ``directory/params`` and the manifest beside it.

    Args:
      directory: new or empty directory (one without ``manifest.json`` or ``params/``); with
        ``replace=True`` an existing ``directory`` is deleted first.
      params: an ``nnx.Module`` (all its variables), an ``nnx.State`` or a pytree of arrays.
      manifest: ``kind`` (str), ``config`` (JSON object) and any JSON metadata; the keys
        ``format_version``, ``format``, ``params_sha256`` and ``files`` are added here.

    Returns:
      The manifest as written (after a JSON round trip: what ``read_manifest`` returns).

    Raises:
      CheckpointError: a manifest without ``kind``/``config`` or with a reserved key, or a
        directory that already holds a checkpoint.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    _check_new_manifest(directory, manifest)
    if replace and directory.exists():
        shutil.rmtree(directory)
    if (directory / MANIFEST).exists() or (directory / PARAMS).exists():
        raise CheckpointError(f"{shorten(str(directory))} already holds a checkpoint "
                              f"({MANIFEST} or {PARAMS}/); choose an empty directory")
    directory.mkdir(parents=True, exist_ok=True)
    host = _host_tree(params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / PARAMS, host)
        checkpointer.wait_until_finished()
    written = json.loads(json.dumps({"format_version": FORMAT_VERSION, **manifest,
                                     "params_sha256": params_sha256(host),
                                     "files": _hash_files(directory / PARAMS)}))
    partial = directory / f"{MANIFEST}.partial"  # the manifest appears whole or not at all
    partial.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    partial.replace(directory / MANIFEST)
    return written


def _check_new_manifest(directory: Path, manifest: Any) -> None:
    where = shorten(str(directory))
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: manifest must be a dict, got {type(manifest).__name__}")
    reserved = [key for key in _RESERVED if key in manifest]
    if reserved:
        raise CheckpointError(f"{where}: manifest key {reserved[0]!r} is written by save itself")
    if not isinstance(manifest.get("kind"), str) or not manifest["kind"]:
        raise CheckpointError(f"{where}: manifest kind={shorten(repr(manifest.get('kind')))}; "
                              "expected a non-empty string")
    if not isinstance(manifest.get("config"), dict):
        raise CheckpointError(f"{where}: manifest config={shorten(repr(manifest.get('config')))}; "
                              "expected a JSON object")


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint, after checking every file under ``params/`` against it.

    Raises:
      CheckpointError: no or unreadable ``manifest.json``, an unknown format, a field of the
        wrong type, or files that are missing, unexpected or changed (each list names up to
        five files and gives the count).
    """
    directory = Path(directory).absolute()
    manifest = _parse(directory)
    if "files" in manifest:
        _check_files(directory, manifest)
    return manifest


def _parse(directory: Path) -> dict[str, Any]:
    """``manifest.json`` parsed and its fields type-checked (no file is hashed)."""
    where = shorten(str(directory))
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{where}: no {MANIFEST}; not a cbcert checkpoint")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{where}: {MANIFEST} is not valid JSON "
                              f"({shorten(str(err))})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: {MANIFEST} is not valid JSON (nested too deeply)"
                              ) from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: damaged {MANIFEST}, expected a JSON object")
    if manifest.get("format_version") == FORMAT_VERSION:
        required = ("kind", "config", "params_sha256", "files")
    elif manifest.get("format_version") == LEGACY_CONVERTED:
        required = ("kind", "config", "params_sha256")
    elif "format_version" not in manifest and manifest.get("format") == LEGACY_FILES:
        required = ("files",)
    else:
        found = manifest.get("format_version", manifest.get("format"))
        raise CheckpointError(f"{where}: format_version={shorten(repr(found))}; this cbcert reads "
                              f"versions {LEGACY_CONVERTED} and {FORMAT_VERSION}")
    checks = {"kind": lambda v: isinstance(v, str) and bool(v),
              "config": lambda v: isinstance(v, dict),
              "params_sha256": lambda v: isinstance(v, str) and bool(_HEX64.fullmatch(v)),
              "files": lambda v: isinstance(v, dict) and all(
                  isinstance(k, str) and isinstance(h, str) for k, h in v.items())}
    for key, ok in checks.items():
        if (key in required or key in manifest) and not ok(manifest.get(key)):
            raise CheckpointError(f"{where}: damaged {MANIFEST}, {key}="
                                  f"{shorten(repr(manifest.get(key)), 80)}")
    return manifest


def _listed(names: list[str]) -> str:
    if not names:
        return "-"
    shown = [shorten(name, 80) for name in names[:_LISTED]]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return f"{shown}{more}"


def _check_files(directory: Path, manifest: dict[str, Any]) -> None:
    actual = _hash_files(directory / PARAMS)
    expected = manifest["files"]
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    changed = sorted(f for f in set(expected) & set(actual) if expected[f] != actual[f])
    if missing or extra or changed:
        raise CheckpointError(
            f"{shorten(str(directory))}: checkpoint does not match its manifest "
            f"(missing: {_listed(missing)}; unexpected: {_listed(extra)}; "
            f"corrupted: {_listed(changed)}); {_RECREATE}")


def load(directory: str | Path, target: Any, manifest: dict[str, Any] | None = None
         ) -> tuple[Any, dict[str, Any]]:
    """Restore the params of a checkpoint into the structure of ``target``.

    Args:
      directory: a checkpoint directory.
      target: pytree of arrays or ``jax.ShapeDtypeStruct`` (e.g. ``nnx.to_pure_dict`` of an
        abstract module's state) giving every leaf's path, shape and dtype.
      manifest: ``read_manifest(directory)`` if the caller already has it (its files are then
        not hashed a second time).

    Returns:
      ``(params, manifest)``: ``params`` shaped like ``target``, as device arrays.

    Raises:
      CheckpointError: anything ``read_manifest`` refuses, params orbax cannot restore into
        ``target``, or restored arrays whose ``params_sha256`` differs from the manifest's.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    where = shorten(str(directory))
    if manifest is None:
        manifest = read_manifest(directory)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), target)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(directory / PARAMS, abstract)
    except Exception as err:  # orbax raises many types for missing, truncated or other trees
        raise CheckpointError(f"{where}: cannot restore the parameters "
                              f"({type(err).__name__}: {shorten(str(err))})") from None
    params = jax.device_put(params)  # host numpy as restored -> device arrays, one transfer
    if "params_sha256" in manifest:
        digest = params_sha256(params)
        if digest != manifest["params_sha256"]:
            raise CheckpointError(f"{where}: params sha256 {digest} does not match the "
                                  f"manifest's {manifest['params_sha256']}; the checkpoint was "
                                  f"altered: {_RECREATE}")
    return params, manifest
