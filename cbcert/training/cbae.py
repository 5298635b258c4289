"""Train a concept-bottleneck autoencoder (CB-AE) on a frozen generator: ``certify train cbae``.

The upstream project (Kulkarni et al., CVPR 2025, posthoc-generative-cbm) trains CB-AEs for
StyleGAN2 on ``w+`` (``num_ws`` copies of one w, which E averages); this module trains the same
bottleneck (``cbcert.generators.cbae.CBAE``) with the upstream recipe for either generator: a
StyleGAN2 world (``num_ws`` of its synthesis network) or one without a released CB-AE
(BigGAN-deep: its latent is the condition ``h = [t·z ; E y]``, ``dw = 2 z_dim``,
``num_ws = 1``). Every step has two phases, each with its own Adam optimiser (upstream's
``opt`` and ``opt_interv``; lr 2e-4, betas (0.5, 0.99), constant), on a fresh batch
``w = g1(z)``, ``z ~ N(0, I)``:

1. Reconstruction and concept alignment::

       L_A = ‖D(E(w)) − w‖²_mean + ‖g2(D(E(w))) − g2(w)‖²_mean
             + Σ_k CE(E(w)_k, ŷ_k | conf_k ≥ τ)

   ``ŷ_k`` are the concept classifier's pseudo-labels on ``g2(w)``: ``s = M(g2(w))[B, K]`` are
   per-concept logits (concept present iff ``s_k > 0``), confidence ``σ(|s_k|)``. Samples below
   the threshold τ (0.9 upstream) are ignored in the mean of concept k; when some concept has no
   confident sample in the batch, upstream's sum is NaN and it drops the whole concept term for
   that batch -- reproduced here.
2. Interventions: pick one concept ``i`` and a value ``v ∈ {0, 1}`` uniformly (one per batch),
   swap the logits of pair ``i`` in ``c = sg(E(w))`` so concept i reads ``v`` (upstream's swap:
   the pair's larger logit moves to the wanted side), ``w' = D(c')``, and with ``ŷ'`` = ``ŷ``
   with column i set to v::

       L_B = Σ_k CE(M(g2(w'))_k, ŷ'_k)   (L_i1, through the frozen classifier and generator)
           + Σ_k CE(E(w')_k, ŷ'_k)       (L_i2)

The two-way logits of concept k are ``[c_k−, c_k+]`` from E (cbcert's pair layout, docs/DESIGN.md)
and ``[0, s_k]`` from M (their softmax is ``[1 − σ(s_k), σ(s_k)]``), so label 1 = present.
Batch norm runs in training mode (batch statistics; running averages with torch's momentum 0.1),
updated by every forward pass in upstream's order. Flax updates the running variance with the
biased batch variance (torch: unbiased); at batch 16 the two differ by a factor 16/15 in the
running estimate only.

Reproducibility: the batch and intervention of step ``t`` come from ``fold_in(key(seed), t)``, so
a run resumed from its progress checkpoint is bit-identical to an uninterrupted one.
``cbcert.training.cbae_run`` holds the resumable run and its files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cbcert.concepts import absent_present, set_concept
from cbcert.engine import compiler
from cbcert.generators.base import Generator
from cbcert.generators.cbae import CBAE, CBAEConfig
from cbcert.schema import ConfigError
from cbcert.training.programs import ProgramCache, abstract, filled

Labeler = Callable[[jax.Array], jax.Array]  # x[B, H, W, 3] in [0, 1] -> s[B, K] concept logits


@dataclass(frozen=True)
class CBAETrainConfig:
    """Hyper-parameters of ``certify train cbae`` (defaults: upstream's CelebA-HQ config).

    Attributes:
      steps: optimisation steps (each: one reconstruction/alignment and one intervention update).
      batch_size: latents per step (16 upstream).
      recon_lr, interv_lr: Adam learning rates of the two phases (2e-4 upstream).
      beta1, beta2: Adam betas ((0.5, 0.99) upstream).
      threshold: pseudo-label confidence τ below which a concept label is ignored (0.9).
      num_unsup: U, unsupervised bottleneck dims after the 2K concept logits (10 upstream).
      seed: root of every random draw (initialisation, batches, interventions).
    """

    steps: int = 5000
    batch_size: int = 16
    recon_lr: float = 2e-4
    interv_lr: float = 2e-4
    beta1: float = 0.5
    beta2: float = 0.99
    threshold: float = 0.9
    num_unsup: int = 10
    seed: int = 0

    def __post_init__(self):
        checks = [("steps", self.steps >= 1, ">= 1"),
                  ("batch_size", self.batch_size >= 2, ">= 2 (batch norm needs a batch)"),
                  ("recon_lr", self.recon_lr > 0, "> 0"), ("interv_lr", self.interv_lr > 0, "> 0"),
                  ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"),
                  ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
                  ("threshold", 0.5 <= self.threshold < 1, "in [0.5, 1)"),
                  ("num_unsup", self.num_unsup >= 0, ">= 0"), ("seed", self.seed >= 0, ">= 0")]
        for name, ok, rule in checks:
            if not ok:
                value = getattr(self, name)
                raise ConfigError(f"{name}={value}; allowed: {rule}", key=name, value=value,
                                  allowed=rule)

    def identity(self) -> dict:
        """Everything but ``steps``: what a resumed run must share with the interrupted one."""
        fields = dataclasses.asdict(self)
        fields.pop("steps")
        return fields


def labeler_pairs(s: jax.Array) -> jax.Array:
    """``s[B, K]`` concept logits -> two-way logits ``[0, s]`` (``[B, K, 2]``)."""
    return jnp.stack([jnp.zeros_like(s), s], axis=-1)


def pseudo_labels(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Labels ``s > 0`` (int32 ``[B, K]``) and confidences ``σ(|s|)`` (``[B, K]``)."""
    return (s > 0).astype(jnp.int32), jax.nn.sigmoid(jnp.abs(s))


def pair_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-sample, per-concept CE: ``logits[B, K, 2], labels[B, K] -> [B, K]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def masked_concept_loss(logits: jax.Array, labels: jax.Array, keep: jax.Array) -> jax.Array:
    """Upstream's thresholded concept loss ``Σ_k mean_{b: keep[b,k]} CE_bk``.

    ``logits[B, K, 2]``, ``labels[B, K]``, ``keep[B, K]`` (bool). If any concept keeps no
    sample its mean is 0/0 = NaN upstream, the total is NaN and upstream drops it: 0 here.
    """
    ce = pair_cross_entropy(logits, labels)
    kept = keep.sum(axis=0)
    per_concept = jnp.where(keep, ce, 0.0).sum(axis=0) / jnp.maximum(kept, 1)
    return jnp.where(jnp.all(kept > 0), per_concept.sum(), 0.0)


@dataclass
class TrainState:
    """Everything a step reads and writes (a pytree of arrays; ``step`` is a Python int)."""

    params: Any
    batch_stats: Any
    opt_recon: Any
    opt_interv: Any
    step: int


def _optimisers(config: CBAETrainConfig):
    return (optax.adam(config.recon_lr, b1=config.beta1, b2=config.beta2),
            optax.adam(config.interv_lr, b1=config.beta1, b2=config.beta2))


def new_cbae(cbae_config: CBAEConfig, seed: int) -> CBAE:
    """A freshly initialised CB-AE (nnx defaults: LeCun-normal Linear kernels, BN scale 1)."""
    return CBAE(cbae_config, rngs=nnx.Rngs(jax.random.fold_in(jax.random.key(seed), 0)))


def init_state(model: CBAE, config: CBAETrainConfig) -> TrainState:
    """Split ``model`` into params / batch statistics and initialise both optimisers."""
    _, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    params, stats = nnx.to_pure_dict(params), nnx.to_pure_dict(stats)
    opt_a, opt_b = _optimisers(config)
    return TrainState(params, stats, opt_a.init(params), opt_b.init(params), 0)


# Compiled programs by what they close over (the graph, the generator's and labeler's
# functions, the settings): a resumed run or a second evaluation in the same process (the
# library API, the tests) reuses their compilation. A few entries: one run's step and
# evaluation, and the last run's.
_PROGRAMS = ProgramCache(4)


def _generator_key(generator: Generator) -> tuple:
    """What a compiled program reads of ``generator`` besides its params."""
    return (generator.g1, generator.g2, generator.latent_dim, generator.classes)


def make_step(generator: Generator, labeler: Labeler, model: CBAE, config: CBAETrainConfig
              ) -> Callable:
    """The jitted training step ``(state arrays, key) -> (state arrays, losses dict)``.

    ``generator`` must have no bottleneck of its own (``E = D = identity``): the CB-AE is
    trained on its ``g1`` output ``w[B, dw]`` and rendered through its ``g2``. Only the
    model's structure is read (its values are the step's inputs).
    """
    model.set_attributes(use_running_average=False)
    train_graphdef, param_template, stat_template = nnx.split(model, nnx.Param, nnx.BatchStat)
    model.set_attributes(use_running_average=True)
    key = ("step", train_graphdef, _generator_key(generator), labeler,
           dataclasses.replace(config, steps=1))
    jitted = _PROGRAMS.get(key, lambda: _build_step(
        generator, labeler, model.config, train_graphdef, abstract(param_template),
        abstract(stat_template), config))

    def step(arrays, key):
        return jitted(arrays, generator.params, key)

    return step


def _build_step(generator, labeler, model_config, train_graphdef, param_template,
                stat_template, config) -> Callable:
    k = model_config.num_concepts
    opt_a, opt_b = _optimisers(config)

    def run(params, stats, fn):
        """``fn(module)`` in training mode; returns its value and the updated BN statistics."""
        module = nnx.merge(train_graphdef, filled(param_template, params),
                           filled(stat_template, stats))
        out = fn(module)
        return out, nnx.to_pure_dict(nnx.state(module, nnx.BatchStat))

    def loss_a(params, stats, gen_params, w, x, labels, keep):
        (c, w_rec), stats = run(params, stats, lambda m: _autoencode(m, w))
        latent = jnp.mean((w_rec - w) ** 2)
        image = jnp.mean((generator.g2(gen_params, w_rec) - x) ** 2)
        concept = masked_concept_loss(absent_present(c, k), labels, keep)
        total = latent + image + concept
        return total, (stats, {"latent": latent, "image": image, "concept": concept})

    def loss_b(params, stats, gen_params, w, labels, concept, value):
        c, stats = run(params, stats, lambda m: m.encode(w))
        c = set_concept(jax.lax.stop_gradient(c), concept, value)
        target = jnp.where((jnp.arange(k) == concept)[None, :], value.astype(jnp.int32), labels)

        def decode_encode(m):
            w_new = m.decode(c)
            return w_new, m.encode(w_new)

        (w_new, c_new), stats = run(params, stats, decode_encode)
        s_new = labeler(generator.g2(gen_params, w_new))
        i1 = pair_cross_entropy(labeler_pairs(s_new), target).mean(axis=0).sum()
        i2 = pair_cross_entropy(absent_present(c_new, k), target).mean(axis=0).sum()
        return i1 + i2, (stats, {"interv_image": i1, "interv_latent": i2})

    # The generator's weights are an argument, not constants baked into the program: XLA would
    # fold computations over them at compile time, and every generator would need its own
    # compilation of an otherwise identical step.
    @compiler.jit
    def jitted(arrays, gen_params, key):
        params, stats, state_a, state_b = arrays
        key_z, key_concept, key_value = jax.random.split(key, 3)
        w = generator.g1(gen_params, generator.sample_inputs(key_z, config.batch_size))
        x = generator.g2(gen_params, w)
        labels, confidence = pseudo_labels(labeler(x))
        keep = confidence >= config.threshold
        (_, (stats, logs_a)), grads = jax.value_and_grad(loss_a, has_aux=True)(
            params, stats, gen_params, w, x, labels, keep)
        updates, state_a = opt_a.update(grads, state_a, params)
        params = optax.apply_updates(params, updates)
        concept = jax.random.randint(key_concept, (), 0, k)
        value = jax.random.bernoulli(key_value)
        (_, (stats, logs_b)), grads = jax.value_and_grad(loss_b, has_aux=True)(
            params, stats, gen_params, w, labels, concept, value)
        updates, state_b = opt_b.update(grads, state_b, params)
        params = optax.apply_updates(params, updates)
        logs = {**logs_a, **logs_b, "confident": keep.mean()}
        return (params, stats, state_a, state_b), logs

    return jitted


def _autoencode(m: CBAE, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    c = m.encode(w)
    return c, m.decode(c)


def trained_module(model: CBAE, state: TrainState) -> CBAE:
    """``model`` (eval mode) carrying ``state``'s parameters and running statistics."""
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    out = nnx.merge(graphdef, filled(params, state.params), filled(stats, state.batch_stats))
    out.set_attributes(use_running_average=True)
    return out


def train_steps(generator: Generator, labeler: Labeler, model: CBAE, config: CBAETrainConfig,
                state: TrainState, until: int, *,
                on_step: Callable[[TrainState, dict], None] | None = None) -> TrainState:
    """Run steps ``state.step .. until − 1``; ``on_step(state, losses)`` after each one.

    Step ``t`` uses ``fold_in(key(seed), t + 1)`` (key 0 initialised the model).
    """
    step = make_step(generator, labeler, model, config)
    root = jax.random.key(config.seed)
    arrays = (state.params, state.batch_stats, state.opt_recon, state.opt_interv)
    for t in range(state.step, until):
        arrays, logs = step(arrays, jax.random.fold_in(root, t + 1))
        state = TrainState(*arrays, t + 1)
        if on_step is not None:
            on_step(state, logs)
    return state


def evaluate(generator: Generator, labeler: Labeler, cbae: CBAE, key: jax.Array, n: int,
             batch: int = 64) -> dict:
    """Held-out quality of a trained CB-AE (eval mode) on ``n`` latents ``w = g1(z)``.

    Returns (floats):
      ``concept_accuracy`` (mean over concepts of ``argmax E(w)_k == ŷ_k``) and per concept,
      ``confident_fraction`` (``conf ≥ 0.9``), ``latent_relative_mse``
      (``‖D(E(w)) − w‖² / ‖w − w̄‖²``), ``image_mse`` (``‖g2(D(E(w))) − g2(w)‖²_mean``) and
      ``intervention_success``: over every concept i and value v, the fraction of samples whose
      rendered intervention ``M(g2(D(swap_i,v(E(w)))))`` reads concept i as v (and per concept).
    """
    k = cbae.config.num_concepts
    # The CB-AE's and the generator's arrays are arguments, not constants baked into the
    # program: evaluations of different weights (before and after training, every run) share
    # one compiled program.
    graphdef, cbae_state = nnx.split(cbae)
    measure = _PROGRAMS.get(("evaluate", graphdef, _generator_key(generator), labeler),
                            lambda: _build_measure(generator, labeler, graphdef, k))
    parts = []
    for start in range(0, n, batch):
        size = min(batch, n - start)
        z = generator.sample_inputs(jax.random.fold_in(key, start), size)
        parts.append(jax.device_get(measure(cbae_state, generator.params, z)))
    return _report(parts, cbae.config.concept_names, n)


def _build_measure(generator, labeler, graphdef, k) -> Callable:
    edited = np.repeat(np.arange(k), 2)  # intervention j = 2 i + v sets concept i to v
    values = np.tile([False, True], k)

    @compiler.jit
    def measure(cbae_state, gp, z):
        model = nnx.merge(graphdef, cbae_state)
        w = generator.g1(gp, z)
        x = generator.g2(gp, w)
        labels, confidence = pseudo_labels(labeler(x))
        c = model.encode(w)
        w_rec = model.decode(c)
        correct = jnp.argmax(absent_present(c, k), -1) == labels
        # The 2k interventions in one loop (one copy of g2 and the labeler in the program).
        edits = jnp.stack([set_concept(c, i, v) for i, v in zip(edited, values, strict=True)])
        read = jax.lax.map(lambda e: labeler(generator.g2(gp, model.decode(e))), edits)
        success = (read[np.arange(2 * k), :, edited] > 0) == values[:, None]  # [2k, B]
        return (correct, confidence >= 0.9, jnp.sum((w_rec - w) ** 2, 1), w,
                jnp.mean((generator.g2(gp, w_rec) - x) ** 2, (1, 2, 3)),
                success.T.reshape(-1, k, 2))

    return measure


def _report(parts: list, names: tuple[str, ...], n: int) -> dict:
    """`evaluate`'s dictionary from the measured batches."""
    correct, confident, sq_err, w, img_err, success = (np.concatenate(p) for p in zip(*parts,
                                                                                     strict=True))
    spread = np.sum((w - w.mean(0)) ** 2) / n
    return {
        "samples": n,
        "concept_accuracy": float(correct.mean()),
        "concept_accuracy_per_concept": dict(zip(names, map(float, correct.mean(0)),
                                                 strict=True)),
        "confident_fraction": float(confident.mean()),
        "latent_relative_mse": float(sq_err.mean() / spread) if spread > 0 else float("nan"),
        "image_mse": float(img_err.mean()),
        "intervention_success": float(success.mean()),
        "intervention_success_per_concept": dict(zip(names, map(float, success.mean((0, 2))),
                                                     strict=True)),
    }
