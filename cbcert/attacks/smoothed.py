"""Attack loss for a smoothed classifier (SmoothAdv, Salman et al., NeurIPS 2019).

The smoothed classifier's soft prediction is ``p(x) = E_delta[softmax(f(x + delta))]``.
SmoothAdv attacks it by maximising ``-log p(x)_y``, with the expectation estimated by
``eot`` Monte Carlo samples whose noise is drawn once and kept fixed during the attack.
Here that estimate is packaged as a logits function, ``x -> log p_hat(x)``, so that
:func:`cbcert.attacks.apgd.apgd` with ``loss='ce'`` optimises exactly the SmoothAdv
loss (cross-entropy of log-probabilities is their negative log-probability).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class _SmoothedLogProbs:
    """Static part of the smoothed logits function (compared by value, so jit reuses it).

    ``noise_scale`` and ``noise_keys`` are call arguments, hence traced: new keys or a
    new noise scale do not recompile the attack.
    """

    logits_fn: Callable[[jax.Array], jax.Array]
    # A bound method is stored as (function, owner): Python compares bound methods by
    # the owner's identity, while frozen noise models compare equal by value.
    noise_fn: Callable
    noise_owner: object
    eot: int

    def _noise(self, key, x, scale):
        if self.noise_owner is None:
            return self.noise_fn(key, x, scale)
        return self.noise_fn(self.noise_owner, key, x, scale)

    def __call__(self, noise_scale, noise_keys, x):
        """``x[B, *event] -> log p_hat[B, C]`` with ``p_hat`` the ``eot``-sample mean softmax."""
        batch, event = x.shape[0], x.shape[1:]
        sample_ids = jnp.arange(self.eot)
        # Sample j of input i uses fold_in(noise_keys[i], j), independent of the batch.
        keys = jax.vmap(lambda k: jax.vmap(lambda j: jax.random.fold_in(k, j))(sample_ids))(
            noise_keys
        )  # [B, eot]
        perturb_one = jax.vmap(self._noise, in_axes=(0, None, None))  # over samples
        noisy = jax.vmap(perturb_one, in_axes=(0, 0, None))(keys, x, noise_scale)
        logits = self.logits_fn(noisy.reshape((batch * self.eot,) + event))  # [B*eot, C]
        log_probs = jax.nn.log_softmax(logits.reshape(batch, self.eot, -1), axis=-1)
        return jax.nn.logsumexp(log_probs, axis=1) - jnp.log(self.eot)  # [B, C]


@dataclasses.dataclass(frozen=True, eq=False)
class SmoothedLogits:
    """``x[B, *event] -> log p_hat[B, C]``: the static part with its traced arrays bound.

    A pytree (``noise_scale`` and ``noise_keys`` are its leaves), so ``apgd`` traces them;
    ``take_rows`` restricts it to some examples, with their own noise keys.
    """

    static: _SmoothedLogProbs
    noise_scale: jax.Array
    noise_keys: jax.Array  # [B]

    def __call__(self, x):
        return self.static(self.noise_scale, self.noise_keys, x)

    def take_rows(self, rows: jax.Array) -> SmoothedLogits:
        """The same function for the examples ``rows[b]`` (indices into the batch)."""
        return dataclasses.replace(self, noise_keys=self.noise_keys[rows])


jax.tree_util.register_dataclass(
    SmoothedLogits, data_fields=["noise_scale", "noise_keys"], meta_fields=["static"]
)


def smoothed_logits_fn(
    logits_fn: Callable[[jax.Array], jax.Array],
    *,
    noise: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    noise_scale,
    noise_keys: jax.Array,
    eot: int,
) -> SmoothedLogits:
    """Logits of the Monte Carlo smoothed classifier, for attacking it with APGD.

    Returns ``g(x[B, *event]) = log p_hat(x)[B, C]`` where
    ``p_hat(x)_i = (1/eot) sum_j softmax(f(noise(k_ij, x_i, noise_scale)))`` and
    ``k_ij = fold_in(noise_keys[i], j)`` (SmoothAdv's fixed noise samples, Salman et
    al. 2019, Sec. 3). ``cross_entropy(g(x), y) = -log p_hat(x)_y`` is the SmoothAdv
    loss, so pass ``g`` to :func:`cbcert.attacks.apgd.apgd` with ``loss='ce'`` and
    ``attack_all=True``: ``argmax p_hat`` is only an estimate of the smoothed prediction,
    so its misclassifying a point must not stop the attack. Judge the adversarial points
    with the Monte Carlo ``PREDICT`` of the smoothed classifier, not with ``p_hat``.

    The result is a :class:`SmoothedLogits` pytree whose arrays (``noise_scale``,
    ``noise_keys``) are traced by ``apgd``: one compilation per (``logits_fn``,
    ``noise``, ``eot``, shapes). A plain ``noise`` function is compared by identity;
    a bound method (``Gaussian().perturb``) by its function and by its owner's value,
    so a fresh but equal frozen noise model does not recompile.

    Args:
      logits_fn: ``x[N, *event] -> logits[N, C]``; called on ``B * eot`` points at once.
      noise: ``noise(key, x[*event], scale) -> x_noisy[*event]`` for one sample (the
        engine noise models' ``perturb``).
      noise_scale: the noise scale (sigma, rho, ...), traced.
      noise_keys: ``[B]`` PRNG keys, one per input, fixed during the attack.
      eot: number of noise samples per input (>= 1).

    Returns:
      A pure function ``x[B, *event] -> log p_hat[B, C]``.
    """
    if isinstance(eot, bool) or not isinstance(eot, (int, np.integer)) or eot < 1:
        raise ValueError(f"eot must be an integer >= 1, got {eot!r}")
    if inspect.ismethod(noise):
        static = _SmoothedLogProbs(logits_fn, noise.__func__, noise.__self__, int(eot))
    else:
        static = _SmoothedLogProbs(logits_fn, noise, None, int(eot))
    return SmoothedLogits(static, jnp.asarray(noise_scale), noise_keys)
