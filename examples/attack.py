"""APGD-CE through generator and classifier, then the smoothed classifier at the attacked points.

    python examples/attack.py [--inputs 16] [--eps 0.1] [--sigma 0.1] [--iters 50]

Attacks ``f_std(g(z))`` in latent space within an L2 ball of radius ε (Croce & Hein's APGD),
then asks the Gaussian-smoothed classifier (σ) whether it still predicts the clean label at
the adversarial latents (``certify attack --smoothed`` attacks the smoothed classifier itself).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import cbcert
from cbcert.runs.pool import agreement_pool


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=16)
    parser.add_argument("--eps", type=float, default=0.1)
    parser.add_argument("--sigma", type=float, default=0.1)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--n", type=int, default=500)
    args = parser.parse_args(argv)

    world = cbcert.load_world("default")
    pool = agreement_pool(world, 0, args.inputs)
    apply_fn = world.latent_apply(("std",))
    params = world.params

    def logits_fn(z):  # [B, d] -> [B, C]
        return apply_fn(params, z)[:, 0]

    z_adv, info = cbcert.apgd(logits_fn, jnp.asarray(pool.latents), jnp.asarray(pool.labels),
                              eps=args.eps, norm="l2", key=jax.random.key(1), n_iter=args.iters)
    print(f"vanilla f_std: {np.mean(info.fooled):.1%} of {args.inputs} inputs fooled at "
          f"L2 ε = {args.eps}")
    smoothed = cbcert.smooth(apply_fn, params, cbcert.gaussian(args.sigma))
    pred = smoothed.predict(np.asarray(z_adv), jax.random.key(2), n=args.n, alpha=0.001)
    kept = pred.prediction[:, 0] == pool.labels
    print(f"smoothed (σ = {args.sigma}): keeps the clean label on {kept.mean():.1%} of the "
          f"attacked latents (abstains on {(pred.prediction[:, 0] == cbcert.ABSTAIN).mean():.1%})")
    return {"fooled": np.asarray(info.fooled), "kept": kept}


if __name__ == "__main__":
    main()
