"""The trainers' shared program pieces (`cbcert.training.programs`). Deterministic."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cbcert.training.programs import ProgramCache, abstract, filled, gradient_step


def test_program_cache_builds_once_per_key_and_drops_the_least_recently_used():
    built = []

    def build(name):
        def make():
            built.append(name)
            return name
        return make

    cache = ProgramCache(2)
    assert cache.get("a", build("a")) == "a"
    assert cache.get("b", build("b")) == "b"
    assert cache.get("a", build("a")) == "a"  # a hit: "b" is now the least recently used
    assert cache.get("c", build("c")) == "c"  # evicts "b"
    assert cache.get("a", build("a")) == "a"
    assert built == ["a", "b", "c"]
    assert cache.get("b", build("b")) == "b"  # rebuilt after its eviction
    assert built == ["a", "b", "c", "b"]


def test_abstract_keeps_shapes_and_filled_copies_values_into_a_fresh_state():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    _, state = nnx.split(model, nnx.Param)
    template = abstract(state)
    leaves = jax.tree.leaves(template)
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in leaves)
    assert sorted(v.shape for v in leaves) == [(2,), (3, 2)]
    values = {"kernel": jnp.ones((3, 2)), "bias": jnp.arange(2.0)}
    out = filled(state, values)
    np.testing.assert_array_equal(out["kernel"][...], np.ones((3, 2)))
    np.testing.assert_array_equal(out["bias"][...], [0.0, 1.0])
    assert not np.array_equal(state["kernel"][...], np.ones((3, 2)))  # the template untouched


def test_gradient_step_is_one_optimiser_update_of_the_loss():
    """One SGD step of a least-squares loss equals ``w − lr · ∇`` computed by hand; the
    statistics and accuracy of the loss's auxiliary output pass through."""
    opt = optax.sgd(0.1)

    def loss_fn(params, stats, x, y):
        r = x @ params["w"] - y
        return jnp.mean(r ** 2), ({"count": stats["count"] + 1}, jnp.float32(0.5))

    step = gradient_step(loss_fn, opt)
    x = jnp.array([[1.0, 2.0], [3.0, -1.0]])
    y = jnp.array([1.0, 0.0])
    params = {"w": jnp.array([0.3, -0.7])}
    new, stats, _, loss, accuracy = step(params, {"count": jnp.int32(0)}, opt.init(params), x, y)
    r = np.asarray(x @ params["w"] - y)
    grad = 2.0 * np.asarray(x).T @ r / 2
    np.testing.assert_allclose(new["w"], np.asarray(params["w"]) - 0.1 * grad, rtol=1e-6)
    np.testing.assert_allclose(loss, np.mean(r ** 2), rtol=1e-6)
    assert int(stats["count"]) == 1 and float(accuracy) == 0.5
