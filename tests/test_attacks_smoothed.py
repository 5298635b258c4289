"""Tests for cbcert.attacks.smoothed (SmoothAdv-style loss for APGD)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import norm as normal

from cbcert.attacks.apgd import apgd
from cbcert.attacks.smoothed import smoothed_logits_fn
from cbcert.certify.cohen import predict_counts


@dataclasses.dataclass(frozen=True)
class _Gaussian:
    """Local stand-in for the engine's Gaussian noise model (same perturb signature)."""

    def perturb(self, key, x, sigma):
        return x + sigma * jax.random.normal(key, x.shape, x.dtype)


def _mlp(seed, d_in=4, hidden=16, classes=3):
    k1, k2 = jax.random.split(jax.random.key(seed))
    w1 = jax.random.normal(k1, (d_in, hidden)) / math.sqrt(d_in)
    w2 = jax.random.normal(k2, (hidden, classes)) / math.sqrt(hidden)
    return lambda x: jnp.tanh(x @ w1) @ w2


MLP = _mlp(0)
X = jax.random.normal(jax.random.key(1), (12, 4))
KEYS = jax.random.split(jax.random.key(2), 12)


def test_matches_explicit_mean_softmax():
    eot, sigma = 5, 0.3
    g = smoothed_logits_fn(
        MLP, noise=_Gaussian().perturb, noise_scale=sigma, noise_keys=KEYS, eot=eot
    )
    expected = []
    for i in range(X.shape[0]):
        noisy = jnp.stack(
            [_Gaussian().perturb(jax.random.fold_in(KEYS[i], j), X[i], sigma) for j in range(eot)]
        )
        expected.append(jnp.log(jnp.mean(jax.nn.softmax(MLP(noisy), axis=-1), axis=0)))
    np.testing.assert_allclose(g(X), jnp.stack(expected), rtol=1e-5, atol=1e-6)
    # Log-probabilities: they normalise.
    np.testing.assert_allclose(jnp.exp(g(X)).sum(-1), 1.0, rtol=1e-5)


def test_noise_follows_the_example_not_its_batch_position():
    kwargs = dict(noise=_Gaussian().perturb, noise_scale=0.5, eot=4)
    perm = jnp.array([5, 0, 11, 3])
    full = jax.jit(smoothed_logits_fn(MLP, noise_keys=KEYS, **kwargs))(X)
    part = jax.jit(smoothed_logits_fn(MLP, noise_keys=KEYS[perm], **kwargs))(X[perm])
    np.testing.assert_allclose(part, full[perm], rtol=1e-6)


def test_linear_smoothed_classifier_attack_reaches_closed_form():
    # f(x) = [0, x_0] (two classes, logits), Gaussian noise: with many samples,
    # E[softmax] is close to the smoothed sigmoid, which is monotone in x_0, so the
    # L2 attack on label 0 moves x_0 by +eps. eot = 256 fixed samples per input.
    f = lambda x: jnp.stack([jnp.zeros_like(x[:, 0]), x[:, 0]], axis=-1)
    x0 = jnp.array([[-2.0, 0.0], [-1.5, 1.0], [-3.0, -1.0]])
    y = jnp.zeros(3, jnp.int32)
    keys = jax.random.split(jax.random.key(3), 3)
    g = smoothed_logits_fn(f, noise=_Gaussian().perturb, noise_scale=0.25, noise_keys=keys, eot=256)
    x_adv, info = apgd(g, x0, y, eps=0.5, norm="l2", key=jax.random.key(4), n_iter=50)
    np.testing.assert_allclose(x_adv, x0 + jnp.array([0.5, 0.0]), atol=2e-3)
    assert not bool(info.fooled.any())
    log_p = jax.jit(g)(x_adv)
    np.testing.assert_allclose(info.loss, -log_p[:, 0], rtol=1e-5)
    # The probit-smoothed logistic (sigmoid(t) ~ Phi(t sqrt(pi/8))) is a sanity bound
    # on p_hat: 256 samples put it within 0.05 of the expectation here.
    approx = normal.cdf(x_adv[:, 0] / jnp.sqrt(8.0 / jnp.pi + 0.25**2))
    np.testing.assert_allclose(jnp.exp(log_p)[:, 1], approx, atol=0.05)


def test_input_whose_eot_estimate_is_wrong_but_predict_right_is_attacked():
    # f(x) = [0, 4 x_0]: class 0 left of x_0 = 0. At x_0 = -0.25 with sigma = 0.5 the
    # smoothed classifier votes class 0 with probability Phi(0.5) = 0.69, but the single
    # EOT sample of noise key 0 lands right of 0 (asserted below).
    f = lambda x: jnp.stack([jnp.zeros_like(x[:, 0]), 4.0 * x[:, 0]], axis=-1)
    sigma, eps = 0.5, 1.0
    x0, y = jnp.array([[-0.25, 0.0]]), jnp.zeros(1, jnp.int32)
    g = smoothed_logits_fn(
        f, noise=_Gaussian().perturb, noise_scale=sigma, noise_keys=jax.random.key(0)[None], eot=1
    )

    def predict(x, seed):
        # PREDICT with n = 1000, alpha = 0.001. At P(class 0) = Phi(0.5) (clean) or
        # Phi(-1.5) (attacked), a wrong or abstaining answer has probability < 1e-12.
        noise = jax.random.normal(jax.random.key(seed), (1000, 2))
        votes = np.argmax(f(x + sigma * noise), axis=-1)
        return int(predict_counts(np.bincount(votes, minlength=2), alpha=0.001).prediction)

    assert int(jnp.argmax(g(x0), axis=-1)[0]) == 1  # the EOT estimate misclassifies x0
    assert predict(x0, 1) == 0  # PREDICT classifies it correctly
    kwargs = dict(eps=eps, norm="l2", key=jax.random.key(2), n_iter=20)
    x_ref, _ = apgd(g, x0, y, **kwargs)
    np.testing.assert_array_equal(x_ref, x0)  # the reference criterion: never attacked
    x_adv, info = apgd(g, x0, y, attack_all=True, **kwargs)
    # Attacked: moved along +x_0 (the loss -log p_hat_0 grows with x_0) to the sphere.
    np.testing.assert_allclose(x_adv[0, 0], x0[0, 0] + eps, atol=1e-4)
    assert float(info.perturbation_norm[0]) == pytest.approx(eps, rel=1e-5)
    assert predict(x_adv, 3) == 1  # not robust: PREDICT misclassifies the attacked point


def test_take_rows_selects_the_examples_noise():
    g = smoothed_logits_fn(MLP, noise=_Gaussian().perturb, noise_scale=0.5, noise_keys=KEYS, eot=3)
    rows = jnp.array([4, 0, 4])
    np.testing.assert_allclose(g.take_rows(rows)(X[rows]), g(X)[rows], rtol=1e-6)


def test_single_compile_when_noise_keys_and_scale_change():
    traces = []

    def counted(x):
        traces.append(None)
        return MLP(x)

    y = jnp.argmax(MLP(X), axis=-1)
    for i, sigma in enumerate((0.1, 0.2, 0.4)):
        # A fresh bound method each time: it compares equal, so no retrace.
        g = smoothed_logits_fn(
            counted,
            noise=_Gaussian().perturb,
            noise_scale=sigma,
            noise_keys=jax.random.split(jax.random.key(10 + i), 12),
            eot=3,
        )
        x_adv, _ = apgd(g, X, y, eps=0.2 + 0.1 * i, norm="linf", key=jax.random.key(i), n_iter=5)
        assert float(jnp.abs(x_adv - X).max()) <= (0.2 + 0.1 * i) * (1 + 1e-6)
        if i == 0:
            after_first = len(traces)
    assert len(traces) == after_first


@pytest.mark.parametrize("eot", [0, -2, 1.5, True])
def test_invalid_eot(eot):
    with pytest.raises(ValueError, match="eot must be an integer >= 1"):
        smoothed_logits_fn(
            MLP, noise=_Gaussian().perturb, noise_scale=0.1, noise_keys=KEYS, eot=eot
        )
