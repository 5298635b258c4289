"""Parity and strictness of the CB-AE port and converter.

The PyTorch reference is written here from the paper's description of the CB-AE (Kulkarni et
al., CVPR 2025): mean over the per-layer latents, ``3 × [Linear, LeakyReLU(0.1), BatchNorm1d]``
then a Linear, mirrored for the decoder, whose output is tiled over the layers. Its state_dict
key names are upstream's ``nn.Sequential`` indices. Every weight and BN statistic is random.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
nn = torch.nn

from cbcert.convert import cbae as convert  # noqa: E402
from cbcert.generators.cbae import CBAEConfig, swap_intervention, swap_pairs  # noqa: E402

TOLERANCE = 1e-5
DW, NUM_WS, BATCH = 32, 5, 6
BINS = [2, 2, 2, 4]  # three binary concepts and an unsupervised group of 4
NAMES = ["smiling", "male", "glasses", "unknown"]
TYPES = ["bin", "bin", "bin", "cat"]


def torch_mlp(din, dhidden, dout):
    layers = []
    for i in range(3):
        layers += [nn.Linear(din if i == 0 else dhidden, dhidden), nn.LeakyReLU(0.1),
                   nn.BatchNorm1d(dhidden)]
    return nn.Sequential(*layers, nn.Linear(dhidden, dout))


class TorchCBAE(nn.Module):
    def __init__(self, dw, concept_dim, num_ws):
        super().__init__()
        self.encoder = torch_mlp(dw, dw, concept_dim)
        self.decoder = torch_mlp(concept_dim, dw, dw)
        self.num_ws = num_ws

    def enc(self, ws):
        return self.encoder(ws.mean(dim=1))

    def dec(self, c):
        return self.decoder(c).unsqueeze(1).repeat(1, self.num_ws, 1)


def torch_swap(concepts, start, value):
    """The swap described in the paper's code release: wanted bin gets the max logit."""
    out = concepts.clone()
    block = out[:, start:start + 2]
    old = block[:, value].clone()
    best, where = block.max(dim=1)
    block[:, value] = best
    for row, (index, old_value) in enumerate(zip(where, old, strict=True)):
        block[row, index] = old_value
    return out


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = TorchCBAE(DW, sum(BINS), NUM_WS)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.3)
                module.running_mean.normal_(0, 0.5)
                module.running_var.uniform_(0.3, 2.0)
                module.num_batches_tracked.fill_(7)
    return model.eval()


@pytest.fixture(scope="module")
def config():
    return CBAEConfig.from_upstream(DW, NUM_WS, BINS, NAMES, TYPES)


@pytest.fixture(scope="module")
def ported(reference, config):
    tensors = {k: v.numpy() for k, v in reference.state_dict().items()}
    return convert.cbae_from_state_dict(config, tensors)


def test_config_from_upstream_bins(config):
    assert config.concept_names == ("smiling", "male", "glasses")
    assert (config.num_unsup, config.concept_dim) == (4, 10)


@pytest.mark.parametrize("bins,types", [([2, 3, 2, 4], TYPES),  # non-binary "bin" group
                                        ([2, 2, 2, 4], ["bin", "cat", "bin", "cat"])])
def test_config_rejects_unsupported_groups(bins, types):
    with pytest.raises(ValueError, match="concept group 1"):
        CBAEConfig.from_upstream(DW, NUM_WS, bins, NAMES, types)


def test_encoder_decoder_parity(reference, ported):
    rng = np.random.default_rng(1)
    ws = rng.normal(size=(BATCH, NUM_WS, DW)).astype(np.float32)
    with torch.no_grad():
        logits = reference.enc(torch.from_numpy(ws)).numpy()
        decoded = reference.dec(torch.from_numpy(logits)).numpy()
    ours = np.asarray(ported.encode_upstream(jnp.asarray(ws)))
    np.testing.assert_allclose(ours, logits, atol=TOLERANCE, rtol=0)
    ours_dec = np.asarray(ported.decode_upstream(jnp.asarray(logits)))
    np.testing.assert_allclose(ours_dec, decoded, atol=TOLERANCE, rtol=0)
    assert np.abs(logits).max() > 0.1  # the comparison is not between near-zero outputs

    # cbcert layout: [c+, c−] pairs (upstream index 1 = present), then u; flat w.
    c = np.asarray(ported.encode(jnp.asarray(ws.reshape(BATCH, -1))))
    np.testing.assert_allclose(c[:, 0:6:2], logits[:, 1:6:2], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(c[:, 1:6:2], logits[:, 0:6:2], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(c[:, 6:], logits[:, 6:], atol=TOLERANCE, rtol=0)
    w = np.asarray(ported.decode(jnp.asarray(c)))
    np.testing.assert_allclose(w, decoded.reshape(BATCH, -1), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("value", [0, 1])
def test_swap_intervention_and_blend_parity(reference, ported, config, value):
    rng = np.random.default_rng(2)
    ws = rng.normal(size=(BATCH, NUM_WS, DW)).astype(np.float32)
    concept, alpha = 1, 0.7
    with torch.no_grad():
        latent = torch.from_numpy(ws)
        new = torch_swap(reference.enc(latent), 2 * concept, value)
        expected = ((1 - alpha) * latent + alpha * reference.dec(new)).numpy()
    got = np.asarray(ported.intervene(jnp.asarray(ws.reshape(BATCH, -1)), concept,
                                      bool(value), alpha))
    np.testing.assert_allclose(got, expected.reshape(BATCH, -1), atol=TOLERANCE, rtol=0)
    state = np.asarray(ported.encode(jnp.asarray(ws.reshape(BATCH, -1))))
    swapped = np.asarray(swap_intervention(jnp.asarray(state), concept, bool(value)))
    assert np.all((swapped[:, 2 * concept] > swapped[:, 2 * concept + 1]) == bool(value))
    with pytest.raises(ValueError, match="concept=3"):
        ported.intervene(jnp.asarray(ws.reshape(BATCH, -1)), 3, True, alpha)


def test_swap_pairs_is_an_involution():
    c = jax.random.normal(jax.random.key(0), (4, 10))
    np.testing.assert_array_equal(swap_pairs(swap_pairs(c, 3), 3), c)
    np.testing.assert_array_equal(swap_pairs(c, 3)[:, 6:], c[:, 6:])


def test_strict_keys(reference, config):
    tensors = {k: v.numpy() for k, v in reference.state_dict().items()}
    with pytest.raises(ValueError, match=r"encoder\.10\.weight"):
        convert.cbae_from_state_dict(config, {**tensors, "encoder.10.weight": np.zeros(3)})
    missing = {k: v for k, v in tensors.items() if k != "decoder.5.running_var"}
    with pytest.raises(ValueError, match=r"decoder\.5\.running_var"):
        convert.cbae_from_state_dict(config, missing)
    wrong = CBAEConfig(DW, NUM_WS, ("a", "b"), 4)  # one concept too few
    with pytest.raises(ValueError, match=r"encoder\.9\.weight: checkpoint shape \(10, 32\)"):
        convert.cbae_from_state_dict(wrong, tensors)


def test_load_cbae_from_files(reference, ported, tmp_path):
    torch.save(reference.state_dict(), tmp_path / "cbae.pt")
    names = ", ".join(f'"{n}"' for n in NAMES)
    (tmp_path / "config.yaml").write_text(
        f"model:\n  latent_noise_dim: {DW}\n  num_ws: {NUM_WS}\n  concepts:\n"
        f"    concept_bins: {BINS}\n    concept_names: [{names}]\n"
        f"    types: {TYPES}\n".replace("'", '"'))
    loaded = convert.load_cbae(tmp_path / "cbae.pt", tmp_path / "config.yaml")
    w = jax.random.normal(jax.random.key(3), (2, NUM_WS * DW))
    np.testing.assert_array_equal(loaded.encode(w), ported.encode(w))
    (tmp_path / "bad.yaml").write_text("model:\n  num_ws: 3\n")
    with pytest.raises(ValueError, match="latent_noise_dim"):
        convert.load_cbae(tmp_path / "cbae.pt", tmp_path / "bad.yaml")
