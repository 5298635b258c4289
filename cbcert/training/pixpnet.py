"""Train a PixPNet / ProtoPNet prototype network (`cbcert.models.pixpnet`) by ProtoPNet's recipe
(Chen et al., NeurIPS 2019, "This looks like that"; PixPNet, Carmichael et al., WACV 2024,
trains its prototype layer the same way on a truncated backbone).

Prototype j belongs to class ``c_j = j // (P/C)`` (P/C consecutive prototypes per class). On a
batch ``x[B, H, W, 3]`` in [0, 1] (ImageNet-normalised inside), with labels ``y[B]``, the
network in training mode (batch norm on batch statistics, running statistics updated as
PyTorch does, in every phase, as ProtoPNet's ``model.train()``) gives the logits and the
min-pooled prototype distances ``d[B, P]``, and the loss is

    L = CE(logits, y) + λ_clst · mean_b min_{j: c_j = y_b} d[b, j]
                      − λ_sep  · mean_b min_{j: c_j ≠ y_b} d[b, j]  + λ_l1 · Σ_{c ≠ c_j} |W[c, j]|

(ProtoPNet's cluster and separation costs, written with the distances directly: its
``max_dist − max(max_dist − d)`` is ``min d``; the ℓ1 term on the readout's wrong-class
connections, linear readouts only). Phases, counted in steps:

1. **warm** (``warm_steps``): Adam on the add-on layers (lr 3·10⁻³, weight decay 10⁻³) and the
   prototypes (3·10⁻³); backbone and readout frozen.
2. **joint** (``joint_steps``): a new Adam on the backbone (10⁻⁴, weight decay 10⁻³), add-on
   layers and prototypes, every learning rate × 0.1 each ``joint_lr_step`` steps (StepLR).
3. **push**: every prototype is replaced by the nearest add-on output patch ``z[h, w]`` of a
   training image of its class (network in eval mode), `push_prototypes`.
4. **last layer** (``last_steps``): a new Adam (10⁻⁴) on the readout only.

ProtoPNet pushes every ten epochs and retrains the readout after each; cbcert pushes once, after
the joint phase (the final model of ProtoPNet's schedule is also one after a push and the
readout's iterations). PyTorch's Adam adds weight decay to the gradient (not AdamW); so does
`optimizer`. A linear readout starts at 1 for a prototype's own class and −0.5 elsewhere (its
``set_last_layer_incorrect_connection``). One step of each phase equals the same step in PyTorch
(``tests/test_training_pixpnet.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cbcert.engine import compiler
from cbcert.schema import ConfigError
from cbcert.training.classifier import IMAGENET_MEAN, IMAGENET_STD, trained_module
from cbcert.training.programs import ProgramCache, abstract, filled, gradient_step

PHASES = ("warm", "joint", "last")
# Top-level attributes of a PixPNet and the parameter group each belongs to.
GROUPS = {"backbone": "features", "add_on": "add_on", "prototypes": "prototypes",
          "readout": "last", "readout_weight": "last"}


@dataclass(frozen=True)
class PixPNetTrainConfig:
    """Settings of ``certify train pixpnet`` (defaults: ProtoPNet's).

    Attributes:
      warm_steps, joint_steps, last_steps: steps of each phase (≥ 0).
      batch_size: images per step.
      lr_features, lr_add_on, lr_prototypes, lr_last: Adam learning rates.
      weight_decay: on the backbone and add-on layers (PyTorch's coupled form).
      joint_lr_step: steps between the joint phase's ×0.1 decays (StepLR; ≥ 1).
      clst, sep, l1: λ_clst, λ_sep, λ_l1 of the loss.
      seed: data order.
    """

    warm_steps: int = 500
    joint_steps: int = 2000
    last_steps: int = 200
    batch_size: int = 32
    lr_features: float = 1e-4
    lr_add_on: float = 3e-3
    lr_prototypes: float = 3e-3
    lr_last: float = 1e-4
    weight_decay: float = 1e-3
    joint_lr_step: int = 1000
    clst: float = 0.8
    sep: float = 0.08
    l1: float = 1e-4
    seed: int = 0

    def __post_init__(self):
        checks = [(name, getattr(self, name) >= 0, "an integer ≥ 0")
                  for name in ("warm_steps", "joint_steps", "last_steps")]
        checks += [("batch_size", self.batch_size >= 1, "an integer ≥ 1"),
                   ("joint_lr_step", self.joint_lr_step >= 1, "an integer ≥ 1")]
        checks += [(name, getattr(self, name) > 0, "> 0")
                   for name in ("lr_features", "lr_add_on", "lr_prototypes", "lr_last")]
        checks += [(name, getattr(self, name) >= 0, "≥ 0")
                   for name in ("weight_decay", "clst", "sep", "l1")]
        for key, ok, allowed in checks:
            if not ok:
                value = getattr(self, key)
                raise ConfigError(f"{key}={value!r}: must be {allowed}", key=key, value=value,
                                  allowed=allowed)

    @property
    def steps(self) -> int:
        """Training steps in all: warm + joint + last."""
        return self.warm_steps + self.joint_steps + self.last_steps

    def phase(self, step: int) -> str:
        """The phase of step ``step`` (0-based): ``warm``, ``joint`` or ``last``."""
        if step < self.warm_steps:
            return "warm"
        return "joint" if step < self.warm_steps + self.joint_steps else "last"


def prototype_owner(num_prototypes: int, num_classes: int) -> np.ndarray:
    """``int[P]``: the class of each prototype, ``j // (P/C)``."""
    return np.arange(num_prototypes) // (num_prototypes // num_classes)


def init_readout(module: nnx.Module) -> nnx.Module:
    """The readout's start: a linear one at ProtoPNet's ``W[c, j] = 1`` if ``c = c_j``, else
    −0.5; a ``sparse`` one (each prototype weighted into its own class only) at 1, so every
    prototype starts as a vote for its class, as the ``proto`` readout's fixed sum."""
    p, c = module.config.num_prototypes, module.config.num_classes
    if module.readout is not None:
        own = jax.nn.one_hot(prototype_owner(p, c), c)  # [P, C] = the kernel's layout
        module.readout.kernel[...] = own - 0.5 * (1 - own)
    if module.readout_weight is not None:
        module.readout_weight[...] = jnp.ones((c, p // c))
    return module


def _labels(params: dict, phase: str) -> dict:
    """The optimiser group of every leaf for ``phase`` (frozen groups: ``"frozen"``)."""
    active = {"warm": ("add_on", "prototypes"), "joint": ("features", "add_on", "prototypes"),
              "last": ("last",)}[phase]
    return {name: jax.tree.map(lambda _, g=GROUPS[name]: g if g in active else "frozen", sub)
            for name, sub in params.items()}


def optimizer(config: PixPNetTrainConfig, phase: str, params: dict
              ) -> optax.GradientTransformation:
    """Phase ``phase``'s optimiser over the whole parameter tree (frozen groups get zero
    updates): PyTorch's Adam per group, weight decay added to the gradient."""
    def adam(lr, decay=0.0):
        if phase == "joint":
            lr = optax.exponential_decay(lr, config.joint_lr_step, 0.1, staircase=True)
        parts = [optax.add_decayed_weights(decay)] if decay else []
        return optax.chain(*parts, optax.adam(lr, b1=0.9, b2=0.999, eps=1e-8))

    transforms = {"features": adam(config.lr_features, config.weight_decay),
                  "add_on": adam(config.lr_add_on, config.weight_decay),
                  "prototypes": adam(config.lr_prototypes), "last": adam(config.lr_last),
                  "frozen": optax.set_to_zero()}
    return optax.multi_transform(transforms, _labels(params, phase))


@dataclass
class TrainState:
    """Parameters, batch statistics, the three phases' optimiser states and the step."""

    params: Any
    batch_stats: Any
    opt_states: dict
    step: int


def init_state(module: nnx.Module, config: PixPNetTrainConfig) -> TrainState:
    """The state at step 0 (the module as given: call `init_readout` first for a new one)."""
    _, params, stats = nnx.split(module, nnx.Param, nnx.BatchStat)
    params, stats = nnx.to_pure_dict(params), nnx.to_pure_dict(stats)
    return TrainState(params, stats, {phase: optimizer(config, phase, params).init(params)
                                      for phase in PHASES}, 0)


def prototype_losses(d: jax.Array, y: jax.Array, owner: jax.Array, num_classes: int
                     ) -> tuple[jax.Array, jax.Array]:
    """``(cluster, separation)``: ``mean_b min_{c_j = y_b} d[b, j]`` and the mean of the
    minimum over the other prototypes; ``d[B, P]``, ``y int[B]``, ``owner int[P]``."""
    own = owner[None, :] == y[:, None]  # [B, P]
    cluster = jnp.min(jnp.where(own, d, jnp.inf), axis=1).mean()
    separation = jnp.min(jnp.where(own, jnp.inf, d), axis=1).mean()
    return cluster, separation


# The last steps built, by (graph, settings, phase), and push scans, by graph: a resumed run in
# the same process (the library API, the tests) reuses their compilation. Four entries: one
# run's phases and its push.
_STEPS = ProgramCache(len(PHASES) + 1)


def make_step(module: nnx.Module, config: PixPNetTrainConfig, phase: str) -> Callable:
    """The jitted step of ``phase``: ``(params, stats, opt_state, x[B, H, W, 3] in [0, 1],
    y int[B]) -> (params, stats, opt_state, loss, accuracy)`` (module docstring). Only the
    module's structure is read (its values are the step's inputs)."""
    module.train()
    graphdef, param_template, stat_template = nnx.split(module, nnx.Param, nnx.BatchStat)
    module.eval()
    return _STEPS.get((graphdef, config, phase), lambda: _build_step(
        graphdef, abstract(param_template), abstract(stat_template), module.config, config,
        phase))


def _build_step(graphdef, param_template, stat_template, model_config, config, phase):
    p, c = model_config.num_prototypes, model_config.num_classes
    owner = jnp.asarray(prototype_owner(p, c))
    wrong = 1.0 - jax.nn.one_hot(owner, c)  # [P, C]: the kernel's wrong-class connections
    mean = jnp.asarray(IMAGENET_MEAN, jnp.float32)
    std = jnp.asarray(IMAGENET_STD, jnp.float32)
    opt = optimizer(config, phase, nnx.to_pure_dict(param_template))

    def loss_fn(params, stats, x, y):
        model = nnx.merge(graphdef, filled(param_template, params),
                          filled(stat_template, stats))
        x = (x - mean) / std
        d = jnp.min(model.distances(x), axis=(1, 2))  # [B, P]
        logits = model.readout_from_distances(d)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        cluster, separation = prototype_losses(d, y, owner, c)
        loss = ce + config.clst * cluster - config.sep * separation
        if model.readout is not None:
            loss = loss + config.l1 * jnp.sum(jnp.abs(model.readout.kernel[...] * wrong))
        accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == y)
        return loss, (nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)), accuracy)

    return gradient_step(loss_fn, opt)


def make_push_scan(module: nnx.Module) -> Callable:
    """The jitted push scan of one batch: ``(params, x[B, H, W, 3] in [0, 1], y int[B]) ->
    (best d[P], best patch z[P, D])`` over the batch's images of each prototype's class
    (``inf`` where the batch has none), the network in eval mode."""
    module.eval()
    return _STEPS.get((nnx.graphdef(module), "push"), lambda: _build_push_scan(module))


def _build_push_scan(module: nnx.Module) -> Callable:
    apply_fn, _ = _pure(module)
    p, c = module.config.num_prototypes, module.config.num_classes
    owner = jnp.asarray(prototype_owner(p, c))
    mean = jnp.asarray(IMAGENET_MEAN, jnp.float32)
    std = jnp.asarray(IMAGENET_STD, jnp.float32)

    @compiler.jit
    def scan(params, x, y):
        z, d = apply_fn(params, (x - mean) / std)  # [B, h, w, D], [B, h, w, P]
        b, h, w, dim = z.shape
        d = jnp.where((y[:, None] == owner[None, :])[:, None, None, :], d, jnp.inf)
        flat = d.reshape(b * h * w, p)
        where = jnp.argmin(flat, axis=0)  # [P]
        return flat[where, jnp.arange(p)], z.reshape(b * h * w, dim)[where]

    return scan


def _pure(module: nnx.Module):
    from cbcert.io.registry import pure_apply

    return pure_apply(module, lambda m, x: (m.latent(x), m.distances(x)))


def push_prototypes(module: nnx.Module, batches) -> tuple[nnx.Module, np.ndarray]:
    """Project every prototype onto its nearest training patch (phase 3): over ``batches``
    (``{"image", "label"}`` dicts), prototype j becomes the add-on output ``z[h, w]`` of an
    image of class ``c_j`` at least distance from it (ties: the first seen). Returns the module
    (eval mode) and the distances ``float32[P]`` before the move.

    Raises:
      ConfigError: (key ``dataset``) a class with prototypes has no image in ``batches``.
    """
    scan = make_push_scan(module)
    _, params = _pure(module)
    best_d = np.full(module.config.num_prototypes, np.inf, np.float32)
    best_z = np.zeros((module.config.num_prototypes, module.config.prototype_dim), np.float32)
    for batch in batches:
        d, z = (np.asarray(a) for a in scan(params, np.asarray(batch["image"], np.float32),
                                            np.asarray(batch["label"], np.int32)))
        better = d < best_d
        best_d[better], best_z[better] = d[better], z[better]
    if not np.isfinite(best_d).all():
        j = int(np.flatnonzero(~np.isfinite(best_d))[0])
        c = int(prototype_owner(module.config.num_prototypes, module.config.num_classes)[j])
        raise ConfigError(f"dataset: class {c} has prototypes but no training image to push "
                          "them onto", key="dataset", value=c)
    module.prototypes[...] = jnp.asarray(best_z)
    return module, best_d


__all__ = ["GROUPS", "PHASES", "PixPNetTrainConfig", "TrainState", "init_readout",
           "init_state", "make_push_scan", "make_step", "optimizer", "prototype_losses",
           "prototype_owner", "push_prototypes", "trained_module"]
