"""The resumable ``certify train classifier`` run (the training maths: ``classifier``).

``out`` holds, while training, ``progress/`` (parameters, running statistics and optimiser
state: a checkpoint of kind ``"classifier-progress"``, `cbcert.training.progress`) and at the
end only the fine-tuned classifier, a checkpoint of its torchvision kind (``resnet18`` …,
``densenet161``) like ``certify convert`` writes: a world directory's ``classifiers`` and
``certify latent --world pixels:…`` read it as they read a converted one. Its manifest records
``steps``, ``identity`` (the initial weights, data and settings) and ``metrics``.

Data order: step s reads batch ``s mod E`` of epoch ``s // E`` (E = batches per epoch, the
last partial batch dropped), so a resumed run reads exactly the batches an uninterrupted one
would, and on CPU reaches the same parameters bit for bit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from flax import nnx

from cbcert.io.registry import save_module
from cbcert.schema import ConfigError
from cbcert.training import progress
from cbcert.training.classifier import (
    ClassifierTrainConfig,
    TrainState,
    init_state,
    make_step,
    set_classes,
    trained_module,
)

PROGRESS_KIND = "classifier-progress"

# (epoch, first batch) -> the batches of that epoch from that one on, each
# {"image": float32[B, H, W, 3] in [0, 1], "label": int[B]} (and "attributes": {0,1}[B, A]
# for an attribute labeler, config.target = "attributes").
Batches = Callable[[int, int], Iterable[dict]]


def _tree(state: TrainState) -> dict:
    return {"params": state.params, "batch_stats": state.batch_stats,
            "opt_state": state.opt_state}


def run(module: nnx.Module, kind: str, batches: Batches, batches_per_epoch: int,
        config: ClassifierTrainConfig, out: Path, *, num_classes: int, identity: dict,
        save_every: int = 200, evaluate: Callable[[nnx.Module], dict] | None = None,
        log: Callable[[str], None] = print,
        on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Fine-tune ``module`` (resuming ``out``'s progress) and write it to ``out``.

    Args:
      module: a converted torchvision classifier (its weights are the start; its last layer is
        replaced when ``num_classes`` differs, `set_classes`); ``num_classes`` counts the
        attributes of an attribute labeler.
      kind: its checkpoint kind (``resnet50`` …), kept for the result.
      batches: `Batches`; ``batches_per_epoch``: E ≥ 1 (full batches of ``config.batch_size``).
      out: a new or empty directory, or one holding an unfinished run with the same identity.
      identity: provenance a resumed run must share (initial weights, dataset, …); the
        settings (``config.identity()``) and ``num_classes`` are added.
      save_every: steps between progress checkpoints (Ctrl-C also saves).
      evaluate: ``(trained module) -> metrics`` recorded in the manifest (e.g. test accuracy).
      on_step: ``(step, {"loss", "accuracy"})`` after every step (progress bars).
    Returns:
      The written manifest.
    Raises:
      ConfigError: ``out`` holds a finished model, foreign files or a run with other settings
        (key ``out``); ``batches_per_epoch < 1`` (key ``batch_size``).
    """
    if batches_per_epoch < 1:
        raise ConfigError(f"batch_size={config.batch_size}: larger than the training set "
                          "(no full batch)", key="batch_size", value=config.batch_size)
    identity = {**identity, "train": config.identity(), "num_classes": num_classes}
    status = progress.out_status(out, "classifier")
    if status == "done":
        raise progress.out_error(out, "already holds a trained classifier; choose another "
                                      "directory")
    module = set_classes(module, num_classes, config.seed)
    state = init_state(module, config)
    if status == "partial":
        saved = progress.load_progress(out, _tree(state), identity)
        if saved is not None:
            tree, manifest = saved
            state = TrainState(tree["params"], tree["batch_stats"], tree["opt_state"],
                               int(manifest["step"]))
            log(f"resuming at step {state.step}/{config.steps} from {out / progress.PROGRESS}")
    out.mkdir(parents=True, exist_ok=True)
    step_fn = make_step(module, config)
    manifest = {"kind": PROGRESS_KIND, "config": dataclasses.asdict(module.config),
                "identity": identity}
    saved_at, start, first = state.step, time.time(), state.step
    every = max(1, config.steps // 10)
    try:
        while state.step < config.steps:
            epoch, index = divmod(state.step, batches_per_epoch)
            for batch in batches(epoch, index):
                target = (np.asarray(batch["attributes"], np.float32)
                          if config.target == "attributes"
                          else np.asarray(batch["label"], np.int32))
                params, stats, opt_state, loss, accuracy = step_fn(
                    state.params, state.batch_stats, state.opt_state,
                    np.asarray(batch["image"], np.float32), target)
                state = TrainState(params, stats, opt_state, state.step + 1)
                logs = {"loss": float(loss), "accuracy": float(accuracy)}
                if on_step is not None:
                    on_step(state.step, logs)
                if state.step % every == 0 or state.step == config.steps:
                    rate = (state.step - first) / max(time.time() - start, 1e-9)
                    log(f"  step {state.step}/{config.steps}: loss {logs['loss']:.4f} "
                        f"accuracy {logs['accuracy']:.3f} ({rate:.2f} steps/s)")
                if state.step % save_every == 0 and state.step < config.steps:
                    progress.save_progress(out, _tree(state), {**manifest, "step": state.step})
                    saved_at = state.step
                if state.step == config.steps:
                    break
    except KeyboardInterrupt:  # Ctrl-C: keep every finished step, then stop
        if state.step > saved_at:
            progress.save_progress(out, _tree(state), {**manifest, "step": state.step})
        log(f"interrupted at step {state.step}/{config.steps}; progress saved in "
            f"{out / progress.PROGRESS}: rerun the same command to resume")
        raise
    trained = trained_module(module, state)
    metrics = evaluate(trained) if evaluate is not None else {}
    return save_module(out, kind, trained, {"sources": {}, "steps": state.step,
                                            "identity": identity, "metrics": metrics},
                       replace=True)


__all__ = ["PROGRESS_KIND", "Batches", "run"]
