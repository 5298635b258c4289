"""XLA:CPU compile time and run time with cbcert's compiler options vs XLA's defaults.

cbcert compiles its programs with ``xla_cpu_use_fusion_emitters=false`` on CPU
(`cbcert.engine.compiler`). For each program below this script lowers it once and compiles it
twice, with XLA's defaults (the fusion emitters) and with cbcert's options, then prints

* the compile time of each (seconds, the faster of two compilations made alternately; the
  persistent cache is off here);
* the run time per call, both compiled programs called alternately in ``--rounds`` rounds
  (`benchmarks/timing.py`), and the median per-round ratio;
* the largest absolute difference of the outputs relative to their largest magnitude, and for
  logits the argmax agreement: the two compilers order float operations differently.

Programs: the built-in world's four classifiers on generated images (the sampler's work, chunk
16), the gradient of the cross-entropy of those logits with respect to the latent (APGD's work,
chunk 8), and a ResNet-50 with random weights at ``--size`` pixels (batch 8).

    PYTHONPATH=. python benchmarks/compiler_options.py [--rounds 5] [--size 64] [--cases ...]

Timings are measurements of a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

CASES = ("world", "world-gradient", "resnet50")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (default 5)")
    parser.add_argument("--seconds", type=float, default=0.5,
                        help="minimum seconds per contender per round (default 0.5)")
    parser.add_argument("--size", type=int, default=64, help="ResNet-50 image side (default 64)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                        help="programs to measure (default: all)")
    args = parser.parse_args()
    for flag, value, low in (("--rounds", args.rounds, 1), ("--size", args.size, 32)):
        if value < low:
            parser.error(f"{flag}={value}; allowed: an integer >= {low}")
    if args.seconds <= 0:
        parser.error(f"--seconds={args.seconds}; allowed: > 0")
    return args


def programs(cases, size: int):
    """``name -> (function, arguments, what the output is)`` for each requested case."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cbcert.models.resnet import ResNet, ResNetConfig
    from cbcert.worlds.builtin import load_builtin

    out = {}
    if {"world", "world-gradient"} & set(cases):
        world = load_builtin("default")
        apply = world.latent_apply(world.model_names)  # (params, z[B, d]) -> logits[B, H, C]
        d = world.generator.latent_dim
        if "world" in cases:
            z = jax.random.normal(jax.random.key(0), (16, d))
            out["world"] = (apply, (world.params, z), "logits")

        def gradient(params, z):
            def loss(z):
                logits = apply(params, z)  # [B, H, C]
                return -jnp.sum(jax.nn.log_softmax(logits)[..., 0])
            return jax.grad(loss)(z)

        if "world-gradient" in cases:
            z = jax.random.normal(jax.random.key(1), (8, d))
            out["world-gradient"] = (gradient, (world.params, z), "gradient")
    if "resnet50" in cases:
        model = ResNet(ResNetConfig.from_name("resnet50"), rngs=nnx.Rngs(0))
        model.eval()
        graphdef, state = nnx.split(model)

        def resnet(state, x):
            return nnx.merge(graphdef, state)(x)

        x = jax.random.uniform(jax.random.key(2), (8, size, size, 3))
        out["resnet50"] = (resnet, (state, x), "logits")
    return out


def main() -> None:
    args = parse_args()
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # time compilations, not cache loads
    import jax
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timing import format_ratio, interleaved, median

    from cbcert.engine.compiler import CPU_OPTIONS, XLA_DEFAULTS

    jax.config.update("jax_enable_compilation_cache", False)
    print(f"versions: python {platform.python_version()}, jax {jax.__version__}; "
          f"{platform.machine()}, {os.cpu_count()} logical CPUs; backend {jax.default_backend()}")
    if jax.default_backend() != "cpu":
        print(f"backend {jax.default_backend()}: cbcert passes no compiler options there, "
              "nothing to compare")
        return
    # Both named explicitly: compile options override XLA_FLAGS, so the comparison holds
    # whatever the environment says.
    print(f"cbcert's options {CPU_OPTIONS} vs XLA's defaults {XLA_DEFAULTS}; {args.rounds} "
          f"rounds, {args.seconds} s per contender per round")
    for name, (fn, fn_args, what) in programs(args.cases, args.size).items():
        compiled, seconds = {}, {}
        for _ in range(2):  # each compiled twice, alternately: the faster of two is reported
            for label, opts in (("XLA defaults", XLA_DEFAULTS), ("cbcert", CPU_OPTIONS)):
                jax.clear_caches()  # else the second compilation is a lookup
                lowered = jax.jit(fn).lower(*fn_args)
                start = time.perf_counter()
                compiled[label] = lowered.compile(compiler_options=opts)
                seconds[label] = min(seconds.get(label, np.inf), time.perf_counter() - start)
        outputs = {label: np.asarray(c(*fn_args)) for label, c in compiled.items()}
        a, b = outputs["XLA defaults"], outputs["cbcert"]
        scale = float(np.abs(a).max()) or 1.0
        agreement = ""
        if what == "logits":
            same = (a.argmax(-1) == b.argmax(-1))
            agreement = f", argmax agreement {int(same.sum())}/{same.size}"

        def work(c, fn_args=fn_args):
            return lambda: (jax.block_until_ready(c(*fn_args)), 1)[1]

        rates, _ = interleaved({label: work(c) for label, c in compiled.items()},
                               args.rounds, args.seconds)
        print(f"{name}: compile {seconds['XLA defaults']:.2f} s -> {seconds['cbcert']:.2f} s "
              f"(speed-up x{seconds['XLA defaults'] / seconds['cbcert']:.2f}); run "
              f"{1e3 / median(rates['XLA defaults']):.2f} ms -> {1e3 / median(rates['cbcert']):.2f}"
              f" ms per call, speed {format_ratio(rates['cbcert'], rates['XLA defaults'])}; "
              f"max |Δ {what}| {float(np.abs(a - b).max()):.1e} of {scale:.1e}{agreement}")


if __name__ == "__main__":
    main()
