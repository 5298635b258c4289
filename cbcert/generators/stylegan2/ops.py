"""StyleGAN2's numerical kernels: 2nd-moment normalisation, bias + activation, the FIR
``upfirdn2d`` as shifted multiply-adds, the 2× up-sampling transposed convolution by output phase,
and the modulated convolution (paper eq. 1-3). Pure ``jax.numpy`` on NHWC arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cbcert.generators.stylegan2.config import LRELU_SLOPE
from cbcert.nn.layers import conv


def normalize_2nd_moment(x: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``x / sqrt(mean_j x_j² + eps)`` over the last axis: ``x[B, D] -> [B, D]``."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def bias_act(x: jax.Array, bias: jax.Array, lrelu: bool, gain: float,
             clamp: float | None) -> jax.Array:
    """``clamp(act(x + b) · gain, ±clamp)``, ``act`` = leaky ReLU (slope 0.2) or identity.

    ``x[..., C]``, ``bias[C]``; the clamp is applied after the gain, as in NVlabs ``bias_act``.
    """
    x = x + bias
    if lrelu:
        x = jnp.where(x >= 0, x, x * LRELU_SLOPE)
    x = x * gain
    if clamp is not None:
        x = jnp.clip(x, -clamp, clamp)
    return x


def upfirdn2d(x: jax.Array, f: jax.Array, up: int, padding: tuple[int, int, int, int],
              gain: float) -> jax.Array:
    """Up-sample, pad, FIR-filter: ``x[B, H, W, C] -> [B, H·up + py0 + py1 − fh + 1,
    W·up + px0 + px1 − fw + 1, C]``.

    Zero insertion (``x[i]`` lands at ``i·up``, ``up − 1`` zeros follow), padding
    ``(px0, px1, py0, py1)`` (negative values crop), then true 2-D convolution with
    ``gain · f[fh, fw]`` keeping only fully overlapping outputs (NVlabs ``upfirdn2d`` with
    ``down=1, flip_filter=False``). Row n of the result is row ``n + fh − 1 − py0`` of the full
    convolution of the zero-inserted input (``scipy.signal.upfirdn``).

    Computed per channel as ``y[n, m] = Σ_{i<fh, j<fw} g[i, j] · p[n + i, m + j]`` with
    ``g = gain · f`` flipped in both axes and ``p`` the up-sampled, padded map: ``fh·fw`` shifted
    multiply-adds (XLA:CPU runs the equivalent depthwise convolution at < 1 GFLOP/s).
    """
    b, h, w, c = x.shape
    px0, px1, py0, py1 = padding
    if up > 1:
        x = x.reshape(b, h, 1, w, 1, c)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, up - 1), (0, 0), (0, up - 1), (0, 0)))
        x = x.reshape(b, h * up, w * up, c)
    x = jnp.pad(x, ((0, 0), (max(py0, 0), max(py1, 0)), (max(px0, 0), max(px1, 0)), (0, 0)))
    x = x[:, max(-py0, 0): x.shape[1] - max(-py1, 0), max(-px0, 0): x.shape[2] - max(-px1, 0)]
    fh, fw = f.shape
    taps = (f[::-1, ::-1] * gain).astype(x.dtype)  # flipped: convolution, not correlation
    ho, wo = x.shape[1] - fh + 1, x.shape[2] - fw + 1
    y = None
    for i in range(fh):
        for j in range(fw):
            term = x[:, i: i + ho, j: j + wo] * taps[i, j]
            y = term if y is None else y + term
    return y


def upsample2d(x: jax.Array, f: jax.Array) -> jax.Array:
    """2× FIR up-sampling ``x[B, H, W, C] -> [B, 2H, 2W, C]`` (DC gain preserved)."""
    fh, fw = f.shape
    padding = ((fw + 1) // 2, (fw - 2) // 2, (fh + 1) // 2, (fh - 2) // 2)
    return upfirdn2d(x, f, up=2, padding=padding, gain=4.0)


# (tap t of a 2-wide input window, output phase p) -> index of the 3-tap kernel (module docstring)
_POLYPHASE_TAP = {(0, 0): 1, (0, 1): 2, (1, 1): 0}


def transposed_conv3_up2(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """Zero insertion then true convolution with a 3×3 kernel, by output phase (polyphase).

    ``x[B, H, W, I], kernel[3, 3, I, O] -> v[B, 2H + 4, 2W + 4, O]`` with (per axis)
    ``v[m] = Σ_s kernel[2 − s] · U[m + s − 3]``, ``U`` the zero-inserted input (``U[2p] = x[p]``,
    zeros between). Only every other ``U`` is non-zero, so ``v[2a] = k[1] x[a − 1]`` and
    ``v[2a + 1] = k[2] x[a − 1] + k[0] x[a]``: one convolution of the input, padded (1, 2), with
    a ``2×2`` kernel holding the four phases' taps side by side (``[2, 2, I, 4O]``, zeros where a
    phase has no tap), then depth-to-space. ``32·H·W·I·O`` FLOPs instead of the ``72·H·W·I·O``
    of the dense 3×3 convolution at twice the resolution; the result is the same linear map.
    """
    zeros = jnp.zeros_like(kernel[0, 0])
    rows = []
    for ty in (0, 1):
        cols = []
        for tx in (0, 1):
            phases = []
            for py in (0, 1):
                for px in (0, 1):
                    iy, ix = _POLYPHASE_TAP.get((ty, py)), _POLYPHASE_TAP.get((tx, px))
                    phases.append(zeros if iy is None or ix is None else kernel[iy, ix])
            cols.append(jnp.concatenate(phases, axis=-1))  # [I, 4O], (py, px, o) order
        rows.append(jnp.stack(cols))
    taps = jnp.stack(rows)  # [2, 2, I, 4O]
    v = conv(jnp.pad(x, ((0, 0), (1, 2), (1, 2), (0, 0))), taps, 1, 0)  # [B, H + 2, W + 2, 4O]
    b, hp, wp, _ = v.shape
    o = kernel.shape[-1]
    v = v.reshape(b, hp, wp, 2, 2, o).transpose(0, 1, 3, 2, 4, 5)
    return v.reshape(b, 2 * hp, 2 * wp, o)


def modulated_conv2d(x: jax.Array, kernel: jax.Array, styles: jax.Array, demodulate: bool,
                     up: int = 1, f: jax.Array | None = None) -> jax.Array:
    """Modulated (and demodulated) convolution, paper eq. 1-3.

    Args:
      x: ``[B, H, W, I]``.
      kernel: ``[k, k, I, O]`` (HWIO), used unscaled (demodulation normalises it).
      styles: ``s[B, I]``.
      demodulate: divide output channel j by ``sqrt(Σ_{i,k} (s_i w_ijk)² + 1e-8)``.
      up: 1 (same-size, cross-correlation with padding k // 2) or 2 (FIR up-sampling with ``f``,
        then the kernel as a true convolution).
      f: ``[fh, fw]`` FIR filter, needed when ``up == 2``.

    Returns:
      ``[B, H·up, W·up, O]``.
    """
    k = kernel.shape[0]
    y = x * styles[:, None, None, :]
    if up == 1:
        y = conv(y, kernel, 1, k // 2)
    elif up == 2:
        if f is None:
            raise ValueError("f=None; the 2x up-sampling convolution needs its FIR filter")
        fh, fw = f.shape
        pad = k // 2
        padding = (pad + (fw + 1) // 2, pad + (fw - 2) // 2,
                   pad + (fh + 1) // 2, pad + (fh - 2) // 2)
        if k == 3:  # the synthesis layers: polyphase transposed conv, then the FIR
            y = upfirdn2d(transposed_conv3_up2(y, kernel), f, up=1,
                          padding=tuple(p - 3 for p in padding), gain=4.0)
        else:
            y = upfirdn2d(y, f, up=2, padding=padding, gain=4.0)
            y = conv(y, kernel[::-1, ::-1], 1, 0)
    else:
        raise ValueError(f"up={up}; allowed: 1, 2")
    if demodulate:
        energy = jnp.sum(jnp.square(kernel), axis=(0, 1))  # [I, O]
        d = jax.lax.rsqrt(jnp.square(styles) @ energy + 1e-8)  # [B, O]
        y = y * d[:, None, None, :]
    return y


# ----------------------------------------------------------------------------- modules
