"""Latent-space certification on the built-in world through the Python API.

    python examples/latent.py [--inputs 20] [--n 1000] [--sigma 0.1]

The same numbers as ``certify latent --sigma 0.1 --inputs 20 --models std,cbm,proto`` (the
CLI's records for these inputs): the pool's agreement set, the root key ``jax.random.key(seed)``
and the pool indices keep every sample's noise identical.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

import cbcert
from cbcert.runs.pool import agreement_pool  # the CLI's input pool (std/cbm agreement set)

MODELS = ("std", "cbm", "proto")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=20)
    parser.add_argument("--n0", type=int, default=100)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--sigma", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    world = cbcert.load_world("default")
    pool = agreement_pool(world, args.seed, args.inputs)
    smoothed = cbcert.smooth(world.latent_apply(MODELS), world.params,
                             cbcert.gaussian(args.sigma))
    cert = smoothed.certify(pool.latents, jax.random.key(args.seed), n0=args.n0, n=args.n,
                            alpha=0.001, indices=pool.indices)  # fields [inputs, models]
    correct = cert.prediction == pool.labels[:, None]
    radius = np.where(correct, np.nan_to_num(cert.radius), 0.0)
    for h, model in enumerate(MODELS):
        print(f"{model:6s} SmAcc {correct[:, h].mean():6.1%}  ACR {radius[:, h].mean():.3f}")
    return {"prediction": cert.prediction, "radius": cert.radius, "labels": pool.labels}


if __name__ == "__main__":
    main()
