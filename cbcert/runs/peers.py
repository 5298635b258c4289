"""Settings every process of a multi-host job must share, checked before any sampling.

The processes of one ``jax.distributed`` job each count part of every input's samples and
process 0 alone writes the records, so processes started with different settings (σ = 0.1 on
one, 0.3 on another) would write records that match neither. `check` gathers every process's
settings (`cbcert.engine.distributed.gather_text`), compares each process's with process 0's,
and on a difference raises `SettingsMismatchError` on every process alike, naming the first
differing key and both values. The CLI checks three times: on joining the job (the command and
`code_identity`), when a runner opens its run directory (the settings pinned in ``run.json``
and `world_identity`), and when a sweep pins its manifest (config, cells, worlds, shard).
Outside a multi-host job every check is free: nothing is computed or compared.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from cbcert.engine import distributed
from cbcert.schema import ConfigError, shorten

_ABSENT = "(absent)"


class SettingsMismatchError(ConfigError):
    """Processes of one multi-host job run with different settings, code or world."""


def in_job() -> bool:
    """Whether this process is one of several of a multi-host job (then settings are checked)."""
    return distributed.is_initialized() and jax.process_count() > 1


def check(settings: dict[str, Any]) -> None:
    """Raise `SettingsMismatchError` on every process unless all processes pass equal
    ``settings`` (a JSON-able dict); nothing outside a multi-host job.

    Every process must call it at the same point; one that does not get there within the
    join timeout is reported the same way (by the processes that did). Values are compared as
    JSON text, so that tuples equal lists and NaN equals NaN.
    """
    if not in_job():
        return
    try:
        texts = distributed.gather_text(json.dumps(settings, sort_keys=True))
    except TimeoutError as err:
        raise SettingsMismatchError(str(err)) from None
    message = first_difference([json.loads(text) for text in texts])
    if message is not None:
        distributed.stop_together()
        raise SettingsMismatchError(message)


def first_difference(settings: list[dict[str, Any]]) -> str | None:
    """The first process whose settings differ from process 0's (``settings[0]``), at the
    first differing key (nested keys dotted: ``run.job.scale``), with both values; None if
    all are equal."""
    reference = _flat(settings[0])
    for process, other in enumerate(settings[1:], start=1):
        theirs = _flat(other)
        for key in sorted(reference.keys() | theirs.keys()):
            if reference.get(key, _ABSENT) != theirs.get(key, _ABSENT):
                return (f"the processes of this distributed job disagree: {key} is "
                        f"{shorten(theirs.get(key, _ABSENT), 120)} on process {process} of "
                        f"{len(settings)} but {shorten(reference.get(key, _ABSENT), 120)} on "
                        "process 0; start every process with the same command, settings, "
                        "cbcert code and world")
    return None


def _flat(value: Any, prefix: str = "") -> dict[str, str]:
    """``{dotted key: JSON text of the value}`` of the leaves of nested dicts."""
    if isinstance(value, dict) and value:
        flat = {}
        for key, item in value.items():
            flat.update(_flat(item, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: json.dumps(value, sort_keys=True)}


@functools.cache
def code_identity() -> dict[str, Any]:
    """The code a process runs: versions of cbcert and jax, and a SHA-256 prefix of each of
    cbcert's Python files (so a host with one edited file is named by that file)."""
    import cbcert

    root = Path(cbcert.__file__).parent
    files = {path.relative_to(root).as_posix():
             hashlib.sha256(path.read_bytes()).hexdigest()[:16]
             for path in sorted(root.rglob("*.py"))}
    return {"cbcert": cbcert.__version__, "jax": jax.__version__, "files": files}


def world_identity(world) -> dict[str, str]:
    """SHA-256 prefixes of the world's parameters, per top-level group (``gen``, ``clf``):
    every leaf's path, dtype, shape and bytes. Computed in a multi-host job only (it reads
    every parameter back to the host)."""
    groups = {}
    for name, params in world.params.items():
        digest = hashlib.sha256()
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            array = np.asarray(leaf)
            digest.update(f"{jax.tree_util.keystr(path)} {array.dtype} {array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        groups[name] = digest.hexdigest()[:16]
    return groups


__all__ = ["SettingsMismatchError", "check", "code_identity", "first_difference", "in_job",
           "world_identity"]
