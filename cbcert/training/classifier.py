"""Fine-tune a converted torchvision classifier (ResNet, DenseNet) on labelled images.

The recipe is torchvision's fine-tuning, step for step as PyTorch computes it, so that one
step here equals one ``torch.optim.SGD`` step of the same model on the same batch:

* input ``x[B, H, W, 3]`` in [0, 1], normalised per channel ``(x − mean) / std`` (ImageNet
  statistics by default, those the converted weights were trained with);
* the model in training mode: batch norm normalises by the batch statistics and updates its
  running statistics as ``torch.nn.BatchNorm2d`` does (`cbcert.nn.layers.TorchBatchNorm`);
* loss (``target="class"``): mean cross-entropy ``L = −(1/B) Σ_b log softmax(f(x_b))[y_b]``;
  an attribute labeler (``target="attributes"``, one logit per attribute, the concept
  classifier a CB-AE is trained with): mean binary cross-entropy over every image and
  attribute, ``L = −(1/(B·A)) Σ_{b,a} [t log σ(f) + (1 − t) log(1 − σ(f))]``, as
  ``torch.nn.BCEWithLogitsLoss``;
* SGD with momentum and weight decay on every parameter (PyTorch's coupled form):
  ``g ← ∇L + λ p``, ``v ← μ v + g``, ``p ← p − η_t v`` (``v = g`` at the first step), with
  ``η_t`` constant or on a cosine from ``lr`` to 0 over ``steps``;
* a new class count replaces the last linear layer (``fc``, ``classifier``) by one drawn
  as ``torch.nn.Linear`` initialises it: weight and bias ``U(−1/√in, 1/√in)``.

The training state is a pytree of plain dicts (`TrainState`), checkpointed by
`cbcert.training.classifier_run`, whose resumed runs equal uninterrupted ones bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from cbcert.schema import ConfigError
from cbcert.training.programs import ProgramCache, abstract, filled, gradient_step

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SCHEDULES = ("cosine", "constant")
TARGETS = ("class", "attributes")


@dataclass(frozen=True)
class ClassifierTrainConfig:
    """Settings of a fine-tuning run (each checked; a bad one is a `ConfigError` naming it).

    Attributes:
      steps: optimiser steps (≥ 1).
      batch_size: images per step (≥ 2: batch statistics need two values).
      lr: peak learning rate η (> 0); momentum: μ in [0, 1); weight_decay: λ ≥ 0.
      schedule: ``cosine`` (η_t = η (1 + cos(π t / steps)) / 2) or ``constant``.
      seed: the data order and a new head's initialisation.
      mean, std: per-channel input normalisation.
      target: ``class`` (softmax over classes) or ``attributes`` (a logit per attribute).
    """

    steps: int = 2000
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-4
    schedule: str = "cosine"
    seed: int = 0
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    target: str = "class"

    def __post_init__(self):
        checks = (("steps", self.steps >= 1, "an integer ≥ 1"),
                  ("batch_size", self.batch_size >= 2, "an integer ≥ 2"),
                  ("lr", self.lr > 0, "> 0"),
                  ("momentum", 0 <= self.momentum < 1, "in [0, 1)"),
                  ("weight_decay", self.weight_decay >= 0, "≥ 0"),
                  ("schedule", self.schedule in SCHEDULES, " or ".join(SCHEDULES)),
                  ("std", len(self.std) == 3 and min(self.std) > 0, "three values > 0"),
                  ("mean", len(self.mean) == 3, "three values"),
                  ("target", self.target in TARGETS, " or ".join(TARGETS)))
        for key, ok, allowed in checks:
            if not ok:
                value = getattr(self, key)
                raise ConfigError(f"{key}={value!r}: must be {allowed}", key=key, value=value,
                                  allowed=allowed)

    def identity(self) -> dict:
        """The settings a resumed run must share (all of them), as JSON-ready values."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}


@dataclass
class TrainState:
    """Everything a step reads and writes: ``params`` and ``batch_stats`` (pure dicts of the
    module's ``nnx.Param`` and ``nnx.BatchStat``), the optimiser state, the step count."""

    params: Any
    batch_stats: Any
    opt_state: Any
    step: int


def head_name(module: nnx.Module) -> str:
    """The attribute holding the last linear layer: ``fc`` (ResNet) or ``classifier``
    (DenseNet). Raises ValueError for a module with neither (e.g. a truncated network)."""
    for name in ("fc", "classifier"):
        if isinstance(getattr(module, name, None), nnx.Linear):
            return name
    raise ValueError(f"{type(module).__name__} has no final linear layer (fc / classifier) to "
                     "train; fine-tune a full resnet* or densenet* classifier")


def set_classes(module: nnx.Module, num_classes: int, seed: int) -> nnx.Module:
    """``module`` with a last linear layer of ``num_classes`` outputs: unchanged if it has
    them, else a new layer initialised as ``torch.nn.Linear`` (weight and bias
    ``U(−1/√in, 1/√in)``, from ``fold_in(key(seed), 1)``); the module's config follows."""
    name = head_name(module)
    head = getattr(module, name)
    if head.out_features == num_classes:
        return module
    fan_in = head.in_features
    bound = 1.0 / fan_in ** 0.5
    k_w, k_b = jax.random.split(jax.random.fold_in(jax.random.key(seed), 1))
    new = nnx.Linear(fan_in, num_classes, rngs=nnx.Rngs(0))
    new.kernel[...] = jax.random.uniform(k_w, (fan_in, num_classes), minval=-bound,
                                         maxval=bound)
    new.bias[...] = jax.random.uniform(k_b, (num_classes,), minval=-bound, maxval=bound)
    setattr(module, name, new)
    module.config = dataclasses.replace(module.config, num_classes=num_classes)
    return module


def optimizer(config: ClassifierTrainConfig) -> optax.GradientTransformation:
    """PyTorch's SGD: weight decay added to the gradient, then heavy-ball momentum."""
    lr = (optax.constant_schedule(config.lr) if config.schedule == "constant"
          else optax.cosine_decay_schedule(config.lr, config.steps))
    return optax.chain(optax.add_decayed_weights(config.weight_decay),
                       optax.sgd(lr, momentum=config.momentum or None))


def init_state(module: nnx.Module, config: ClassifierTrainConfig) -> TrainState:
    """The state at step 0: the module's parameters and statistics, a fresh optimiser."""
    _, params, stats = nnx.split(module, nnx.Param, nnx.BatchStat)
    params, stats = nnx.to_pure_dict(params), nnx.to_pure_dict(stats)
    return TrainState(params, stats, optimizer(config).init(params), 0)


def make_step(module: nnx.Module, config: ClassifierTrainConfig) -> Callable:
    """The jitted step ``(params, stats, opt_state, x[B, H, W, 3], y) -> (params, stats,
    opt_state, loss, accuracy)`` of the module docstring (``x`` in [0, 1], not normalised;
    ``y``: ``int[B]`` classes, or ``{0,1}[B, A]`` attributes with ``target="attributes"``,
    whose accuracy is over every image and attribute). Only the module's structure is read
    (its values are the step's inputs)."""
    module.train()
    graphdef, param_template, stat_template = nnx.split(module, nnx.Param, nnx.BatchStat)
    module.eval()
    return _STEPS.get((graphdef, config), lambda: _build_step(
        graphdef, abstract(param_template), abstract(stat_template), config))


# The last steps built, by (graph, settings).
_STEPS = ProgramCache(2)


def _build_step(graphdef, param_template, stat_template, config: ClassifierTrainConfig
                ) -> Callable:
    opt = optimizer(config)
    mean = jnp.asarray(config.mean, jnp.float32)
    std = jnp.asarray(config.std, jnp.float32)

    def loss_fn(params, stats, x, y):
        model = nnx.merge(graphdef, filled(param_template, params),
                          filled(stat_template, stats))
        logits = model((x - mean) / std)
        if config.target == "attributes":
            y = y.astype(logits.dtype)
            loss = optax.sigmoid_binary_cross_entropy(logits, y).mean()
            accuracy = jnp.mean((logits > 0) == (y > 0.5))
        else:
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == y)
        return loss, (nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)), accuracy)

    return gradient_step(loss_fn, opt)


def trained_module(module: nnx.Module, state: TrainState) -> nnx.Module:
    """``module`` in inference mode carrying ``state``'s parameters and running statistics."""
    graphdef, params, stats = nnx.split(module, nnx.Param, nnx.BatchStat)
    out = nnx.merge(graphdef, filled(params, state.params), filled(stats, state.batch_stats))
    out.eval()
    return out


__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "SCHEDULES", "TARGETS", "ClassifierTrainConfig",
           "TrainState", "head_name", "init_state", "make_step", "optimizer", "set_classes",
           "trained_module"]
