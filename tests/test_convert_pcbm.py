"""PCBM / PCBM-h conversion: parity with a PyTorch reference, restricted unpickling, strictness.

The reference modules are written here from the public structure of mertyg/post-hoc-cbm
(``PosthocLinearCBM``: ``cavs``, ``intercepts``, ``norms``, ``classifier``; ``PosthocHybridCBM``:
``bottleneck``, ``residual_classifier``) and registered as ``models.pcbm_utils`` only while
``torch.save`` pickles them, exactly as the upstream scripts do. The backbone is a torchvision
ResNet-18 or, as in post-hoc-cbm's CUB setup, pytorchcv's ``resnet18_cub`` (reference written
here from pytorchcv's module structure, so its state_dict keys are pytorchcv's). Ports run in
float32 and are compared with the whole reference in float64 (``parity.assert_parity``).
"""

from __future__ import annotations

import copy
import pickle
import sys
import types

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # JAX already uses the cores
nn = torch.nn

from click.testing import CliRunner  # noqa: E402
from parity import assert_parity, float64_copy  # noqa: E402
from test_convert_resnet import (  # noqa: E402
    images,
    randomize,
    state_dict_numpy,
    torch_pair,
    torch_resnet,
)

from cbcert import cli  # noqa: E402
from cbcert.convert import convert, pcbm, pickles, pytorchcv  # noqa: E402
from cbcert.io.registry import load_converted, pure_apply  # noqa: E402

K, D = 7, 512  # concepts, ResNet-18 embedding width
CUB_SIZE = 193  # the smallest input whose last feature map is 7x7 (odd: exercises the floors)
CUB_WIDTH = 16  # concepts, classes: 2 images x 16 = the 32 outputs a parity check needs


class PosthocLinearCBM(nn.Module):
    def __init__(self, bank, weight: np.ndarray, bias: np.ndarray, backbone_name="resnet18"):
        super().__init__()
        self.backbone_name = backbone_name
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
        # The scikit-learn head is float64 (upstream evaluates it in scikit-learn); the output
        # takes the embedding's dtype (float32, or float64 in a float64 reference).
        return self.classifier(margins.to(self.classifier.weight.dtype)).to(emb.dtype)


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


def make_bank(seed: int, k: int = K) -> dict:
    rng = np.random.default_rng(seed)
    names = [f"concept_{i}" for i in range(k)]
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


def head_float64(head: nn.Module) -> nn.Module:
    """``float64_copy`` of a PCBM head, including the bank tensors kept as plain attributes."""
    head = float64_copy(head)
    bottleneck = getattr(head, "bottleneck", head)
    for name in ("cavs", "intercepts", "norms"):
        setattr(bottleneck, name, getattr(bottleneck, name).double())
    return head


def head_float32(head: nn.Module) -> nn.Module:
    """The head evaluated wholly in float32, its float64 scikit-learn weights rounded as the
    float32 port's are, so that its float32 error includes that rounding."""
    return copy.deepcopy(head).float()


def reference_logits(backbone_model, head, x):
    """``(float64, float32)`` logits of the whole reference (backbone and head)."""
    backbone64, head64 = float64_copy(backbone_model), head_float64(head)
    head32 = head_float32(head)
    return torch_pair(lambda t: head32(backbone_model.embed(t)),
                      lambda t: head64(backbone64.embed(t)), x)


def margins(head, embedding):
    """Concept margins ``(V e + b) / ||V||`` of a PCBM or PCBM-h head."""
    bank = getattr(head, "bottleneck", head)
    return ((bank.cavs @ embedding.T + bank.intercepts) / bank.norms).T


def head_weights(outputs: int, seed: int, k: int = K) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((outputs, k)), rng.standard_normal(outputs)  # float64


def test_pcbm_with_float64_head_matches_pytorch(backbone, bank, tmp_path):
    reference, tensors = backbone
    head = PosthocLinearCBM(bank[0], *head_weights(3, seed=13)).eval()
    save_as_upstream(head, tmp_path / "pcbm.ckpt")
    model, checkpoint = pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet18", tensors,
                                                   concept_bank_path=bank[1])
    assert checkpoint.concept_names == tuple(bank[0]["names"]) and not checkpoint.hybrid
    x = images(16, 32, seed=14)
    apply_fn, params = pure_apply(model, lambda m, x: (m(x), m.concept_scores(x),
                                                       *m.class_head()))
    logits, scores, w, b = jax.jit(apply_fn)(params, x)
    np.testing.assert_allclose(np.asarray(scores) @ np.asarray(w).T + np.asarray(b), logits,
                               rtol=1e-5, atol=1e-5)  # the head as (W, b): explanations
    expected = reference_logits(reference, head, x)
    assert np.abs(expected[0]).max() > 0.1
    assert_parity(logits, *expected, "pcbm logits")
    reference64, head64 = float64_copy(reference), head_float64(head)
    expected_scores = torch_pair(lambda t: margins(head, reference.embed(t)),
                                 lambda t: margins(head64, reference64.embed(t)), x)
    assert_parity(scores, *expected_scores, "pcbm concept scores")


def test_binary_single_logit_becomes_zero_and_logit(backbone, bank, tmp_path):
    reference, tensors = backbone
    head = PosthocLinearCBM(bank[0], *head_weights(1, seed=15)).eval()
    save_as_upstream(head, tmp_path / "binary.ckpt")
    model, _ = pcbm.pcbm_from_checkpoints(tmp_path / "binary.ckpt", "resnet18", tensors)
    x = images(32, 32, seed=16)
    logits, r, w, b = (np.asarray(a, np.float64) for a in jax.jit(
        lambda m, x: (m(x), m.concept_scores(x), *m.class_head()))(model, x))
    single = reference_logits(reference, head, x)  # [B, 1] each
    assert logits.shape == (32, 2)
    np.testing.assert_array_equal(logits[:, 0], 0.0)
    assert_parity(logits[:, 1:], *single, "pcbm binary logit")
    # As a two-class head (explanations): r Wᵀ + b = the logits up to a shift common to both
    # classes, W = [-w/2 ; w/2]: same softmax, evidence ∓ r_i w_i / 2 for each class.
    two = r @ w.T + b
    np.testing.assert_allclose(two[:, 1] - two[:, 0], logits[:, 1] - logits[:, 0], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(w[0], -w[1])


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
    x = images(16, 32, seed=19)
    assert_parity(jax.jit(apply_fn)(params, x), *reference_logits(reference, hybrid, x),
                  "pcbm-h converted")


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


def test_a_pcbm_pickle_without_pcbm_structure_is_refused_by_name(bank, tmp_path):
    """A hybrid whose bottleneck was removed (crafted or damaged) is a clear error, not a
    KeyError from deep inside the reader."""
    hybrid = PosthocHybridCBM(PosthocLinearCBM(bank[0], *head_weights(3, seed=17)), seed=18)
    del hybrid.bottleneck
    save_as_upstream(hybrid, tmp_path / "broken.ckpt")
    with pytest.raises(ValueError, match="broken.ckpt.*not a post-hoc-cbm .*PosthocHybridCBM"):
        pcbm.load_pcbm_checkpoint(tmp_path / "broken.ckpt")


# ------------------------------------------------------------------ pytorchcv resnet18_cub backbone


class TorchConvBlock(nn.Module):
    """pytorchcv ``ConvBlock``: ``conv`` (no bias, padding k // 2), ``bn``, optional ReLU."""

    def __init__(self, cin, cout, kernel, stride, activate=True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.activate = activate

    def forward(self, x):
        x = self.bn(self.conv(x))
        return torch.relu(x) if self.activate else x


class TorchResBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = TorchConvBlock(cin, cout, 3, stride)
        self.conv2 = TorchConvBlock(cout, cout, 3, 1, activate=False)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class TorchResUnit(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = TorchResBlock(cin, cout, stride)
        self.resize_identity = cin != cout or stride != 1
        if self.resize_identity:
            self.identity_conv = TorchConvBlock(cin, cout, 1, stride, activate=False)

    def forward(self, x):
        identity = self.identity_conv(x) if self.resize_identity else x
        return torch.relu(self.body(x) + identity)


class TorchInitBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = TorchConvBlock(3, 64, 7, 2)
        self.pool = nn.MaxPool2d(3, 2, 1)

    def forward(self, x):
        return self.pool(self.conv(x))


class TorchPytorchcvResNet18(nn.Module):
    """pytorchcv's ``resnet18_cub`` structure (same module names, so the same state_dict keys)."""

    def __init__(self, num_classes=200):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("init_block", TorchInitBlock())
        cin = 64
        for i in range(4):
            stage = nn.Sequential()
            cout = 64 * 2**i
            for j in range(2):
                stage.add_module(f"unit{j + 1}", TorchResUnit(cin, cout, 2 if j == 0 and i else 1))
                cin = cout
            self.features.add_module(f"stage{i + 1}", stage)
        self.features.add_module("final_pool", nn.AvgPool2d(7, stride=1))
        self.output = nn.Linear(cin, num_classes)

    def embed(self, x):
        """post-hoc-cbm's ``ResNetBottom``: every child but ``output``, flattened."""
        return torch.flatten(self.features(x), 1)

    def forward(self, x):
        return self.output(self.embed(x))


@pytest.fixture(scope="module")
def cub():
    """The reference, its tensors, 193 px images and the ``(float64, float32)`` embeddings."""
    reference = TorchPytorchcvResNet18(num_classes=CUB_WIDTH)
    randomize(reference, seed=51)
    reference.eval()
    reference64 = float64_copy(reference)
    x = images(2, CUB_SIZE, seed=52)
    return reference, state_dict_numpy(reference), x, torch_pair(reference.embed,
                                                                  reference64.embed, x)


def head_outputs(head, embeddings):
    """``(float64, float32)`` head logits and margins on the reference's embeddings."""
    head64, head32 = head_float64(head), head_float32(head)
    with torch.no_grad():
        e64, e32 = (torch.from_numpy(e) for e in embeddings)
        return ((head64(e64).numpy(), head32(e32).numpy()),
                (margins(head64, e64).numpy(), margins(head32, e32).numpy()))


@pytest.fixture(scope="module")
def cub_bank(tmp_path_factory):
    bank = make_bank(seed=50, k=CUB_WIDTH)
    path = tmp_path_factory.mktemp("cub_bank") / "cub_resnet18_cub_0.1_50.pkl"
    with open(path, "wb") as handle:
        pickle.dump(bank["pickle"], handle)
    return bank, path


def cub_head(bank, seed):
    return PosthocLinearCBM(bank, *head_weights(CUB_WIDTH, seed, CUB_WIDTH),
                            backbone_name="resnet18_cub")


def test_pcbm_on_pytorchcv_resnet18_cub_matches_pytorch(cub, cub_bank, tmp_path):
    reference, tensors, x, embeddings = cub
    head = cub_head(cub_bank[0], seed=53)
    save_as_upstream(head.eval(), tmp_path / "pcbm.ckpt")
    model, checkpoint = pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet18_cub",
                                                   tensors, concept_bank_path=cub_bank[1])
    assert checkpoint.backbone_name == "resnet18_cub"
    assert model.config.backbone_classes == CUB_WIDTH
    apply_fn, params = pure_apply(
        model, lambda m, x: (m(x), m.concept_scores(x), m.backbone(x)))
    logits, scores, backbone_logits = jax.jit(apply_fn)(params, x)
    expected_logits, expected_scores = head_outputs(head, embeddings)
    assert np.abs(expected_logits[0]).max() > 0.1
    assert_parity(logits, *expected_logits, "pcbm resnet18_cub logits")
    assert_parity(scores, *expected_scores, "pcbm resnet18_cub concept scores")
    # The backbone's own classifier (AvgPool2d(7) on the 7x7 map, then output) is kept intact.
    assert_parity(backbone_logits, *torch_pair(reference, float64_copy(reference), x),
                  "pytorchcv resnet18_cub logits")


def test_pytorchcv_backbone_needs_a_7x7_feature_map(cub, cub_bank, tmp_path):
    _, tensors, _, _ = cub
    head = cub_head(cub_bank[0], seed=54)
    save_as_upstream(head, tmp_path / "pcbm.ckpt")
    model, _ = pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet18_cub", tensors)
    apply_fn, params = pure_apply(model)
    for size in (192, 224):  # shape inference only: 6x6 (wrong), 7x7 (right)
        image = jax.ShapeDtypeStruct((1, size, size, 3), np.float32)
        if size == 192:
            with pytest.raises(ValueError, match=r"inputs of 192x192 px give 6x6\. Use 193\.\.224"):
                jax.eval_shape(apply_fn, params, image)
        else:
            assert jax.eval_shape(apply_fn, params, image).shape == (1, CUB_WIDTH)


def test_pytorchcv_keys_are_strict(cub):
    _, tensors, _, _ = cub
    tensors = dict(tensors)
    tensors["features.stage5.unit1.body.conv1.conv.weight"] = np.zeros((1, 1, 3, 3), np.float32)
    del tensors["features.stage3.unit2.body.conv2.bn.running_var"]
    tensors["features.stage2.unit1.identity_conv.conv.weight"] = np.zeros((128, 64, 3, 3),
                                                                          np.float32)
    with pytest.raises(ValueError) as error:
        pytorchcv.resnet_from_state_dict("resnet18_cub", tensors)
    message = str(error.value)
    assert "unknown keys (1)" in message
    assert "features.stage5.unit1.body.conv1.conv.weight" in message
    assert "missing keys (1)" in message
    assert "features.stage3.unit2.body.conv2.bn.running_var" in message
    assert ("features.stage2.unit1.identity_conv.conv.weight: checkpoint shape (128, 64, 3, 3), "
            "architecture expects (128, 64, 1, 1)") in message
    # stage1.unit1 keeps its identity (64 -> 64, stride 1): a projection there is unknown.
    with pytest.raises(ValueError, match=r"unknown keys \(1\)[\s\S]*stage1\.unit1\.identity_conv"):
        pytorchcv.resnet_from_state_dict("resnet18_cub", {
            **cub[1], "features.stage1.unit1.identity_conv.conv.weight": np.zeros((64, 64, 1, 1))})
    with pytest.raises(ValueError, match=r"name='resnet50_cub'; allowed: \['resnet18_cub'\]"):
        pytorchcv.resnet_from_state_dict("resnet50_cub", cub[1])


def test_backbone_family_mismatch_names_the_fix(cub, backbone, cub_bank, tmp_path):
    head = cub_head(cub_bank[0], seed=55)
    save_as_upstream(head, tmp_path / "pcbm.ckpt")
    with pytest.raises(ValueError, match=r"backbone='resnet18' is a torchvision name, but the "
                                         r"backbone state_dict has pytorchcv keys"):
        pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet18", cub[1])
    with pytest.raises(ValueError, match=r"backbone='resnet18_cub' is a pytorchcv name[\s\S]*"
                                         r"pass backbone='resnet18'"):
        pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet18_cub", backbone[1])
    with pytest.raises(ValueError, match=r"backbone='vgg16'; allowed: .*'resnet18_cub'"):
        pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "vgg16", backbone[1])
    # Through the backbone prefix, the strict table names pytorchcv keys in the PCBM's terms.
    broken = {k: v for k, v in cub[1].items() if k != "features.init_block.conv.bn.weight"}
    with pytest.raises(ValueError, match=r"missing keys \(1\)[\s\S]*"
                                         r"backbone\.features\.init_block\.conv\.bn\.weight"):
        pcbm.pcbm_from_checkpoints(tmp_path / "pcbm.ckpt", "resnet18_cub", broken)


def test_cli_converts_a_pcbm_h_on_resnet18_cub(cub, cub_bank, tmp_path):
    reference, _, x, embeddings = cub
    hybrid = PosthocHybridCBM(cub_head(cub_bank[0], seed=56), seed=57)
    hybrid = hybrid.float().eval()
    save_as_upstream(hybrid, tmp_path / "pcbm-h.ckpt")
    torch.save(reference.state_dict(), tmp_path / "resnet18_cub-2333-200d8b9c.pth")
    result = CliRunner().invoke(cli.main, [
        "convert", "pcbm", str(tmp_path / "pcbm-h.ckpt"), str(tmp_path / "out"),
        "--backbone", "resnet18_cub", "--backbone-path",
        str(tmp_path / "resnet18_cub-2333-200d8b9c.pth"), "--concept-bank", str(cub_bank[1])])
    assert result.exit_code == 0, result.output
    apply_fn, params, manifest = load_converted(tmp_path / "out")
    assert manifest["config"]["backbone"] == "resnet18_cub"
    assert manifest["upstream_backbone_name"] == "resnet18_cub"
    expected, _ = head_outputs(hybrid, embeddings)
    assert_parity(jax.jit(apply_fn)(params, x), *expected, "pcbm-h resnet18_cub converted")
