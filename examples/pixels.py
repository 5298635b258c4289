"""Pixel-space certification of your images (Cohen et al.'s setting) with a converted classifier.

    certify convert resnet18 resnet18.pth r18         # once, where torch is installed
    python examples/pixels.py --images data.npz --classifier r18 [--sigma 0.25] [--n 1000]

``data.npz`` holds ``x[N, H, W, 3]`` in [0, 1] and ``y[N]``. Prints locuslab/smoothing's
columns (idx, label, predict, radius, correct). The CLI equivalent writes records and the TSV:
``certify latent --world pixels:data.npz --classifier r18 --sigma 0.25 --export cohen``.
"""

from __future__ import annotations

import argparse

import jax

import cbcert


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", required=True)
    parser.add_argument("--classifier", required=True)
    parser.add_argument("--normalize", default="imagenet", choices=["imagenet", "cifar10", "none"])
    parser.add_argument("--sigma", type=float, default=0.25, help="pixel units on [0, 1]")
    parser.add_argument("--n0", type=int, default=100)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--alpha", type=float, default=0.001)
    args = parser.parse_args(argv)

    world = cbcert.load_world(f"pixels:{args.images}", classifier=args.classifier,
                              normalize=args.normalize)
    smoothed = cbcert.smooth(world.latent_apply(("std",)), world.params,
                             cbcert.gaussian(args.sigma))
    x, y = world.dataset.latents, world.dataset.labels  # flattened images, labels
    cert = smoothed.certify(x, jax.random.key(0), n0=args.n0, n=args.n, alpha=args.alpha)
    print("idx\tlabel\tpredict\tradius\tcorrect")
    for i, (label, pred, radius) in enumerate(zip(y, cert.prediction[:, 0], cert.radius[:, 0],
                                                  strict=True)):
        shown = 0.0 if pred == cbcert.ABSTAIN else radius
        print(f"{i}\t{label}\t{pred}\t{shown:.3}\t{int(pred == label)}")
    return {"prediction": cert.prediction[:, 0], "radius": cert.radius[:, 0], "labels": y}


if __name__ == "__main__":
    main()
