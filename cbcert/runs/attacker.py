"""The attack of one run: APGD per model and budget on memory-bounded sub-batches of inputs.

`Attacker` builds everything a run needs once (logits functions per model, the smoothed
classifier's EOT noise, PREDICT counts) so each model compiles once; keys follow the module
docstring of `cbcert.runs.attack` (per global input index, so results do not depend on the
batching).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import Partial

from cbcert.attacks.apgd import apgd
from cbcert.attacks.smoothed import smoothed_logits_fn
from cbcert.certify.cohen import Prediction
from cbcert.certify.monte_carlo import predict_heads
from cbcert.certify.smoothing import of_space
from cbcert.engine.keys import Stream, stream_key
from cbcert.engine.memory import batch_within_memory
from cbcert.engine.sampler import map_inputs

# APGD's smallest sub-batch: XLA:CPU rounds a row differently in batches of 1-2 than in 4+.
MIN_ATTACK_CHUNK = 4


@dataclass(frozen=True)
class _Head:
    """Logits of one head ``h`` of ``apply``: ``(params, x[B, *event]) -> [B, C]``.

    Compared by value, so every batch and budget of a model reuses one APGD compilation.
    """

    apply: Callable
    head: int

    def __call__(self, params, x):
        return self.apply(params, x)[:, self.head]


def attack_keys(root: jax.Array, model_id: int, eps: float, indices: np.ndarray) -> jax.Array:
    """APGD keys ``[B]`` of one (model, ε) for global inputs ``indices[B]``.

    ``fold_in(fold_in(fold_in(fold_in(root, Stream.ATTACK), model_id), bits(ε)), i)`` with
    ``bits(ε)`` the float32 bit pattern of ε, so equal budgets give equal keys whatever the
    other budgets of the run, and an input's key does not depend on its batch.
    """
    eps_bits = int(np.float32(eps).view(np.uint32))
    key = jax.random.fold_in(stream_key(root, Stream.ATTACK), model_id)
    key = jax.random.fold_in(key, eps_bits)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(indices, jnp.uint32))


def eot_keys(root: jax.Array, indices: np.ndarray) -> jax.Array:
    """EOT noise keys ``[B]`` of global inputs ``indices[B]``: ``fold_in(fold_in(root, 4), i)``."""
    key = stream_key(root, Stream.EOT)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(indices, jnp.uint32))


def _pad(x: np.ndarray, size: int) -> np.ndarray:
    """Pad ``x[v, ...]`` to ``[size, ...]`` with copies of its last row (one compiled shape)."""
    if len(x) == size:
        return x
    return np.concatenate([x, np.repeat(x[-1:], size - len(x), axis=0)])


class Attacker:
    """Everything one run needs per unit, built once so that each model compiles once.

    ``job`` is the run's `cbcert.runs.attack.AttackJob`.
    """

    def __init__(self, world, job, chunk_size: int | None = None,
                 max_memory: int | None = None):
        self.job = job
        self.world = world
        self.params = world.params
        self.memory = dict(chunk_size=chunk_size, max_memory=max_memory)
        self.root = jax.random.key(job.seed)
        k = world.generator.num_concepts
        self.apply_of = functools.partial(world.apply, job.space)
        self.noise = world.noise(of_space(job.space).noise(k), job.space)
        # A conditional world's class position rides after z: a box [k, k] pins it.
        self.pinned = world.perturbed_size(job.space)
        self.apply_all = self.apply_of(job.models)
        # One single-head apply per model for PREDICT on its own adversarial points (the
        # all-heads one when there is a single model: one compilation fewer).
        self.apply_one = {
            m: self.apply_all if len(job.models) == 1 else self.apply_of((m,)) for m in job.models
        }
        self.logits = {
            m: Partial(_Head(self.apply_all, h), self.params) for h, m in enumerate(job.models)
        }
        self.model_id = {m: world.model_names.index(m) for m in job.models}
        self._chunks: dict[str, int] = {}

    def chunk(self, model: str, example: np.ndarray) -> int:
        """Inputs per APGD call for ``model``: ``--chunk-size``, or what ``max_memory`` fits.

        One attacked input costs a forward and backward pass of the generator and classifier
        (``eot`` of them when smoothed); the batch is the largest power of two of those within
        the memory budget, between ``MIN_ATTACK_CHUNK`` and ``--batch``, and no larger than
        the call's ``len(example)`` inputs rounded up to a power of two (at least
        ``MIN_ATTACK_CHUNK``): a call of few inputs pads to few rows, and one that needs no more
        than ``MIN_ATTACK_CHUNK`` rows compiles no memory probe. Sub-batches do not change
        results: every input has its own random starts and EOT noise.
        """
        job = self.job
        if self.memory["chunk_size"] is not None:
            return max(min(self.memory["chunk_size"], job.batch), 1)
        minimum = min(MIN_ATTACK_CHUNK, job.batch)
        needed = min(max(1 << max(len(example) - 1, 0).bit_length(), minimum), job.batch)
        if needed <= minimum:
            return minimum
        if model not in self._chunks:
            head = self.logits[model].func

            def gradient(params, x):
                y = jnp.zeros(x.shape[0], jnp.int32)
                return jax.grad(lambda x: -jnp.sum(jax.nn.log_softmax(head(params, x))[
                    jnp.arange(x.shape[0]), y]))(x)

            self._chunks[model] = batch_within_memory(
                gradient, self.params, example.shape[1:], example.dtype,
                max_memory=self.memory["max_memory"], factor=job.eot if job.smoothed else 1,
                minimum=minimum, maximum=job.batch)
        return min(self._chunks[model], needed)

    def clean_predictions(self, x: np.ndarray, idx: np.ndarray) -> dict[str, dict]:
        """Per model: clean prediction ``[v]`` (PREDICT when smoothed, argmax otherwise)."""
        if self.job.smoothed:
            result = self._predict(self.apply_all, x, idx, len(self.job.models))  # [v, H]
            return {m: _prediction_fields(result, h) for h, m in enumerate(self.job.models)}
        labels = map_inputs(_argmax(self.apply_all), self.params, x, **self.memory)  # [v, H]
        return {m: {"prediction": labels[:, h]} for h, m in enumerate(self.job.models)}

    def _predict(self, apply_fn, x, idx, heads: int) -> Prediction:
        """PREDICT (``n`` estimation samples, level α) of ``x[v]`` by every head: fields
        ``[v, H]``, through the one path of `cbcert.api.predict_heads`."""
        return predict_heads(apply_fn, self.params, x, self.noise, self.root, self.job.n,
                             self.job.alpha, scale=self.job.scale, heads=heads,
                             num_classes=self.world.num_classes, indices=idx, progress=False,
                             **self.memory)

    def _bounds(self, x0: np.ndarray) -> dict[str, np.ndarray]:
        """APGD box bounds: none, or for inputs ``[z ; k]`` of a multi-class conditional world
        ``z`` free and ``k`` pinned (``lower = upper = k``): k has no gradient and APGD's
        random start leaves pinned coordinates alone, so the attack moves z only."""
        if self.pinned is None:
            return {}
        lower, upper = np.full_like(x0, -np.inf), np.full_like(x0, np.inf)
        lower[:, self.pinned:] = upper[:, self.pinned:] = x0[:, self.pinned:]
        return {"lower": lower, "upper": upper}

    def attack(self, model: str, eps: float, x, labels, idx) -> dict[str, np.ndarray]:
        """Attack ``x[v, *event]`` (global inputs ``idx[v]``) at budget ε; fields ``[v]``
        (``point``: the adversarial inputs ``[v, *event]``).

        Runs APGD on sub-batches of `chunk` inputs (the last padded), so no call holds more
        than the memory budget whatever ``--batch`` is.
        """
        size = self.chunk(model, x)
        parts = [self._attack(model, eps, x[s:s + size], labels[s:s + size], idx[s:s + size],
                              size) for s in range(0, len(x), size)]
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}

    def _attack(self, model: str, eps: float, x, labels, idx, size: int) -> dict[str, np.ndarray]:
        job, valid = self.job, len(x)
        logits_fn = self.logits[model]
        padded_idx = _pad(idx, size)
        if job.smoothed:
            logits_fn = smoothed_logits_fn(
                logits_fn,
                noise=self.noise.perturb,
                noise_scale=jnp.float32(job.scale),
                noise_keys=eot_keys(self.root, padded_idx),
                eot=job.eot,
            )
        x0 = _pad(x, size)
        x_adv, info = apgd(
            logits_fn,
            jnp.asarray(x0),
            jnp.asarray(_pad(labels, size), jnp.int32),
            eps=eps,
            norm=job.norm,
            key=attack_keys(self.root, self.model_id[model], eps, padded_idx),
            n_iter=job.iters,
            n_restarts=job.restarts,
            loss=job.loss,
            attack_all=job.smoothed,
            **self._bounds(x0),
        )
        x_adv = np.asarray(x_adv)[:valid]
        fields = {
            "point": x_adv,  # [v, *event] the adversarial inputs
            "loss": np.asarray(info.loss)[:valid],
            "perturbation_norm": np.asarray(info.perturbation_norm)[:valid],
            "attack_fooled": np.asarray(info.fooled)[:valid],
        }
        if job.smoothed:
            fields.update(_prediction_fields(self._predict(self.apply_one[model], x_adv, idx, 1),
                                             0))
        else:  # APGD's own final pass: the logits its loss and "fooled" come from
            fields["prediction"] = np.asarray(info.prediction)[:valid]
        return fields


@functools.lru_cache(maxsize=32)
def _argmax(apply_fn: Callable) -> Callable:
    """``(params, x[B, *event]) -> int32[B, H]`` argmax of every head (one object: one jit)."""
    return lambda params, x: jnp.argmax(apply_fn(params, x), axis=-1).astype(jnp.int32)


def _prediction_fields(result: Prediction, head: int) -> dict[str, np.ndarray]:
    return {"prediction": result.prediction[:, head], "p_value": result.p_value[:, head]}
