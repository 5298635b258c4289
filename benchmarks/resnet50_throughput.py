"""Throughput of a converted ResNet-50 under plain ``jax.jit`` vs the PyTorch reference, on CPU.

Random weights (every parameter and BN statistic drawn), 224x224 inputs, inference mode on both
sides; the converted model is checked against PyTorch before timing. Prints images/s per batch
size, the JAX/PyTorch ratio at batch 8 and at each side's best batch, the versions and the
command.

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
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for both frameworks")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    parser.add_argument("--min-seconds", type=float, default=4.0,
                        help="time each configuration at least this long (and >= 2 calls)")
    args = parser.parse_args()
    if args.threads < 1 or min(args.batches) < 1 or args.size < 32:
        parser.error(f"--threads={args.threads}, --batches={args.batches}, --size={args.size}; "
                     "need threads >= 1, batches >= 1, size >= 32")
    return args


def pin_threads(threads: int) -> None:
    """Must run before jax/torch are imported."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_cpu_multi_thread_eigen=true"
                               f" intra_op_parallelism_threads={threads}").strip()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(threads)


def time_calls(fn, min_seconds: float) -> float:
    """Seconds per call of ``fn()`` (after one warm-up call), over >= 2 calls and min_seconds."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    args = parse_args()
    pin_threads(args.threads)

    import jax
    import numpy as np
    import torch

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

    rows = []
    for batch in args.batches:
        x = rng.standard_normal((batch, args.size, args.size, 3)).astype(np.float32)
        x_jax = jax.device_put(x)
        x_torch = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
        jax_s = time_calls(lambda x_jax=x_jax: jitted(params, x_jax).block_until_ready(),
                           args.min_seconds)
        with torch.inference_mode():
            torch_s = time_calls(lambda x_torch=x_torch: reference(x_torch), args.min_seconds)
        rows.append((batch, batch / jax_s, batch / torch_s))
        print(f"batch {batch:4d}: jax {batch / jax_s:8.2f} img/s   torch {batch / torch_s:8.2f} "
              f"img/s   ratio {torch_s / jax_s:5.2f}", flush=True)

    by_batch = {b: (j, t) for b, j, t in rows}
    best_jax = max(rows, key=lambda r: r[1])
    best_torch = max(rows, key=lambda r: r[2])
    print(f"\nmax |logit difference| jax vs torch (batch 2, {args.size} px): {error:.2e}")
    if 8 in by_batch:
        j, t = by_batch[8]
        print(f"batch 8 ratio (jax / torch images/s): {j / t:.2f}")
    print(f"best-batch ratio: jax {best_jax[1]:.2f} img/s (batch {best_jax[0]}) / torch "
          f"{best_torch[2]:.2f} img/s (batch {best_torch[0]}) = {best_jax[1] / best_torch[2]:.2f}")
    import flax
    import jaxlib

    print(f"versions: python {platform.python_version()}, jax {jax.__version__}, jaxlib "
          f"{jaxlib.__version__}, flax {flax.__version__}, torch {torch.__version__}, numpy "
          f"{np.__version__}; {platform.machine()} {os.cpu_count()} logical CPUs, "
          f"{args.threads} threads")
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))


if __name__ == "__main__":
    main()
