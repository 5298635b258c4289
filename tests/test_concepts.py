"""The concept layout: pairs, flips, states, CB-AE interventions (`cbcert.concepts`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbcert.concepts import (
    absent_present,
    concept_state,
    flip_pairs,
    join,
    margins,
    pairs,
    set_concept,
    swap_pairs,
    unsupervised,
)

K, U = 6, 3


def _concepts(key, n):
    return jax.random.normal(key, (n, 2 * K + U))


def test_flip_pairs_swaps_exactly_the_flipped_pairs():
    c = jnp.arange(2 * K + U, dtype=jnp.float32)
    eta = jnp.array([1, 0, 0, 1, 0, 1], bool)
    got = np.asarray(flip_pairs(c, eta, K))
    want = np.array([1, 0, 2, 3, 4, 5, 7, 6, 8, 9, 11, 10, 12, 13, 14], np.float32)
    np.testing.assert_array_equal(got, want)


def test_flip_pairs_is_an_involution_and_flips_the_state():
    c = _concepts(jax.random.key(0), 32)  # [32, 2K+U]
    eta = jax.random.bernoulli(jax.random.key(1), 0.5, (32, K))
    flipped = flip_pairs(c, eta, K)
    np.testing.assert_array_equal(flip_pairs(flipped, eta, K), c)
    state, new_state = concept_state(c, K), concept_state(flipped, K)
    np.testing.assert_array_equal(state != new_state, eta)
    np.testing.assert_array_equal(flipped[:, 2 * K :], c[:, 2 * K :])


def test_concept_state_compares_interleaved_pairs():
    c = jnp.array([2.0, 1.0, -1.0, 0.5, 9.0])  # K=2, U=1
    np.testing.assert_array_equal(concept_state(c, 2), [True, False])


def test_flip_pairs_rejects_short_vectors():
    with pytest.raises(ValueError, match="2\\*num_concepts=12"):
        flip_pairs(jnp.zeros(11), jnp.zeros(K, bool), K)


def test_pairs_join_margins_and_swaps_agree_with_the_layout():
    c = jnp.arange(2 * K + U, dtype=jnp.float32)  # c_i+ = 2i, c_i- = 2i + 1
    np.testing.assert_array_equal(pairs(c, K)[:, 0], 2 * np.arange(K))
    np.testing.assert_array_equal(join(pairs(c, K), unsupervised(c, K)), c)
    np.testing.assert_array_equal(margins(c, K), -np.ones(K))
    np.testing.assert_array_equal(swap_pairs(swap_pairs(c, K), K), c)
    np.testing.assert_array_equal(swap_pairs(c, K), flip_pairs(c, jnp.ones(K, bool), K))
    np.testing.assert_array_equal(absent_present(c, K)[:, 1], 2 * np.arange(K))
    assert swap_pairs(c, 0) is c


def test_set_concept_swaps_only_when_the_state_differs():
    c = jnp.array([[2.0, 1.0, -1.0, 0.5, 9.0]])  # K = 2: concept 0 on, concept 1 off
    np.testing.assert_array_equal(set_concept(c, 0, True), c)
    np.testing.assert_array_equal(set_concept(c, 0, False), [[1.0, 2.0, -1.0, 0.5, 9.0]])
    np.testing.assert_array_equal(set_concept(c, 1, True), [[2.0, 1.0, 0.5, -1.0, 9.0]])
    with pytest.raises(ValueError, match="num_concepts=0"):
        concept_state(c, 0)
