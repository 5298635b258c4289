"""The uniform draws of ``--bound randomized``, keyed like every other draw.

The randomized Clopper–Pearson bound (`cbcert.certify.bounds.randomized_clopper_pearson_lower`)
is valid because its uniform ``u`` is independent of the votes; the draw of input ``i`` comes
from the run's root key, ``fold_in(fold_in(root, Stream.BOUND), i)``, so it is the same whatever
the batch, chunk, schedule or resume point, and a rerun with the same ``--seed`` reproduces the
certificate bit for bit.
"""

from __future__ import annotations

import jax
import numpy as np

from cbcert.engine.keys import Stream, stream_key

BOUNDS = ("clopper_pearson", "randomized")


def bound_uniforms(root: jax.Array, indices) -> np.ndarray:
    """``[N]`` float64 draws ``u_i = (b_i + 1/2) / 2³²`` in (0, 1), ``b_i`` the uint32 bits of
    ``fold_in(stream_key(root, Stream.BOUND), indices[i])`` (exact in float64).

    Args:
      root: the run's root key (typed or raw). indices: ``[N]`` global input indices.
    """
    key = stream_key(root, Stream.BOUND)
    idx = np.asarray(indices, np.uint32)
    bits = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), (), np.uint32))(idx)
    return (np.asarray(bits, np.float64) + 0.5) / 2.0**32


__all__ = ["BOUNDS", "bound_uniforms"]
