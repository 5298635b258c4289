"""The README's main command as a benchmark: ``certify latent --sigma 0.1`` on the built-in world.

Part 1, the command: runs ``certify latent --sigma 0.1`` in this process exactly as the CLI
does (``cbcert.cli.main``, a fresh output directory, ``--quiet``), with the wall time of each
stage and the XLA compilation inside it (JAX's monitoring events), the total, and the samples
per second of the estimation stage. The stages are timed with ``--units-at-once 1`` (one batch
of inputs at a time: stages of batches running side by side would overlap); then the command
runs again as users run it (its batches two at a time on CPU, `cbcert.runs.units`) and its
total is printed beside the staged one:

* pool: the agreement pool (latents drawn, images rendered and classified, std/cbm agreement);
* inputs: the clean inputs in the perturbation space;
* selection: PREDICT's ``n0`` samples per input (``count_classes``);
* estimation: ESTIMATE's ``n`` samples per input (``count_classes``);
* bounds: Clopper–Pearson bounds and radii of every (input, model), the rest of
  ``certify_heads``;
* the rest: records, summary, run directory (the command's total minus the stages above).

Part 2, the nets (``--no-torch`` skips it): the engine's ``count_classes`` on the world's
pipeline (generator + the main job's models on the same noisy latent, the chunk the command
uses) against a PyTorch loop over the same nets (``benchmarks/world_torch.py``, loaded with the
same weights) and the same noise law, PyTorch at ``--batches`` (8-512), then interleaved rounds of
PyTorch at its best batch and the engine; samples/s, the median per-round ratio. bf16
(``--dtype bfloat16``, and PyTorch's bf16 autocast) is timed only where ``lscpu`` shows bf16
units (``avx512_bf16`` or ``amx_bf16``); elsewhere the script says so and makes no bf16 claim.

Part 3, the shared work (``--no-sharing`` skips it): the main job's models judged on the same
noisy samples in one pass (one rendering, one backbone on the built-in world, every head on its
features: what ``certify latent`` runs) against one engine pass per model (each renders the
images and runs its own backbone), interleaved rounds, each at its automatic chunk; samples/s
counts a noisy latent judged by every model once, and the ratio is what sharing saves.

    PYTHONPATH=. python benchmarks/main_job.py                  # the full main job, ~3 min
    PYTHONPATH=. python benchmarks/main_job.py --inputs 10      # a shorter command
    PYTHONPATH=. python benchmarks/main_job.py --rounds 5 --no-command
    PYTHONPATH=. python benchmarks/main_job.py --no-command --no-torch      # part 3 only
    PYTHONPATH=. python benchmarks/main_job.py --inputs 1 --num 32 --batches 8 16   # smoke run

Timings are measurements of a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=None,
                        help="--inputs of the command (default: the CLI's, 100)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (default 3)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="minimum seconds per contender per round (default 2)")
    parser.add_argument("--num", type=int, default=512,
                        help="part 2: noisy samples per latent per pass (default 512)")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128, 512],
                        help="part 2: PyTorch batch sizes swept (default 8 32 128 512)")
    parser.add_argument("--no-command", action="store_true", help="skip part 1")
    parser.add_argument("--no-torch", action="store_true", help="skip part 2")
    parser.add_argument("--no-sharing", action="store_true", help="skip part 3")
    args = parser.parse_args()
    for flag, value in (("--rounds", args.rounds), ("--inputs", args.inputs),
                        ("--num", args.num), ("--batches", min(args.batches))):
        if value is not None and value < 1:
            parser.error(f"{flag}={value}; allowed: an integer >= 1")
    if args.seconds <= 0:
        parser.error(f"--seconds={args.seconds}; allowed: > 0")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cbcert.runs.machine import cpu_description  # noqa: E402

# ------------------------------------------------------------------------ the machine


def has_bf16_units(flags: list[str]) -> bool:
    return "avx512_bf16" in flags or "amx_bf16" in flags


# ------------------------------------------------------------------------ part 1: the command


class StageClock:
    """Wall time and XLA compile time per named stage; stages nest (the innermost one is
    charged), and compile events are charged to the stage running when they arrive."""

    def __init__(self):
        self.wall = collections.Counter()
        self.compile = collections.Counter()
        self.calls = collections.Counter()
        self.stack: list[str] = []
        self.active = True
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event: str, duration: float, **kwargs) -> None:
        del kwargs
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.compile[self.stack[-1] if self.stack else "the rest"] += duration

    @contextlib.contextmanager
    def stage(self, name: str):
        outer = self.stack[-1] if self.stack else None
        self.stack.append(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.stack.pop()
            self.wall[name] += seconds
            self.calls[name] += 1
            if outer is not None:
                self.wall[outer] -= seconds  # the inner stage is not the outer one's time

    def wrap(self, module, name: str, stage) -> None:
        """Replace ``module.name`` with a timed call; ``stage(*args, **kwargs)`` names it."""
        original = getattr(module, name)

        def timed(*args, **kwargs):
            if not self.active:  # no longer timing (threads would interleave the stack)
                return original(*args, **kwargs)
            with self.stage(stage(*args, **kwargs)):
                return original(*args, **kwargs)

        setattr(module, name, timed)


def run_command(inputs: int | None) -> dict:
    """``certify latent --sigma 0.1 [--inputs N]`` in-process; prints and returns its stages."""
    from click.testing import CliRunner

    from cbcert.certify import monte_carlo
    from cbcert.cli import main
    from cbcert.runs import certify

    clock = StageClock()
    job = certify.CertifyJob(noise="gaussian", scale=0.1)  # the CLI's defaults
    clock.wrap(certify, "agreement_pool", lambda *a, **k: "pool")
    clock.wrap(certify, "space_inputs", lambda *a, **k: "inputs")
    clock.wrap(certify, "certify_heads", lambda *a, **k: "bounds")
    clock.wrap(monte_carlo, "count_classes",
               lambda *a, **k: "selection" if a[5] == job.n0 else "estimation")
    args = ["latent", "--sigma", "0.1", "--quiet"]
    if inputs is not None:
        args += ["--inputs", str(inputs)]
    num_inputs = inputs or job.num_inputs

    def command(*extra: str) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            result = CliRunner().invoke(main, [*args, *extra, "--out", str(Path(tmp) / "run")])
            seconds = time.perf_counter() - start
        if result.exit_code != 0:
            raise SystemExit(f"`certify {' '.join([*args, *extra])}` failed:\n{result.output}")
        return seconds

    total = command("--units-at-once", "1")
    clock.active = False
    rest = total - sum(clock.wall.values())
    compile_total = sum(clock.compile.values())
    print(f"\n1. `certify {' '.join(args)} --units-at-once 1`: {total:.1f} s in all, "
          f"{compile_total:.1f} s of it "
          f"XLA compilation ({num_inputs} inputs, models {','.join(job.models)}, n0 "
          f"{job.n0}, n {job.n})")
    for name in ("pool", "inputs", "selection", "estimation", "bounds"):
        print(f"   {name:<11} {clock.wall[name]:7.2f} s  (compile {clock.compile[name]:6.2f} s, "
              f"{clock.calls[name]} call(s))")
    print(f"   {'the rest':<11} {rest:7.2f} s  (compile {clock.compile['the rest']:6.2f} s): "
          "records, summary, run directory, imports of the command")
    steady = clock.wall["estimation"] - clock.compile["estimation"]
    samples = num_inputs * job.n
    if steady > 0:
        print(f"   estimation: {samples} samples of {len(job.models)} models, "
              f"{samples / steady:.0f} samples/s without its compilation")
    default = command()  # compiled programs are in JAX's caches now: compare steady totals
    again = command("--units-at-once", "1")
    print(f"   as users run it (batches two at a time on CPU): {default:.1f} s, against "
          f"{again:.1f} s one at a time, both after the first run's compilation: "
          f"x{again / default:.2f}")
    return {"total": total, "compile": compile_total, "default": default, **clock.wall}


# ------------------------------------------------------------------------ parts 2 and 3: the nets


def engine_inputs(world) -> tuple[tuple[str, ...], np.ndarray, jax.Array]:
    """What parts 2 and 3 sample from: the main job's models, two clean latents ``[2, d]`` and
    the estimation stream key."""
    from cbcert.engine import keys
    from cbcert.runs.certify import CertifyJob

    models = CertifyJob(noise="gaussian", scale=0.1).models
    latents = np.array(jax.random.normal(jax.random.key(1), (2, world.generator.latent_dim)))
    return models, latents, keys.stream_key(jax.random.key(0), keys.STREAM_ESTIMATE)


def run_nets(world, source: str, rounds: int, seconds: float, bf16: bool, num: int,
             batches: list[int]) -> None:
    """The engine vs a PyTorch loop on the world's nets, interleaved rounds."""
    import engine_throughput as et
    import timing
    import torch

    from cbcert.engine import noise, sampler

    models, latents, key = engine_inputs(world)
    if models != et.WORLD_MODELS:
        raise SystemExit(f"the main job's models {models} differ from the twin's "
                         f"{et.WORLD_MODELS}")
    apply_fn, params, classes = world.latent_apply(models), world.params, world.num_classes
    model = et.torch_world(world, world.classifier_params)
    probe = latents[[0, 1, 0, 1]] + 0.1 * np.random.default_rng(2).standard_normal(
        (4, latents.shape[1]), np.float32)
    print(f"\n2. the nets: generator + {', '.join(models)} on the same noisy latent, weights "
          f"{source}, σ = {et.SIGMA} (the noise law of both loops; the rate does not depend on σ)")
    et.world_parity(world, apply_fn, params, model, probe, "fp32")
    z = torch.from_numpy(latents)
    sweep = et.torch_rates(model, z, num, batches, classes)
    best = max(sweep, key=sweep.get)
    print("   PyTorch batch sweep (one pass each): " + ", ".join(
        f"{b}: {r:.0f}" for b, r in sweep.items()) + f" samples/s; best batch {best}")

    chunks: dict[str, list] = collections.defaultdict(list)

    def engine(p, name, **kwargs):
        def work():
            sampler.count_classes(apply_fn, p, latents, noise.Gaussian(), key, num,
                                  scale=et.SIGMA, num_classes=classes,
                                  progress=lambda done, total: chunks[name].append(done),
                                  **kwargs)
            return len(latents) * num
        return work

    def torch_loop(batch, autocast=False):
        def work():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                for x in z:
                    et.cohen_loop(model, x, num, batch, classes)
            return len(latents) * num
        return work

    contenders = {f"torch fp32, batch {best}": torch_loop(best), "engine fp32": engine(
        params, "engine fp32")}
    if bf16:
        contenders[f"torch bf16 autocast, batch {best}"] = torch_loop(best, autocast=True)
        contenders["engine bf16"] = engine(sampler.cast_floating(params, jnp.bfloat16),
                                           "engine bf16", dtype=jnp.bfloat16)
    rates, first = timing.interleaved(contenders, rounds, seconds)
    reference = rates[f"torch fp32, batch {best}"]
    print(f"   {rounds} interleaved rounds (median samples/s; ratio: median of per-round ratios):")
    for name, values in rates.items():
        line = f"   {name:<30} {timing.median(values):8.0f} samples/s"
        if name.startswith("engine"):
            line += (f"   {timing.format_ratio(values, reference)} vs PyTorch's best fp32 batch,"
                     f" chunk {chunks[name][0]}, first call {first[name]:.1f} s")
        print(line)
    if bf16:
        print("   engine bf16 vs engine fp32: "
              + timing.format_ratio(rates["engine bf16"], rates["engine fp32"]))


def run_sharing(world, rounds: int, seconds: float, num: int) -> None:
    """All models in one engine pass vs one pass per model, interleaved rounds."""
    import engine_throughput as et
    import timing

    from cbcert.engine import noise, sampler

    models, latents, key = engine_inputs(world)
    params, classes = world.params, world.num_classes

    def count(apply_fn):
        return sampler.count_classes(apply_fn, params, latents, noise.Gaussian(), key, num,
                                     scale=et.SIGMA, num_classes=classes)

    together = world.latent_apply(models)
    alone = [world.latent_apply((m,)) for m in models]
    # The same votes either way: each model's counts in the shared pass are its own pass's.
    shared_counts = np.asarray(count(together))
    same = all(np.array_equal(shared_counts[:, i], np.asarray(count(fn))[:, 0])
               for i, fn in enumerate(alone))

    def shared():
        count(together)
        return len(latents) * num

    def separate():
        for fn in alone:
            count(fn)
        return len(latents) * num

    rates, _ = timing.interleaved({"one pass, all models": shared,
                                   "one pass per model": separate}, rounds, seconds)
    print(f"\n3. shared work: {', '.join(models)} judged on the same noisy latents in one pass "
          f"vs one pass per model ({rounds} interleaved rounds; samples/s: noisy latents "
          "judged by every model)")
    for name, values in rates.items():
        print(f"   {name:<22} {timing.median(values):8.0f} samples/s")
    print("   sharing saves " + timing.format_ratio(rates["one pass, all models"],
                                                     rates["one pass per model"])
          + f"; counts identical per model: {same}")


def main() -> None:
    args = ARGS
    model, flags = cpu_description()
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    print(f"CPU: {model}, {os.cpu_count()} logical CPUs, ISA flags: {' '.join(flags) or '?'}; "
          f"python {platform.python_version()}, jax {jax.__version__}; XLA_FLAGS "
          f"{os.environ.get('XLA_FLAGS', '(none)')}; load average {load}")
    bf16 = has_bf16_units(flags)
    if not bf16:
        print("no bf16 units on this CPU (lscpu shows neither avx512_bf16 nor amx_bf16): bf16 "
              "is not timed and no bf16 claim is made")
    if not args.no_command:
        run_command(args.inputs)
    if args.no_torch and args.no_sharing:
        return
    import engine_throughput as et

    world, source = et.load_default_world()  # once for both parts
    if not args.no_torch:
        run_nets(world, source, args.rounds, args.seconds, bf16, args.num, args.batches)
    if not args.no_sharing:
        run_sharing(world, args.rounds, args.seconds, args.num)


if __name__ == "__main__":
    main()
