import jax
import numpy as np

from cbcert.engine import keys


def test_sample_key_is_nested_fold_in():
    root = jax.random.key(7)
    got = keys.sample_key(root, 12, 3)
    want = jax.random.fold_in(jax.random.fold_in(root, 12), 3)
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))


def test_sample_key_vmaps_over_traced_indices():
    root = jax.random.key(7)
    i = np.array([0, 5, 5, 2**31 - 1], np.int32)
    j = np.array([0, 0, 9, 4], np.int32)
    batched = jax.vmap(keys.sample_key, in_axes=(None, 0, 0))(root, i, j)
    for row, (ii, jj) in enumerate(zip(i, j, strict=True)):
        np.testing.assert_array_equal(
            jax.random.key_data(batched[row]),
            jax.random.key_data(keys.sample_key(root, int(ii), int(jj))),
        )


def test_streams_are_distinct_and_raw_keys_match_typed_keys():
    root = jax.random.key(0)
    select = keys.stream_key(root, keys.STREAM_SELECT)
    estimate = keys.stream_key(root, keys.STREAM_ESTIMATE)
    assert keys.STREAM_SELECT != keys.STREAM_ESTIMATE
    assert not np.array_equal(jax.random.key_data(select), jax.random.key_data(estimate))
    raw = keys.sample_key(keys.stream_key(jax.random.PRNGKey(0), keys.STREAM_SELECT), 4, 2)
    np.testing.assert_array_equal(raw, jax.random.key_data(keys.sample_key(select, 4, 2)))


def test_sample_keys_differ_across_inputs_and_samples():
    root = jax.random.key(1)
    grid = [jax.random.key_data(keys.sample_key(root, i, j)) for i in range(4) for j in range(4)]
    assert len({tuple(np.asarray(k).tolist()) for k in grid}) == 16
