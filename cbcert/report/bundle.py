"""Writing a judge bundle (`cbcert.runs.bundle`) to its directory: JSON manifest, JSONL items
and answers, 8-bit RGB PNG images."""

from __future__ import annotations

from pathlib import Path

from cbcert.runs.bundle import MANIFEST, JudgeBundle
from cbcert.runs.directory import json_line, write_json


def write_bundle(bundle: JudgeBundle, directory: Path) -> Path:
    """Write ``bundle`` into ``directory`` (created; its parent must exist): images first, then
    ``items.jsonl`` and ``answers.jsonl``, then ``bundle.json`` last, so a bundle with a
    manifest is complete. Returns the manifest's path."""
    import numpy as np
    from PIL import Image  # matplotlib's own dependency

    directory.mkdir(exist_ok=True)
    for relative, pixels in bundle.images.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.round(np.asarray(pixels) * 255).astype(np.uint8), "RGB").save(
            path, format="PNG")
    (directory / bundle.manifest["items"]).write_text("".join(map(json_line, bundle.items)))
    if bundle.manifest["answers"]:
        (directory / bundle.manifest["answers"]).write_text(
            "".join(map(json_line, bundle.answers)))
    write_json(directory / MANIFEST, bundle.manifest)
    return directory / MANIFEST


__all__ = ["write_bundle"]
