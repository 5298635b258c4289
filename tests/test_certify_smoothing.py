"""Smoothing table (`cbcert.certify.smoothing`): certificates hold for the noise actually drawn.

The engine samples with a float32 scale: σ rounded to float32, ρ to the 2⁻²³ grid of float32
uniforms (``jax.random.bernoulli`` is ``uniform < float32(ρ)``). A certificate computed with the
typed σ or ρ can then claim more than the drawn noise supports (ρ = 0.39 once certified Hamming
radius 2 where the drawn noise supports 1). These tests compare the radius rules the runners use
against exact arithmetic for the noise actually drawn: ``fractions.Fraction`` for Hamming radii,
60-digit ``mpmath`` for L2 radii.
"""

from fractions import Fraction
from math import comb

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest

from cbcert.certify.bounds import clopper_pearson_lower
from cbcert.certify.cohen import certify_counts
from cbcert.certify.hamming import BernoulliHammingRadius
from cbcert.certify.smoothing import smoothing
from cbcert.engine.noise import BernoulliFlips, Gaussian
from cbcert.runs.certify import CertifyJob

K = 12  # concepts of the built-in world
GAUSSIAN, BERNOULLI = smoothing("gaussian"), smoothing("bernoulli")


def _rule(noise: str, scale: float):
    job = CertifyJob(noise=noise, scale=scale)  # the rule the runner certifies with
    return job.smoothing.radius_rule(job.scale, K)


def _exact_threshold(delta: int, rho: Fraction) -> Fraction:
    """The p* with L_Δ(p*) = 1/2 exactly, for Bernoulli(ρ) flips (Neyman–Pearson filling)."""
    regions = []
    for j in range(delta + 1):
        px = comb(delta, j) * (1 - rho) ** j * rho ** (delta - j)
        pxp = comb(delta, j) * rho**j * (1 - rho) ** (delta - j)
        regions.append((pxp / px, px, pxp))
    regions.sort(key=lambda region: region[0])
    mass, gain = Fraction(0), Fraction(0)
    for ratio, px, pxp in regions:
        if gain + pxp >= Fraction(1, 2):
            return mass + (Fraction(1, 2) - gain) / ratio
        mass, gain = mass + px, gain + pxp
    raise AssertionError("the regions hold all the P_x' mass")


def _exact_radius(p: float, thresholds: list[Fraction]) -> int:
    """Largest Δ with L_Δ'(p) > 1/2 for all Δ' ≤ Δ (L is increasing in p, decreasing in Δ)."""
    radius = 0
    for threshold in thresholds:
        if Fraction(p) <= threshold:
            break
        radius += 1
    return radius


def test_bernoulli_drawn_probability_is_the_float32_uniform_grid():
    """``drawn`` models jax.random.bernoulli: 1[u < float32(ρ)], u = k / 2²³ (checked bit-exactly
    on 2¹⁶ keys: the Bernoulli draw equals the threshold of the same key's uniform)."""
    keys = jax.random.split(jax.random.key(3), 2**16)
    for rho in (0.39, 0.13, 0.2, 0.5 - 2**-30):
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
        flips = jax.vmap(lambda k, r=rho: jax.random.bernoulli(k, np.float32(r)))(keys)
        np.testing.assert_array_equal(np.asarray(flips), np.asarray(u) < np.float32(rho))
        assert np.all(np.asarray(u) * 2**23 == np.round(np.asarray(u) * 2**23))
        expected = np.ceil(np.float64(np.float32(rho)) * 2**23) / 2**23
        assert BernoulliFlips(K).drawn(rho) == expected


def test_drawn_rho_is_below_rho_where_the_issue_says():
    for rho in (0.13, 0.26, 0.38, 0.39):
        assert BernoulliFlips(K).drawn(rho) < rho
        assert BERNOULLI.certified_scale(rho, K) == BernoulliFlips(K).drawn(rho)
    assert BERNOULLI.certified_scale(0.2, K) == 0.2  # drawn 0.2000000030 > 0.2
    assert Gaussian().drawn(0.1) > 0.1 and GAUSSIAN.certified_scale(0.1, K) == 0.1
    assert Gaussian().drawn(0.3) > 0.3
    assert GAUSSIAN.certified_scale(0.7, K) == Gaussian().drawn(0.7) < 0.7


def test_rho_039_certifies_what_the_drawn_noise_supports():
    """The issue's case: ρ = 0.39, n = 2672, α = 0.01, nA = 1978."""
    p = float(clopper_pearson_lower(1978, 2672, 0.01))
    assert BernoulliHammingRadius(0.39, K).radius(p, None) == 2  # the typed ρ claims 2
    thresholds = [_exact_threshold(d, Fraction(BernoulliFlips(K).drawn(0.39))) for d in (1, 2)]
    assert _exact_radius(p, thresholds) == 1
    select = np.array([20, 0])
    cert = certify_counts(select, np.array([1978, 2672 - 1978]), 0.01, _rule("bernoulli", 0.39))
    assert cert.radius == 1


def test_exact_ties_are_not_certified():
    """L_Δ(p) = 1/2 exactly (in rational arithmetic on these doubles) must give radius Δ − 1;
    plain float comparisons certified Δ = 2 in these cases (a rounding error of ~1e-16)."""
    cases = [(0.45, 0.6), (0.305, 0.89), (0.345, 0.81), (0.37, 0.76), (0.42, 0.66),
             (0.435, 0.63)]
    for rho, p in cases:
        thresholds = [_exact_threshold(d, Fraction(rho)) for d in (1, 2, 3)]
        assert _exact_radius(p, thresholds) == 1
        assert BernoulliHammingRadius(rho, K).radius(p, None) == 1, (rho, p)


@pytest.mark.parametrize("decimals", [2, 3])
def test_hamming_radius_never_exceeds_the_exact_one_for_the_drawn_rho(decimals):
    """Every ρ with 2 (3) decimals in (0, ½), at the exact thresholds p*_Δ of every Δ ≤ K and
    at their float neighbours: the runner's radius ≤ the exact radius for the drawn ρ."""
    step = 10**-decimals
    for i in range(1, round(0.5 / step)):
        rho = round(i * step, decimals)
        drawn = Fraction(BernoulliFlips(K).drawn(rho))
        thresholds = [_exact_threshold(d, drawn) for d in range(1, K + 1)]
        points = []
        for threshold in thresholds:
            value = float(threshold)
            points += [np.nextafter(value, 0), value, np.nextafter(value, 1)]
        points = np.array([p for p in points if 0.5 <= p < 1])
        reported = _rule("bernoulli", rho).radius(points, None)
        exact = np.array([_exact_radius(p, thresholds) for p in points])
        assert np.all(reported <= exact), (rho, points[reported > exact])
        assert np.all(reported >= exact - 1)  # and not needlessly weak


def _exact_l2(p: float, sigma_drawn: float) -> mpmath.mpf:
    return mpmath.mpf(sigma_drawn) * mpmath.sqrt(2) * mpmath.erfinv(2 * mpmath.mpf(p) - 1)


@pytest.mark.parametrize("decimals", [2, 3])
def test_l2_radius_never_exceeds_the_exact_one_for_the_drawn_sigma(decimals):
    """Every σ with 2 (3) decimals in (0, 1], bounds from n = 1000 at α = 0.001 (saturated and
    interior): radius ≤ σ_drawn Φ⁻¹(p) exactly, up to float64 rounding of Φ⁻¹ and of the
    product (relative 1e-14; the float32 rounding of σ that this guards is ~1e-8)."""
    mpmath.mp.dps = 60
    p = clopper_pearson_lower(np.array([1000, 990, 900, 700]), 1000, 0.001)
    step = 10**-decimals
    violations = []
    for i in range(1, round(1 / step) + 1):
        sigma = round(i * step, decimals)
        drawn = Gaussian().drawn(sigma)
        reported = _rule("gaussian", sigma).radius(p, None)
        for r, q in zip(reported, p, strict=True):
            if r > _exact_l2(q, drawn) * (1 + mpmath.mpf("1e-14")):
                violations.append((sigma, q))
    assert not violations


def test_huge_n_keeps_radii_finite():
    """p_lower rounds to 1.0 at n ~ 1e17; the cap keeps the certificate finite and sound."""
    n = 2**62
    counts = np.array([n, 0])
    cert = certify_counts(counts, counts, 0.001, _rule("gaussian", 0.5))
    assert np.isfinite(cert.radius) and cert.p_lower < 1.0
    many = BERNOULLI.radius_rule(0.2, 1000)
    assert many.radius(1.0, None) == 1000  # what an uncapped bound would certify
    cert = certify_counts(counts, counts, 0.001, many)
    assert cert.radius == many.radius(np.nextafter(1.0, 0.0), None) < 1000


def test_run_and_attack_names_come_from_the_table():
    """Certify and attack cells are named through `SMOOTHINGS` (the names results/reference
    and every existing run directory carry, unchanged)."""
    from cbcert.certify.smoothing import attack_name

    assert [smoothing(k).name(s) for k, s in (("gaussian", 0.1), ("bernoulli", 0.2),
                                              ("fixed", 2))] == [
        "latent-sigma0.1", "concept-rho0.2", "concept-flips2"]
    assert attack_name("latent") == "attack-latent"
    assert attack_name("concept") == "attack-concept"
    assert attack_name("latent", 0.25) == "attack-latent-smoothed-sigma0.25"
    assert attack_name("concept", 0.2) == "attack-concept-smoothed-rho0.2"


def test_the_radius_rule_is_the_tables_for_every_kind():
    """One constructor per kind in the table, at the certified scale (fixed flips: m exactly)."""
    from cbcert.certify.hamming import FixedFlipHammingRadius
    from cbcert.certify.l2 import L2Radius

    assert GAUSSIAN.radius_rule(0.7, K) == L2Radius(GAUSSIAN.certified_scale(0.7, K))
    assert BERNOULLI.radius_rule(0.39, K) == BernoulliHammingRadius(
        BERNOULLI.certified_scale(0.39, K), K)
    assert smoothing("fixed").radius_rule(3, K) == FixedFlipHammingRadius(3, K)
