"""Parity of float32 ports with float64 references, at a tolerance derived from float32 error.

float32 results differ between CPUs of the same kind (oneDNN and XLA pick AVX-512/AMX or AVX2
kernels, block sums differently, split work over threads), so a float32 port compared with a
float32 PyTorch run at an atol tuned on one machine fails on another. Here the reference is exact
at float32 scale -- the reference evaluated in float64 on the same float32 weights and inputs
(``float64_copy``) -- and the port, run in float32 as users run it, must satisfy

    max |port − ref64|  ≤  tol = C · max( max |ref32 − ref64|,  ε · max |ref64| )      (1)

where ``ref32`` is an independent float32 evaluation of the same function on the same machine
(the PyTorch reference in float32), ε = 2⁻²³ is float32's machine epsilon and the maxima run
over N ≥ 32 compared outputs.

Derivation. To first order a float32 evaluation returns ``ref64 + J δ``: δ are the local
rounding errors (a length-n dot product's is bounded by γ_n Σ|wᵢ xᵢ|, γ_n ≈ nε/2), J the
sensitivity of the output to them. J and the operands belong to the function, its weights and
its inputs, which the port and the reference share; only the order of operations (blocking, SIMD
width, threads, direct or Winograd convolution) differs. So both errors are draws of the same
size, and the reference's realised error, measured in the same run, is this computation's
float32 error on this machine *including its conditioning* (cancellation, softmax of large
logits, clamps) -- which no fixed atol knows. Over N outputs the maximum of such errors is a
stable statistic only for N not too small: for independent Gaussian errors of equal spread the
ratio of two maxima exceeds 4 with probability 6e-2 for N = 2, 2e-5 for N = 16 and 2.5e-7 for
N = 32 (simulated), hence MIN_ELEMENTS = 32. C = 8 = 4 × 2 then also allows the port's error
spread to be twice the reference's (the patch-matmul convolution sums in another order than
oneDNN's kernels). The floor ε·max|ref64| (one rounding of the largest output) keeps (1)
meaningful where the float32 reference happens to be (nearly) exact. Measured over the suite's
60 checks with 2 and 1 threads and with oneDNN/XLA capped at AVX2 and at SSE4.1: the port's
maximum error was 0.25..3.4x the reference's (3.4 only where the floor sets tol), err/tol ≤ 0.34.

Power. A bound measured from float32 error would hide a wrong port if a fixture were so badly
conditioned that its float32 error approached the size of real bugs. (1) is therefore also
required to be at most ``POWER · max|ref64|`` with POWER = 5e-4 (the suite's largest is 8e-5):
a port wrong by 1e-3 · max|ref64| at some output shows an error there of at least that minus its
own float32 rounding (≤ tol ≤ 5e-4 · max|ref64|), i.e. at least tol, and fails any check;
``tests/test_parity.py`` shows it on a ResNet with one perturbed weight. A fixture that trips the
guard needs better-conditioned weights, not a larger tolerance.
"""

from __future__ import annotations

import copy

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23
AGREEMENT = 8.0  # C in (1): allowed ratio between the port's and the reference's float32 error
MIN_ELEMENTS = 32  # fewer outputs make the measured maximum error a noisy estimate
POWER = 5e-4  # largest tol / max|ref64| a check may use (see "Power" above)


def float64_copy(module):
    """A deep copy of a ``torch.nn.Module`` with every float parameter and buffer in float64.

    The float32 weights are exactly representable in float64, so the copy computes the same
    function on the same numbers, with rounding errors ~2⁻⁵³ instead of 2⁻²⁴.
    """
    return copy.deepcopy(module).double()


def parity_tolerance(ref64: np.ndarray, ref32: np.ndarray) -> float:
    """``tol`` of (1) in the module docstring, checked against the power guard."""
    ref64, ref32 = np.asarray(ref64, np.float64), np.asarray(ref32, np.float64)
    assert ref64.shape == ref32.shape, (ref64.shape, ref32.shape)
    assert ref64.size >= MIN_ELEMENTS, (
        f"{ref64.size} outputs; compare at least {MIN_ELEMENTS} (a larger batch) so that the "
        "float32 reference's maximum error estimates its spread")
    scale = float(np.abs(ref64).max())
    err32 = float(np.abs(ref32 - ref64).max())
    tol = AGREEMENT * max(err32, EPS32 * scale)
    assert tol <= POWER * scale, (
        f"the float32 reference is off by {err32:.3g} at output scale {scale:.3g}: the fixture is "
        f"too ill-conditioned for a check to catch a 1e-3 relative bug; condition it better")
    return tol


def assert_parity(got, ref64, ref32, what: str) -> float:
    """Assert the float32 ``got`` matches the float64 ``ref64`` within (1); return err / tol.

    Args:
      got: the port's float32 output.
      ref64: the reference in float64 on the same weights and inputs.
      ref32: the reference in float32 (measures this computation's float32 error here).
      what: name printed with the error and tolerance (``pytest -rP`` shows it).
    """
    got, ref64 = np.asarray(got), np.asarray(ref64, np.float64)
    assert got.shape == ref64.shape, (got.shape, ref64.shape)
    tol = parity_tolerance(ref64, ref32)
    diff = np.abs(got.astype(np.float64) - ref64)
    err = float(diff.max())
    where = np.unravel_index(int(diff.argmax()), diff.shape)
    ratio = err / tol
    print(f"parity[{what}] err={err:.3g} tol={tol:.3g} err/tol={ratio:.3f} "
          f"ref32_err={float(np.abs(np.asarray(ref32) - ref64).max()):.3g} "
          f"scale={float(np.abs(ref64).max()):.3g}")
    assert err <= tol, (f"{what}: max |port - float64 reference| = {err:.3g} at {where} exceeds "
                        f"tol = {tol:.3g} (float32 reference error x {AGREEMENT:g})")
    return ratio
