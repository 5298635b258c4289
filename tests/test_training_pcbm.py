"""The PCBM trainer's maths against the references post-hoc-cbm fits with: scikit-learn's
``SVC(kernel="linear")`` for the concept bank, its elastic-net ``LogisticRegression`` for the
head (the minimiser SGDClassifier approximates), ``torch.optim.Adam`` for one PCBM-h step; the
concept vocabulary and samples; an interrupted run resuming to the same parameters."""

import warnings

import numpy as np
import pytest

from cbcert.schema import ConfigError
from cbcert.training import pcbm as P


def _svm_primal(x, t, w, b, c):
    return 0.5 * w @ w + c * np.maximum(0.0, 1 - t * (x @ w + b)).sum()


def test_linear_svms_match_sklearn_svc():
    """Three SVMs at once (vmapped SMO) equal SVC(kernel="linear", C=0.1) solved to 1e-8: the
    weights to 1e-4 relative, the intercepts to 1e-4, the primal objective to 1e-5 relative
    (deterministic data; the float32 solver reached ~1e-6 when written)."""
    from sklearn.svm import SVC

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 100, 64)).astype(np.float32)
    labels = (rng.random((3, 100)) < 0.5).astype(int)
    x[labels == 1] += 0.3
    out = P.fit_linear_svms(x, labels, 0.1, tol=1e-6)
    for k in range(3):
        ref = SVC(kernel="linear", C=0.1, tol=1e-8).fit(x[k].astype(np.float64), labels[k])
        w, b = ref.coef_[0], ref.intercept_[0]
        assert np.linalg.norm(out["cavs"][k] - w) <= 1e-4 * np.linalg.norm(w)
        assert abs(out["intercepts"][k] - b) <= 1e-4
        t = np.where(labels[k] == 1, 1.0, -1.0)
        ours = _svm_primal(x[k].astype(np.float64), t, out["cavs"][k].astype(np.float64),
                           float(out["intercepts"][k]), 0.1)
        assert abs(ours - _svm_primal(x[k], t, w, b, 0.1)) <= 1e-5 * ours
    assert (out["iterations"] < 200_000).all()


def _logistic_reference(features, targets, lam, l1_ratio):
    from sklearn.linear_model import LogisticRegression

    with warnings.catch_warnings():  # newer scikit-learn deprecates penalty= in favour of
        warnings.simplefilter("ignore")  # l1_ratio alone; the problem is the same
        ref = LogisticRegression(penalty="elasticnet", solver="saga", l1_ratio=l1_ratio,
                                 C=1 / (len(features) * lam), tol=1e-10, max_iter=100_000)
        ref.fit(features.astype(np.float64), targets)
    return ref.coef_[0], ref.intercept_[0]


@pytest.mark.parametrize("num_classes", [2, 3])
def test_elastic_net_head_is_the_minimiser_sklearn_finds(num_classes):
    """One-vs-rest elastic-net logistic regression equals LogisticRegression(elasticnet,
    saga, C = 1/(Nλ)) solved to 1e-10, class by class, to 1e-4 (the objective F of the module
    docstring is strictly convex here: ρ < 1); two classes keep one logit, class 1 positive."""
    rng = np.random.default_rng(1)
    n, k, lam, l1_ratio = 300, 8, 1e-2, 0.5
    features = rng.normal(size=(n, k)).astype(np.float32)
    labels = rng.integers(0, num_classes, n)
    features[np.arange(n), labels] += 1.0
    out = P.fit_elastic_net_logistic(features, labels, num_classes, lam=lam, l1_ratio=l1_ratio,
                                     tol=1e-6)
    outputs = 1 if num_classes == 2 else num_classes
    assert out["kernel"].shape == (k, outputs) and out["bias"].shape == (outputs,)
    for c in range(outputs):
        positive = 1 if num_classes == 2 else c
        w, b = _logistic_reference(features, (labels == positive).astype(int), lam, l1_ratio)
        np.testing.assert_allclose(out["kernel"][:, c], w, atol=1e-4)
        assert abs(out["bias"][c] - b) <= 1e-4
    assert (out["mapping"] <= 1e-5).all()


def test_strong_l1_gives_exact_zeros_where_sklearn_does():
    """ρ = 0.99 and a large λ: the soft-threshold makes exact zeros, the same weights as the
    reference's zero pattern (its nonzeros > 1e-3 in magnitude) and values to 1e-4."""
    rng = np.random.default_rng(2)
    n, k, lam = 400, 10, 0.05
    features = rng.normal(size=(n, k)).astype(np.float32)
    labels = (features[:, 0] - features[:, 1] + 0.3 * rng.normal(size=n) > 0).astype(int)
    out = P.fit_elastic_net_logistic(features, labels, 2, lam=lam, l1_ratio=0.99, tol=1e-7)
    w, b = _logistic_reference(features, labels, lam, 0.99)
    np.testing.assert_allclose(out["kernel"][:, 0], w, atol=1e-4)
    assert np.array_equal(out["kernel"][:, 0] != 0, np.abs(w) > 1e-3)
    assert 0 < np.sum(out["kernel"] != 0) < k


def test_one_hybrid_step_equals_torch_adam():
    """One PCBM-h step (CE + λ₂·mean(W²), Adam lr 0.01) equals torch.optim.Adam's on the same
    batch and weights: loss and updated parameters to 1e-6."""
    torch = pytest.importorskip("torch")
    config = P.PCBMTrainConfig()
    rng = np.random.default_rng(3)
    b, d, c = 16, 32, 5
    e = rng.normal(size=(b, d)).astype(np.float32)
    concept = rng.normal(size=(b, 1)).astype(np.float32)  # a single broadcast concept logit
    y = rng.integers(0, c, b).astype(np.int32)
    residual = P.init_residual(d, c, seed=0)
    opt, step = P.make_hybrid_step(config)
    new, _, loss = step(residual, opt.init(residual), concept, e, y)

    linear = torch.nn.Linear(d, c)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(np.asarray(residual["kernel"]).T.copy()))
        linear.bias.copy_(torch.from_numpy(np.array(residual["bias"])))
    adam = torch.optim.Adam(linear.parameters(), lr=config.hybrid_lr)
    out = torch.from_numpy(concept) + linear(torch.from_numpy(e))
    ref_loss = (torch.nn.functional.cross_entropy(out, torch.from_numpy(y).long())
                + config.l2_penalty * (linear.weight ** 2).mean())
    adam.zero_grad()
    ref_loss.backward()
    adam.step()
    assert abs(float(loss) - ref_loss.item()) <= 1e-6
    np.testing.assert_allclose(np.asarray(new["kernel"]), linear.weight.detach().numpy().T,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(new["bias"]), linear.bias.detach().numpy(), atol=1e-6)


def test_residual_initialisation_is_torch_linears_law():
    """U(±1/√D) as torch.nn.Linear draws: inside the bounds, spread over them (a 2,000-draw
    sample's extremes lie within 1 % of the bounds with probability 1 − 2·0.99²⁰⁰⁰ ≈ 1)."""
    residual = P.init_residual(400, 5, seed=0)
    bound = 1 / 20
    kernel = np.asarray(residual["kernel"])
    assert kernel.shape == (400, 5) and np.abs(kernel).max() <= bound
    assert kernel.max() > 0.98 * bound and kernel.min() < -0.98 * bound


def test_select_concepts_all_count_and_names():
    labels = np.array([[1, 0, 1, 1], [1, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 1]])
    names = ("a", "b", "c", "d")  # a: in every image, b: in none; c: 1/4, d: 3/4
    assert P.select_concepts(labels, names, "all")[1] == ("c", "d")
    labels5 = np.array([[0, 1, 1], [0, 1, 0], [1, 1, 0], [1, 0, 0]])
    assert P.select_concepts(labels5, ("x", "y", "z"), 1)[1] == ("x",)  # rate 1/2 first
    assert P.select_concepts(labels5, ("x", "y", "z"), 2)[1] == ("x", "y")  # ties by index
    assert P.select_concepts(labels, names, ["d", "c"])[1] == ("d", "c")
    for choice, text in ((3, r"\[1, 2\]"), (["a"], "every"), (["b"], "no"), (["q"], "not an")):
        with pytest.raises(ConfigError, match=text) as err:
            P.select_concepts(labels, names, choice)
        assert err.value.key == "concepts"


def test_concept_samples_are_disjoint_halves_and_keyed():
    rng = np.random.default_rng(4)
    attributes = (rng.random((60, 3)) < 0.5).astype(int)
    attributes[:3, 2], attributes[3:, 2] = 1, 0  # concept 2: three positives only
    pos, neg = P.concept_samples(attributes, 5, seed=7)
    assert pos.shape == neg.shape == (3, 10)
    for k in range(2):  # enough images: without replacement, the right side
        assert len(set(pos[k])) == 10 and len(set(neg[k])) == 10
        assert attributes[pos[k], k].all() and not attributes[neg[k], k].any()
    assert set(pos[2]) <= {0, 1, 2}  # too few: drawn with replacement
    again = P.concept_samples(attributes, 5, seed=7)
    assert np.array_equal(pos, again[0]) and np.array_equal(neg, again[1])
    assert not np.array_equal(pos, P.concept_samples(attributes, 5, seed=8)[0])
    attributes[:, 1] = 1
    with pytest.raises(ConfigError, match="every") as err:
        P.concept_samples(attributes, 5, seed=7, names=("a", "b", "c"))
    assert err.value.key == "concepts"


@pytest.mark.parametrize(("field", "value"), [("svm_c", 0.0), ("l1_ratio", 1.5),
                                              ("n_samples", 0), ("hybrid_lr", -1.0)])
def test_config_refuses_out_of_range_settings(field, value):
    with pytest.raises(ConfigError) as err:
        P.PCBMTrainConfig(**{field: value})
    assert err.value.key == field


@pytest.fixture(scope="module")
def cub(tmp_path_factory):
    from cbcert.datasets.cub import class_attribute_majority, load_cub
    from cbcert.datasets.synthetic import write_cub_layout
    from cbcert.training.pcbm_run import PCBMData

    root = write_cub_layout(tmp_path_factory.mktemp("cub") / "CUB_200_2011", num_classes=4,
                            images_per_class=6, num_attributes=12, image_size=32)
    train, test = load_cub(root, "train"), load_cub(root, "test")
    attributes = class_attribute_majority(train)[train.labels()]
    picked, names = P.select_concepts(attributes, train.attribute_names, 5)
    return PCBMData(train.items, test.items, attributes[:, picked], names, train.num_classes)


@pytest.fixture(scope="module")
def resnet18(resnet18_dir):
    from cbcert.io.registry import load_module

    return load_module(resnet18_dir)[0]


def _interrupt_at(stage, when):
    def on_progress(name, done, total):
        if name == stage and done == when:
            raise KeyboardInterrupt
    return on_progress


def test_interrupted_run_resumes_to_the_same_parameters(cub, resnet18, tmp_path):
    """Ctrl-C while embedding and again in PCBM-h's Adam steps; rerunning the same call twice
    gives the PCBM and PCBM-h of an uninterrupted run, bit for bit (CPU)."""
    from cbcert.io import checkpoint
    from cbcert.training.pcbm_run import run

    config = P.PCBMTrainConfig(n_samples=4, hybrid_epochs=3, hybrid_batch_size=4)
    kwargs = dict(batch_size=4, image_size=32, identity={"test": 1}, save_every=2,
                  log=lambda s: None)
    full = run(resnet18, "resnet18", cub, config, tmp_path / "a", hybrid_out=tmp_path / "ah",
               **kwargs)
    for on_progress in (_interrupt_at("embed", 8), _interrupt_at("hybrid", 5)):
        with pytest.raises(KeyboardInterrupt):
            run(resnet18, "resnet18", cub, config, tmp_path / "b", hybrid_out=tmp_path / "bh",
                on_progress=on_progress, **kwargs)
        assert (tmp_path / "b" / "progress").is_dir()
    resumed = run(resnet18, "resnet18", cub, config, tmp_path / "b", hybrid_out=tmp_path / "bh",
                  **kwargs)
    assert resumed["pcbmh"]["metrics"]["hybrid"]["steps"] == 9  # 3 epochs of 12/4 batches
    for a, b in (("a", "b"), ("ah", "bh")):
        left = checkpoint.read_manifest(tmp_path / a)
        right = checkpoint.read_manifest(tmp_path / b)
        assert left["params_sha256"] == right["params_sha256"]
    assert not (tmp_path / "b" / "progress").exists()
    assert full["pcbm"]["config"]["residual_outputs"] == 0
    assert full["pcbmh"]["config"]["residual_outputs"] == 4
    assert full["pcbm"]["concept_names"] == list(cub.concept_names)
    with pytest.raises(ConfigError) as err:  # a finished run is not overwritten
        run(resnet18, "resnet18", cub, config, tmp_path / "a", **kwargs)
    assert err.value.key == "out"
