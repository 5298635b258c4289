"""The built-in concept world: structure g = g2∘D∘E∘g1, exact concepts, classes, gradients."""

import hashlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbcert.concepts import concept_state, flip_pairs
from cbcert.generators.concept_world import (
    VOCABULARY,
    ConceptWorldConfig,
    class_patterns,
    label_of,
    make_world,
)


@pytest.fixture(scope="module")
def world():
    return make_world(ConceptWorldConfig())


@pytest.fixture(scope="module")
def sample(world):
    z = world.sample_latents(jax.random.key(3), 64)
    return z, world.generator.concepts(world.params, z)


def test_decode_inverts_encode(world, sample):
    g = world.generator
    z, _ = sample
    w = g.g1(g.params, z)
    np.testing.assert_allclose(g.decode(g.params, g.encode(g.params, w)), w, atol=1e-5)


def test_concept_read_out_matches_ground_truth(world, sample):
    z, c = sample
    k = world.generator.num_concepts
    np.testing.assert_array_equal(concept_state(c, k), world.concepts_of(world.params, z))


@pytest.mark.parametrize("i", range(12))
def test_flip_changes_exactly_that_concept_and_its_attribute(world, sample, i):
    g = world.generator
    k = g.num_concepts
    z, c = sample
    eta = jnp.zeros((c.shape[0], k), bool).at[:, i].set(True)
    flipped = flip_pairs(c, eta, k)
    # Read back through the generator: decode to w, re-encode, read the concept state.
    back = concept_state(g.encode(g.params, g.decode(g.params, flipped)), k)
    before = concept_state(c, k)
    np.testing.assert_array_equal(back != before, np.asarray(eta))
    # The attribute is visible: the image changes for every sample whose concept is clearly
    # on or off (|v_i| > 0.05, strength outside [0.12, 0.88]); inside the thin band around the
    # concept boundary both renderings are half-way and legitimately close.
    clear = np.abs(np.asarray(world.concept_signal(world.params, z)[:, i])) > 0.05
    assert clear.sum() > 40
    x0 = g.image_from_concepts(g.params, c)
    x1 = g.image_from_concepts(g.params, flipped)
    change = np.asarray(jnp.max(jnp.abs(x1 - x0), axis=(1, 2, 3)))
    assert change[clear].min() > 0.1
    # ... and flipping twice restores the image exactly.
    x2 = g.image_from_concepts(g.params, flip_pairs(flipped, eta, k))
    np.testing.assert_allclose(x2, x0, atol=1e-5)


def test_flip_touches_nothing_else(world, sample):
    """Flipping concept i equals rendering with only attribute i's strength mirrored."""
    from cbcert.generators.concept_world import render

    g, cfg = world.generator, world.config
    k = g.num_concepts
    _, c = sample
    v = c[:, 0 : 2 * k : 2] * 2 / cfg.logit_scale
    a = jax.nn.sigmoid(cfg.sharpness * v)
    u = c[:, 2 * k :]
    eta = jnp.zeros((c.shape[0], k), bool).at[:, 4].set(True)
    expected = render(cfg, g.params, a.at[:, 4].set(1 - a[:, 4]), u)
    np.testing.assert_allclose(g.image_from_concepts(g.params, flip_pairs(c, eta, k)), expected,
                               atol=1e-5)


def test_gradients_in_latent_and_concept_space_are_finite_and_nonzero(world, sample):
    g = world.generator
    z, c = sample
    gz = jax.grad(lambda z: jnp.sum(g.image(g.params, z) ** 2))(z[:8])
    gc = jax.grad(lambda c: jnp.sum(g.image_from_concepts(g.params, c) ** 2))(c[:8])
    for grad in (gz, gc):
        assert bool(jnp.all(jnp.isfinite(grad)))
        assert float(jnp.min(jnp.linalg.norm(grad, axis=1))) > 0


def test_elementwise_logsumexp_is_jax_logsumexp_bit_for_bit():
    """The renderer's ``_logsumexp4`` (elementwise, fast on XLA:CPU) gives the same bits as
    ``jax.nn.logsumexp`` over the stacked maps, values and gradients, on the renderer's range
    (±12·|p|, |p| up to ~10) and far beyond it (±600, where exp overflows without the max).
    Deterministic: no failure probability."""
    from cbcert.generators.concept_world import _logsumexp4

    for scale in (12.0, 600.0):
        a, b, c, d = scale * jax.random.normal(jax.random.key(0), (4, 2048))

        def fast(*xs):
            return jnp.sum(jax.jit(_logsumexp4)(*xs))

        def reference(*xs):
            return jnp.sum(jax.jit(lambda *v: jax.nn.logsumexp(jnp.stack(v), axis=0))(*xs))

        assert np.array_equal(jax.jit(_logsumexp4)(a, b, c, d),
                              jax.jit(lambda *v: jax.nn.logsumexp(jnp.stack(v), axis=0))(
                                  a, b, c, d)), scale
        for got, want in zip(jax.grad(fast, argnums=(0, 1, 2, 3))(a, b, c, d),
                             jax.grad(reference, argnums=(0, 1, 2, 3))(a, b, c, d),
                             strict=True):
            assert np.array_equal(got, want), scale


def test_images_are_rgb_in_unit_range(world, sample):
    x = world.generator.image(world.params, sample[0])
    assert x.shape == (64, 32, 32, 3)
    assert float(x.min()) >= 0 and float(x.max()) <= 1


def test_labels_are_nearest_pattern_in_hamming_distance():
    patterns = class_patterns(ConceptWorldConfig())
    cube = np.array(list(itertools.product([0, 1], repeat=12)), bool)
    dist = (cube[:, None, :] != patterns[None].astype(bool)).sum(-1)  # [4096, C]
    np.testing.assert_array_equal(label_of(jnp.asarray(cube), jnp.asarray(patterns)),
                                  np.argmin(dist, axis=1))


@pytest.mark.parametrize("preset", ["default", "k8", "k16", "similar10", "dissimilar10"])
def test_class_patterns_have_close_and_far_pairs(preset):
    config = ConceptWorldConfig.from_preset(preset)
    p = class_patterns(config)
    assert p.shape == (config.num_classes, config.num_concepts)
    dist = (p[:, None] != p[None]).sum(-1)
    off = dist[~np.eye(len(p), dtype=bool)]
    assert off.min() >= 1, "patterns must be distinct"
    assert off.min() <= 2, "some classes are semantically close"
    assert off.max() >= config.num_concepts // 2, "some classes are far"


def test_presets_and_vocabulary():
    assert len(VOCABULARY) == 16
    w = make_world(ConceptWorldConfig.from_preset("px64"))
    z = w.sample_latents(jax.random.key(0), 2)
    assert w.generator.image(w.params, z).shape == (2, 64, 64, 3)
    with pytest.raises(ValueError, match="unknown world preset 'nope'"):
        ConceptWorldConfig.from_preset("nope")
    with pytest.raises(ValueError, match="num_concepts=10"):
        ConceptWorldConfig(num_concepts=10)


def test_world_is_deterministic_in_its_structure_seed():
    a, b = make_world(ConceptWorldConfig()), make_world(ConceptWorldConfig())
    c = make_world(ConceptWorldConfig(structure_seed=1))
    np.testing.assert_array_equal(a.params["A"], b.params["A"])
    assert not np.array_equal(a.params["A"], c.params["A"])


def test_vocabulary_study_keeps_the_task_fixed_across_k():
    """vocab12/vocab16 add concepts outside k8's class rule: same patterns, same first 8
    concepts and the same class for every latent, while the concept model sees 8, 12, 16."""
    worlds = [make_world(ConceptWorldConfig.from_preset(p)) for p in ("k8", "vocab12", "vocab16")]
    assert [w.generator.num_concepts for w in worlds] == [8, 12, 16]
    z = worlds[0].sample_latents(jax.random.key(4), 4096)
    labels = [np.asarray(w.label_of(w.params, z)) for w in worlds]
    concepts = [np.asarray(w.concepts_of(w.params, z)) for w in worlds]
    for w, y, c in zip(worlds[1:], labels[1:], concepts[1:], strict=True):
        np.testing.assert_array_equal(w.params["patterns"], worlds[0].params["patterns"])
        np.testing.assert_array_equal(c[:, :8], concepts[0])
        np.testing.assert_array_equal(y, labels[0])
    assert len(np.unique(labels[0])) == 10  # every class occurs: a non-trivial task
    # A concept outside the core never changes the class; a core concept can.
    big = worlds[2]
    flipped = concepts[2].copy()
    flipped[:, 8:] ^= True
    np.testing.assert_array_equal(big.label_of_concepts(big.params, flipped), labels[2])
    flipped = concepts[2].copy()
    flipped[:, :8] ^= True
    assert np.any(np.asarray(big.label_of_concepts(big.params, flipped)) != labels[2])


def test_label_concepts_is_checked_and_left_out_of_old_identities():
    with pytest.raises(ValueError, match="label_concepts=13"):
        ConceptWorldConfig(label_concepts=13)
    assert "label_concepts" not in ConceptWorldConfig().identity()  # shipped weights match
    assert ConceptWorldConfig.from_preset("vocab12").identity()["label_concepts"] == 8


def test_saturated_patterns_are_far_apart_and_old_presets_keep_their_patterns():
    """The saturated family's 10 patterns are pairwise ≥ 6 apart (a state at its pattern needs
    3 flips to change class); adding the separation field left every other preset's patterns
    where they were (their first anchor draws are the same numbers)."""
    config = ConceptWorldConfig.from_preset("saturated")
    p = class_patterns(config)
    dist = (p[:, None] != p[None]).sum(-1)[~np.eye(10, dtype=bool)]
    assert p.shape == (10, 12) and dist.min() >= 6
    # Every fragile preset's patterns, pinned (sha256 of their int8 bytes, computed before the
    # separation and its restarts existed): the shipped weights and results/reference rest
    # on them.
    digest = hashlib.sha256()
    for preset in ("default", "k8", "k16", "similar5", "similar10", "dissimilar5",
                   "dissimilar10", "vocab12", "vocab16"):
        digest.update(class_patterns(ConceptWorldConfig.from_preset(preset))
                      .astype(np.int8).tobytes())
    assert digest.hexdigest() == ("463cb37fdacff36510f2a9b69a70e4bc"
                                  "7025935f1e740f4d97c2bbd1bc7c6869")
    with pytest.raises(ValueError, match="found no 10 patterns over 12 concepts at pairwise "
                                         "Hamming distance ≥ 12"):
        class_patterns(ConceptWorldConfig(num_anchor_classes=10, num_near_classes=0,
                                          class_separation=12))


def test_saturated_fields_are_checked_and_left_out_of_old_identities():
    with pytest.raises(ValueError, match="class_separation=13 not in"):
        ConceptWorldConfig(class_separation=13)
    with pytest.raises(ValueError, match=r"prior_flip=0.5 not in \[0, 0.5\)"):
        ConceptWorldConfig(prior_flip=0.5)
    identity = ConceptWorldConfig().identity()
    assert "class_separation" not in identity and "prior_flip" not in identity
    saturated = ConceptWorldConfig.from_preset("saturated").identity()
    assert saturated["class_separation"] == 6 and saturated["prior_flip"] == 0.03


@pytest.fixture(scope="module")
def saturated():
    return make_world(ConceptWorldConfig.from_preset("saturated"))


def test_conditioning_reflects_only_wrong_concept_coordinates(saturated):
    """``condition`` keeps |t| of every coordinate, leaves the nuisance coordinates alone and
    sets each core concept to the target the key draws (recomputed here as documented)."""
    w, params = saturated, saturated.params
    n = 64
    z = jax.random.normal(jax.random.key(1), (n, 32))
    keys = jax.random.split(jax.random.key(2), n)
    out = w.condition(params, z, keys)
    a = np.asarray(params["A"], np.float64)
    t, t_out = np.asarray(z, np.float64) @ a.T, np.asarray(out, np.float64) @ a.T
    np.testing.assert_allclose(np.abs(t_out), np.abs(t), atol=1e-5)
    np.testing.assert_allclose(t_out[:, 12:], t[:, 12:], atol=1e-5)
    y = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 0), (), 0, 10))(keys)
    flips = jax.vmap(lambda k: jax.random.bernoulli(jax.random.fold_in(k, 1), 0.03, (12,)))(keys)
    y, flips = np.asarray(y), np.asarray(flips)
    want = (np.asarray(params["patterns"])[y] > 0) ^ flips
    np.testing.assert_array_equal(np.asarray(w.concepts_of(params, out)), want)
    # The fragile family's prior is the standard normal itself.
    default = make_world(ConceptWorldConfig())
    assert not default.conditional
    assert default.condition(default.params, z, keys) is z


def test_conditioned_coordinate_has_the_conditional_normal_law(saturated):
    """Reflection is exact conditioning: a concept coordinate t_i of the saturated prior,
    given its bit, has the law of a standard normal rejection-sampled on that bit. Two-sample
    Kolmogorov–Smirnov test on 20,000 + 20,000 draws with fixed keys; the test fails with
    probability 10⁻⁴ when the laws are equal."""
    from scipy.stats import ks_2samp

    w = saturated
    z = w.sample_latents(jax.random.key(5), 20_000)
    t = np.asarray(z, np.float64) @ np.asarray(w.params["A"], np.float64).T  # [n, d]
    omega = w.config.frequency
    ref = np.asarray(jax.random.normal(jax.random.key(6), (400_000,)), np.float64)
    for i, bit in ((0, True), (0, False), (7, True)):
        got = t[:, i][(np.sin(omega * t[:, i]) > 0) == bit]
        want = ref[(np.sin(omega * ref) > 0) == bit][:20_000]
        assert ks_2samp(got, want).pvalue > 1e-4, (i, bit)
    # The states concentrate on the patterns: distance to the nearest pattern ~ Binomial(12,
    # 0.03) (a state 3 flips from its pattern may sit nearer another; that is rare): P(0)
    # = 0.694 within ±0.02 (≥ 6 standard errors: failure probability < 10⁻⁸).
    b = np.asarray(w.concepts_of(w.params, z))
    p = np.asarray(w.params["patterns"], bool)
    nearest = (b[:, None] != p[None]).sum(-1).min(1)
    assert abs(np.mean(nearest == 0) - 0.97**12) < 0.02
    assert np.mean(nearest <= 2) > 0.99
