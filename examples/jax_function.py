"""Certify any jax.jit-able classifier: a Flax NNX MLP trained on two Gaussian blobs.

    python examples/jax_function.py [--n 10000] [--sigma 0.5]

Prints, per test point, Cohen et al.'s CERTIFY result: class (-1 = abstain) and L2 radius.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import cbcert


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(2, 32, rngs=rngs)
        self.out = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def train(steps: int) -> MLP:
    """A few Adam steps on blobs centred at (-1, 0) (class 0) and (1, 0) (class 1)."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    key = jax.random.key(1)
    y = jnp.arange(256) % 2
    x = jax.random.normal(key, (256, 2)) * 0.5 + jnp.stack([2.0 * y - 1, 0 * y], axis=1)

    @nnx.jit
    def step(model, optimizer):
        def loss(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        optimizer.update(model, nnx.grad(loss)(model))

    for _ in range(steps):
        step(model, optimizer)
    return model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--n0", type=int, default=100)
    parser.add_argument("--sigma", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)

    graphdef, params = nnx.split(train(args.steps))

    def apply_fn(params, x):  # pure: (params, x[B, 2]) -> logits[B, 2]
        return nnx.merge(graphdef, params)(x)

    smoothed = cbcert.smooth(apply_fn, params, cbcert.gaussian(args.sigma))
    points = jnp.array([[-2.0, 0.0], [-0.1, 0.0], [0.1, 0.5], [2.0, 1.0]])
    cert = smoothed.certify(points, jax.random.key(0), n0=args.n0, n=args.n, alpha=0.001)
    for point, label, radius in zip(points.round(2).tolist(), cert.prediction, cert.radius,
                                    strict=True):
        print(f"x = {point}: class {int(label):2d}, certified L2 radius {radius:.3f}")
    return {"prediction": cert.prediction, "radius": cert.radius}


if __name__ == "__main__":
    main()
