"""The float64 parity check (``tests/parity.py``) fails for a wrong port, not only for noise."""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # JAX already uses the cores

from parity import AGREEMENT, EPS32, assert_parity, float64_copy, parity_tolerance  # noqa: E402
from test_convert_resnet import (  # noqa: E402
    images,
    state_dict_numpy,
    torch_pair,
    torch_resnet,
)

from cbcert.convert import torchvision  # noqa: E402
from cbcert.io import registry  # noqa: E402


@pytest.fixture(scope="module")
def resnet18():
    reference = torch_resnet("resnet18", num_classes=10, seed=41)
    x = images(4, 33, seed=42)
    return state_dict_numpy(reference), x, torch_pair(reference, float64_copy(reference), x)


def port_logits(tensors, x):
    apply_fn, params = registry.pure_apply(torchvision.resnet_from_state_dict("resnet18", tensors))
    return np.asarray(jax.jit(apply_fn)(params, x))


def scale_fc_row(tensors, ref64):
    """The classifier row of the largest |logit| off by 1e-3: that logit is off by ~1e-3."""
    row = int(np.unravel_index(np.abs(ref64).argmax(), ref64.shape)[1])
    tensors["fc.weight"][row] *= 1 + 1e-3


def scale_bn_gain(tensors, ref64):
    """One BN scale vector deep inside (layer3) off by 1e-3 relative."""
    tensors["layer3.1.bn2.weight"] *= 1 + 1e-3


@pytest.mark.parametrize("perturb", [scale_fc_row, scale_bn_gain])
def test_a_port_wrong_by_1e_3_relative_fails(resnet18, perturb):
    tensors, x, (ref64, ref32) = resnet18
    assert assert_parity(port_logits(tensors, x), ref64, ref32, "resnet18 unperturbed") <= 1.0
    wrong = {k: v.copy() for k, v in tensors.items()}
    perturb(wrong, ref64)
    logits = port_logits(wrong, x)
    # The bug is far larger than float32 noise, yet only ~1e-3 of the output scale.
    assert np.abs(logits - ref64).max() < 2e-3 * np.abs(ref64).max()
    with pytest.raises(AssertionError, match="exceeds tol"):
        assert_parity(logits, ref64, ref32, "resnet18 perturbed")


def test_tolerance_formula_and_power_guard():
    ref64 = np.linspace(-2.0, 1.0, 32)
    assert parity_tolerance(ref64, ref64) == AGREEMENT * EPS32 * 2.0  # exact float32: the floor
    noisy = ref64.copy()
    noisy[[3, 7]] += [1e-6, -3e-6]
    assert parity_tolerance(ref64, noisy) == pytest.approx(AGREEMENT * 3e-6)
    with pytest.raises(AssertionError, match="too ill-conditioned"):
        parity_tolerance(ref64, ref64 + 2e-4)  # float32 error 1e-4 of the scale
    with pytest.raises(AssertionError, match="compare at least 32"):
        parity_tolerance(ref64[:31], ref64[:31])
