"""An attack run's units one after the other against several at once, on the built-in world.

`certify attack` (and every attack cell of a sweep) attacks each (batch, model, ε) unit on its
own; on CPU it runs two at a time, each in its own thread (`cbcert.runs.units`).
This times the same units through `cbcert.runs.attacker.Attacker` — APGD, and for a smoothed
attack PREDICT at the adversarial point — with ``--units`` at once against one at a time, in
interleaved rounds after a warm-up that compiles every unit, and checks that both give the same
adversarial points bit for bit (exit 1 otherwise). Printed: the CPU and its logical CPUs, the
median seconds of each, their ratio, and the points' agreement.

    PYTHONPATH=. python benchmarks/attack_units.py                    # vanilla, 100 iterations
    PYTHONPATH=. python benchmarks/attack_units.py --smoothed --iters 20
    PYTHONPATH=. python benchmarks/attack_units.py --quick            # smoke run

Measured on the 2-core Intel Xeon VM (AVX-512), 2026-12-06, 16 inputs, std/cbm/proto × ε
{0.01, 0.03}: vanilla (100 iterations) 16.6 s one at a time, 8.7 s two at once (1.9×);
smoothed (σ = 0.1, EOT 8, 20 iterations, PREDICT n = 1,000) 77 s against 46 s (1.7×).
"""

import argparse
import statistics
import sys
import time

import numpy as np

from cbcert.runs.attack import AttackJob
from cbcert.runs.attacker import Attacker
from cbcert.runs.machine import describe
from cbcert.runs.pool import agreement_pool, space_inputs
from cbcert.runs.units import Units
from cbcert.worlds.builtin import load_builtin


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", default="default", help="built-in world preset")
    parser.add_argument("--space", choices=("latent", "concept"), default="latent")
    parser.add_argument("--smoothed", action="store_true",
                        help="attack the smoothed classifier (σ = 0.1 latent, ρ = 0.2 concept)")
    parser.add_argument("--iters", type=int, default=100, help="APGD iterations")
    parser.add_argument("--inputs", type=int, default=16, help="inputs of the one batch")
    parser.add_argument("--models", default="std,cbm,proto")
    parser.add_argument("--units", type=int, default=2, help="units at once (>= 2)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved timed rounds")
    parser.add_argument("--quick", action="store_true",
                        help="2 iterations, 4 inputs, std only, 1 round (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.iters, args.inputs, args.models, args.rounds = 2, 4, "std", 1
    for name, low in (("iters", 1), ("inputs", 1), ("units", 2), ("rounds", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name}={getattr(args, name)}: must be >= {low}")
    return args


def main() -> int:
    args = parse_args()
    machine = describe()
    print(f"CPU {machine['cpu']}, {machine['logical_cpus']} logical CPUs; "
          f"ISA {' '.join(machine['isa']) or '-'}")
    world = load_builtin(args.world)
    smoothing = dict(smoothed=True, scale=0.1 if args.space == "latent" else 0.2, eot=8,
                     n=1000, alpha=0.05) if args.smoothed else {}
    job = AttackJob(space=args.space, eps=(0.01, 0.03), iters=args.iters,
                    models=tuple(args.models.split(",")), num_inputs=args.inputs,
                    batch=args.inputs, **smoothing)
    pool = agreement_pool(world, job.seed, job.num_inputs, space=job.space)
    x = space_inputs(world, pool.latents, job.space)
    labels, idx = pool.labels, pool.indices
    attacker = Attacker(world, job)
    units = [(m, e) for m in job.models for e in job.eps]

    def one_at_a_time():
        return [attacker.attack(m, e, x, labels, idx) for m, e in units]

    def at_once():  # the runs' own mechanism
        with Units(args.units) as run:
            return list(run(lambda u: attacker.attack(*u, x, labels, idx), units))

    what = (f"{'smoothed ' if args.smoothed else ''}{job.space} attack on {args.world}: "
            f"{len(units)} units ({', '.join(job.models)} × ε 0.01, 0.03), {args.inputs} "
            f"inputs, {args.iters} iterations")
    print(what)
    tic = time.perf_counter()
    reference = one_at_a_time()  # compiles every unit
    print(f"warm-up (compilation included): {time.perf_counter() - tic:.1f} s")
    times = {"one at a time": [], f"{args.units} at once": []}
    same = True
    for _ in range(args.rounds):
        for name, fn in zip(times, (one_at_a_time, at_once), strict=True):
            tic = time.perf_counter()
            result = fn()
            times[name].append(time.perf_counter() - tic)
            same &= all(np.array_equal(a["point"], b["point"])
                        for a, b in zip(reference, result, strict=True))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, median in medians.items():
        print(f"  {name:>14}: {median:7.2f} s (median of {args.rounds})")
    first, second = medians.values()
    print(f"  {args.units} at once vs one at a time: x{first / second:.2f}")
    print(f"  adversarial points identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
