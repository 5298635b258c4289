"""cbcert's Python API: randomized smoothing of any JAX model on the engine the CLI runs on.

``smooth(apply_fn, params, noise)`` wraps a pure, jittable classifier ``apply_fn(params,
x[B, *event]) -> logits[B, C]`` (or ``[B, H, C]``: H heads judged on the *same* noisy samples)
into a smoothed classifier ``g(x) = argmax_c P(argmax f(x + δ) = c)`` with ``δ`` the noise
(SPEC §4). Its ``predict`` and ``certify`` are Cohen et al.'s (2019) ``PREDICT`` and
``CERTIFY`` — the reference ``Smooth(model, num_classes, sigma).certify(x, n0, n, alpha,
batch)`` — for a whole batch of inputs at once, with explicit keys, and return arrays:
predictions (``ABSTAIN`` = −1), radii (NaN when abstaining), the probability bounds and the
counts behind them. ``certify latent``, ``certify concept`` and ``certify predict`` go through
the same path (`cbcert.certify.monte_carlo`), so the API and the CLI give the same numbers for
the same settings.

Keys: ``key`` is the root key (``jax.random.key(seed)``; ``--seed`` in the CLI). Selection
samples use its stream 0, estimation samples its stream 1 (``cbcert.engine.keys``), and sample
j of input n is ``fold_in(fold_in(stream, indices[n]), j)``: results do not depend on the batch,
chunk size, devices or on which other inputs are certified alongside.

>>> import jax, jax.numpy as jnp, cbcert
>>> def apply_fn(params, x):                    # any jittable (params, x[B, d]) -> logits[B, C]
...     return x @ params["w"]
>>> params = {"w": jnp.array([[1.0, -1.0], [0.5, 0.5]])}
>>> smoothed = cbcert.smooth(apply_fn, params, cbcert.gaussian(0.5))
>>> x = jnp.array([[3.0, 0.0], [0.01, 0.0]])   # class 0 iff x0 + 0.5 ε0 > 0
>>> cert = smoothed.certify(x, jax.random.key(0), n0=100, n=1000, alpha=0.001)
>>> cert.prediction.tolist()                    # the second input is a coin flip: abstain
[0, -1]
>>> round(float(cert.radius[0]), 4)             # σ Φ⁻¹(0.001^(1/1000)) = 0.5 · 2.4633
1.2316
>>> smoothed.predict(x, jax.random.key(1), n=1000, alpha=0.001).prediction.tolist()
[0, -1]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from cbcert.certify.anytime import AnytimeSchedule
from cbcert.certify.bounds import check_alpha
from cbcert.certify.cohen import ABSTAIN, Certificate, Prediction
from cbcert.certify.monte_carlo import certify_heads, predict_heads
from cbcert.certify.schedule import Schedule, Stopping
from cbcert.certify.sequential import SequentialCertificate, SequentialPrediction
from cbcert.certify.smoothing import Smoothing, smoothing
from cbcert.engine.keys import Stream, stream_key
from cbcert.engine.noise import restrict
from cbcert.engine.sampler import count_classes
from cbcert.engine.validity import check_dtype
from cbcert.schema import ConfigError

Params = Any
# Relative shortfall of a Schedule's Σ α_k below alpha still taken as alpha (float rounding).
_ALPHA_ROUNDING = 1e-9


@dataclasses.dataclass(frozen=True)
class Noise:
    """A smoothing noise and its scale; build it with `gaussian`, `bernoulli` or `fixed_flips`.

    Attributes:
      kind: ``gaussian`` (``x + σ ε``, certified L2 radius), ``bernoulli`` (each concept pair
        of ``c[2K + U]`` swapped with probability ρ, certified Hamming radius) or ``fixed``
        (exactly m pairs swapped).
      scale: σ, ρ or m, checked here against the same ranges as the CLI's flags (the API's
        edge: `Smoothed` and the engine below trust it).
      num_concepts: K for the concept noises (0 for gaussian).
      perturbed: noise only on the first ``perturbed`` coordinates of flat inputs
        ``x[N, D]``, the rest carried unchanged (a multi-class conditional generator's
        ``[z ; k]``: `cbcert.engine.noise.Leading`); None = every coordinate.
    """

    kind: str
    scale: float
    num_concepts: int = 0
    perturbed: int | None = None

    def __post_init__(self) -> None:
        self.smoothing.check(self.scale, self.num_concepts or None)

    @property
    def smoothing(self) -> Smoothing:
        """The `cbcert.certify.smoothing` entry of this kind (engine noise + certificate)."""
        return smoothing(self.kind)

    def engine_noise(self):
        """The ``cbcert.engine.noise`` model sampled."""
        return restrict(self.smoothing.noise(self.num_concepts), self.perturbed)

    def radius_rule(self, dtype=None):
        """The radius rule at the certified scale ``min(typed, drawn)`` (SPEC §4) for inputs of
        ``dtype``: σ is drawn in float32, or bfloat16 for bfloat16 inputs (None: float32)."""
        return self.smoothing.radius_rule(self.scale, self.num_concepts, dtype)


def gaussian(sigma: float) -> Noise:
    """Gaussian noise ``x + σ ε``, ``ε ~ N(0, I)``; certified L2 radius ``σ Φ⁻¹(pA_lower)``.

    σ is in the units of ``x``: latent units for a generator's latent, pixel units on [0, 1]
    for images (as in Cohen et al.). Allowed: σ in [1e-30, 1e30].
    """
    return Noise("gaussian", sigma)


def _concepts(num_concepts: int) -> int:
    if isinstance(num_concepts, bool) or not isinstance(num_concepts, int | np.integer) \
            or num_concepts < 1:
        detail = f"got {num_concepts!r}, allowed: an integer >= 1 (K, concepts of c[2K + U])"
        raise ConfigError(f"num_concepts: {detail}", key="num_concepts", value=num_concepts,
                          allowed="[1, inf)", detail=detail)
    return int(num_concepts)


def bernoulli(rho: float, num_concepts: int) -> Noise:
    """Bernoulli concept flips: each of the K pairs of ``c[2K + U]`` swapped w.p. ρ in (0, ½).

    ``c = [c0+, c0−, …, c(K−1)+, c(K−1)−, u]`` is cbcert's concept layout (`cbcert.concepts`);
    the certificate is the Hamming radius of Lee et al. (2019).
    """
    return Noise("bernoulli", rho, _concepts(num_concepts))


def fixed_flips(flips: int, num_concepts: int) -> Noise:
    """Exactly m uniformly chosen concept pairs of ``c[2K + U]`` swapped (1 ≤ m ≤ K)."""
    return Noise("fixed", flips, _concepts(num_concepts))


@functools.lru_cache(maxsize=64)
def _with_head_axis(apply_fn: Callable) -> Callable:
    """``apply_fn`` with logits ``[B, C]`` seen as one head ``[B, 1, C]`` (one object per fn)."""
    return lambda params, x: apply_fn(params, x)[:, None, :]


@dataclasses.dataclass(frozen=True, eq=False)
class Smoothed:
    """A smoothed classifier ``g`` of ``apply_fn`` under ``noise``; build it with `smooth`.

    Attributes:
      apply_fn: ``(params, x[B, *event]) -> logits[B, C]`` or ``[B, H, C]``, pure, jittable.
      params: its parameter pytree.
      noise: the `Noise`.
      num_classes: C, or None to read it from ``apply_fn``'s output shape.
      chunk_size, max_memory, dtype, mesh: engine settings (``count_classes``): samples per
        device step (default from ``max_memory``: a quarter of device memory, 8 MiB on CPU,
        where compute-bound models get at least 32 samples per step),
        compute dtype of the noisy samples (a floating dtype, e.g. ``"bfloat16"``; counts and
        statistics stay exact; others are refused with TypeError), device mesh (default: all
        devices).

    Inputs and logits must be finite: a NaN or inf input, or a NaN or inf logit of any noisy
    sample, is refused with `cbcert.engine.validity.NonFiniteError` (a ValueError naming the
    inputs and the samples) rather than counted as a vote.
    """

    apply_fn: Callable
    params: Params
    noise: Noise
    num_classes: int | None = None
    chunk_size: int | None = None
    max_memory: int | None = None
    dtype: Any = None
    mesh: Any = None
    _shapes: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_dtype(self.dtype)

    def _prepare(self, x) -> tuple[Any, Callable, int, int]:
        """(inputs as an array, engine fn ``[B, H, C]``, C, H, or 0 when ``apply_fn`` has no
        head axis) for inputs ``x``."""
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim < 1 or x.shape[0] < 1:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [N, *event] with N >= 1")
        probe = jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)
        if probe not in self._shapes:  # traced once per event shape and dtype
            self._shapes[probe] = jax.eval_shape(self.apply_fn, self.params, probe).shape
        shape = self._shapes[probe]
        if len(shape) not in (2, 3) or shape[0] != 1:
            raise ValueError(f"apply_fn returns shape {shape} for one input; expected logits "
                             "[B, C] or [B, H, C]")
        classes = shape[-1]
        if self.num_classes is not None and self.num_classes != classes:
            raise ValueError(f"num_classes={self.num_classes} but apply_fn returns {classes} "
                             "logits")
        heads = len(shape) == 3
        fn = self.apply_fn if heads else _with_head_axis(self.apply_fn)
        return x, fn, int(classes), shape[1] if heads else 0

    def _engine(self, num_classes: int) -> dict[str, Any]:
        return dict(num_classes=num_classes, chunk_size=self.chunk_size,
                    max_memory=self.max_memory, dtype=self.dtype)

    def counts(self, x, key: jax.Array, n: int, *, stream: Stream = Stream.ESTIMATE,
               indices=None, progress=None) -> np.ndarray:
        """Class counts ``[N, C]`` (``[N, H, C]`` with heads) of ``n`` noisy samples per input.

        ``counts[i, c] = #{j < n : argmax f(x̃_ij) = c}``, ``x̃_ij`` drawn from ``fold_in(
        fold_in(stream_key(key, stream), indices[i]), j)``.
        """
        x, fn, classes, heads = self._prepare(x)
        out = count_classes(fn, self.params, x, self.noise.engine_noise(),
                            stream_key(key, stream), n, scale=self.noise.scale,
                            indices=indices, progress=progress, mesh=self.mesh,
                            **self._engine(classes))
        return out if heads else out[:, 0]

    def predict(self, x, key: jax.Array, n: int, alpha: float, *, schedule="fixed",
                indices=None, progress=None) -> Prediction | SequentialPrediction:
        """Cohen et al.'s ``PREDICT`` of every input: the top class, or ``ABSTAIN``.

        ``nA, nB`` = the two largest of ``n`` estimation counts; abstain if the two-sided
        binomial test of ``nA`` out of ``nA + nB`` at ½ has p-value ``> α``, so a returned class
        differs from ``g(x)`` with probability at most α. ``schedule="sequential"`` (or a
        `Schedule` ending at ``n`` whose levels sum to ``alpha``) tests at anytime-valid
        checkpoints up to ``n`` and stops each input at its first significant one
        (`cbcert.certify.sequential`).

        Args:
          x: ``[N, *event]`` inputs. key: root key (module docstring). n: samples per input.
          alpha: error level in (0, 1). indices: ``[N]`` global input indices (default
          ``arange(N)``). progress: ``callback(done, total)`` over (input, sample) pairs.

        Returns:
          `Prediction` (fields ``[N]``, ``[N, H]`` with heads): prediction, count_top,
          count_runner_up, p_value; sequential: `SequentialPrediction` (+ samples, stop_reason).

        Raises:
          NonFiniteError: a NaN or inf input or logit (`Smoothed`).
        """
        plan = _plan(schedule, n, alpha)
        if isinstance(plan, AnytimeSchedule):
            raise ValueError("schedule='anytime' certifies; PREDICT takes 'fixed', 'sequential' "
                             "or a Schedule")
        x, fn, classes, heads = self._prepare(x)
        result = predict_heads(fn, self.params, x, self.noise.engine_noise(), key, n, alpha,
                               scale=self.noise.scale, heads=max(heads, 1), plan=plan,
                               indices=indices, progress=progress, mesh=self.mesh,
                               **self._engine(classes))
        return _heads(result, heads)

    def certify(self, x, key: jax.Array, n0: int, n: int, alpha: float, *,
                two_class: bool = False, schedule="fixed", target_radius: float | None = None,
                radius_tolerance: float | None = None, indices=None,
                progress=None, uniform=None) -> Certificate | SequentialCertificate:
        """Cohen et al.'s ``CERTIFY`` of every input: a class and a certified radius, or abstain.

        ``ĉA = argmax`` of ``n0`` selection counts; ``nA`` its count among ``n`` fresh
        estimation samples; ``pA_lower = CP_lower(nA, n, α)`` (one-sided Clopper–Pearson);
        abstain if ``pA_lower < ½``, else radius ``σ Φ⁻¹(pA_lower)`` (gaussian) or the Hamming
        radius (concept flips). With probability ``>= 1 − α`` the smoothed classifier is
        constant, equal to ``ĉA``, within the radius. ``two_class``: ``pA_lower`` and the
        runner-up's ``pB_upper`` at α/2 each, radius ``σ/2 (Φ⁻¹(pA_lower) − Φ⁻¹(pB_upper))``.
        ``schedule="sequential"`` (or a `Schedule` ending at ``n`` whose levels sum to
        ``alpha``): anytime-valid checkpoints up to ``n``, inputs stop at ``target_radius`` /
        within ``radius_tolerance`` / when decided (`cbcert.certify.sequential`; the
        certificate stays valid at level α); the fixed schedule refuses both stopping rules.
        ``schedule="anytime"`` (or an `AnytimeSchedule`): the same with a confidence sequence
        (`cbcert.certify.anytime`).
        Gaussian radii use ``min(σ, σ as drawn)``, σ drawn in the inputs' dtype (float32, or
        bfloat16 for bfloat16 inputs).

        Args:
          x: ``[N, *event]`` inputs (a latent ``z``, a concept representation ``c[2K + U]``,
            or pixels). key: root key. n0, n: selection and estimation samples per input.
          alpha: probability that a certificate is wrong, in (0, 1). indices: ``[N]`` global
            input indices (default ``arange(N)``). progress: ``callback(done, total)``.
          uniform: ``[N]`` draws in [0, 1) for randomized Clopper–Pearson bounds (e.g.
            `cbcert.certify.randomized.bound_uniforms`); None: the standard bounds.

        Returns:
          `Certificate` with fields ``[N]`` (``[N, H]`` with heads): prediction, count_top,
          count_runner_up, p_lower, p_upper, radius; `SequentialCertificate` adds samples,
          certified_samples, stop_reason.

        Raises:
          NonFiniteError: a NaN or inf input or logit (`Smoothed`).
        """
        plan = _plan(schedule, n, alpha)
        stopping = _stopping(schedule, target_radius, radius_tolerance)
        x, fn, classes, heads = self._prepare(x)
        rule = self.noise.radius_rule(jax.dtypes.canonicalize_dtype(x.dtype))
        result = certify_heads(fn, self.params, x, self.noise.engine_noise(), key, n0, n, alpha,
                               scale=self.noise.scale, rule=rule, plan=plan,
                               two_class=two_class, stopping=stopping, indices=indices,
                               progress=progress, uniform=uniform, mesh=self.mesh,
                               **self._engine(classes))
        return _heads(result, heads)


def smooth(apply_fn: Callable, params: Params, noise: Noise, **engine: Any) -> Smoothed:
    """The smoothed classifier of ``apply_fn`` under ``noise`` (`Smoothed`; module docstring).

    Args:
      apply_fn: pure, jittable ``(params, x[B, *event]) -> logits[B, C]`` (or ``[B, H, C]``).
        Pass the same function object across calls to reuse its compilation.
      params: its parameters (any pytree of arrays).
      noise: ``gaussian(σ)``, ``bernoulli(ρ, K)`` or ``fixed_flips(m, K)``.
      engine: `Smoothed`'s optional fields: num_classes, chunk_size, max_memory, dtype, mesh.
    """
    if not isinstance(noise, Noise):
        raise TypeError(f"noise={noise!r}; build it with cbcert.gaussian(σ), "
                        "cbcert.bernoulli(ρ, K) or cbcert.fixed_flips(m, K)")
    return Smoothed(apply_fn, params, noise, **engine)


def _plan(schedule, n: int, alpha: float) -> Schedule | AnytimeSchedule | None:
    """The `Schedule` of a call, None for the fixed schedule (Cohen's n samples at once); a
    given one must end at ``n`` and spend exactly ``alpha`` (an `AnytimeSchedule`: end at ``n``,
    at level ``alpha``)."""
    if isinstance(schedule, AnytimeSchedule):
        if schedule.n != n or schedule.alpha != check_alpha(alpha):
            raise ValueError(f"the anytime schedule has n = {schedule.n}, alpha = "
                             f"{schedule.alpha:g}; the call n = {n}, alpha = {alpha:g}")
        return schedule
    if schedule == "anytime":
        return AnytimeSchedule.geometric(n, alpha)
    if isinstance(schedule, Schedule):
        if schedule.checkpoints[-1] != n:
            raise ValueError(f"schedule ends at n = {schedule.checkpoints[-1]}, but n = {n}")
        alpha = check_alpha(alpha)
        # Above alpha the certificates would claim more confidence than they have; below it,
        # alpha would misstate their level. Schedule.geometric rounds its sum down by ulps.
        if not alpha * (1 - _ALPHA_ROUNDING) <= schedule.alpha <= alpha:
            raise ValueError(f"the schedule's levels sum to {schedule.alpha:g}, but alpha = "
                             f"{alpha:g}; they must sum to alpha (build the schedule with it, "
                             "e.g. Schedule.geometric(n, alpha))")
        return schedule
    if schedule not in ("fixed", "sequential"):
        raise ValueError(f"schedule={schedule!r}; allowed: 'fixed', 'sequential', 'anytime' or "
                         "a Schedule")
    plan = Schedule.of(schedule, n, alpha)
    return None if schedule == "fixed" else plan


def _stopping(schedule, target_radius, radius_tolerance) -> Stopping:
    """The stopping rules of a call; `ConfigError` naming one given with the fixed schedule
    (which draws all n samples and would silently ignore it)."""
    stopping = Stopping(target_radius, radius_tolerance)
    if isinstance(schedule, str) and schedule == "fixed":
        for key, value in (("target_radius", target_radius),
                           ("radius_tolerance", radius_tolerance)):
            if value is not None:
                detail = (f"only the sequential schedule stops early; pass "
                          f"schedule='sequential' (or a Schedule), or drop {key}")
                raise ConfigError(f"{key}={value!r}: {detail}", key=key, value=value,
                                  detail=detail)
    return stopping


def _heads(result, heads: int):
    """Drop the head axis of every field when ``apply_fn`` has none."""
    if heads:
        return result
    return dataclasses.replace(result, **{f.name: getattr(result, f.name)[:, 0]
                                          for f in dataclasses.fields(result)})


__all__ = ["ABSTAIN", "Noise", "Smoothed", "bernoulli", "fixed_flips", "gaussian", "smooth"]
