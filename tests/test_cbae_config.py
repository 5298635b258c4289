"""CB-AE configs shaped like upstream's (Trustworthy-ML-Lab/posthoc-generative-cbm ``config/``).

Upstream (``models/basic.py``) supervises the first ``len(concept_names)`` groups of
``concept_bins``, one fewer when the names end with ``"unknown"``; later groups are the
unsupervised part. Its configs therefore come in three shapes, each mirrored below with the
same sections, keys, list-length relationships and kinds of values: names ending in
``"unknown"`` with all lists equally long (CelebA-HQ), names one shorter than bins and types
(CUB), and names as long as bins with no unsupervised group (the ``cc_*`` classifier configs).
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from test_convert_cbae import TorchCBAE  # noqa: E402

from cbcert.convert import cbae as convert  # noqa: E402
from cbcert.generators.cbae import CBAEConfig  # noqa: E402

CUB_NAMES = ["Small size 5 to 9 inches", "Perching like shape", "Solid breast pattern",
             "Black bill color", "Bill length shorter than head", "Black wing color",
             "Solid belly pattern", "All purpose bill shape", "Black upperparts color",
             "White underparts color"]
CELEBA_NAMES = ["attractive", "lipstick", "mouth-closed", "smiling", "cheekbones", "makeup",
                "gender", "eyebrows"]


def upstream_yaml(bins, names, types, latent=512, num_ws=14, dataset="cub", output=None) -> str:
    """An upstream StyleGAN2 CB-AE config, every section and key as upstream writes them."""
    document = {
        "dataset": {"name": dataset, "transforms_1": "(0.5)", "transforms_2": "(0.5)",
                    "img_size": 256, "batch_size": 16, "test_batch_size": 100,
                    "num_channels": 3},
        "model": {"pretrained": f"models/checkpoints/stylegan2-{dataset}-256x256.pkl",
                  "type": "cbae_stygan2", "latent_noise_dim": latent, "input_latent_dim": 10,
                  "has_concepts": True, "num_ws": num_ws,
                  "concepts": {"concept_bins": bins, "concept_names": names, "emb_size": 16,
                               "concept_output": list(bins) if output is None else output,
                               "types": types}},
        "train_config": {"epochs": 50, "recon_lr": 0.0002, "conc_lr": 0.0002,
                         "betas": "(.5, .99)", "save_model": True, "use_cuda": True,
                         "log_interval": 100, "steps_per_epoch": 1000, "pl_prob_thresh": 0.75,
                         "plot_loss": True},
        "evaluation": {"generation": True, "save_images": True, "save_concept_image": True,
                       "save_results": True},
    }
    return yaml.safe_dump(document, sort_keys=False)


def model_section(text: str) -> dict:
    return yaml.safe_load(text)["model"]


CUB = upstream_yaml([2] * 10 + [40], CUB_NAMES, ["bin"] * 10 + ["cat"])


def test_cub_config_pairs_ten_names_with_the_first_ten_of_eleven_groups():
    config = convert.config_from_upstream(model_section(CUB))
    assert config.concept_names == tuple(CUB_NAMES)
    assert (config.latent_dim, config.num_ws) == (512, 14)
    assert (config.num_concepts, config.num_unsup, config.concept_dim) == (10, 40, 60)


@pytest.mark.parametrize("bins,names,types,expected", [
    # CelebA-HQ (cbae_stygan2/celebahq.yaml): 9 names ending in "unknown", 9 bins, 9 types
    ([2] * 8 + [10], [*CELEBA_NAMES, "unknown"], ["bin"] * 8 + ["cat"], (8, 10)),
    # cbae_stygan2_thr90: the same with an unsupervised group of 40
    ([2] * 8 + [40], [*CELEBA_NAMES, "unknown"], ["bin"] * 8 + ["cat"], (8, 40)),
    # celebahq40.yaml: 41 names (40 attributes + "unknown"), 41 bins and types
    ([2] * 40 + [10], [f"attribute_{i}" for i in range(40)] + ["unknown"],
     ["bin"] * 40 + ["cat"], (40, 10)),
    # cc_stygan2_thr90: 8 names, 8 bins, 8 types, no unsupervised group
    ([2] * 8, CELEBA_NAMES, ["bin"] * 8, (8, 0)),
])
def test_every_upstream_shape_is_read(bins, names, types, expected):
    config = convert.config_from_upstream(model_section(upstream_yaml(bins, names, types)))
    k, u = expected
    assert config.concept_names == tuple(names[:k])
    assert (config.num_concepts, config.num_unsup, config.concept_dim) == (k, u, 2 * k + u)


def test_cub_shaped_checkpoint_loads_and_encodes_like_pytorch(tmp_path):
    """End to end: an upstream-layout state_dict of the CUB width (60) with its YAML."""
    dw, num_ws = 16, 3
    (tmp_path / "cub.yaml").write_text(upstream_yaml([2] * 10 + [40], CUB_NAMES,
                                                     ["bin"] * 10 + ["cat"], latent=dw,
                                                     num_ws=num_ws))
    torch.manual_seed(0)
    reference = TorchCBAE(dw, 60, num_ws).eval()
    torch.save(reference.state_dict(), tmp_path / "cub.pt")
    model = convert.load_cbae(tmp_path / "cub.pt", tmp_path / "cub.yaml")
    assert model.config.concept_names == tuple(CUB_NAMES) and model.config.num_unsup == 40
    ws = np.random.default_rng(0).normal(size=(4, num_ws, dw)).astype(np.float32)
    with torch.no_grad():
        logits = reference.enc(torch.from_numpy(ws)).numpy()
    np.testing.assert_allclose(model.encode_upstream(ws), logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(types=["bin", "cat", "bin", "cat"]),
     "concept group 1 ('b'): type='cat', bins=2; cbcert certifies binary concepts"),
    (lambda c: c.update(concept_bins=[2, 3, 2, 4], concept_output=[2, 3, 2, 4]),
     "concept group 1 ('b'): type='bin', bins=3"),
    (lambda c: c.update(concept_names=["a", "unknown", "b", "c"]),
     "concept_names has 'unknown' at position 1"),
    (lambda c: c.update(concept_names=["a", "b", "c", "d", "e"]),
     "concept_names names 5 supervised concepts but concept_bins has only 4 groups"),
    (lambda c: c.update(types=["bin", "bin"]),
     "types has 2 entries; the 3 supervised concepts need one each"),
    (lambda c: c.update(concept_output=[2, 2, 2, 8]),
     "model.concepts.concept_output=[2, 2, 2, 8] differs from concept_bins=[2, 2, 2, 4]"),
    (lambda c: c.update(concept_bins=[2, 2, "2", 4]),
     "model.concepts.concept_bins=[2, 2, '2', 4]; expected a list of int"),
    (lambda c: c.update(concept_bins=[2, 2, 2, 0], concept_output=[2, 2, 2, 0]),
     "concept_bins[3]=0; allowed: integers >= 1"),
    (lambda c: c.pop("types"), "missing key model.concepts.types"),
])
def test_configs_upstream_would_misread_are_refused_naming_the_key(tmp_path, edit, message):
    text = upstream_yaml([2, 2, 2, 4], ["a", "b", "c", "unknown"], ["bin"] * 3 + ["cat"],
                         latent=8, num_ws=2)
    document = yaml.safe_load(text)
    edit(document["model"]["concepts"])
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(document))
    with pytest.raises(ValueError) as caught:
        convert.load_cbae(tmp_path / "missing.pt", tmp_path / "c.yaml")
    assert str(caught.value).startswith(f"{tmp_path / 'c.yaml'}: ")
    assert message in str(caught.value)


def test_configs_of_other_generators_name_the_missing_key():
    """DCGAN/PGAN/DDPM configs (no ``num_ws``) belong to CB-AEs cbcert does not port."""
    document = yaml.safe_load(CUB)
    del document["model"]["num_ws"]
    document["model"].update(type="cbae_ddpm", latent_shape=[512, 2, 2])
    with pytest.raises(ValueError, match="missing key model.num_ws"):
        convert.config_from_upstream(document["model"])


def test_from_upstream_pairs_by_position_not_by_length():
    """The K-th name pairs with the K-th group whatever follows; the rest is unsupervised."""
    config = CBAEConfig.from_upstream(8, 2, [2, 2, 3, 5], ["x", "y"], ["bin", "bin", "cat"])
    assert config.concept_names == ("x", "y") and config.num_unsup == 8
