"""PCBM / PCBM-h conversion: parity with a PyTorch reference, restricted unpickling, strictness.

The reference modules are written here from the public structure of mertyg/post-hoc-cbm
(``PosthocLinearCBM``: ``cavs``, ``intercepts``, ``norms``, ``classifier``; ``PosthocHybridCBM``:
``bottleneck``, ``residual_classifier``) and registered as ``models.pcbm_utils`` only while
``torch.save`` pickles them, exactly as the upstream scripts do. Measured max |logit error|
(float32 port vs float64 head, ResNet-18 backbone, 32 px): 3.6e-7 at logit scale ~2.
"""

from __future__ import annotations

import pickle
import sys
import types

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # JAX already uses the cores
nn = torch.nn

from test_convert_resnet import images, state_dict_numpy, torch_forward, torch_resnet  # noqa: E402

from cbcert.convert import common, convert, load_converted, pcbm, pickles  # noqa: E402

TOLERANCE = 1e-4
K, D = 7, 512  # concepts, ResNet-18 embedding width


class PosthocLinearCBM(nn.Module):
    def __init__(self, bank, weight: np.ndarray, bias: np.ndarray):
        super().__init__()
        self.backbone_name = "resnet18"
        self.cavs = torch.tensor(bank["vectors"]).float()
        self.intercepts = torch.tensor(bank["intercepts"]).float()
        self.norms = torch.norm(self.cavs, p=2, dim=1, keepdim=True)
        self.names = list(bank["names"])
        self.n_concepts = len(self.names)
        self.n_classes = max(2, weight.shape[0])
        self.idx_to_class = {np.int64(i): f"class {i}" for i in range(self.n_classes)}
        self.classifier = nn.Linear(self.n_concepts, self.n_classes)
        # As set_weights does with scikit-learn's coef_: float64, [1, K] for binary tasks.
        self.classifier.weight.data = torch.tensor(weight)
        self.classifier.bias.data = torch.tensor(bias)

    def forward(self, emb):
        margins = ((self.cavs @ emb.T + self.intercepts) / self.norms).T
        # The scikit-learn head is float64 (upstream evaluates it in scikit-learn); float64 is
        # the exact reference for the float32 port.
        return self.classifier(margins.to(self.classifier.weight.dtype)).float()


class PosthocHybridCBM(nn.Module):
    def __init__(self, bottleneck, seed):
        super().__init__()
        self.bottleneck = bottleneck
        self.d_embedding = bottleneck.cavs.shape[1]
        self.n_classes = bottleneck.n_classes
        self.residual_classifier = nn.Linear(self.d_embedding, self.n_classes)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.residual_classifier.weight.copy_(0.05 * torch.randn(
                self.residual_classifier.weight.shape, generator=gen))
            self.residual_classifier.bias.copy_(torch.randn(self.n_classes, generator=gen))

    def forward(self, emb):
        b = self.bottleneck
        margins = ((b.cavs @ emb.T + b.intercepts) / b.norms).T
        return b.classifier(margins) + self.residual_classifier(emb)


def save_as_upstream(module: nn.Module, path) -> None:
    """torch.save the whole module with the class path the upstream scripts produce."""
    package, upstream = types.ModuleType("models"), types.ModuleType("models.pcbm_utils")
    upstream.PosthocLinearCBM, upstream.PosthocHybridCBM = PosthocLinearCBM, PosthocHybridCBM
    package.pcbm_utils = upstream
    saved = {name: sys.modules.get(name) for name in ("models", "models.pcbm_utils")}
    originals = {cls: cls.__module__ for cls in (PosthocLinearCBM, PosthocHybridCBM)}
    sys.modules.update({"models": package, "models.pcbm_utils": upstream})
    try:
        for cls in originals:
            cls.__module__ = "models.pcbm_utils"
        torch.save(module, path)
    finally:
        for cls, name in originals.items():
            cls.__module__ = name
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value


def make_bank(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    names = [f"concept_{i}" for i in range(K)]
    coefs = [rng.standard_normal((1, D)) * rng.uniform(0.1, 3.0) for _ in names]  # float64
    intercepts = [rng.standard_normal(1) for _ in names]
    pickled = {n: (c, 0.9, 0.8, b, {"max": np.float64(1.0), "pos_count": np.int64(50)})
               for n, c, b in zip(names, coefs, intercepts, strict=True)}
    return {"pickle": pickled, "names": names,
            "vectors": np.concatenate(coefs), "intercepts": np.stack(intercepts)}


@pytest.fixture(scope="module")
def backbone():
    reference = torch_resnet("resnet18", num_classes=4, seed=11)
    return reference, state_dict_numpy(reference)


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    bank = make_bank(seed=12)
    path = tmp_path_factory.mktemp("bank") / "cub_resnet18_0.1_50.pkl"
    with open(path, "wb") as handle:
        pickle.dump(bank["pickle"], handle)
    return bank, path


def reference_logits(backbone_model, head, x):
    return torch_forward(lambda t: head(backbone_model.embed(t)), x)


def head_weights(outputs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((outputs, K)), rng.standard_normal(outputs)  # float64


def test_pcbm_with_float64_head_matches_pytorch(backbone, bank, tmp_path):
    reference, tensors = backbone
    head = PosthocLinearCBM(bank[0], *head_weights(3, seed=13)).eval()
    save_as_upstream(head, tmp_path / "pcbm.ckpt")
    model, checkpoint = pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet18", tensors,
                                                   concept_bank_path=bank[1])
    assert checkpoint.concept_names == tuple(bank[0]["names"]) and not checkpoint.hybrid
    x = images(2, 32, seed=14)
    apply_fn, params = common.pure_apply(model, lambda m, x: (m(x), m.concept_scores(x)))
    logits, scores = jax.jit(apply_fn)(params, x)
    expected = reference_logits(reference, head, x)
    assert np.abs(expected).max() > 0.1
    np.testing.assert_allclose(np.asarray(logits), expected, atol=TOLERANCE, rtol=0)
    expected_scores = torch_forward(
        lambda t: ((head.cavs @ reference.embed(t).T + head.intercepts) / head.norms).T, x)
    np.testing.assert_allclose(np.asarray(scores), expected_scores, atol=TOLERANCE, rtol=0)


def test_binary_single_logit_becomes_zero_and_logit(backbone, bank, tmp_path):
    reference, tensors = backbone
    head = PosthocLinearCBM(bank[0], *head_weights(1, seed=15)).eval()
    save_as_upstream(head, tmp_path / "binary.ckpt")
    model, _ = pcbm.pcbm_from_checkpoints(tmp_path / "binary.ckpt", "resnet18", tensors)
    x = images(2, 32, seed=16)
    logits = np.asarray(jax.jit(lambda m, x: m(x))(model, x))
    single = reference_logits(reference, head, x)  # [B, 1]
    assert logits.shape == (2, 2)
    np.testing.assert_array_equal(logits[:, 0], 0.0)
    np.testing.assert_allclose(logits[:, 1:], single, atol=TOLERANCE, rtol=0)


def test_hybrid_matches_pytorch_and_round_trips(backbone, bank, tmp_path):
    reference, tensors = backbone
    hybrid = PosthocHybridCBM(PosthocLinearCBM(bank[0], *head_weights(3, seed=17)), seed=18)
    hybrid = hybrid.float().eval()  # as train_pcbm_h.py does before saving
    save_as_upstream(hybrid, tmp_path / "pcbm-hybrid.ckpt")
    torch.save(reference.state_dict(), tmp_path / "backbone.pth")
    manifest = convert("pcbm", tmp_path / "pcbm-hybrid.ckpt", tmp_path / "out",
                       backbone="resnet18", backbone_path=tmp_path / "backbone.pth",
                       concept_bank_path=bank[1])
    assert manifest["config"]["residual_outputs"] == 3
    assert manifest["concept_names"] == bank[0]["names"]
    assert set(manifest["sources"]) == {"checkpoint", "backbone", "concept_bank"}
    apply_fn, params, loaded = load_converted(tmp_path / "out")
    assert loaded == manifest
    x = images(2, 32, seed=19)
    np.testing.assert_allclose(np.asarray(jax.jit(apply_fn)(params, x)),
                               reference_logits(reference, hybrid, x), atol=TOLERANCE, rtol=0)


def test_concept_bank_matches_reference_construction(bank):
    loaded = pcbm.load_concept_bank(bank[1])
    vectors32 = torch.tensor(bank[0]["vectors"]).float()
    assert loaded.names == tuple(bank[0]["names"])
    np.testing.assert_array_equal(loaded.vectors, vectors32.numpy())
    np.testing.assert_array_equal(loaded.intercepts, bank[0]["intercepts"][:, 0].astype(np.float32))
    np.testing.assert_allclose(loaded.norms, torch.norm(vectors32, dim=1).numpy(), rtol=1e-6)


def test_a_different_bank_is_refused(backbone, bank, tmp_path):
    _, tensors = backbone
    head = PosthocLinearCBM(bank[0], *head_weights(3, seed=20))
    save_as_upstream(head, tmp_path / "pcbm.ckpt")
    other = make_bank(seed=21)
    with open(tmp_path / "other.pkl", "wb") as handle:
        pickle.dump(other["pickle"], handle)
    with pytest.raises(ValueError, match="CAVs differ from the ones stored"):
        pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet18", tensors,
                                   concept_bank_path=tmp_path / "other.pkl")


def test_cav_width_mismatch_and_extra_tensor_are_named(backbone, bank, tmp_path):
    _, tensors = backbone
    head = PosthocLinearCBM(bank[0], *head_weights(3, seed=22))
    head.register_buffer("temperature", torch.ones(1))
    save_as_upstream(head, tmp_path / "pcbm.ckpt")
    with pytest.raises(ValueError, match=r"unknown keys \(1\)[\s\S]*temperature"):
        pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet18", tensors)
    with pytest.raises(ValueError, match=r"cavs: checkpoint shape \(7, 512\), architecture "
                                         r"expects \(7, 2048\)"):
        pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet50",
                                   {"fc.weight": np.zeros((4, 2048), np.float32)})


class Exploit:
    def __reduce__(self):
        return (print, ("pwned",))


def test_restricted_unpickler_refuses_foreign_globals(tmp_path, capsys):
    path = tmp_path / "bank.pkl"
    with open(path, "wb") as handle:
        pickle.dump({"c": Exploit()}, handle)
    with pytest.raises(ValueError, match=r"refusing to load global builtins\.print"):
        pcbm.load_concept_bank(path)
    assert "pwned" not in capsys.readouterr().out
    torch.save({"model": nn.Linear(2, 2)}, tmp_path / "module.pt")
    with pytest.raises(ValueError, match=r"torch\.nn\.modules\.linear\.Linear"):
        pickles.load_torch_zip(tmp_path / "module.pt")
