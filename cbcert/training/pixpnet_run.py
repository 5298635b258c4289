"""The resumable ``certify train pixpnet`` run (the maths: `cbcert.training.pixpnet`).

A new PixPNet starts from a converted or fine-tuned torchvision classifier (`new_pixpnet`): its
backbone truncated after the feature layer keeps the classifier's weights; the add-on layers
are initialised as ProtoPNet's (Kaiming-normal weights, fan-out, ReLU gain; zero biases), the
prototypes ``U(0, 1)`` and a linear readout at 1 / −0.5 (`init_readout`).

``out`` holds, while training, ``progress/`` (parameters, statistics and the three phases'
optimiser states; its manifest has ``step`` and ``pushed``) and at the end only the PixPNet, a
checkpoint of kind ``pixpnet`` that a world directory's ``classifiers.proto`` reads. Step s
reads batch ``s mod E`` of epoch ``s // E`` (the last partial batch dropped), the push runs
once when the joint phase ends and is saved at once, so a resumed run reaches the parameters of
an uninterrupted one bit for bit on CPU.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbcert.io.registry import save_module
from cbcert.models.pixpnet import PixPNet, PixPNetConfig
from cbcert.schema import ConfigError
from cbcert.training import progress
from cbcert.training.pixpnet import (
    PixPNetTrainConfig,
    TrainState,
    init_readout,
    init_state,
    make_step,
    push_prototypes,
    trained_module,
)

PROGRESS_KIND = "pixpnet-progress"

# (epoch, first batch) -> that epoch's batches from that one on, {"image", "label"} each.
Batches = Callable[[int, int], Iterable[dict]]


def new_pixpnet(classifier: nnx.Module, config: PixPNetConfig, seed: int) -> PixPNet:
    """A PixPNet of ``config`` on ``classifier``'s weights (module docstring); the random parts
    are drawn from ``fold_in(key(seed), 3)``.

    Raises:
      ConfigError: (key ``init``) the classifier's architecture is not the config's backbone.
    """
    module = PixPNet(config, rngs=nnx.Rngs(seed))
    source = nnx.to_pure_dict(nnx.state(classifier))
    target = nnx.to_pure_dict(nnx.state(module.backbone))

    def take(want, have, where):
        if isinstance(want, dict):
            if not isinstance(have, dict) or not set(want) <= set(have):
                raise ConfigError(f"init: the classifier has no {where or 'backbone'} fitting "
                                  f"{config.feature_extractor} up to {config.feature_layer}",
                                  key="init", value=where)
            return {k: take(v, have[k], f"{where}.{k}".strip(".")) for k, v in want.items()}
        if np.shape(want) != np.shape(have):
            raise ConfigError(f"init: {where} has shape {np.shape(have)}, the backbone needs "
                              f"{np.shape(want)}", key="init", value=where)
        return jnp.asarray(have)

    state = nnx.state(module.backbone)
    nnx.replace_by_pure_dict(state, take(target, source, ""))
    nnx.update(module.backbone, state)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 3), len(module.add_on) + 1)
    for conv, key in zip(module.add_on, keys[:-1], strict=True):
        kernel = conv.kernel[...]  # [1, 1, cin, cout]
        conv.kernel[...] = jax.random.normal(key, kernel.shape) * (2.0 / kernel.shape[-1]) ** 0.5
        if conv.bias is not None:
            conv.bias[...] = jnp.zeros_like(conv.bias[...])
    module.prototypes[...] = jax.random.uniform(keys[-1], module.prototypes[...].shape)
    return init_readout(module)


def _tree(state: TrainState) -> dict:
    return {"params": state.params, "batch_stats": state.batch_stats,
            "opt_states": state.opt_states}


def run(module: PixPNet, batches: Batches, batches_per_epoch: int,
        push_batches: Callable[[], Iterable[dict]], config: PixPNetTrainConfig, out: Path, *,
        identity: dict, save_every: int = 200, evaluate: Callable[[nnx.Module], dict] | None = None,
        log: Callable[[str], None] = print,
        on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train ``module`` through warm, joint, push and last-layer phases, resuming ``out``.

    Args:
      module: a new PixPNet (`new_pixpnet`) — the start of a new run and the template of a
        resumed one.
      batches: `Batches`; batches_per_epoch: E ≥ 1 (full batches).
      push_batches: the training images for the push, ``{"image", "label"}`` batches.
      out: a new or empty directory, or one holding an unfinished run with the same identity.
      identity: provenance a resumed run must share; the settings are added.
      evaluate: ``(trained module) -> metrics`` for the manifest.
      on_step: ``(step, {"loss", "accuracy"})`` after every step.
    Returns:
      The written manifest.
    Raises:
      ConfigError: ``out`` holds a model, foreign files or other settings (key ``out``);
        no full batch (key ``batch_size``); a class without images at the push (``dataset``).
    """
    if batches_per_epoch < 1:
        raise ConfigError(f"batch_size={config.batch_size}: larger than the training set "
                          "(no full batch)", key="batch_size", value=config.batch_size)
    identity = {**identity, "train": dataclasses.asdict(config),
                "model": dataclasses.asdict(module.config)}
    status = progress.out_status(out, "PixPNet")
    if status == "done":
        raise progress.out_error(out, "already holds a trained PixPNet; choose another "
                                      "directory")
    state, pushed = init_state(module, config), False
    if status == "partial":
        saved = progress.load_progress(out, _tree(state), identity)
        if saved is not None:
            tree, manifest = saved
            state = TrainState(tree["params"], tree["batch_stats"], tree["opt_states"],
                               int(manifest["step"]))
            pushed = bool(manifest["pushed"])
            log(f"resuming at step {state.step}/{config.steps} from {out / progress.PROGRESS}")
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"kind": PROGRESS_KIND, "config": dataclasses.asdict(module.config),
                "identity": identity}
    steps = {phase: make_step(module, config, phase) for phase in ("warm", "joint", "last")}
    push_at = config.warm_steps + config.joint_steps
    saved_at, start, first = state.step, time.time(), state.step
    every = max(1, config.steps // 10)

    def save():
        nonlocal saved_at
        progress.save_progress(out, _tree(state), {**manifest, "step": state.step,
                                                   "pushed": pushed})
        saved_at = state.step

    def push():
        nonlocal state, pushed
        pushed_module, distances = push_prototypes(trained_module(module, state),
                                                   push_batches())
        params = dict(state.params)
        params["prototypes"] = jnp.asarray(pushed_module.prototypes[...])
        state, pushed = TrainState(params, state.batch_stats, state.opt_states, state.step), True
        log(f"  push: prototypes moved onto training patches (mean distance before "
            f"{float(np.mean(distances)):.4f})")
        save()

    try:
        if state.step >= push_at and not pushed:
            push()
        while state.step < config.steps:
            epoch, index = divmod(state.step, batches_per_epoch)
            for batch in batches(epoch, index):
                phase = config.phase(state.step)
                params, stats, opt_state, loss, accuracy = steps[phase](
                    state.params, state.batch_stats, state.opt_states[phase],
                    np.asarray(batch["image"], np.float32),
                    np.asarray(batch["label"], np.int32))
                state = TrainState(params, stats, {**state.opt_states, phase: opt_state},
                                   state.step + 1)
                logs = {"loss": float(loss), "accuracy": float(accuracy)}
                if on_step is not None:
                    on_step(state.step, logs)
                if state.step % every == 0 or state.step == config.steps:
                    rate = (state.step - first) / max(time.time() - start, 1e-9)
                    log(f"  step {state.step}/{config.steps} ({phase}): loss "
                        f"{logs['loss']:.4f} accuracy {logs['accuracy']:.3f} "
                        f"({rate:.2f} steps/s)")
                if state.step == push_at:
                    push()
                    break  # the next batch comes from the loop's recomputed position
                if state.step % save_every == 0 and state.step < config.steps:
                    save()
                if state.step == config.steps:
                    break
    except KeyboardInterrupt:  # Ctrl-C: keep every finished step, then stop
        if state.step > saved_at:
            save()
        log(f"interrupted at step {state.step}/{config.steps}; progress saved in "
            f"{out / progress.PROGRESS}: rerun the same command to resume")
        raise
    trained = trained_module(module, state)
    metrics = evaluate(trained) if evaluate is not None else {}
    return save_module(out, "pixpnet", trained, {"sources": {}, "steps": state.step,
                                                 "identity": identity, "metrics": metrics},
                       replace=True)


__all__ = ["PROGRESS_KIND", "Batches", "new_pixpnet", "run"]
