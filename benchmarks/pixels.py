"""Pixel-space certification throughput: cbcert's engine vs the reference PyTorch loop.

A converted ResNet-18 (random weights, every parameter and BN statistic drawn) classifies noisy
copies of an image as in Cohen et al.'s ``Smooth._sample_noise`` (locuslab/smoothing
``core.py``): repeat the image ``batch`` times, add ``σ · randn_like``, normalise, classify,
``bincount`` the argmax. The engine runs the same computation through
``cbcert.smooth(...).counts`` (noise drawn on device from per-sample keys, chunks sized by
``--max-memory``). Prints samples/s of both and the engine/PyTorch ratio at the loop's batch 8
and at its best batch, measured in one run, plus compilation time separately.

    python benchmarks/pixels.py --threads 2 --size 64 --samples 2048

Threads are pinned before jax and torch are imported and both flush denormals.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from resnet50_throughput import pin_threads  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--samples", type=int, default=2048, help="noisy samples per timing")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64, 128, 256],
                        help="PyTorch loop batch sizes")
    parser.add_argument("--sigma", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=2, help="timings per setting (best kept)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="engine samples per step (default: from --max-memory)")
    parser.add_argument("--max-memory", type=int, default=None,
                        help="engine bytes per step (default: the engine's, 8 MiB on CPU)")
    args = parser.parse_args()
    if min(args.threads, args.samples, min(args.batches), args.repeats) < 1 or args.size < 32:
        parser.error("need --threads, --samples, --batches, --repeats >= 1 and --size >= 32")
    return args


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    args = parse_args()
    pin_threads(args.threads)

    import jax
    import numpy as np
    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from test_convert_resnet import torch_resnet  # reference ResNet, torchvision key names

    import cbcert
    from cbcert.convert import convert

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    model = torch_resnet("resnet18", num_classes=1000, seed=0)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    rng = np.random.default_rng(0)
    image = rng.uniform(0, 1, (1, args.size, args.size, 3)).astype(np.float32)

    with tempfile.TemporaryDirectory() as tmp:
        torch.save(model.state_dict(), pathlib.Path(tmp) / "r18.pth")
        convert("resnet18", pathlib.Path(tmp) / "r18.pth", pathlib.Path(tmp) / "r18")
        np.savez(pathlib.Path(tmp) / "x.npz", x=image, y=np.zeros(1, np.int64))
        world = cbcert.load_world(f"pixels:{tmp}/x.npz", classifier=pathlib.Path(tmp) / "r18")
    smoothed = cbcert.smooth(world.latent_apply(("std",)), world.params,
                             cbcert.gaussian(args.sigma), chunk_size=args.chunk_size,
                             max_memory=args.max_memory)
    z = world.dataset.latents

    start = time.perf_counter()
    smoothed.counts(z, jax.random.key(0), args.samples)  # compiles
    first = time.perf_counter() - start
    engine_s = best_of(lambda: smoothed.counts(z, jax.random.key(1), args.samples), args.repeats)
    engine = args.samples / engine_s
    print(f"engine: {engine:8.1f} samples/s  (first call incl. compilation {first:.1f} s)",
          flush=True)

    x = torch.from_numpy(image.transpose(0, 3, 1, 2).copy())[0]
    mean_t, std_t = (torch.tensor(v).view(1, 3, 1, 1) for v in (mean, std))

    def reference_loop(batch_size: int) -> np.ndarray:
        counts = np.zeros(1000, np.int64)
        remaining = args.samples
        with torch.inference_mode():
            while remaining > 0:
                this_batch = min(batch_size, remaining)
                batch = x.repeat((this_batch, 1, 1, 1))
                noise = torch.randn_like(batch) * args.sigma
                predictions = model((batch + noise - mean_t) / std_t).argmax(1)
                counts += np.bincount(predictions.numpy(), minlength=1000)
                remaining -= this_batch
        return counts

    loop = {}
    for batch in args.batches:
        reference_loop(batch)  # warm-up
        loop[batch] = args.samples / best_of(lambda batch=batch: reference_loop(batch),
                                             args.repeats)
        print(f"torch loop batch {batch:4d}: {loop[batch]:8.1f} samples/s   engine / loop "
              f"{engine / loop[batch]:5.2f}", flush=True)
    best = max(loop, key=loop.get)
    if 8 in loop:
        print(f"\nengine / loop at batch 8: {engine / loop[8]:.2f}")
    print(f"engine / loop at its best batch ({best}): {engine / loop[best]:.2f}")
    import flax
    import jaxlib

    print(f"settings: resnet18, {args.size} px, σ = {args.sigma}, {args.samples} samples per "
          f"timing, best of {args.repeats}")
    print(f"versions: python {platform.python_version()}, jax {jax.__version__}, jaxlib "
          f"{jaxlib.__version__}, flax {flax.__version__}, torch {torch.__version__}, numpy "
          f"{np.__version__}; {platform.machine()} {os.cpu_count()} logical CPUs, "
          f"{args.threads} threads")
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))


if __name__ == "__main__":
    main()
