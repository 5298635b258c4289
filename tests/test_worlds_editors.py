"""Concept editors (`cbcert.worlds.editors`): the perfect editor is the pair swap, the
imperfect one fails and leaks at its designed rates (checked through the built-in generator's
own concept read-out ``C(E(D(c')))``, as edit verification reads it), and the
``imperfect-editor`` world is the default world with that editor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from cbcert.concepts import concept_state, flip_pairs
from cbcert.robustness.explain import verify_edit
from cbcert.worlds.builtin import EDITOR_VARIANTS, load_builtin
from cbcert.worlds.editors import (
    EditorDefects,
    designed_validity,
    imperfect_editor,
    partners,
    perfect_editor,
)

K = 12
DEFECTS = EditorDefects(fail=0.2, leak=0.1)


@pytest.fixture(scope="module")
def world():
    return load_builtin("imperfect-editor")


def _edits(world, n, m, seed, pairs=False):
    """``n`` edits on latents of the world: (before, after) read-outs and targets, each ``[n,
    K]`` bool, through the world's editor. Targets: one concept from each of m random partner
    pairs (no two targets partners), or with ``pairs`` both concepts of m random pairs."""
    gen, params = world.generator, world.params["gen"]
    z = jax.random.normal(jax.random.key(seed), (n, gen.latent_dim))
    c = gen.concepts(params, z)
    rng = np.random.default_rng(seed)
    targets = np.zeros((n, K), bool)
    for row in range(n):
        chosen = 2 * rng.choice(K // 2, m, replace=False)
        targets[row, chosen if pairs else chosen + rng.integers(0, 2, m)] = True
        if pairs:
            targets[row, chosen + 1] = True
    keys = jax.random.split(jax.random.key(seed + 1), n)
    edited = world.edit(keys, c, targets)
    read = concept_state(gen.encode(params, gen.decode(params, edited)), K)
    return np.asarray(concept_state(c, K)), np.asarray(read), targets


def test_perfect_editor_is_the_pair_swap_and_no_defect_is_perfect():
    c = jax.random.normal(jax.random.key(0), (6, 2 * K + 20))
    targets = jax.random.bernoulli(jax.random.key(1), 0.3, (6, K))
    keys = jax.random.split(jax.random.key(2), 6)
    swap = flip_pairs(c, targets, K)
    np.testing.assert_array_equal(jax.vmap(perfect_editor(K))(keys, c, targets), swap)
    none = imperfect_editor(K, EditorDefects(0.0, 0.0))
    np.testing.assert_array_equal(jax.vmap(none)(keys, c, targets), swap)


def test_applied_flips_are_targets_or_their_partners():
    """Whatever the draws, the editor flips only targets and partners of targets."""
    c = jax.random.normal(jax.random.key(3), (500, 2 * K + 20))
    targets = np.asarray(jax.random.bernoulli(jax.random.key(4), 0.25, (500, K)))
    edit = jax.vmap(imperfect_editor(K, EditorDefects(0.5, 0.5)))
    after = edit(jax.random.split(jax.random.key(5), 500), c, targets)
    flipped = np.asarray(concept_state(after, K) != concept_state(c, K))
    allowed = targets | targets[:, np.asarray(partners(K))]
    assert not (flipped & ~allowed).any()
    assert (flipped != targets).any()  # some failed or leaked


@pytest.mark.parametrize("m,pairs,designed", [(1, False, 0.8 * 0.9), (3, False, 0.72**3),
                                               (2, True, 0.8**4)])
def test_accepted_share_is_the_designed_one(world, m, pairs, designed):
    """Over 4,000 edits, verification (the generator's read-out) accepts a share whose count is
    Binomial(4000, P(valid)) under the design: ((1 − fail)(1 − leak))^m for m targets no two of
    them partners, (1 − fail)^4 for two partner pairs (a leak onto a target does nothing); the
    two-sided region holds 1 − 10⁻⁶ of it (failure probability 10⁻⁶ each, fixed keys)."""
    before, after, targets = _edits(world, 4000, m, seed=10 + m, pairs=pairs)
    np.testing.assert_allclose(designed_validity(DEFECTS, targets), designed)
    valid = verify_edit(before, after, targets).sum()
    low, high = scipy.stats.binom.interval(1 - 1e-6, 4000, designed)
    assert low <= valid <= high, (valid, low, high)


def test_single_edits_fail_leak_or_succeed_at_the_designed_rates(world):
    """One target per edit: nothing changes (failed) with p = fail, target and partner flip
    (leaked) with (1 − fail) leak, exactly the target with (1 − fail)(1 − leak); each count
    inside its Binomial(4000, p) region of probability 1 − 10⁻⁶ (failure probability ≤ 3·10⁻⁶
    over the three)."""
    before, after, targets = _edits(world, 4000, 1, seed=20)
    changed = after != before
    mate = np.asarray(partners(K))
    target = targets.argmax(axis=1)
    failed = ~changed.any(axis=1)
    exact = (changed == targets).all(axis=1)
    leaked = changed[np.arange(4000), target] & changed[np.arange(4000), mate[target]] & (
        changed.sum(axis=1) == 2)
    assert (failed | exact | leaked).all()
    for count, p in ((failed.sum(), DEFECTS.fail), (leaked.sum(), 0.8 * 0.1),
                     (exact.sum(), 0.8 * 0.9)):
        low, high = scipy.stats.binom.interval(1 - 1e-6, 4000, p)
        assert low <= count <= high, (count, p)


def test_the_imperfect_editor_world_is_the_default_world_with_that_editor(world):
    default = load_builtin("default")
    assert world.name == "builtin:imperfect-editor" and default.editor is None
    assert world.metadata["editor"] == {"fail": 0.2, "leak": 0.1}
    assert EDITOR_VARIANTS["imperfect-editor"] == ("default", DEFECTS)
    z = jax.random.normal(jax.random.key(0), (4, world.generator.latent_dim))
    np.testing.assert_array_equal(world.latent_images(world.params, z),
                                  default.latent_images(default.params, z))
    with pytest.raises(ValueError, match="editor variants: imperfect-editor"):
        load_builtin("imperfect")


def test_bad_defects_and_odd_vocabularies_are_refused():
    with pytest.raises(ValueError, match="fail=1.0 must be in"):
        EditorDefects(1.0, 0.0)
    with pytest.raises(ValueError, match="leak=-0.1 must be in"):
        EditorDefects(0.0, -0.1)
    with pytest.raises(ValueError, match="must be even"):
        partners(7)
    two = np.zeros(K, bool)
    two[[0, 2]] = True  # not partners
    assert designed_validity(DEFECTS, two) == pytest.approx((0.8 * 0.9) ** 2)
    two[[2, 1]] = [False, True]  # partners 0 and 1
    assert designed_validity(DEFECTS, two) == pytest.approx(0.8**2)
    assert jnp.array_equal(partners(4), jnp.array([1, 0, 3, 2]))
