import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from cbcert.concepts import concept_state
from cbcert.engine import noise

K, U = 6, 3


def _concepts(key, n):
    return jax.random.normal(key, (n, 2 * K + U))


@functools.cache
def _batched(model):
    return jax.jit(jax.vmap(model.perturb, in_axes=(0, None, None)))


def _many(model, x, param, n, seed=0):
    return _batched(model)(jax.random.split(jax.random.key(seed), n), x, param)


def test_gaussian_moments():
    x = jnp.full((4, 5), 3.0)
    samples = np.asarray(_many(noise.Gaussian(), x, 0.5, 4000)) - 3.0  # 80 000 draws
    # Sample mean ~ N(0, 0.25/80000): |mean| > 0.01 is a 5.7-sigma event (p < 2e-8).
    assert abs(samples.mean()) < 0.01
    # Sample std has sd ≈ 0.5/sqrt(2*80000) = 1.25e-3; 0.0075 is 6 sigma (p < 2e-9).
    assert abs(samples.std() - 0.5) < 0.0075


def test_bernoulli_flip_rate():
    c = _concepts(jax.random.key(2), 1)[0]
    samples = _many(noise.BernoulliFlips(K), c, 0.2, 5000)
    flips = np.asarray(concept_state(samples, K) != concept_state(c, K))
    # 30 000 Bernoulli(0.2) draws: sd of the rate 2.3e-3; 0.012 is > 5 sigma (p < 1e-7).
    assert abs(flips.mean() - 0.2) < 0.012
    np.testing.assert_array_equal(samples[:, 2 * K :], np.broadcast_to(c[2 * K :], (5000, U)))


@pytest.mark.parametrize("m", [0, 1, 4, K])
def test_fixed_flips_flip_exactly_m(m):
    c = _concepts(jax.random.key(3), 1)[0]
    samples = _many(noise.FixedFlips(K), c, jnp.int32(m), 3000)
    flips = np.asarray(concept_state(samples, K) != concept_state(c, K))
    np.testing.assert_array_equal(flips.sum(axis=1), m)
    # Each concept is in the subset with probability m/K; 3000 draws, sd <= 0.0092, 0.05 > 5 sd.
    np.testing.assert_allclose(flips.mean(axis=0), m / K, atol=0.05)


def test_fixed_flips_subsets_are_uniform():
    c = _concepts(jax.random.key(4), 1)[0]
    samples = _many(noise.FixedFlips(4), c[: 2 * 4], jnp.int32(2), 6000)
    flips = np.asarray(concept_state(samples, 4) != concept_state(c[:8], 4))
    codes = flips @ (1 << np.arange(4))
    _, counts = np.unique(codes, return_counts=True)
    assert counts.size == 6  # C(4, 2) subsets, all seen
    # Chi-square goodness of fit to uniform over 6 subsets; fails with probability 1e-4.
    assert scipy.stats.chisquare(counts).pvalue > 1e-4


def test_fixed_flips_count_is_traced():
    model = noise.FixedFlips(K)
    c = jnp.zeros(2 * K).at[0::2].set(1.0)  # every concept on
    traces = []

    @jax.jit
    def flipped(m):
        traces.append(None)
        return concept_state(model.perturb(jax.random.key(0), c, m), K)

    assert [int((~flipped(jnp.int32(m))).sum()) for m in range(K + 1)] == list(range(K + 1))
    assert len(traces) == 1


def test_sphere_shift_norm_is_eps():
    x = jnp.ones((3, 4, 2))
    samples = _many(noise.SphereShift(), x, 0.3, 500)
    norms = np.linalg.norm(np.asarray(samples - x).reshape(500, -1), axis=1)
    np.testing.assert_allclose(norms, 0.3, rtol=1e-5)


def test_sphere_shift_ball_radius_distribution():
    d = 5
    x = jnp.zeros(d)
    samples = _many(noise.SphereShift(ball=True), x, 2.0, 4000)
    radii = np.linalg.norm(np.asarray(samples), axis=1) / 2.0
    assert radii.max() <= 1.0 + 1e-6
    # Uniform in the ball <=> (r/eps)^d ~ U(0, 1); KS test fails with probability 1e-4.
    assert scipy.stats.kstest(radii**d, "uniform").pvalue > 1e-4
    # Directions are uniform: the mean of u over 4000 draws has sd 1/sqrt(5*4000) per axis.
    directions = np.asarray(samples) / np.linalg.norm(np.asarray(samples), axis=1, keepdims=True)
    assert np.abs(directions.mean(axis=0)).max() < 6 / np.sqrt(d * 4000)


@pytest.mark.parametrize(
    "model, param, match",
    [
        (noise.Gaussian(), -0.1, "sigma=-0.1 must be finite and in \\[0, inf\\)"),
        (noise.Gaussian(), float("nan"), "sigma=nan"),
        (noise.BernoulliFlips(K), 1.5, "rho=1.5 must be in \\[0, 1\\]"),
        (noise.FixedFlips(K), 7, "m=7 must be an integer in \\[0, 6\\]"),
        (noise.FixedFlips(K), 1.5, "m=1.5"),
        (noise.SphereShift(), -1.0, "eps=-1.0"),
        (noise.Gaussian(), [0.1, 0.2], "sigma=.* must be a real scalar"),
    ],
)
def test_check_scale_rejects_out_of_range(model, param, match):
    with pytest.raises(ValueError, match=match):
        model.check_scale(param)


def test_check_scale_returns_traced_dtypes():
    assert noise.Gaussian().check_scale(0.25).dtype == np.float32
    assert noise.FixedFlips(K).check_scale(3.0).dtype == np.int32


def test_concept_noise_rejects_bad_events():
    with pytest.raises(ValueError, match="one flat vector"):
        noise.BernoulliFlips(K).check_event((2, 2 * K))
    with pytest.raises(ValueError, match="num_concepts=0"):
        noise.FixedFlips(0)


@pytest.mark.parametrize("inner", [noise.Gaussian(), noise.SphereShift(),
                                   noise.SphereShift(ball=True)])
def test_leading_moves_only_the_leading_coordinates_exactly_as_inner(inner):
    """`Leading`: the first d coordinates get inner's noise bit for bit (same key, same width,
    so σ, the sphere and the ball law see d), the tail (a class position) never moves."""
    d = 7
    z = jax.random.normal(jax.random.key(1), (d,))
    x = jnp.concatenate([z, jnp.asarray([3.0])])
    wrapped = noise.restrict(inner, d)
    assert noise.restrict(inner, None) is inner
    got = np.asarray(_many(wrapped, x, 0.5, 64))
    expected = np.asarray(_many(inner, z, 0.5, 64))
    np.testing.assert_array_equal(got[:, :d], expected)
    np.testing.assert_array_equal(got[:, d], 3.0)
    assert wrapped.check_scale(0.5) == inner.check_scale(0.5)
    with pytest.raises(ValueError, match=r"event shape \(7,\): expected one flat vector longer "
                                         "than the 7 perturbed coordinates"):
        wrapped.check_event((d,))
