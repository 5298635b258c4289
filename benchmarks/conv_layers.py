"""Where the engine's CPU time goes in a network's convolutions: every shape, engine vs PyTorch.

For each distinct convolution of ``--net`` at ``--size`` px, times convolution + inference batch
norm + ReLU at batch ``--batch``. Networks: ``resnet50`` — torchvision's ResNet-50 (stem, and per
stage the bottleneck's 1x1 / 3x3 / 1x1 and the projection shortcut); ``world`` — the built-in
world's classifiers (`cbcert.models.world_classifiers`: stem, one basic block per stage with
its projection, the prototype head's two 1x1 add-on layers; their convolutions carry a bias,
not a batch norm: a per-channel scale and shift either way). Paths:

* ``engine`` — ``cbcert.nn.layers.conv``, the path the ported models take on this backend
  (patch matmul or XLA's native convolution, ``native_is_faster``), BN folded to a scale and
  shift that XLA fuses into the convolution's output loop;
* ``native`` — ``lax.conv_general_dilated`` always;
* ``patches`` — ``cbcert.nn.layers.conv_patches`` always (im2col + one matmul);
* ``torch`` — ``Conv2d`` + ``BatchNorm2d`` + ``ReLU`` in inference mode (oneDNN on CPU).

Every path is checked against PyTorch first (max |Δ| relative to max |output| ≤ 1e-4, float32;
exit 1 otherwise). Timing follows ``benchmarks/timing.py``: every contender once per round, the
order rotated, ``--rounds`` rounds, medians. Printed per shape: milliseconds of each path, GFLOP/s
of the engine's path and of PyTorch's, and the engine's time minus PyTorch's weighted by how
often the shape occurs in the network (its share of the whole-network gap); then the totals and
a float32 matmul reference (a 2048³ product in XLA and in PyTorch) as the machine's practical
peak.

    PYTHONPATH=. python benchmarks/conv_layers.py --batch 16 --rounds 3
    PYTHONPATH=. python benchmarks/conv_layers.py --net world --size 32 --batch 32

Threads are pinned before jax and torch are imported; both flush denormals.
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
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--net", choices=("resnet50", "world"), default="resnet50",
                        help="whose convolution shapes (default: resnet50)")
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    parser.add_argument("--min-seconds", type=float, default=0.4,
                        help="time each path at least this long in each round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.threads < 1 or args.batch < 1 or args.size < 32 or args.rounds < 1 \
            or args.min_seconds < 0:
        parser.error(f"--threads={args.threads}, --batch={args.batch}, --size={args.size}, "
                     f"--rounds={args.rounds}, --min-seconds={args.min_seconds}; need threads, "
                     "batch, rounds >= 1, size >= 32, min-seconds >= 0")
    return args


def resnet50_convolutions(size: int) -> dict[tuple[int, int, int, int, int], int]:
    """``{(cin, cout, kernel, stride, input side): occurrences}`` of torchvision's ResNet-50
    (bottleneck v1.5: the stride sits on the 3x3) at ``size`` px input."""
    shapes: dict[tuple[int, int, int, int, int], int] = {}

    def add(shape):
        shapes[shape] = shapes.get(shape, 0) + 1

    side = (size + 2 * 3 - 7) // 2 + 1
    add((3, 64, 7, 2, size))
    side = (side + 2 - 3) // 2 + 1  # max pool 3x3, stride 2, padding 1
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for block in range(blocks):
            s = stride if block == 0 else 1
            out_side = (side + 2 - 3) // s + 1
            add((cin, width, 1, 1, side))
            add((width, width, 3, s, side))
            add((width, width * 4, 1, 1, out_side))
            if block == 0:
                add((cin, width * 4, 1, s, side))
            cin, side = width * 4, out_side
    return shapes


def world_convolutions(size: int) -> dict[tuple[int, int, int, int, int], int]:
    """``{(cin, cout, kernel, stride, input side): occurrences}`` of the built-in world's
    classifiers (`NetConfig` defaults: widths 24/48/96, prototype_dim 32) at ``size`` px."""
    from cbcert.models.world_classifiers import NetConfig

    config = NetConfig()
    w1, w2, w3 = config.widths
    d = config.prototype_dim
    shapes = {(3, w1, 3, 1, size): 1, (w1, w1, 3, 1, size): 2}  # stem, stage 1
    shapes[(w1, w2, 3, 2, size)] = 1  # stage 2: conv1, its projection, conv2
    shapes[(w1, w2, 1, 2, size)] = 1
    shapes[(w2, w2, 3, 1, size // 2)] = 1
    shapes[(w2, w3, 3, 2, size // 2)] = 1  # stage 3
    shapes[(w2, w3, 1, 2, size // 2)] = 1
    shapes[(w3, w3, 3, 1, size // 4)] = 1
    shapes[(w2, d, 1, 1, size // 2)] = 1  # prototype add-on layers on the stage-2 map
    shapes[(d, d, 1, 1, size // 2)] = 1
    return shapes


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from resnet50_throughput import pin_threads

    pin_threads(args.threads)  # before jax and torch are imported

    import jax
    import jax.numpy as jnp
    import numpy as np
    import timing
    import torch

    from cbcert.nn.layers import conv, conv_patches

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    rng = np.random.default_rng(0)
    paths = {
        "engine": lambda x, w, s, p: conv(x, w, s, p),
        "native": lambda x, w, s, p: jax.lax.conv_general_dilated(
            x, w, (s, s), [(p, p), (p, p)], dimension_numbers=("NHWC", "HWIO", "NHWC")),
        "patches": lambda x, w, s, p: conv_patches(x, w, s, p),
    }
    net, convolutions = {"resnet50": ("ResNet-50", resnet50_convolutions),
                         "world": ("built-in world classifiers", world_convolutions)}[args.net]
    print(f"{net} convolutions at {args.size} px, batch {args.batch}, conv + BN + ReLU, "
          f"ms (median of {args.rounds} interleaved rounds)")
    print(f"{'cin cout k s side':>22} {'count':>5} {'engine':>8} {'native':>8} {'patches':>8} "
          f"{'torch':>8} {'GFLOP/s engine':>15} {'torch':>6} {'gap ms x count':>15}")
    totals = dict.fromkeys([*paths, "torch"], 0.0)
    failures = []
    for (cin, cout, k, stride, side), count in convolutions(args.size).items():
        pad = k // 2
        x = rng.standard_normal((args.batch, side, side, cin)).astype(np.float32)
        w = (rng.standard_normal((k, k, cin, cout)) / np.sqrt(k * k * cin)).astype(np.float32)
        bn = torch.nn.BatchNorm2d(cout).eval()
        with torch.no_grad():
            bn.running_mean.copy_(torch.from_numpy(rng.standard_normal(cout).astype(np.float32)))
            bn.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2, cout).astype(np.float32)))
            bn.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, cout).astype(np.float32)))
            bn.bias.copy_(torch.from_numpy(rng.standard_normal(cout).astype(np.float32)))
        scale = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach().numpy()
        shift = (bn.bias.detach().numpy() - bn.running_mean.numpy() * scale)
        layer = torch.nn.Conv2d(cin, cout, k, stride, pad, bias=False).eval()
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(w.transpose(3, 2, 0, 1).copy()))
        reference = torch.nn.Sequential(layer, bn, torch.nn.ReLU(inplace=True)).eval()
        x_torch = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
        with torch.inference_mode():
            expected = reference(x_torch).numpy().transpose(0, 2, 3, 1)
        x_jax, w_jax = jnp.asarray(x), jnp.asarray(w)
        contenders = {}
        for name, path in paths.items():
            def layer_fn(x, w, path=path, stride=stride, pad=pad, scale=scale, shift=shift):
                return jax.nn.relu(path(x, w, stride, pad) * scale + shift)

            fn = jax.jit(layer_fn)
            error = float(np.abs(np.asarray(fn(x_jax, w_jax)) - expected).max())
            if error > 1e-4 * float(np.abs(expected).max()):
                failures.append(f"{name} {(cin, cout, k, stride, side)}: max |Δ| {error:.2e}")

            def work(fn=fn, x_jax=x_jax, w_jax=w_jax):
                fn(x_jax, w_jax).block_until_ready()
                return 1

            contenders[name] = work

        def torch_work(reference=reference, x_torch=x_torch):
            with torch.inference_mode():
                reference(x_torch)
            return 1

        contenders["torch"] = torch_work
        rates, _ = timing.interleaved(contenders, args.rounds, args.min_seconds)
        ms = {name: 1e3 / timing.median(r) for name, r in rates.items()}
        for name in totals:
            totals[name] += ms[name] * count
        out_side = (side + 2 * pad - k) // stride + 1
        gflop = 2 * args.batch * out_side**2 * k * k * cin * cout / 1e9
        print(f"{cin:5d} {cout:4d} {k:2d} {stride:2d} {side:4d} {count:5d} "
              + " ".join(f"{ms[n]:8.2f}" for n in ("engine", "native", "patches", "torch"))
              + f" {gflop / ms['engine'] * 1e3:15.0f} {gflop / ms['torch'] * 1e3:6.0f}"
              f" {(ms['engine'] - ms['torch']) * count:+15.2f}", flush=True)
    print("whole network (each shape times its count), ms: "
          + ", ".join(f"{name} {v:.1f}" for name, v in totals.items())
          + f"; torch/engine x{totals['torch'] / totals['engine']:.2f}")

    a = rng.standard_normal((2048, 2048)).astype(np.float32)
    matmul = jax.jit(jnp.dot)
    a_jax, a_torch = jnp.asarray(a), torch.from_numpy(a)
    rates, _ = timing.interleaved(
        {"xla": lambda: (matmul(a_jax, a_jax).block_until_ready(), 1)[1],
         "torch": lambda: (torch.mm(a_torch, a_torch), 1)[1]}, args.rounds, 1.0)
    print("float32 matmul 2048^3, GFLOP/s: " + ", ".join(
        f"{name} {2 * 2048**3 * timing.median(r) / 1e9:.0f}" for name, r in rates.items()))
    print(f"versions: python {platform.python_version()}, jax {jax.__version__}, torch "
          f"{torch.__version__}; {platform.machine()} {os.cpu_count()} logical CPUs, "
          f"{args.threads} threads")
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    if failures:
        print("PARITY FAILURE: " + "; ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
