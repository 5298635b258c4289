"""Counts on 1, 2 and 8 (fake CPU) devices are bit-identical to the single-device run."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import processes as testing
import pytest

from cbcert.engine import keys, noise, sampler

# The child builds the same problem as _problem() below, so both sides share this source.
PROBLEM = """
import jax, jax.numpy as jnp, numpy as np
from cbcert.engine import keys, noise, sampler

K = 3
WEIGHTS = np.asarray(jax.random.normal(jax.random.key(1), (6, 2, 4)))
INPUTS = np.asarray(jax.random.normal(jax.random.key(2), (5, 6)))
CONCEPTS = np.asarray(jax.random.normal(jax.random.key(3), (5, 2 * K)))
KEY = keys.stream_key(jax.random.key(0), keys.STREAM_SELECT)


def heads(params, x):
    return jnp.einsum("bd,dhc->bhc", x, params)


def gaussian_counts(mesh, chunk_size, subset=None):
    rows = list(range(5)) if subset is None else subset
    return sampler.count_classes(heads, WEIGHTS, INPUTS[rows], noise.Gaussian(), KEY, 45,
                                 scale=0.8, num_classes=4, indices=rows, chunk_size=chunk_size,
                                 mesh=mesh)


def flip_labels(mesh):
    fn = lambda p, clean, noisy: jnp.argmax(heads(p, noisy), -1)
    return sampler.map_samples(fn, WEIGHTS, CONCEPTS, noise.FixedFlips(K), KEY, 12,
                               scale=2, chunk_size=16, mesh=mesh)
"""

CHILD = PROBLEM + """
import json
from jax.sharding import Mesh
devices = np.asarray(jax.devices())
assert devices.size == 8, devices
runs = {}
runs["1 device, chunk 64"] = gaussian_counts(Mesh(devices[:1], ("data",)), 64)
for size in (7, 1000):
    runs[f"2 devices, chunk {size}"] = gaussian_counts(Mesh(devices[:2], ("data",)), size)
for size in (7, 64, 1000):
    runs[f"8 devices, chunk {size}"] = gaussian_counts(Mesh(devices, ("data",)), size)
grid = Mesh(devices.reshape(2, 4), ("hosts", "chips"))
runs["2x4 mesh, chunk 64"] = gaussian_counts(grid, 64)
runs["8 devices, subset"] = gaussian_counts(None, 7, subset=[3, 0])
runs["8 devices, fixed flips"] = flip_labels(None)
print("RESULT " + json.dumps({name: value.tolist() for name, value in runs.items()}))
"""


def _result(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_counts_identical_on_1_2_and_8_devices():
    child = testing.start_python(CHILD, num_devices=8)  # runs while this process computes
    scope: dict = {}
    exec(PROBLEM, scope)  # noqa: S102 - the same problem definition as the child's
    reference = scope["gaussian_counts"](None, 64)
    reference_flips = scope["flip_labels"](None)
    runs = _result(testing.wait_python(child, timeout=240))
    assert len(runs) == 9
    for name, counts in runs.items():
        if name == "8 devices, subset":
            np.testing.assert_array_equal(counts, reference[[3, 0]], err_msg=name)
        elif name == "8 devices, fixed flips":
            np.testing.assert_array_equal(counts, reference_flips, err_msg=name)
        else:
            np.testing.assert_array_equal(counts, reference, err_msg=name)


def test_reference_is_not_trivial():
    # Guards the test above: the counts must actually depend on the noise keys.
    def heads(params, x):
        return jnp.einsum("bd,dhc->bhc", x, params)

    weights = np.asarray(jax.random.normal(jax.random.key(1), (6, 2, 4)))
    inputs = np.asarray(jax.random.normal(jax.random.key(2), (5, 6)))
    counts = [
        sampler.count_classes(heads, weights, inputs, noise.Gaussian(),
                              keys.stream_key(jax.random.key(0), stream), 45, scale=0.8,
                              num_classes=4,
                              chunk_size=64)
        for stream in (keys.STREAM_SELECT, keys.STREAM_ESTIMATE)
    ]
    assert not np.array_equal(counts[0], counts[1])
    assert (counts[0].max(axis=-1) < 45).any()
