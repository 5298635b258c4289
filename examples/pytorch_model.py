"""A PyTorch model in cbcert: convert its state_dict once, then certify it in JAX (no torch).

    python examples/pytorch_model.py [--checkpoint resnet18.pth] [--size 64] [--n 1000]

Without ``--checkpoint`` it saves torchvision's ``resnet18()`` (random weights; needs
torchvision). ``cbcert.convert.convert`` checks every key and shape against the architecture
(the same as ``certify convert resnet18 …``); ``cbcert.load_converted`` then gives a pure
``(apply_fn, params)`` that cbcert smooths like any JAX function.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import numpy as np

import cbcert


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a torchvision resnet18 state_dict")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=0.25)
    parser.add_argument("--n0", type=int, default=100)
    parser.add_argument("--n", type=int, default=1000)
    args = parser.parse_args(argv)

    from cbcert.convert import convert  # needs torch: the write side only

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            import torch
            import torchvision

            checkpoint = Path(tmp) / "resnet18.pth"
            torch.save(torchvision.models.resnet18().state_dict(), checkpoint)
        convert("resnet18", checkpoint, Path(tmp) / "r18")
        apply_fn, params, manifest = cbcert.load_converted(Path(tmp) / "r18")

    images = np.random.default_rng(0).uniform(0, 1, (3, args.size, args.size, 3))
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])

    def classify(params, x):  # noise is added in pixel space, normalisation after it
        return apply_fn(params, (x - mean.astype(x.dtype)) / std.astype(x.dtype))

    smoothed = cbcert.smooth(classify, params, cbcert.gaussian(args.sigma))
    cert = smoothed.certify(images.astype(np.float32), jax.random.key(0), n0=args.n0, n=args.n,
                            alpha=0.001)
    print(f"{manifest['kind']} ({manifest['params_sha256'][:12]}): predictions "
          f"{cert.prediction.tolist()}, radii {np.round(cert.radius, 3).tolist()}")
    return {"prediction": cert.prediction, "radius": cert.radius}


if __name__ == "__main__":
    main()
