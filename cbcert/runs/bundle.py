"""Judge bundles: what `certify explain --export DIR` hands a council of judges (multimodal
models run elsewhere, people, the built-in known-answer scorer), and the pre-registered inputs
they judge.

**Pre-registration.** The judged inputs are ``judge_inputs`` positions of the explain run's
agreement set drawn without replacement from the run's key, stream `Stream.JUDGE`:
``sorted(choice(fold_in(key(seed), 8), num_inputs, judge_inputs))``. They depend on the seed
and the number of inputs only (not on any image, prediction or explanation), and the run writes
them to ``judge_subset.json`` in its directory right after drawing the pool, before any
explanation is computed, so nobody can pick the inputs whose explanations look good.

**Layout** of a bundle directory (version 1; images are the generator's output in [0, 1],
enlarged by pixel repetition to at least 128 px):

* ``bundle.json``: ``{"format": "cbcert-judge-bundle", "version": 1, "world", "settings"
  (the explain run's), "subset": {"stream", "seed", "drawn_from", "positions", "indices"},
  "score_range": [1, 9], "instructions", "models", "class_names", "concept_names",
  "items": "items.jsonl", "answers": "answers.jsonl" | null}``;
* ``items.jsonl``: one line per judged input and explained model, ``{"schema":
  "cbcert-judge-item/1", "id": "<index>-<model>", "input": index, "model", "unit": "concept" |
  "prototype", "label" (the agreement label's class name), "prediction" (class name), "cited":
  [{"name", "contribution", "share"}, …] (the clean explanation, ranked), "perturbed": {"eps":
  {"prediction", "cited"}, "tau": {…}}, "images": {"clean", "eps", "tau"[, "edit"]} (paths in
  the bundle), "edit": {"flipped": [concept names], "prediction", "verified"} (concept models
  on worlds with counterfactuals: every concept the explanation cites flipped at once, by the
  world's editor, as the run made it — an imperfect editor's image may show another edit, and
  "verified" says whether edit verification accepted it) | null,
  "residual": {"logit", "share"} (cbmh) | null}``;
* ``answers.jsonl`` (worlds with a known class rule; never shown to judges): ``{"id",
  "known_answer": 1 + 8·F1, "precision", "recall", "f1"}`` for the concept models' items;
* ``explanations.json``: every clean explanation of the run (`cbcert.runs.explain.export`);
* ``images/<index>/{clean,eps,tau}.png`` and ``images/<index>/edit-<model>.png``.

Judges score items 1–9 in one JSONL file each (`cbcert.robustness.judges`); ``certify judge``
reads them back (`cbcert.runs.judge`). This module builds the bundle's content as arrays and
dicts; `cbcert.report.bundle.write_bundle` writes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbcert.engine.keys import Stream, sample_key, stream_key
from cbcert.engine.noise import FixedFlips, SphereShift
from cbcert.robustness.explain import JUDGE_RANGE
from cbcert.runs.explanations import edit_keys, edit_mapping

FORMAT = "cbcert-judge-bundle"
VERSION = 1
ITEM_SCHEMA = "cbcert-judge-item/1"
MANIFEST = "bundle.json"
ITEMS = "items.jsonl"
ANSWERS = "answers.jsonl"
EXPLANATIONS = "explanations.json"
SUBSET = "judge_subset.json"  # in the explain run's directory
DEFAULT_INPUTS = 20
MIN_PIXELS = 128
INSTRUCTIONS = (
    "Score each explanation from 1 (worst) to 9 (best): how well do the cited concepts, with "
    "their signs and shares, justify the model's prediction on the clean image? A positive "
    "share is evidence for the prediction, a negative one evidence against it. The other "
    "images show the same input after a small latent shift (eps), after concept flips (tau) "
    "and, for concept models, with every cited concept flipped at once (edit).")


def draw_subset(seed: int, num_inputs: int, size: int) -> np.ndarray:
    """``[size]`` sorted positions into the first ``num_inputs`` agreement inputs, drawn
    without replacement from stream `Stream.JUDGE` of ``jax.random.key(seed)``."""
    if not 1 <= size <= num_inputs:
        raise ValueError(f"size={size} must be in [1, num_inputs={num_inputs}]")
    key = stream_key(jax.random.key(seed), Stream.JUDGE)
    return np.sort(np.asarray(jax.random.choice(key, num_inputs, (size,), replace=False)))


def subset_record(seed: int, num_inputs: int, positions: np.ndarray,
                  indices: np.ndarray) -> dict[str, Any]:
    """The pre-registration written to `SUBSET`: positions into the agreement set and the
    inputs' pool indices."""
    return {"stream": f"JUDGE ({int(Stream.JUDGE)})", "seed": int(seed),
            "drawn_from": int(num_inputs), "positions": [int(p) for p in positions],
            "indices": [int(i) for i in indices]}


def view_images(world, job, pool, concepts: np.ndarray, positions: np.ndarray
                ) -> dict[str, np.ndarray]:
    """``{"clean", "eps", "tau"}`` → ``[n, H, W, 3]`` images of the agreement inputs at
    ``positions``: ``g(z)``, the ε-shifted ``g(z + ε u)`` and the τ-flipped
    ``g2(D(F(c, η)))`` with the perturb run's keys (the explain run's own perturbations)."""
    params, root = world.params, jax.random.key(job.seed)
    gen, k = world.generator, world.generator.num_concepts
    shift, flips = world.noise(SphereShift(), "latent"), FixedFlips(k)
    z, c = pool.latents[positions], concepts[positions]
    index = pool.indices[positions]
    shifted = np.stack([shift.perturb(sample_key(stream_key(root, Stream.GEOMETRIC), int(i), 0),
                                      z[r], job.eps) for r, i in enumerate(index)])
    flipped = np.stack([flips.perturb(sample_key(stream_key(root, Stream.SEMANTIC), int(i), 0),
                                      c[r], job.tau) for r, i in enumerate(index)])
    return {"clean": np.asarray(world.latent_images(params, z)),
            "eps": np.asarray(world.latent_images(params, shifted)),
            "tau": np.asarray(gen.image_from_concepts(params["gen"], flipped))}


@dataclass(frozen=True)
class JudgeBundle:
    """A bundle's content (module docstring): ``manifest`` (``bundle.json``), ``items``
    (``items.jsonl`` lines), ``answers`` (``answers.jsonl`` lines; empty without a known
    answer) and ``images`` (bundle path → ``[H, W, 3]`` float image in [0, 1])."""

    manifest: dict[str, Any]
    items: list[dict[str, Any]]
    answers: list[dict[str, Any]]
    images: dict[str, np.ndarray]


def _enlarge(image: np.ndarray) -> np.ndarray:
    factor = max(1, -(-MIN_PIXELS // min(image.shape[:2])))
    return np.clip(np.repeat(np.repeat(image, factor, axis=0), factor, axis=1), 0.0, 1.0)


def _cited(cited: list[dict]) -> list[dict]:
    return [{"name": c["name"], "contribution": c["contribution"], "share": c["share"]}
            for c in cited]


def build(world, job, pool, concepts: np.ndarray, records: list[dict], positions: np.ndarray,
          concept_names: tuple[str, ...]) -> JudgeBundle:
    """The bundle of a finished explain run.

    Args:
      world, job, pool: the run's world, `ExplainJob` and agreement pool.
      concepts: ``[N, 2K + U]`` the clean concept representations of the pool's inputs.
      records: the run's records (``explanations.jsonl``, input-major within each model).
      positions: the pre-registered positions (`draw_subset`).
      concept_names: the names cbm/cbmh cite.
    """
    by_key = {(r["index"], r["model"]): r for r in records}
    names = world.class_names
    images = view_images(world, job, pool, concepts, positions)
    paths: dict[str, np.ndarray] = {}
    items, answers = [], []
    judged = pool.indices[positions]
    mapping = edit_mapping(world)
    edits = {m: _edits(world, job, m, concepts[positions], judged,
                       [by_key[(int(i), m)] for i in judged], mapping)
             for m in job.models if by_key[(int(pool.indices[0]), m)].get("counterfactuals")}
    for row, index in enumerate(int(i) for i in pool.indices[positions]):
        shown = {}
        for view in ("clean", "eps", "tau"):
            shown[view] = f"images/{index}/{view}.png"
            paths[shown[view]] = _enlarge(images[view][row])
        for m in job.models:
            r = by_key[(index, m)]
            unit = "prototype" if m == "proto" else "concept"
            item_images, edit = dict(shown), None
            if m in edits:
                image, flipped, prediction = (e[row] for e in edits[m])
                item_images["edit"] = f"images/{index}/edit-{m}.png"
                paths[item_images["edit"]] = _enlarge(image)
                edit = {"flipped": [concept_names[i] for i in flipped],
                        "prediction": names[prediction],
                        "verified": r["counterfactuals"]["all"]["valid"]}
            logit = r.get("logit") or {}
            items.append({
                "schema": ITEM_SCHEMA, "id": f"{index}-{m}", "input": index, "model": m,
                "unit": unit, "label": names[r["label"]], "prediction": names[r["prediction"]],
                "cited": _cited(r["cited"]),
                "perturbed": {v: {"prediction": names[r[v]["prediction"]],
                                  "cited": _cited(r[v]["cited"])} for v in ("eps", "tau")},
                "images": item_images, "edit": edit,
                "residual": ({"logit": logit["residual"], "share": logit["residual_share"]}
                             if "residual" in logit else None)})
            if r.get("f1") is not None:
                answers.append({"id": f"{index}-{m}", "known_answer": 1 + 8 * r["f1"],
                                "precision": r["precision"], "recall": r["recall"],
                                "f1": r["f1"]})
    manifest = {
        "format": FORMAT, "version": VERSION, "world": world.name,
        "settings": asdict(job) | {"models": list(job.models)},
        "subset": subset_record(job.seed, job.num_inputs, positions, pool.indices[positions]),
        "score_range": list(JUDGE_RANGE), "instructions": INSTRUCTIONS,
        "models": list(job.models), "class_names": list(names),
        "concept_names": list(concept_names), "items": ITEMS,
        "answers": ANSWERS if answers else None, "explanations": EXPLANATIONS}
    return JudgeBundle(manifest, items, answers, paths)


def _edits(world, job, model: str, concepts: np.ndarray, indices: np.ndarray,
           records: list[dict], mapping: np.ndarray):
    """Per record: the image of its "all cited concepts" counterfactual edit (the world's
    editor with the run's key of that edit: slot ``top_k``), those concepts, and ``model``'s
    prediction there."""
    gen, k = world.generator, world.generator.num_concepts
    targets = np.zeros((len(records), k), bool)
    flipped = []
    for row, r in enumerate(records):
        flipped.append([e["concept"] for e in r["counterfactuals"]["single"]])
        targets[row, mapping[flipped[-1]]] = True
    slots = job.top_k + 1
    keys = edit_keys(job.seed, indices, slots)[slots - 1::slots]
    c = world.edit(keys, jnp.asarray(concepts), jnp.asarray(targets))
    image = gen.image_from_concepts(world.params["gen"], c)
    logits = world.classify(world.params["clf"], image, (model,))[:, 0]
    return np.asarray(image), flipped, [int(y) for y in np.argmax(logits, axis=-1)]


__all__ = ["ANSWERS", "DEFAULT_INPUTS", "EXPLANATIONS", "FORMAT", "ITEMS", "ITEM_SCHEMA",
           "JudgeBundle", "MANIFEST", "SUBSET", "VERSION", "build", "draw_subset",
           "subset_record", "view_images"]
