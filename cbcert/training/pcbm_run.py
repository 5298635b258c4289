"""The resumable ``certify train pcbm`` run (the maths: `cbcert.training.pcbm`).

Stages, in order:

1. **Embeddings** ``e = backbone.embed((x − mean) / std)`` of every training and test image,
   in dataset order (``float32[N, D]`` and ``[M, D]``), batch by batch.
2. **Concept bank**: one linear SVM per concept on ``n`` positive and ``n`` negative training
   embeddings (`concept_samples`, `fit_linear_svms`); the other ``n`` + ``n`` measure it.
3. **PCBM head**: the elastic-net logistic regression on the training margins
   (`fit_elastic_net_logistic`).
4. **PCBM-h residual** (only with ``hybrid_out``): ``hybrid_epochs`` epochs of Adam over the
   training embeddings, the concept head frozen (`make_hybrid_step`).

``out`` holds, while running, ``progress/`` (a checkpoint of kind ``"pcbm-progress"``: both
embedding arrays, PCBM-h's residual and Adam state; its manifest counts the embedded images and
the residual's steps) and at the end only the PCBM, a checkpoint of kind ``pcbm`` that a world
directory's ``classifiers.cbm`` and ``certify latent --world pixels:… --classifier`` read as
they read a converted one (its manifest: ``concept_names``, ``identity``, ``metrics``, and per
concept its SVM's accuracies). PCBM-h goes to ``hybrid_out`` (kind ``pcbm`` with a residual
head: ``classifiers.cbmh``). Stages 2–3 take seconds and are recomputed from the saved
embeddings on resume; everything is deterministic, so an interrupted run resumes to the
parameters of an uninterrupted one, bit for bit on CPU.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbcert.datasets.common import Example, batches, num_batches
from cbcert.engine import compiler
from cbcert.io.registry import pure_apply, save_module
from cbcert.models.pcbm import PCBM, PCBMConfig
from cbcert.schema import ConfigError
from cbcert.training import progress
from cbcert.training.classifier import IMAGENET_MEAN, IMAGENET_STD
from cbcert.training.pcbm import (
    PCBMTrainConfig,
    concept_samples,
    fit_elastic_net_logistic,
    fit_linear_svms,
    hybrid_order,
    init_residual,
    make_hybrid_step,
    margins,
)

PROGRESS_KIND = "pcbm-progress"


@dataclasses.dataclass(frozen=True)
class PCBMData:
    """What a PCBM is trained on.

    Attributes:
      train, test: the splits' records (`cbcert.datasets.common.Example`).
      concepts: ``{0,1}[N, K]`` the concept labels of the training images (image-level, or a
        class's majority as CBM's processed CUB data; the caller chooses).
      concept_names: the K names, in order.
      num_classes: C.
    """

    train: Sequence[Example]
    test: Sequence[Example]
    concepts: np.ndarray
    concept_names: tuple[str, ...]
    num_classes: int


def _labels(items: Sequence[Example]) -> np.ndarray:
    return np.asarray([item.label for item in items], np.int32)


def _head_logits(r: np.ndarray, head: dict) -> np.ndarray:
    """``[N, K] -> [N, P]``: the concept head's logits (P = 1: one logit, class 1 iff > 0)."""
    return (r @ head["kernel"] + head["bias"]).astype(np.float32)


def _predict(logits: np.ndarray) -> np.ndarray:
    return (logits[:, 0] > 0).astype(np.int32) if logits.shape[1] == 1 else logits.argmax(-1)


def _bank(train_e: np.ndarray, data: PCBMData, config: PCBMTrainConfig) -> tuple[dict, list]:
    """Stage 2: ``(svm result, per-concept report)``."""
    pos, neg = concept_samples(data.concepts, config.n_samples, config.seed, data.concept_names)
    n = config.n_samples
    rows = np.concatenate([pos[:, :n], neg[:, :n]], axis=1)  # [K, 2n]
    held = np.concatenate([pos[:, n:], neg[:, n:]], axis=1)
    side = np.concatenate([np.ones((len(pos), n), np.int32), np.zeros((len(pos), n), np.int32)],
                          axis=1)
    svm = fit_linear_svms(train_e[rows], side, config.svm_c, tol=config.svm_tol)
    report = []
    for k, name in enumerate(data.concept_names):
        accuracy = [float(np.mean(((train_e[idx] @ svm["cavs"][k] + svm["intercepts"][k]) > 0)
                                  == side[k])) for idx in (rows[k], held[k])]
        report.append({"name": name, "positives": int(np.sum(data.concepts[:, k] > 0)),
                       "svm_train_accuracy": accuracy[0], "svm_test_accuracy": accuracy[1],
                       "smo_iterations": int(svm["iterations"][k])})
    return svm, report


def _pcbm_module(backbone: nnx.Module, kind: str, svm: dict, head: dict, residual: dict | None,
                 num_classes: int) -> PCBM:
    """The trained parts in a `PCBM` (the backbone module is used as it is)."""
    k = svm["cavs"].shape[0]
    config = PCBMConfig(backbone=kind, backbone_classes=backbone.config.num_classes,
                        num_concepts=k, head_outputs=head["kernel"].shape[1],
                        residual_outputs=num_classes if residual is not None else 0)
    module = nnx.eval_shape(lambda: PCBM(config, rngs=nnx.Rngs(0)))
    module.backbone = backbone
    cavs = jnp.asarray(svm["cavs"], jnp.float32)
    module.cavs = nnx.Param(cavs)
    module.intercepts = nnx.Param(jnp.asarray(svm["intercepts"], jnp.float32))
    module.norms = nnx.Param(jnp.linalg.norm(cavs, axis=1))
    module.head.kernel = nnx.Param(jnp.asarray(head["kernel"], jnp.float32))
    module.head.bias = nnx.Param(jnp.asarray(head["bias"], jnp.float32))
    if residual is not None:
        module.residual.kernel = nnx.Param(jnp.asarray(residual["kernel"], jnp.float32))
        module.residual.bias = nnx.Param(jnp.asarray(residual["bias"], jnp.float32))
    return module


def run(backbone: nnx.Module, kind: str, data: PCBMData, config: PCBMTrainConfig, out: Path, *,
        hybrid_out: Path | None = None, batch_size: int = 64, image_size: int = 224,
        identity: dict, save_every: int = 200, log: Callable[[str], None] = print,
        on_progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Train a PCBM (and PCBM-h) on ``backbone``'s embeddings, resuming ``out``'s progress.

    Args:
      backbone: a torchvision ResNet/DenseNet module of kind ``kind`` (converted or fine-tuned
        with ``certify train classifier``) whose config is the kind's own architecture.
      data: `PCBMData`; config: `PCBMTrainConfig`.
      out: a new or empty directory, or one holding an unfinished run with the same identity;
        the PCBM goes there. hybrid_out: where PCBM-h goes (None: no PCBM-h).
      batch_size, image_size: the embedding pass (images centre-cropped and resized).
      identity: provenance a resumed run must share (backbone, dataset …); the settings, the
        concepts, batch and image size are added.
      save_every: embedding batches / residual steps between progress checkpoints (Ctrl-C
        also saves).
      on_progress: ``(stage, done, total)`` with stage ``"embed"`` or ``"hybrid"``.
    Returns:
      ``{"pcbm": manifest, "pcbmh": manifest or None}``.
    Raises:
      ConfigError: ``out``/``hybrid_out`` hold something else or a run with other settings
        (key ``out`` / ``hybrid_out``); a backbone whose architecture is not its kind's (key
        ``backbone``); a degenerate concept (key ``concepts``).
    """
    if backbone.config != PCBMConfig(kind, backbone.config.num_classes, 1, 1).backbone_config():
        raise ConfigError(f"backbone: its architecture is not torchvision's {kind} (a PCBM "
                          "checkpoint rebuilds the backbone from its name)", key="backbone",
                          value=kind)
    for key, path in (("out", out), ("hybrid_out", hybrid_out)):
        if path is not None and progress.out_status(path, "PCBM") == "done":
            raise ConfigError(f"{path}: already holds a trained model; choose another "
                              "directory", key=key, value=str(path))
    if hybrid_out is not None and progress.out_status(hybrid_out, "PCBM") != "new":
        raise ConfigError(f"{hybrid_out}: not empty; PCBM-h goes to a new or empty directory",
                          key="hybrid_out", value=str(hybrid_out))
    identity = {**identity, "train": dataclasses.asdict(config), "batch_size": batch_size,
                "image_size": image_size, "concepts": list(data.concept_names),
                "hybrid": hybrid_out is not None}
    n_train, n_test = len(data.train), len(data.test)
    dim = backbone.config.embedding_dim
    optimizer, step_fn = make_hybrid_step(config)
    residual = init_residual(dim, data.num_classes, config.seed)
    state = {"train": np.zeros((n_train, dim), np.float32),
             "test": np.zeros((n_test, dim), np.float32),
             "residual": residual, "opt_state": optimizer.init(residual)}
    counts = {"train": 0, "test": 0, "hybrid_step": 0}
    if progress.out_status(out, "PCBM") == "partial":
        saved = progress.load_progress(out, state, identity)
        if saved is not None:
            state, manifest = saved
            state = {**state, "train": np.array(state["train"]), "test": np.array(state["test"])}
            counts = {key: int(manifest[key]) for key in counts}
            log(f"resuming from {out / progress.PROGRESS} ({counts['train']}/{n_train} + "
                f"{counts['test']}/{n_test} images embedded, residual step "
                f"{counts['hybrid_step']})")
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"kind": PROGRESS_KIND, "config": dataclasses.asdict(config),
                "identity": identity}
    last_saved = dict(counts)

    def save() -> None:
        progress.save_progress(out, state, {**manifest, **counts})
        last_saved.update(counts)

    apply_fn, params = pure_apply(backbone, lambda m, x: m.embed(x))
    mean, std = np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
    embed = compiler.jit(lambda p, x: apply_fn(p, (x - mean) / std))
    try:
        for split, items in (("train", data.train), ("test", data.test)):
            total = num_batches(len(items), batch_size)
            start, started = counts[split] // batch_size, time.time()
            if start == total:
                continue
            log(f"embedding the {split} split: {len(items)} images")
            for b, batch in enumerate(batches(items, batch_size=batch_size, image_size=image_size,
                                              seed=config.seed, shuffle=False, start=start),
                                      start + 1):
                e = np.asarray(embed(params, np.asarray(batch["image"], np.float32)))
                state[split][batch["index"]] = e
                counts[split] = min(b * batch_size, len(items))
                if on_progress is not None:
                    on_progress("embed", counts["train"] + counts["test"], n_train + n_test)
                if b % save_every == 0 and b < total:
                    save()
            rate = (total - start) * batch_size / max(time.time() - started, 1e-9)
            log(f"  {split}: done ({rate:.1f} images/s)")
        train_e, test_e = state["train"], state["test"]
        svm, report = _bank(train_e, data, config)
        log(f"concept bank: {len(report)} SVMs, held-out accuracy mean "
            f"{np.mean([r['svm_test_accuracy'] for r in report]):.3f}")
        r_train = margins(train_e, svm["cavs"], svm["intercepts"])
        r_test = margins(test_e, svm["cavs"], svm["intercepts"])
        y_train, y_test = _labels(data.train), _labels(data.test)
        head = fit_elastic_net_logistic(r_train, y_train, data.num_classes, lam=config.lam,
                                        l1_ratio=config.l1_ratio, tol=config.head_tol,
                                        max_iter=config.head_max_iter)
        concept_train, concept_test = _head_logits(r_train, head), _head_logits(r_test, head)
        metrics = {"train_accuracy": float(np.mean(_predict(concept_train) == y_train)),
                   "test_accuracy": float(np.mean(_predict(concept_test) == y_test)),
                   "head_nonzero_weights": int(np.sum(head["kernel"] != 0)),
                   "head_iterations": int(np.max(head["iterations"])),
                   "svm_test_accuracy_mean": float(np.mean([r["svm_test_accuracy"]
                                                            for r in report]))}
        log(f"PCBM: test accuracy {metrics['test_accuracy']:.3f}")
        hybrid = None
        if hybrid_out is not None:
            per_epoch = num_batches(n_train, config.hybrid_batch_size)
            steps = config.hybrid_epochs * per_epoch
            residual, opt_state = state["residual"], state["opt_state"]
            while counts["hybrid_step"] < steps:
                epoch, index = divmod(counts["hybrid_step"], per_epoch)
                order = hybrid_order(n_train, config.seed, epoch)
                rows = order[index * config.hybrid_batch_size:
                             (index + 1) * config.hybrid_batch_size]
                residual, opt_state, loss = step_fn(residual, opt_state, concept_train[rows],
                                                    train_e[rows], y_train[rows])
                counts["hybrid_step"] += 1
                state["residual"], state["opt_state"] = residual, opt_state
                if on_progress is not None:
                    on_progress("hybrid", counts["hybrid_step"], steps)
                if counts["hybrid_step"] % per_epoch == 0:
                    log(f"  PCBM-h epoch {counts['hybrid_step'] // per_epoch}/"
                        f"{config.hybrid_epochs}: loss {float(loss):.4f}")
                if counts["hybrid_step"] % save_every == 0 and counts["hybrid_step"] < steps:
                    save()
            residual = jax.tree.map(np.asarray, state["residual"])
            logits = concept_test + test_e @ residual["kernel"] + residual["bias"]
            hybrid = {"residual": residual, "metrics": {
                "test_accuracy": float(np.mean(logits.argmax(-1) == y_test)),
                "steps": counts["hybrid_step"]}}
            log(f"PCBM-h: test accuracy {hybrid['metrics']['test_accuracy']:.3f}")
    except KeyboardInterrupt:  # Ctrl-C: keep what is finished, then stop
        if counts != last_saved:
            save()
        log(f"interrupted; progress saved in {out / progress.PROGRESS}: rerun the same "
            "command to resume")
        raise
    names = list(data.concept_names)
    common = {"sources": {}, "concept_names": names, "identity": identity, "concepts": report}
    written = {"pcbm": None, "pcbmh": None}
    if hybrid is not None:
        module = _pcbm_module(backbone, kind, svm, head, hybrid["residual"], data.num_classes)
        written["pcbmh"] = save_module(hybrid_out, "pcbm", module,
                                       {**common, "metrics": {**metrics, "hybrid":
                                                              hybrid["metrics"]}},
                                       replace=True)
    module = _pcbm_module(backbone, kind, svm, head, None, data.num_classes)
    written["pcbm"] = save_module(out, "pcbm", module, {**common, "metrics": metrics},
                                  replace=True)
    return written


__all__ = ["PROGRESS_KIND", "PCBMData", "run"]
