"""Throughput of a converted ResNet-50 under plain ``jax.jit`` vs the PyTorch reference, on CPU.

Random weights (every parameter and BN statistic drawn), 224x224 inputs, inference mode on both
sides; the converted model is checked against PyTorch before timing. Prints images/s per batch
size (median over ``--rounds`` interleaved rounds, `benchmarks/timing.py`), the JAX/PyTorch
ratio at each batch and at each side's best batch (median of per-round ratios, with range), the
versions and the command.

    python benchmarks/resnet50_throughput.py --threads 2 --batches 8 16 32

Threads are pinned before jax and torch are imported (XLA's Eigen pool and torch's intra-op
pool get the same count) and both flush denormals, so the comparison is per-core fair.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for both frameworks")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    parser.add_argument("--min-seconds", type=float, default=3.0,
                        help="time each configuration at least this long in each round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of interleaved timing (every configuration once per round)")
    args = parser.parse_args()
    if args.threads < 1 or min(args.batches) < 1 or args.size < 32 or args.rounds < 1:
        parser.error(f"--threads={args.threads}, --batches={args.batches}, --size={args.size}, "
                     f"--rounds={args.rounds}; need threads >= 1, batches >= 1, size >= 32, "
                     "rounds >= 1")
    return args


def pin_threads(threads: int) -> None:
    """Must run before jax/torch are imported."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_cpu_multi_thread_eigen=true"
                               f" intra_op_parallelism_threads={threads}").strip()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(threads)


def main() -> None:
    args = parse_args()
    pin_threads(args.threads)

    import jax
    import numpy as np
    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import timing

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from test_convert_resnet import state_dict_numpy, torch_resnet  # reference, no torchvision

    from cbcert.convert.torchvision import resnet_from_state_dict
    from cbcert.io.registry import pure_apply

    torch.set_num_threads(args.threads)
    # XLA's CPU runtime flushes denormals to zero; torch must too, or random-weight activations
    # in the denormal range would measure the FPU's slow path instead of the kernels.
    torch.set_flush_denormal(True)
    reference = torch_resnet("resnet50", num_classes=1000, seed=0)
    model = resnet_from_state_dict("resnet50", state_dict_numpy(reference))
    apply_fn, params = pure_apply(model)
    jitted = jax.jit(apply_fn)

    rng = np.random.default_rng(0)
    check = rng.standard_normal((2, args.size, args.size, 3)).astype(np.float32)
    with torch.inference_mode():
        expected = reference(torch.from_numpy(check.transpose(0, 3, 1, 2).copy())).numpy()
    error = float(np.abs(np.asarray(jitted(params, check)) - expected).max())

    # Every configuration once per round, the order rotated each round (benchmarks/timing.py):
    # ratios are taken within a round, so a load change between configurations cancels out.
    contenders = {}
    for batch in args.batches:
        x = rng.standard_normal((batch, args.size, args.size, 3)).astype(np.float32)
        x_jax = jax.device_put(x)
        x_torch = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())

        def jax_work(x_jax=x_jax, batch=batch):
            jitted(params, x_jax).block_until_ready()
            return batch

        def torch_work(x_torch=x_torch, batch=batch):
            with torch.inference_mode():
                reference(x_torch)
            return batch

        contenders[f"jax {batch}"], contenders[f"torch {batch}"] = jax_work, torch_work
    rates, _ = timing.interleaved(contenders, args.rounds, args.min_seconds)
    for batch in args.batches:
        j, t = rates[f"jax {batch}"], rates[f"torch {batch}"]
        print(f"batch {batch:4d}: jax {timing.median(j):8.2f} img/s   torch "
              f"{timing.median(t):8.2f} img/s   jax/torch {timing.format_ratio(j, t)}", flush=True)
    best_jax = max(args.batches, key=lambda b: timing.median(rates[f"jax {b}"]))
    best_torch = max(args.batches, key=lambda b: timing.median(rates[f"torch {b}"]))
    print(f"\nmax |logit difference| jax vs torch (batch 2, {args.size} px): {error:.2e}")
    print(f"best-batch ratio: jax batch {best_jax} / torch batch {best_torch} "
          f"{timing.format_ratio(rates[f'jax {best_jax}'], rates[f'torch {best_torch}'])} "
          f"(medians over rounds: samples/s per batch above)")
    import flax
    import jaxlib

    print(f"versions: python {platform.python_version()}, jax {jax.__version__}, jaxlib "
          f"{jaxlib.__version__}, flax {flax.__version__}, torch {torch.__version__}, numpy "
          f"{np.__version__}; {platform.machine()} {os.cpu_count()} logical CPUs, "
          f"{args.threads} threads")
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))


if __name__ == "__main__":
    main()
