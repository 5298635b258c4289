"""Parity and strictness of the CB-AE port and converter.

The PyTorch reference is written here from the paper's description of the CB-AE (Kulkarni et
al., CVPR 2025): mean over the per-layer latents, ``3 × [Linear, LeakyReLU(0.1), BatchNorm1d]``
then a Linear, mirrored for the decoder, whose output is tiled over the layers. Its state_dict
key names are upstream's ``nn.Sequential`` indices. Every weight and BN statistic is random. The
port runs in float32 and is compared with the reference in float64 (``parity.assert_parity``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
nn = torch.nn

from parity import assert_parity, float64_copy  # noqa: E402

from cbcert import cli  # noqa: E402
from cbcert.concepts import set_concept, swap_pairs  # noqa: E402
from cbcert.convert import cbae as convert  # noqa: E402
from cbcert.generators.cbae import CBAEConfig  # noqa: E402
from cbcert.io import registry  # noqa: E402

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
def reference64(reference):
    return float64_copy(reference)


def to_cbcert(logits: np.ndarray) -> np.ndarray:
    """Upstream concept logits -> cbcert's layout: ``[c+, c−]`` pairs (upstream index 1 is
    "present"), then the unsupervised block."""
    out = logits.copy()
    out[:, 0:6:2], out[:, 1:6:2] = logits[:, 1:6:2], logits[:, 0:6:2]
    return out


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


def test_encoder_decoder_parity(reference, reference64, ported):
    rng = np.random.default_rng(1)
    ws = rng.normal(size=(BATCH, NUM_WS, DW)).astype(np.float32)
    with torch.no_grad():
        logits = reference.enc(torch.from_numpy(ws)).numpy()
        logits64 = reference64.enc(torch.from_numpy(ws).double()).numpy()
        # Both decoders read the float32 logits: the port decodes the same numbers.
        decoded = reference.dec(torch.from_numpy(logits)).numpy()
        decoded64 = reference64.dec(torch.from_numpy(logits).double()).numpy()
    ours = np.asarray(ported.encode_upstream(jnp.asarray(ws)))
    assert_parity(ours, logits64, logits, "cbae encoder")
    ours_dec = np.asarray(ported.decode_upstream(jnp.asarray(logits)))
    assert_parity(ours_dec, decoded64, decoded, "cbae decoder")
    assert np.abs(logits).max() > 0.1  # the comparison is not between near-zero outputs

    # cbcert layout: [c+, c−] pairs (upstream index 1 = present), then u; flat w.
    c = np.asarray(ported.encode(jnp.asarray(ws.reshape(BATCH, -1))))
    assert_parity(c, to_cbcert(logits64), to_cbcert(logits), "cbae encode, cbcert layout")
    w = np.asarray(ported.decode(jnp.asarray(to_cbcert(logits))))
    assert_parity(w, decoded64.reshape(BATCH, -1), decoded.reshape(BATCH, -1),
                  "cbae decode, cbcert layout")


@pytest.mark.parametrize("value", [0, 1])
def test_swap_intervention_and_blend_parity(reference, reference64, ported, config, value):
    rng = np.random.default_rng(2)
    ws = rng.normal(size=(BATCH, NUM_WS, DW)).astype(np.float32)
    concept, alpha = 1, 0.7

    def blend(model, latent):
        new = torch_swap(model.enc(latent), 2 * concept, value)
        return ((1 - alpha) * latent + alpha * model.dec(new)).numpy().reshape(BATCH, -1)

    with torch.no_grad():
        expected = blend(reference, torch.from_numpy(ws))
        expected64 = blend(reference64, torch.from_numpy(ws).double())
    got = np.asarray(ported.intervene(jnp.asarray(ws.reshape(BATCH, -1)), concept,
                                      bool(value), alpha))
    assert_parity(got, expected64, expected, f"cbae intervention value={value}")
    state = np.asarray(ported.encode(jnp.asarray(ws.reshape(BATCH, -1))))
    swapped = np.asarray(set_concept(jnp.asarray(state), concept, bool(value)))
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
    # `certify convert cbae` writes the same module once, in the one checkpoint format.
    result = CliRunner().invoke(cli.main, ["convert", "cbae", str(tmp_path / "cbae.pt"),
                                           str(tmp_path / "out"), "--config",
                                           str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    restored, manifest = registry.load_module(tmp_path / "out")
    assert manifest["kind"] == "cbae" and set(manifest["sources"]) == {"checkpoint", "config"}
    assert restored.config == ported.config
    np.testing.assert_array_equal(restored.encode(w), ported.encode(w))
    c = ported.encode(w)
    np.testing.assert_array_equal(restored.decode(c), ported.decode(c))
    result = CliRunner().invoke(cli.main, ["convert", "cbae", str(tmp_path / "cbae.pt"),
                                           str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "--config: not given; kind 'cbae' needs it" in result.output, result.output
    (tmp_path / "bad.yaml").write_text("model:\n  num_ws: 3\n")
    with pytest.raises(ValueError, match="latent_noise_dim"):
        convert.load_cbae(tmp_path / "cbae.pt", tmp_path / "bad.yaml")
