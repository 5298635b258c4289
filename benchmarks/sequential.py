"""Fixed-n CERTIFY vs the anytime-valid sequential schedule on the built-in default world.

For each configuration (latent σ = 0.1 and 0.25, concept ρ = 0.2) the same inputs are certified
with ``--schedule fixed`` and with ``--schedule sequential`` under two stopping settings, all at
the same α and maximum n, through the real runner (`cbcert.runs.certify.run`: agreement pool,
selection samples, continuous batching, records). Printed per configuration: samples drawn
(selection + estimation), wall time of the run, their ratios against the fixed schedule, and
certified accuracy at every radius of the report grid (σ/4 steps, or Hamming 0…K) for every
model, with the largest difference from the fixed schedule. Every configuration is compiled once
by a warm-up run before anything is timed.

    PYTHONPATH=. python benchmarks/sequential.py                # n = 1000, 16 inputs, ~5 min
    PYTHONPATH=. python benchmarks/sequential.py --quick        # smoke run
    PYTHONPATH=. python benchmarks/sequential.py --inputs 32 --n 2000
    PYTHONPATH=. python benchmarks/sequential.py --n 100000 --inputs 8 \
        --settings target anytime-target --no-fixed             # Cohen's n, targets only
    PYTHONPATH=. python benchmarks/sequential.py --n 100000 --inputs 8 --configs gaussian:0.1 \
        --settings anytime-precision --tolerances 1 0.5 0.25    # Cohen's n, no target

Sequential settings: ``futility`` (no target: stops only when no later checkpoint can improve
the radius, e.g. hopeless inputs), ``precision`` (``--radius-tolerance`` = one grid step: σ/4,
or 1 for Hamming), ``target`` (``--target-radius`` = the table's first certified-accuracy
column, σ/2 or Hamming 1: the question "is this input certified at r?"; certified accuracy at
r is what it answers, so ``max |ΔCA|`` is also printed at r alone; an input that cannot reach r
stops early and reports what it had, so certified accuracy at other radii drops by design).
``anytime``, ``anytime-precision`` and ``anytime-target`` are the same three with ``--schedule
anytime`` (`cbcert.certify.anytime`). ``--tolerances 1 0.5 0.25`` runs each precision setting
once per fraction of the grid step (``precision@0.5``: ``--radius-tolerance`` = half a step).
``--no-fixed`` skips running the fixed schedule (its samples are N · (n0 + n) by construction;
certified accuracy is then compared with nothing).
"""

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from cbcert.runs.certify import CertifyJob, run
from cbcert.worlds.builtin import load_builtin

SETTINGS = ("futility", "precision", "target", "anytime", "anytime-precision", "anytime-target")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=16, help="agreement inputs certified")
    parser.add_argument("--n", type=int, default=1000, help="(maximum) estimation samples")
    parser.add_argument("--n0", type=int, default=100, help="selection samples")
    parser.add_argument("--alpha", type=float, default=0.001)
    parser.add_argument("--quick", action="store_true", help="4 inputs, n = 200 (smoke test)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS,
                        help="schedules to run besides fixed")
    parser.add_argument("--no-fixed", action="store_true",
                        help="do not run the fixed schedule (samples N·(n0 + n) by definition)")
    parser.add_argument("--tolerances", type=float, nargs="+", default=[1.0],
                        help="precision settings: --radius-tolerance as fractions of the grid "
                             "step, one run each (default: 1)")
    parser.add_argument("--configs", nargs="+", default=["gaussian:0.1", "gaussian:0.25",
                                                         "bernoulli:0.2"])
    args = parser.parse_args()
    if min(args.tolerances) <= 0:
        parser.error(f"--tolerances={args.tolerances}: each must be > 0")
    if args.quick:
        args.inputs, args.n, args.n0 = 4, 200, 20
    return args


def timed_run(world, job: CertifyJob, out: Path) -> tuple[dict, float]:
    start = time.perf_counter()
    summary = run(world, job, out)
    return summary, time.perf_counter() - start


def drawn(summary: dict, job: CertifyJob, out: Path) -> int:
    """Samples drawn: the summary's count (sequential) or N · (n0 + n) (fixed)."""
    if "samples" in summary:
        return summary["samples"]["total"]
    return job.num_inputs * (job.n0 + job.n)


def main() -> None:
    args = parse_args()
    world = load_builtin("default")
    k = world.generator.num_concepts
    print(f"world {world.name}: {world.num_classes} classes, K = {k} concepts; n0 = {args.n0}, "
          f"n = {args.n} (max), α = {args.alpha}, {args.inputs} inputs, models std/cbm/proto")
    totals = {"fixed": [0, 0.0]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for noise, scale in ((c.split(":")[0], float(c.split(":")[1])) for c in args.configs):
            base = dict(noise=noise, scale=scale, n0=args.n0, n=args.n, alpha=args.alpha,
                        num_inputs=args.inputs)
            step = 1.0 if noise == "bernoulli" else scale / 4
            target = 1.0 if noise == "bernoulli" else scale / 2  # the table's first CA column
            every = {
                "fixed": CertifyJob(**base),
                "futility": CertifyJob(schedule="sequential", **base),
                "precision": CertifyJob(schedule="sequential", radius_tolerance=step, **base),
                "target": CertifyJob(schedule="sequential", target_radius=target, **base),
                "anytime": CertifyJob(schedule="anytime", **base),
                "anytime-precision": CertifyJob(schedule="anytime", radius_tolerance=step,
                                                **base),
                "anytime-target": CertifyJob(schedule="anytime", target_radius=target, **base),
            }
            jobs = {name: job for name, job in every.items()
                    if name in args.settings or (name == "fixed" and not args.no_fixed)}
            if args.tolerances != [1.0]:  # each precision setting once per tolerance
                expanded = {}
                for name, job in jobs.items():
                    if "precision" not in name:
                        expanded[name] = job
                        continue
                    for f in args.tolerances:
                        expanded[f"{name}@{f:g}"] = dataclasses.replace(
                            job, radius_tolerance=step * f)
                jobs = expanded
            # Warm-up: compile the pool, the encoder and the sampling step of this noise.
            run(world, CertifyJob(noise=noise, scale=scale, n0=10, n=20, num_inputs=1,
                                  alpha=0.01), root / f"warm-{noise}{scale}")
            results = {}
            if args.no_fixed:
                results["fixed"] = (None, float("nan"), args.inputs * (args.n0 + args.n))
                totals["fixed"] = [totals["fixed"][0] + results["fixed"][2], float("nan")]
            for name, job in jobs.items():
                out = root / f"{noise}{scale}-{name}"
                summary, seconds = timed_run(world, job, out)
                results[name] = (summary, seconds, drawn(summary, job, out))
                totals.setdefault(name, [0, 0.0])
                totals[name][0] += results[name][2]
                totals[name][1] += seconds
            report(noise, scale, results, target)
    fixed_samples, fixed_seconds = totals["fixed"]
    print("\nall configurations:")
    for name, (samples, seconds) in totals.items():
        print(f"  {name:21s} {samples:9d} samples ({fixed_samples / samples:5.2f}x fewer), "
              f"{seconds:7.1f} s ({fixed_seconds / seconds:5.2f}x less wall time)")


def report(noise: str, scale: float, results: dict, target: float) -> None:
    symbol = "ρ" if noise == "bernoulli" else "σ"
    fixed_summary, fixed_seconds, fixed_samples = results["fixed"]
    print(f"\n{noise} {symbol} = {scale}:")
    if fixed_summary is None:
        print(f"  fixed     samples {fixed_samples:7d} (not run: N · (n0 + n))")
    ran = {name: r for name, r in results.items() if r[0] is not None}
    for name, (summary, seconds, samples) in ran.items():
        reasons = {}
        for entry in summary["models"].values():
            for reason, count in entry.get("stop_reasons", {}).items():
                reasons[reason] = reasons.get(reason, 0) + count
        line = (f"  {name:21s} samples {samples:7d} ({fixed_samples / samples:6.2f}x fewer)  "
                f"wall {seconds:6.1f} s")
        if fixed_summary is not None:
            worst, worst_at = 0.0, 0.0
            for model, entry in summary["models"].items():
                grid = np.array(entry["radius_grid"])
                gap = np.abs(np.array(entry["certified_accuracy"])
                             - np.array(fixed_summary["models"][model]["certified_accuracy"]))
                worst = max(worst, float(np.max(gap)))
                worst_at = max(worst_at, float(np.max(gap[np.abs(grid - target) < 1e-9])))
            line += (f" ({fixed_seconds / seconds:5.2f}x less)  max |ΔCA| {100 * worst:4.1f} "
                     f"points (at radius {target:g}: {100 * worst_at:4.1f})")
        print(line + f"  stops {reasons or '-'}")
    first = next(iter(ran.values()))[0]
    grid = first["models"]["std"]["radius_grid"]
    shown = [i for i, r in enumerate(grid) if any(
        ran[name][0]["models"][m]["certified_accuracy"][i] > 0
        for name in ran for m in ran[name][0]["models"])] or [0]
    header = " ".join(f"{grid[i]:>6g}" for i in shown)
    print(f"  certified accuracy (%) at radius   {header}")
    for model in first["models"]:
        for name, (summary, _, _) in ran.items():
            ca = summary["models"][model]["certified_accuracy"]
            row = " ".join(f"{100 * ca[i]:6.1f}" for i in shown)
            print(f"    {model:5s} {name:21s}    {row}")


if __name__ == "__main__":
    main()
