"""The resumable ``certify train cbae`` run and its files (the training maths: ``cbae``).

``out`` holds, while training, ``progress/`` (the whole train state: parameters, batch
statistics, both optimiser states; a checkpoint of kind ``"cbae-progress"`` written atomically
through ``progress.tmp/``) and at the end only the trained CB-AE, a checkpoint of kind
``"cbae"`` (``cbcert.io``) whose manifest records ``steps``, ``identity`` (the generator,
labeler, settings and concepts it was trained with) and ``metrics`` (``cbae.evaluate``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from cbcert.generators.base import Generator
from cbcert.generators.cbae import CBAE, CBAEConfig
from cbcert.io.registry import save_module
from cbcert.schema import ConfigError
from cbcert.training import progress
from cbcert.training.cbae import (
    CBAETrainConfig,
    Labeler,
    TrainState,
    evaluate,
    init_state,
    new_cbae,
    train_steps,
    trained_module,
)

KIND = "cbae"
PROGRESS_KIND = "cbae-progress"
PROGRESS = progress.PROGRESS


def _progress_tree(state: TrainState) -> dict:
    return {"params": state.params, "batch_stats": state.batch_stats,
            "opt_recon": state.opt_recon, "opt_interv": state.opt_interv}


def save_progress(out: Path, state: TrainState, identity: dict, cbae_config: CBAEConfig
                  ) -> None:
    """Write ``out/progress`` (full train state + identity) atomically via a temporary copy."""
    progress.save_progress(out, _progress_tree(state), {
        "kind": PROGRESS_KIND, "config": dataclasses.asdict(cbae_config), "step": state.step,
        "identity": identity})


def load_progress(out: Path, template: TrainState, identity: dict) -> TrainState | None:
    """The saved train state in ``out/progress`` (None if there is none).

    Raises:
      ConfigError: (key ``out``) the saved run was started with different settings (names
        the first one).
    """
    saved = progress.load_progress(out, _progress_tree(template), identity)
    if saved is None:
        return None
    tree, manifest = saved
    return TrainState(tree["params"], tree["batch_stats"], tree["opt_recon"],
                      tree["opt_interv"], int(manifest["step"]))


def write_cbae(out: Path, cbae: CBAE, metadata: dict) -> dict:
    """Write the trained CB-AE as a checkpoint of kind ``"cbae"`` (``sources`` empty).

    The directory is replaced (it only held this run's progress); returns the manifest.
    """
    return save_module(out, KIND, cbae, {"sources": {}, **metadata}, replace=True)


def out_status(out: Path) -> str:
    """``"new"`` (absent or empty), ``"done"`` (a written CB-AE), ``"partial"`` (progress only).

    Raises:
      ConfigError: (key ``out``) a non-empty directory that is neither (refuse to overwrite
        user files).
    """
    return progress.out_status(out, "CB-AE")


def run(generator: Generator, labeler: Labeler, concept_names: tuple[str, ...], config:
        CBAETrainConfig, out: Path, *, identity: dict, save_every: int = 500,
        eval_samples: int = 512, log: Callable[[str], None] = print,
        on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train (or resume) a CB-AE for ``generator`` and write it to ``out``; returns its manifest.

    Args:
      generator: a generator without bottleneck (``E = D = identity``); ``g1(z)`` is ``w[B, dw]``
        (StyleGAN2: ``num_ws`` copies of one w, which the CB-AE averages, as upstream's).
      labeler: ``x[B, H, W, 3] -> s[B, K]`` concept logits of a frozen concept classifier.
      concept_names: the K concepts, in the labeler's output order.
      out: new/empty directory, or one holding an unfinished run with the same settings.
      identity: provenance that must match on resume (generator, labeler files …); stored.
      save_every: steps between progress checkpoints (an interrupt, Ctrl-C, also saves).
      eval_samples: held-out latents for the final ``evaluate``.
      on_step: ``(step, losses)`` after every step (progress bars).
    """
    if generator.num_concepts:
        raise ConfigError(f"generator {generator.name} already has a concept bottleneck "
                          f"(K={generator.num_concepts}); train a CB-AE on one without",
                          key="generator", value=generator.name)
    if not concept_names:
        raise ConfigError("concept_names=(); need at least one concept", key="concept_names",
                          value=concept_names, allowed="at least one name")
    latent = jax.eval_shape(lambda z: generator.g1(generator.params, z),
                            jax.ShapeDtypeStruct((1, generator.input_dim), jnp.float32))
    scores = jax.eval_shape(labeler, jax.ShapeDtypeStruct((1, *generator.image_shape),
                                                          jnp.float32))
    if scores.shape != (1, len(concept_names)):
        raise ConfigError(f"the concept classifier outputs {scores.shape[-1]} logits but "
                          f"{len(concept_names)} concept names were given", key="concept_names",
                          value=concept_names, allowed=f"{scores.shape[-1]} names")
    cbae_config = CBAEConfig(latent_dim=latent.shape[1] // generator.num_ws,
                             num_ws=generator.num_ws, concept_names=concept_names,
                             num_unsup=config.num_unsup)
    identity = {**identity, "train": config.identity(), "concepts": list(concept_names)}
    status = out_status(out)
    if status == "done":
        raise progress.out_error(out, "already holds a trained CB-AE; choose another directory")
    model = new_cbae(cbae_config, config.seed)
    state = init_state(model, config)
    if status == "partial":
        state = load_progress(out, state, identity) or state
        log(f"resuming at step {state.step}/{config.steps} from {out / PROGRESS}")
    out.mkdir(parents=True, exist_ok=True)
    start, first = time.time(), state.step
    every = max(1, config.steps // 10)

    saved = {"step": state.step, "latest": state}

    def after(state: TrainState, logs: dict) -> None:
        saved["latest"] = state
        if on_step is not None:
            on_step(state.step, logs)
        if state.step % every == 0 or state.step == config.steps:
            rate = (state.step - first) / max(time.time() - start, 1e-9)
            log(f"  step {state.step}/{config.steps}: " + " ".join(
                f"{name} {float(v):.4f}" for name, v in logs.items()) + f" ({rate:.2f} steps/s)")
        if state.step % save_every == 0 and state.step < config.steps:
            save_progress(out, state, identity, cbae_config)
            saved["step"] = state.step

    try:
        state = train_steps(generator, labeler, model, config, state, config.steps,
                            on_step=after)
    except KeyboardInterrupt:  # Ctrl-C: keep every finished step, then stop
        latest = saved["latest"]
        if latest.step > saved["step"]:
            save_progress(out, latest, identity, cbae_config)
        log(f"interrupted at step {latest.step}/{config.steps}; progress saved in "
            f"{out / PROGRESS}: rerun the same command to resume")
        raise
    if state.step > first:
        save_progress(out, state, identity, cbae_config)  # kept until the CB-AE itself is written
    cbae = trained_module(model, state)
    metrics = evaluate(generator, labeler, cbae, jax.random.fold_in(jax.random.key(config.seed),
                                                                    -1 % 2**31), eval_samples)
    return write_cbae(out, cbae, {"steps": state.step, "identity": identity,
                                  "metrics": metrics})
