"""Resumable training runs: the output directory and its ``progress/`` checkpoint.

A trainer's ``out`` holds, while training, ``progress/``: the whole train state as one
checkpoint (``cbcert.io.checkpoint``; its manifest has the run's ``kind``, ``step`` and
``identity``), written atomically through ``progress.tmp/``; at the end only what was trained
(a model checkpoint: ``manifest.json`` and ``params/``). Rerunning the same command resumes
from ``progress/``; a run with other settings is refused naming the first that differs.
Used by ``certify train cbae`` (`cbcert.training.cbae_run`) and ``certify train classifier``
(`cbcert.training.classifier_run`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from cbcert.io import checkpoint
from cbcert.schema import ConfigError

PROGRESS = "progress"


def out_error(out: Path, detail: str) -> ConfigError:
    """The output directory ``out`` cannot take this run (key ``out``; ``detail`` says why)."""
    return ConfigError(f"{out}: {detail}", key="out", value=str(out), detail=detail)


def flat(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}} -> {"a.b": 1}`` after a JSON round trip (tuples become lists)."""
    out = {}
    for key, value in json.loads(json.dumps(tree)).items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def out_status(out: Path, what: str) -> str:
    """``"new"`` (absent or empty), ``"done"`` (a written model), ``"partial"`` (progress only).

    Raises:
      ConfigError: (key ``out``) a non-empty directory that is neither (user files are never
        overwritten); ``what`` names the run in the message (e.g. ``"CB-AE"``).
    """
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return "new"
    if not out.is_dir():
        raise out_error(out, "exists and is not a directory")
    names = {p.name for p in out.iterdir()}
    if checkpoint.MANIFEST in names:
        return "done"
    if names <= {PROGRESS, f"{PROGRESS}.tmp"}:
        return "partial"
    raise out_error(out, f"a non-empty directory that is not a {what} run (holds "
                         f"{sorted(names)[:3]}); choose a new or empty directory")


def save_progress(out: Path, tree: Any, manifest: dict[str, Any]) -> None:
    """Write ``out/progress`` (``tree``: the train state's arrays; ``manifest``: ``kind``,
    ``config``, ``step``, ``identity``) atomically via a temporary copy."""
    tmp = out / f"{PROGRESS}.tmp"
    checkpoint.save(tmp, tree, manifest, replace=True)
    final = out / PROGRESS
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def load_progress(out: Path, template: Any, identity: dict) -> tuple[Any, dict] | None:
    """``(tree, manifest)`` of the saved train state in ``out/progress`` (a torn temporary copy
    is skipped), shaped like ``template``; None if there is none.

    Raises:
      ConfigError: (key ``out``) the saved run was started with different settings (names
        the first one).
    """
    for name in (PROGRESS, f"{PROGRESS}.tmp"):
        path = out / name
        if not (path / checkpoint.MANIFEST).is_file():
            continue
        try:
            manifest = checkpoint.read_manifest(path)
        except checkpoint.CheckpointError:
            continue  # a torn temporary copy; the other one is complete
        saved, wanted = flat(manifest.get("identity", {})), flat(identity)
        for key in sorted(set(saved) | set(wanted)):
            if saved.get(key) != wanted.get(key):
                was, now = json.dumps(saved.get(key)), json.dumps(wanted.get(key))
                raise out_error(out, f"holds an unfinished run with {key}={was}, not {now}; "
                                     "use another output directory, or the same settings to "
                                     "resume")
        tree, _ = checkpoint.load(path, template, manifest)
        return tree, manifest
    return None


__all__ = ["PROGRESS", "flat", "load_progress", "out_error", "out_status", "save_progress"]
