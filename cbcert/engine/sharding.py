"""Data-parallel placement of Monte Carlo chunks on a device mesh.

A chunk of B (input, sample) pairs is split along its leading axis over *every* axis of the
mesh; parameters, key and noise scale are replicated. The same code serves one device, many
local devices and a multi-host job (TPU pod slice, or ``jax.distributed`` on CPU): host arrays
become global ``jax.Array``s through ``jax.make_array_from_callback``, which asks each process
only for the shards its own devices hold.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def default_mesh() -> Mesh:
    """A 1-D mesh named ``"data"`` over all devices of the job (global in multi-host runs)."""
    return Mesh(np.asarray(jax.devices()), (DATA_AXIS,))


def batch_spec(mesh: Mesh) -> P:
    """Partition spec splitting a leading batch axis over all mesh axes."""
    return P(tuple(mesh.axis_names))


def num_shards(mesh: Mesh) -> int:
    """Number of devices a batch is split over (the chunk size must be a multiple of it)."""
    return mesh.devices.size


def put_batch(mesh: Mesh, host: np.ndarray) -> jax.Array:
    """Global array ``[B, ...]`` split along axis 0 over ``mesh``, from a host array.

    Args:
      mesh: device mesh; ``B`` must be a multiple of ``num_shards(mesh)``.
      host: the full batch ``[B, ...]``, identical on every process of a multi-host job.
    """
    return _put(host, NamedSharding(mesh, batch_spec(mesh)))


def put_replicated(mesh: Mesh, tree):
    """Replicates a pytree of arrays on every device of ``mesh`` (every process passes the same)."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda leaf: _put(leaf, sharding), tree)


def _put(value, sharding: NamedSharding) -> jax.Array:
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    # Multi-host: each process materialises only the shards of its own devices.
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def fetch_replicated(tree):
    """Host copy of a pytree of fully replicated global arrays, valid on every process."""
    return jax.tree.map(lambda leaf: np.asarray(leaf.addressable_data(0)), tree)
