"""Sequential schedules: the checkpoints, levels and stopping settings fixed before sampling.

A `Schedule` holds the checkpoints ``n_1 < … < n_K`` at which the estimation counts are
examined and the level ``α_k`` of each, ``Σ α_k <= α``. The union bound behind the anytime-valid
certificate (`cbcert.certify.sequential`) holds only because ``n_k`` and ``α_k`` are constants:
every constructor here depends on ``n``, ``α`` and the schedule options alone, never on counts.
`Stopping` holds the stopping settings (they may look at the data: they only decide when to
stop). `check_settings` checks a run's schedule keys together, for jobs and config sections;
`largest_radius` and `samples_needed` say what a schedule can certify at best (the pre-flight
checks: saturated one-class L2 needs ``n >= ⌈ln α / ln Φ(r/σ)⌉`` for radius r).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cbcert.certify.bounds import check_alpha
from cbcert.certify.cohen import RadiusRule, certify_counts
from cbcert.schema import ConfigError

# Default first checkpoint: unanimous votes at 32 samples already certify R/σ ≈ 0.7 at
# α_1 = 10⁻⁴, and hopeless inputs (top class near 1/C) are recognised.
DEFAULT_FIRST_CHECKPOINT = 32
DEFAULT_CHECKPOINT_RATIO = 2.0
# Default share of α spent at the last checkpoint n: a run that goes to n loses little radius
# against the fixed schedule (saturated n = 1000, α = 0.001: R/σ 2.463 → 2.429 at 1/2).
DEFAULT_FINAL_SHARE = 0.5


def _error(key: str, value, detail: str, allowed: str | None = None) -> ConfigError:
    return ConfigError(f"key '{key}': {detail}", key=key, value=value, allowed=allowed,
                       detail=detail)


@dataclass(frozen=True)
class Schedule:
    """Checkpoints ``n_1 < … < n_K`` and their levels ``α_1 … α_K`` (fixed before sampling).

    Attributes:
      checkpoints: strictly increasing sample counts ``n_k >= 1``; the last is the maximum n.
      alphas: level of each checkpoint's bounds, each in (0, 1); ``alpha = Σ α_k``.

    >>> Schedule.geometric(1000, 0.001).checkpoints
    (32, 64, 128, 256, 512, 1000)
    >>> Schedule.fixed(1000, 0.001)
    Schedule(checkpoints=(1000,), alphas=(0.001,))
    """

    checkpoints: tuple[int, ...]
    alphas: tuple[float, ...]

    def __post_init__(self) -> None:
        checkpoints = tuple(self.checkpoints)
        if not checkpoints or any(
            not isinstance(c, int | np.integer) or isinstance(c, bool) or c < 1
            for c in checkpoints
        ):
            raise _error("checkpoints", checkpoints, f"expected integers >= 1, got "
                         f"{list(checkpoints)}")
        if any(b <= a for a, b in zip(checkpoints, checkpoints[1:], strict=False)):
            raise _error("checkpoints", checkpoints,
                         f"must increase strictly, got {list(checkpoints)}")
        alphas = tuple(float(a) for a in self.alphas)
        if len(alphas) != len(checkpoints):
            raise _error("alphas", alphas, f"{len(alphas)} levels for {len(checkpoints)} "
                         "checkpoints; give one per checkpoint")
        for a in alphas:
            check_alpha(a)
        if math.fsum(alphas) >= 1.0:
            raise _error("alphas", alphas, f"sum {math.fsum(alphas)} must be below 1")
        object.__setattr__(self, "checkpoints", tuple(int(c) for c in checkpoints))
        object.__setattr__(self, "alphas", alphas)

    @property
    def n(self) -> int:
        """The maximum number of estimation samples, ``n_K``."""
        return self.checkpoints[-1]

    @property
    def alpha(self) -> float:
        """``Σ_k α_k``: the probability that any bound of any checkpoint is wrong is at most it."""
        return math.fsum(self.alphas)

    @classmethod
    def fixed(cls, n: int, alpha: float) -> Schedule:
        """The fixed-n ``CERTIFY`` schedule: one checkpoint ``n`` at level ``α``."""
        return cls((int(n),), (check_alpha(alpha),))

    @classmethod
    def geometric(cls, n: int, alpha: float, *, first: int | None = None,
                  ratio: float | None = None, final_share: float | None = None) -> Schedule:
        """Geometric checkpoints ``n_1 = first``, ``n_{k+1} = ⌈ratio · n_k⌉``, … ``n_K = n``.

        An intermediate checkpoint closer to ``n`` than a factor ``√ratio`` is dropped (it
        would spend α for almost no saving). Levels: ``α_K = s·α`` at ``n`` (``s`` =
        ``final_share``) and ``α_k = (1 − s)·α / (K−1)`` at each earlier checkpoint, so
        ``Σ α_k = α`` (rounded down to stay ``<= α`` in floating point). ``first >= n`` gives
        `fixed`. Depends only on ``n``, ``α`` and the options -- never on data -- as the union
        bound requires.

        Args:
          n: maximum estimation samples, ``>= 1``.
          alpha: total error level in (0, 1).
          first: first checkpoint (default 32).
          ratio: growth factor ``> 1`` (default 2).
          final_share: share of α spent at ``n``, in (0, 1) (default 1/2). A larger share
            loses less radius on inputs that need all n samples, a smaller one stops clear
            inputs a little earlier (the samples a bound needs grow like ``ln(1/α_k)``).
        """
        alpha = check_alpha(alpha)
        first = DEFAULT_FIRST_CHECKPOINT if first is None else first
        ratio = DEFAULT_CHECKPOINT_RATIO if ratio is None else ratio
        share = DEFAULT_FINAL_SHARE if final_share is None else final_share
        check_schedule_options(first, ratio, share)
        if first >= n:
            return cls.fixed(n, alpha)
        checkpoints = []
        c = int(first)
        while c < n:
            checkpoints.append(c)
            c = max(c + 1, math.ceil(c * ratio))
        while len(checkpoints) > 1 and n < checkpoints[-1] * math.sqrt(ratio):
            checkpoints.pop()
        checkpoints.append(int(n))
        early = len(checkpoints) - 1
        alphas = [alpha * (1 - share) / early] * early + [alpha * share]
        while math.fsum(alphas) > alpha:
            alphas[-1] = float(np.nextafter(alphas[-1], 0.0))
        return cls(tuple(checkpoints), tuple(alphas))

    @classmethod
    def of(cls, kind: str, n: int, alpha: float, *, first: int | None = None,
           ratio: float | None = None, final_share: float | None = None) -> Schedule:
        """The schedule of a run: ``fixed`` or ``sequential`` (`geometric`)."""
        if kind == "fixed":
            return cls.fixed(n, alpha)
        if kind == "sequential":
            return cls.geometric(n, alpha, first=first, ratio=ratio, final_share=final_share)
        raise _error("schedule", kind, f"got {kind!r}, allowed: fixed, sequential",
                     "fixed, sequential")


def check_schedule_options(first, ratio, final_share=None) -> None:
    """Raise `ConfigError` (keys ``first_checkpoint``, ``checkpoint_ratio``,
    ``final_alpha_share``) for options outside their ranges (None = default)."""
    if first is not None and (not isinstance(first, int | np.integer) or isinstance(first, bool)
                              or not 1 <= first < 2**31):
        raise _error("first_checkpoint", first, f"expected an integer in [1, 2**31), got "
                     f"{first!r}", "[1, 2**31)")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float)
                              or not math.isfinite(ratio) or not 1.0 < ratio <= 1e6):
        raise _error("checkpoint_ratio", ratio, f"expected a number in (1, 1e6], got "
                     f"{ratio!r}", "(1, 1e6]")
    if final_share is not None and (isinstance(final_share, bool)
                                    or not isinstance(final_share, int | float)
                                    or not 0.0 < final_share < 1.0):
        raise _error("final_alpha_share", final_share, f"expected a number in (0, 1), got "
                     f"{final_share!r}", "(0, 1)")


SCHEDULES = ("fixed", "sequential", "anytime")
# The settings of a sequential run besides ``schedule`` (None: the default; off for stopping).
SEQUENTIAL_KEYS = ("target_radius", "radius_tolerance", "first_checkpoint", "checkpoint_ratio",
                   "final_alpha_share")


def check_settings(schedule: str, *, mode: str = "certify", n: int | None = None,
                   **settings) -> None:
    """Raise `ConfigError` (naming the key) unless the schedule settings are valid together.

    ``schedule`` must be ``fixed``, ``sequential`` or ``anytime``; ``settings`` are the
    `SEQUENTIAL_KEYS` (None = unset), checked against their ranges, refused with the fixed
    schedule (which would ignore them) and, for ``target_radius``/``radius_tolerance``, with
    ``PREDICT``. Given the run's ``n``, a ``first_checkpoint`` above it is refused too
    (`Schedule.geometric` would quietly make that the fixed schedule; ``first_checkpoint = n``
    asks for it). The anytime schedule (`cbcert.certify.anytime`) certifies only (its
    confidence sequence bounds one class, not PREDICT's comparison of two) and spends no α on
    checkpoints, so ``final_alpha_share`` is refused with it.
    """
    if schedule not in SCHEDULES:
        raise _error("schedule", schedule, f"got {schedule!r}, allowed: "
                     f"{', '.join(SCHEDULES)}", ", ".join(SCHEDULES))
    if schedule == "anytime" and mode == "predict":
        raise _error("schedule", schedule, "got 'anytime', allowed with PREDICT: fixed, "
                     "sequential (the anytime schedule certifies)", "fixed, sequential")
    if schedule == "anytime" and settings.get("final_alpha_share") is not None:
        value = settings["final_alpha_share"]
        raise _error("final_alpha_share", value, f"got {value!r}, which only the sequential "
                     "schedule uses (the anytime schedule spends no α on checkpoints)")
    unknown = set(settings) - set(SEQUENTIAL_KEYS)
    if unknown:
        raise ValueError(f"unknown schedule settings {sorted(unknown)}")
    Stopping(settings.get("target_radius"), settings.get("radius_tolerance"))
    check_schedule_options(settings.get("first_checkpoint"), settings.get("checkpoint_ratio"),
                           settings.get("final_alpha_share"))
    for key in SEQUENTIAL_KEYS:
        value = settings.get(key)
        if value is None:
            continue
        if schedule == "fixed":
            raise _error(key, value, f"got {value!r}, which only the sequential and anytime "
                         "schedules use")
        if mode == "predict" and key in ("target_radius", "radius_tolerance"):
            raise _error(key, value, f"got {value!r}; PREDICT certifies no radius")
    first = settings.get("first_checkpoint")
    if schedule != "fixed" and first is not None and n is not None and first > n:
        raise _error("first_checkpoint", first, f"got {first}, allowed range [1, n={n}] (the "
                     "checkpoints end at n)", f"[1, {n}]")


@dataclass(frozen=True)
class Stopping:
    """When a sequential run stops early (never what it certifies).

    Attributes:
      target_radius: stop once certified at this radius (``success``), or once even the
        optimistic projection cannot reach it (``futility``); None: no target.
      radius_tolerance: stop once the optimistic radius exceeds the best certified radius by at
        most this much (``precision``); None: off.
    """

    target_radius: float | None = None
    radius_tolerance: float | None = None

    def __post_init__(self) -> None:
        for key, low_open in (("target_radius", False), ("radius_tolerance", True)):
            value = getattr(self, key)
            if value is None:
                continue
            ok = (isinstance(value, int | float) and not isinstance(value, bool)
                  and math.isfinite(value) and (value > 0 if low_open else value >= 0))
            if not ok:
                allowed = "(0, inf)" if low_open else "[0, inf)"
                raise _error(key, value, f"expected a number in {allowed}, got {value!r}",
                             allowed)



def largest_radius(schedule: Schedule, radius_rule: RadiusRule, *,
                   two_class: bool = False) -> float:
    """The largest radius the schedule can certify at all: unanimous votes, best checkpoint.

    NaN when even unanimous votes abstain at every checkpoint (``n`` too small for ``α``: the
    one-class saturated bound ``α_k^{1/n_k}`` must reach 1/2).
    """
    best = -np.inf
    for trials, level in zip(schedule.checkpoints, schedule.alphas, strict=True):
        counts = np.array([[trials, 0]])
        cert = certify_counts(np.array([[1, 0]]), counts, level, radius_rule,
                              two_class=two_class)
        best = max(best, float(np.where(np.isnan(cert.radius), -np.inf, cert.radius)[0]))
    return float("nan") if best == -np.inf else best


def samples_needed(radius: float, alpha: float, radius_rule: RadiusRule, *,
                   two_class: bool = False) -> int | None:
    """Smallest ``n`` whose unanimous votes certify ``radius`` at level ``α`` (fixed n).

    For L2 one-class this is ``⌈ln α / ln Φ(r/σ)⌉`` (the saturated bound ``α^{1/n}`` must reach
    ``Φ(r/σ)``); computed by bisection through the radius rule so that it holds for every
    rule. None if no ``n < 2³¹`` suffices.
    """
    def certifies(n: int) -> bool:
        cert = certify_counts(np.array([1, 0]), np.array([n, 0]), alpha, radius_rule,
                              two_class=two_class)
        return bool(np.where(np.isnan(cert.radius), -np.inf, cert.radius) >= radius)

    high = 1
    while not certifies(high):
        if high >= 2**30:
            return None
        high *= 2
    low = high // 2  # certifies(low) is False (or low = 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if certifies(mid) else (mid, high)
    return high

__all__ = [
    "DEFAULT_CHECKPOINT_RATIO", "DEFAULT_FINAL_SHARE", "DEFAULT_FIRST_CHECKPOINT", "SCHEDULES",
    "SEQUENTIAL_KEYS", "Schedule", "Stopping", "check_schedule_options", "check_settings",
    "largest_radius", "samples_needed",
]
