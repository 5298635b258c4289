"""The anytime schedule against the published sequential procedure, on identical Bernoulli streams.

The question of Voráček (NeurIPS 2024, arXiv 2406.17830, §3): "is this input robust at radius
r?", i.e. is the top class's probability ``p_A`` above ``p0 = Φ(r/σ)``. Each configuration
(true ``p_A``, ``r/σ``, α) draws ``--streams`` Bernoulli(p_A) vote streams of up to ``--n``
samples, and every procedure reads the *same* streams:

* ``fixed``     -- Cohen's fixed-n CERTIFY: Clopper–Pearson at ``n`` and α;
* ``ckpt``      -- today's ``--schedule sequential`` (`cbcert.certify.sequential`): geometric
  checkpoints 32, 64, … n, half of α at n, target ``r`` (success / futility as in the library);
* ``kt``        -- the KT procedure, re-implemented from the paper's description: the
  Krichevsky–Trofimov (Beta(1/2, 1/2)) mixture likelihood ratio ``M_t(p0)`` checked after every
  sample; "robust" when ``M_t(p0) >= 1/α`` with ``k/t > p0``, "not robust" when
  ``M_t(p0) >= 1/α`` with ``k/t < p0``, undecided at ``n``;
* ``cp1.1``     -- the paper's union bound: Clopper–Pearson on checkpoints of ratio 1.1 from 10
  with ``α_k = 5α/((k+4)(k+5))``, robust when the lower bound clears ``p0``, not robust when
  the upper bound falls below it;
* ``anytime``   -- the new ``--schedule anytime`` (`cbcert.certify.anytime`) at the checkpoints
  a run with a target uses (every sample to 20, ratio 1.05, plus `AnytimeSchedule.with_target`'s
  points): certificate from the one-sided mixture confidence sequence, futility from its
  optimistic projection to ``n``;
* ``anytime/1`` -- the same confidence sequence read after every sample (futility at the
  checkpoints), i.e. the schedule's statistics without the engine's checkpoint spacing.

Every procedure is turned into count boundaries (stop certified when ``k_t >= S(t)``, stop
uncertified when ``k_t <= F(t)``) computed with the library's own functions; the streams are
simulated exactly at every sample by dyadic blocks refined with binomial bridges (a
hypergeometric split of a block's count) wherever a boundary might be crossed, which is cheap
far from the boundaries. Printed per configuration: mean and 95th percentile of the samples to
a decision, the fraction certified, and -- where ``p_A < p0``, so certifying r over-claims --
the realised false-certification rate with its two-sided 99.9 % Clopper–Pearson interval.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/sequential_anchor.py           # 10⁵ streams
    PYTHONPATH=. python benchmarks/sequential_anchor.py --quick                     # smoke run
"""

import argparse
import math
import time

import numpy as np
from scipy import special, stats

from cbcert.certify.anytime import (
    AnytimeSchedule,
    log_mixture,
    projected_radius,
)
from cbcert.certify.bounds import clopper_pearson_lower, clopper_pearson_upper
from cbcert.certify.l2 import L2Radius
from cbcert.certify.schedule import Schedule
from cbcert.certify.sequential import reachable_radius

P_GRID = (0.5, 0.7, 0.9, 0.99, 0.999, 0.9999, 0.99999)
RADII = (0.25, 0.5, 1.0, 2.0)  # r / σ
ALPHAS = (0.001, 0.05)
PROCEDURES = ("fixed", "ckpt", "kt", "cp1.1", "anytime", "anytime/1")
NEVER = np.iinfo(np.int64).max // 4
MAX_BLOCK = 2**12
FIRST, RATIO = None, None  # the schedule's defaults


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument("--n", type=int, default=100_000, help="Cohen's n: the budget")
    parser.add_argument("--alphas", type=float, nargs="+", default=ALPHAS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2,000 streams, n = 10,000")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.n = 2000, 10_000
    return args


# --- boundaries: S[t] (certify when k_t >= S[t]) and F[t] (stop uncertified when k_t <= F[t]) ---


def smallest(pred, trials: np.ndarray) -> np.ndarray:
    """Smallest count ``c in [0, t]`` with ``pred(c, t)`` (monotone in c) per t; t + 1 if none."""
    low = np.full(trials.shape, -1, np.int64)  # pred false (or -1)
    high = trials + 1  # pred true (or t + 1)
    while np.any(high - low > 1):
        mid = (low + high) // 2
        ok = pred(np.clip(mid, 0, trials), trials) & (mid <= trials)
        low, high = np.where(ok, low, mid), np.where(ok, mid, high)
    return high


def largest(pred, trials: np.ndarray) -> np.ndarray:
    """Largest count ``c`` with ``pred(c, t)`` (monotone decreasing in c) per t; −1 if none."""
    return smallest(lambda c, t: ~pred(c, t), trials) - 1


def boundaries(name: str, n: int, alpha: float, r: float) -> tuple[np.ndarray, np.ndarray]:
    """``S[t], F[t]`` for ``t = 0 … n`` of one procedure at target ``r/σ`` (σ = 1)."""
    rule, p0 = L2Radius(1.0), float(stats.norm.cdf(r))
    S = np.full(n + 1, NEVER, np.int64)
    F = np.full(n + 1, -1, np.int64)

    def certified(p_lower):
        return np.nan_to_num(rule.radius(np.maximum(p_lower, 0.5), None), nan=-1.0) >= r

    if name == "fixed":
        t = np.array([n])
        S[t] = smallest(lambda c, t: certified(clopper_pearson_lower(c, t, alpha)), t)
    elif name == "ckpt":
        schedule = Schedule.geometric(n, alpha)
        for k, (c_t, level) in enumerate(zip(schedule.checkpoints, schedule.alphas,
                                             strict=True)):
            t = np.array([c_t])
            S[t] = smallest(lambda c, t, level=level: certified(
                clopper_pearson_lower(c, t, level)), t)
            if k < len(schedule.checkpoints) - 1:
                F[t] = largest(lambda c, t, k=k: reachable_radius(
                    c, np.zeros_like(c), k, schedule, rule) < r, t)
    elif name == "kt":
        t = np.arange(1, n + 1)
        log_level = math.log(1 / alpha)

        def log_kt(c, t):
            return (special.betaln(c + 0.5, t - c + 0.5) - special.betaln(0.5, 0.5)
                    - special.xlogy(c, p0) - special.xlog1py(t - c, -p0))

        S[t] = smallest(lambda c, t: (c > p0 * t) & (log_kt(c, t) >= log_level), t)
        F[t] = largest(lambda c, t: (c < p0 * t) & (log_kt(c, t) >= log_level), t)
    elif name == "cp1.1":
        checkpoints, c_t = [], 10
        while c_t < n:
            checkpoints.append(c_t)
            c_t = max(c_t + 1, math.ceil(1.1 * c_t))
        checkpoints.append(n)
        for k, c_t in enumerate(checkpoints, start=1):
            level = 5 * alpha / ((k + 4) * (k + 5))
            t = np.array([c_t])
            S[t] = smallest(lambda c, t, level=level: clopper_pearson_lower(c, t, level) > p0, t)
            F[t] = largest(lambda c, t, level=level: clopper_pearson_upper(c, t, level) < p0, t)
    elif name in ("anytime", "anytime/1"):
        schedule = (AnytimeSchedule.geometric(n, alpha, first=FIRST, ratio=RATIO)
                    .with_target(r, rule)
                    if name == "anytime" else AnytimeSchedule.geometric(n, alpha, first=1,
                                                                         ratio=1.01))
        grid = np.array(schedule.checkpoints)
        S[grid] = smallest(lambda c, t: certified(schedule.lower(c, t)), grid)
        F[grid[:-1]] = largest(lambda c, t: projected_radius(c, 0 * c, t, schedule, rule) < r,
                               grid[:-1])
        if name == "anytime/1":
            t = np.arange(1, n + 1)
            # L_t >= p0 exactly when M_t(p0) >= 1/α (M_t is non-increasing below k/t).
            level = math.log(1 / alpha) + 1e-9
            S[t] = smallest(lambda c, t: (c > p0 * t) & (log_mixture(c, t, p0) >= level), t)
    else:
        raise ValueError(name)
    F[n] = np.minimum(S[n], n + 1) - 1  # the budget: every procedure stops at n
    F = np.minimum(F, S - 1)
    return S, F


# --- exact first passage of a Bernoulli count walk over boundaries -----------------------------


def pyramid(values: np.ndarray, reduce, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Dyadic block reductions, flat: ``out[:, offset[j] + b] = reduce(values[:, b·2^j + 1 …
    (b+1)·2^j])`` for every level ``j``; returns ``(out [D, ~2·size], offset [levels])``."""
    levels = [values[..., 1:size + 1]]
    while levels[-1].shape[-1] > 1:
        last = levels[-1]
        levels.append(reduce(last[..., 0::2], last[..., 1::2]))
    offset = np.cumsum([0] + [level.shape[-1] for level in levels[:-1]])
    return np.concatenate(levels, axis=-1), offset


def first_passage(p: float, S: np.ndarray, F: np.ndarray, streams: int, n: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stop time ``[D, streams]``, certified flag ``[D, streams]`` of D procedures on the same
    streams, and each stream's ``(t, k_t)`` at its last stop ``[2, streams]``.

    A stream walks ``k_t`` (votes of the top class after ``t`` samples) in aligned dyadic
    blocks; a block's count is drawn at once and split with a binomial bridge (hypergeometric
    draw of the first half's count) only while some running procedure might stop inside it.
    Inside a block ``(t0, te]`` the count satisfies ``max(k0, ke − (te − t)) <= k_t <= min(ke,
    k0 + t − t0)``, so stopping certified needs ``ke >= min S`` and ``max(t − S(t)) >= t0 − k0``
    there, and stopping uncertified ``k0 <= max F`` and ``max(F(t) − t) >= ke − te``.
    """
    size = 1 << max(1, (n - 1).bit_length())
    grid = np.arange(size + 1)

    def pad(a, fill):
        return np.concatenate([a, np.full((a.shape[0], size + 1 - a.shape[1]), fill, np.int64)],
                              axis=1)

    S, F = pad(S, NEVER), pad(F, -1)
    min_s, offset = pyramid(S, np.minimum, size)  # [D, blocks of all levels]
    slack_s, _ = pyramid(grid - S, np.maximum, size)
    max_f, _ = pyramid(F, np.maximum, size)
    slack_f, _ = pyramid(F - grid, np.maximum, size)
    D = S.shape[0]
    stop = np.full((D, streams), -1, np.int64)
    certified = np.zeros((D, streams), bool)
    t = np.zeros(streams, np.int64)
    k = np.zeros(streams, np.int64)
    depth_max = size.bit_length() + 1
    stack_t = np.zeros((streams, depth_max), np.int64)
    stack_k = np.zeros((streams, depth_max), np.int64)
    depth = np.zeros(streams, np.int64)
    alive = np.arange(streams)
    while alive.size:
        empty = alive[depth[alive] == 0]
        if empty.size:
            tt = t[empty]
            block = np.minimum(np.where(tt == 0, MAX_BLOCK, tt & -tt), MAX_BLOCK)
            stack_t[empty, 0] = tt + block
            stack_k[empty, 0] = k[empty] + rng.binomial(block, p)
            depth[empty] = 1
        top = depth[alive] - 1
        te, ke = stack_t[alive, top], stack_k[alive, top]
        t0, k0 = t[alive], k[alive]
        length = te - t0
        level = np.log2(length).astype(np.int64)
        at = offset[level] + (t0 >> level)  # [m]
        running = stop[:, alive] < 0  # [D, m]
        possible = np.any(running & (
            ((ke >= min_s[:, at]) & (slack_s[:, at] >= t0 - k0))
            | ((k0 <= max_f[:, at]) & (slack_f[:, at] >= ke - te))), axis=0)
        unit = length == 1
        evaluate = possible & unit
        if evaluate.any():
            rows, at, kk = alive[evaluate], te[evaluate], ke[evaluate]
            s_now, f_now = S[:, at], F[:, at]  # [D, e]
            live = stop[:, rows] < 0
            hit = live & (kk[None] >= s_now)
            miss = live & ~hit & (kk[None] <= f_now)
            stop[:, rows] = np.where(hit | miss, at[None], stop[:, rows])
            certified[:, rows] |= hit
        advance = ~possible | unit
        rows = alive[advance]
        t[rows], k[rows] = te[advance], ke[advance]
        depth[rows] -= 1
        split = possible & ~unit
        if split.any():
            rows = alive[split]
            half = length[split] // 2
            good = ke[split] - k0[split]
            mid_k = k0[split] + rng.hypergeometric(good, length[split] - good, half)
            stack_t[rows, depth[rows]] = t0[split] + half
            stack_k[rows, depth[rows]] = mid_k
            depth[rows] += 1
        alive = alive[(stop[:, alive] < 0).any(axis=0)]
    return stop, certified, np.stack([t, k])


def interval(x: int, trials: int, level: float = 0.999) -> tuple[float, float]:
    """Two-sided Clopper–Pearson interval at ``level`` for ``x`` events in ``trials``."""
    a = (1 - level) / 2
    low = 0.0 if x == 0 else float(stats.beta.ppf(a, x, trials - x + 1))
    high = 1.0 if x == trials else float(stats.beta.ppf(1 - a, x + 1, trials - x))
    return low, high


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"{args.streams} streams per configuration, n = {args.n}, p_A grid {P_GRID} plus "
          f"p_A = p0 − 1e-6 for each radius; σ = 1")
    ratio_rows = []
    for alpha in args.alphas:
        for r in RADII:
            p0 = float(stats.norm.cdf(r))
            start = time.perf_counter()
            bounds = [boundaries(name, args.n, alpha, r) for name in PROCEDURES]
            S = np.stack([b[0] for b in bounds[1:]])  # fixed n is read off the end: below
            F = np.stack([b[1] for b in bounds[1:]])
            fixed_at = bounds[0][0][args.n]
            print(f"\nα = {alpha}, r = {r}σ (p0 = {p0:.6f}); boundaries "
                  f"{time.perf_counter() - start:.1f} s")
            print(f"  {'p_A':>9s}  " + "  ".join(f"{name:>21s}" for name in PROCEDURES)
                  + "   (mean / p95 samples, % certified)")
            for p in (*P_GRID, p0 - 1e-6):
                begin = time.perf_counter()
                walked, cert, (t_end, k_end) = first_passage(p, S, F, args.streams, args.n,
                                                             rng)
                # The same streams continued to n for fixed-n CERTIFY.
                k_n = k_end + rng.binomial(args.n - t_end, p)
                stop = np.concatenate([np.full((1, args.streams), args.n), walked])
                cert = np.concatenate([(k_n >= fixed_at)[None], cert])
                means = stop.mean(axis=1)
                p95 = np.percentile(stop, 95, axis=1)
                cells = [f"{m:9.0f} / {q:6.0f} {100 * c.mean():5.1f}%"
                         for m, q, c in zip(means, p95, cert, strict=True)]
                print(f"  {p:9.6g}  " + "  ".join(cells)
                      + f"   [{time.perf_counter() - begin:.1f} s]")
                if p < p0:
                    errs = []
                    for name, c in zip(PROCEDURES, cert, strict=True):
                        x = int(c.sum())
                        low, high = interval(x, args.streams)
                        flag = "" if low <= alpha else "  ABOVE α"
                        errs.append(f"{name} {x / args.streams:.2e} [{low:.1e}, {high:.1e}]{flag}")
                    print("    false certifications (99.9 % CP): " + "; ".join(errs))
                kt, ours, ours1 = (means[PROCEDURES.index(x)] for x in ("kt", "anytime",
                                                                        "anytime/1"))
                ratio_rows.append((alpha, r, p, means[0] / ours, means[1] / ours, kt / ours,
                                   kt / ours1))
    print("\nmean samples to decision, ratios (> 1: the anytime schedule stops earlier)")
    print(f"  {'α':>6s} {'r/σ':>5s} {'p_A':>9s} {'fixed/any':>10s} {'ckpt/any':>9s} "
          f"{'KT/any':>7s} {'KT/any1':>8s}")
    for alpha, r, p, f, c, kt, kt1 in ratio_rows:
        print(f"  {alpha:6g} {r:5g} {p:9.6g} {f:10.2f} {c:9.2f} {kt:7.3f} {kt1:8.3f}")


if __name__ == "__main__":
    main()
