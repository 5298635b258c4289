"""World directories: a tiny world from random real-format parts, run through the CLI.

The parts are written in the formats users bring: a stylegan2-ada-pytorch pickle (the
persistence-style reference generator of ``test_convert_stylegan2``), a CB-AE ``.pt`` state_dict
with its upstream YAML, a torchvision ResNet-18 state_dict converted by ``convert``, and a PCBM
and a PixPNet written in the checkpoint format (``cbcert.io.registry.save_module``). The same
generator and CB-AE converted with ``certify convert`` make a world of converted parts only,
which must load and certify with torch blocked and give the very same logits.

Random classifiers rarely agree, and the agreement set (std and cbm predict the same class) is
what every command draws its inputs from. So the PCBM is built to reproduce the std head
exactly, as ``cbcert.worlds.builtin.untrained_world`` does: same backbone, CAV k = row k of the fc
weight, intercept k = fc bias k, concept head = diag(‖V_k‖), so ``h(r) = W e + b`` = std logits
and the two models agree on every input unless two std logits lie within float rounding
of each other.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from flax import nnx

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

import test_convert_stylegan2 as sg_ref  # noqa: E402
from parity import assert_parity  # noqa: E402
from processes import run_python  # noqa: E402
from test_convert_biggan import FIELDS as BIGGAN_FIELDS  # noqa: E402
from test_convert_biggan import TorchBigGAN  # noqa: E402
from test_convert_resnet import torch_resnet  # noqa: E402

from cbcert import cli  # noqa: E402
from cbcert.convert import convert  # noqa: E402
from cbcert.engine.noise import Gaussian  # noqa: E402
from cbcert.engine.sampler import count_classes  # noqa: E402
from cbcert.io import checkpoint, registry  # noqa: E402
from cbcert.models.pcbm import PCBM, PCBMConfig  # noqa: E402
from cbcert.models.pixpnet import PixPNet, PixPNetConfig  # noqa: E402
from cbcert.runs import explanations  # noqa: E402
from cbcert.schema import ConfigError  # noqa: E402
from cbcert.worlds.directory import (  # noqa: E402
    build_generator,
    generator_identity,
    load_world_dir,
)
from cbcert.worlds.manifest import Preprocess, read_manifest  # noqa: E402

DW, NUM_WS, RESOLUTION = 10, 6, 16  # tiny StyleGAN2: w_dim 10, 16 px -> 6 style layers
BINS, TYPES = [2, 2, 2, 4], ["bin", "bin", "bin", "cat"]  # K = 3 concepts, U = 4
CLASSES = ["cat", "dog"]


def write_stylegan2_pickle(path, extra=None, **kwargs):
    """The tiny reference StyleGAN2 (``kwargs``: e.g. ``c_dim``) pickled at ``path`` as ``G`` and
    ``G_ema``, with ``D = None`` and the ``extra`` entries."""
    reference = sg_ref.Generator(z_dim=12, w_dim=DW, resolution=RESOLUTION,
                                 channels=sg_ref.CHANNELS, clamp=sg_ref.CLAMP, mapping_layers=2,
                                 seed=0, **kwargs).eval()
    with pytest.MonkeyPatch.context() as patch:  # pickle resolves the upstream module names
        patch.setitem(sys.modules, "torch_utils", types.ModuleType("torch_utils"))
        patch.setitem(sys.modules, "torch_utils.persistence", sg_ref.persistence)
        patch.setitem(sys.modules, "dnnlib", types.ModuleType("dnnlib"))
        patch.setitem(sys.modules, "dnnlib.util", sg_ref.dnnlib_util)
        path.write_bytes(pickle.dumps({"G": reference, "D": None, "G_ema": reference,
                                       **(extra or {})}))
    return reference


def write_cbae(directory) -> None:
    def mlp(din, dout):
        layers = []
        for i in range(3):
            layers += [torch.nn.Linear(din if i == 0 else DW, DW), torch.nn.LeakyReLU(0.1),
                       torch.nn.BatchNorm1d(DW)]
        return torch.nn.Sequential(*layers, torch.nn.Linear(DW, dout))

    torch.manual_seed(0)
    cbae = torch.nn.Module()
    cbae.encoder, cbae.decoder = mlp(DW, sum(BINS)), mlp(sum(BINS), DW)
    torch.save(cbae.state_dict(), directory / "cbae.pt")
    concepts = {"concept_bins": BINS, "concept_names": ["a", "b", "c", "unknown"],
                "types": TYPES}
    model = {"latent_noise_dim": DW, "num_ws": NUM_WS, "concepts": concepts}
    (directory / "cbae.yaml").write_text(yaml.safe_dump({"model": model}))


def random_module(build, seed: int):
    """A module with random weights, built shape-only and filled with numpy draws (eager JAX
    init of a ResNet-18 compiles one op per shape: seconds on a loaded CPU). Matrices and
    kernels ~ N(0, 1/fan_in), 1-D scales and variances 1, biases and means 0.
    """
    graphdef, state = nnx.split(registry.abstract(build))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    rng = np.random.default_rng(seed)
    filled = []
    for path, leaf in leaves:
        if len(leaf.shape) >= 2:
            fan_in = int(np.prod(leaf.shape[:-1]))
            filled.append(rng.standard_normal(leaf.shape, np.float32) / np.float32(fan_in**0.5))
        else:
            value = 1.0 if str(path[-1].key) in ("scale", "var") else 0.0
            filled.append(np.full(leaf.shape, value, np.float32))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, filled))
    return nnx.merge(graphdef, state)


def pcbm_reproducing(std_module) -> PCBM:
    """A PCBM on the std backbone whose logits equal the std logits (module docstring)."""
    config = PCBMConfig(backbone="resnet18", backbone_classes=len(CLASSES),
                        num_concepts=len(CLASSES), head_outputs=len(CLASSES))
    pcbm = random_module(lambda rngs: PCBM(config, rngs=rngs), 0)
    nnx.update(pcbm.backbone, nnx.state(std_module))
    kernel, bias = std_module.fc.kernel[...], std_module.fc.bias[...]  # [D, C], [C]
    norms = jnp.linalg.norm(kernel, axis=0)  # [C]
    pcbm.cavs.set_value(kernel.T)
    pcbm.intercepts.set_value(bias)
    pcbm.norms.set_value(norms)
    pcbm.head.kernel.set_value(jnp.diag(norms))
    pcbm.head.bias.set_value(jnp.zeros(len(CLASSES)))
    return pcbm


def write_module(directory, kind, module) -> None:
    registry.save_module(directory, kind, module, {"sources": {}})


MANIFEST = {
    "format_version": 1,
    "name": "tiny",
    "generator": {"kind": "stylegan2", "pickle": "g.pkl", "truncation_psi": 0.7},
    "cbae": {"checkpoint": "cbae.pt", "config": "cbae.yaml"},
    "classifiers": {"std": "std", "cbm": "cbm", "proto": "proto"},
    "class_names": CLASSES,
    "preprocess": {"size": [32, 32], "mean": [0.485, 0.456, 0.406],
                   "std": [0.229, 0.224, 0.225]},
}


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    write_stylegan2_pickle(root / "g.pkl")
    write_cbae(root)
    torch.save(torch_resnet("resnet18", len(CLASSES), seed=1).state_dict(), root / "std.pth")
    convert("resnet18", root / "std.pth", root / "std")
    std_module, _ = registry.load_module(root / "std")
    write_module(root / "cbm", "pcbm", pcbm_reproducing(std_module))
    proto_config = PixPNetConfig(feature_extractor="resnet18", feature_layer="layer2",
                                 num_prototypes=4, prototype_dim=8, num_classes=len(CLASSES))
    proto = random_module(lambda rngs: PixPNet(proto_config, rngs=rngs), 2)
    proto.prototypes.set_value(jax.random.uniform(jax.random.key(3), (4, 8)))
    write_module(root / "proto", "pixpnet", proto)
    (root / "world.json").write_text(json.dumps(MANIFEST))
    return root


@pytest.fixture(scope="module")
def world(world_dir):
    return load_world_dir(world_dir)


CONVERTED = {**MANIFEST, "name": "tiny-converted",
             "generator": {"kind": "stylegan2", "converted": "sg2", "truncation_psi": 0.7},
             "cbae": {"converted": "cbae"}}


@pytest.fixture(scope="module")
def converted_dir(world_dir, tmp_path_factory):
    """The tiny world with its generator and CB-AE converted by ``certify convert``."""
    root = tmp_path_factory.mktemp("converted")
    for role in ("std", "cbm", "proto"):
        (root / role).symlink_to(world_dir / role)
    for args in (["stylegan2", str(world_dir / "g.pkl"), str(root / "sg2"), "--network", "G_ema"],
                 ["cbae", str(world_dir / "cbae.pt"), str(root / "cbae"), "--config",
                  str(world_dir / "cbae.yaml")]):
        result = CliRunner().invoke(cli.main, ["convert", *args])
        assert result.exit_code == 0, result.output
    (root / "world.json").write_text(json.dumps(CONVERTED))
    return root


def with_manifest(tmp_path, world_dir, edit) -> str:
    """A copy of the world directory's manifest, edited, next to links to its parts."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for part in world_dir.iterdir():
        if part.name != "world.json":
            (tmp_path / part.name).symlink_to(part)
    manifest = json.loads(json.dumps(MANIFEST))
    edit(manifest)
    (tmp_path / "world.json").write_text(json.dumps(manifest))
    return str(tmp_path)


def test_loaded_world_composes_generator_preprocessing_and_classifiers(world):
    assert world.name == "dir:tiny" and world.model_names == ("std", "cbm", "proto")
    assert world.class_names == tuple(CLASSES) and world.true_label is None
    assert world.generator.concept_names == ("a", "b", "c") and world.generator.concept_dim == 10
    z = jax.random.normal(jax.random.key(0), (3, 12))
    logits = jax.jit(world.latent_apply(("std", "cbm", "proto")))(world.params, z)
    assert logits.shape == (3, 3, 2)
    # The PCBM reproduces the std head (float rounding only), so the two always agree.
    np.testing.assert_allclose(logits[:, 1], logits[:, 0], atol=1e-4)
    x = world.latent_images(world.params, z)
    assert x.shape == (3, RESOLUTION, RESOLUTION, 3)
    scores = world.concept_scores(world.classifier_params, x)
    assert scores.shape == (3, len(CLASSES))
    assert world.encode_latents(world.params, z).shape == (3, 10)


def test_converted_parts_load_like_the_upstream_files(world, world_dir, converted_dir):
    """`certify convert stylegan2|cbae` record their sources; the world they make has the very
    same generator parameters as the one converted from the files on every load."""
    sg2 = checkpoint.read_manifest(converted_dir / "sg2")
    assert (sg2["kind"], sg2["network"], sg2["format_version"]) == ("stylegan2", "G_ema", 2)
    assert sg2["sources"] == {"checkpoint": {"file": "g.pkl", "sha256": checkpoint.sha256_file(
        world_dir / "g.pkl")}}
    cbae = checkpoint.read_manifest(converted_dir / "cbae")
    assert cbae["kind"] == "cbae" and set(cbae["sources"]) == {"checkpoint", "config"}
    assert cbae["config"]["concept_names"] == ["a", "b", "c"]
    converted = load_world_dir(converted_dir)
    assert converted.name == "dir:tiny-converted"
    assert converted.generator.concept_names == world.generator.concept_names
    leaves = jax.tree_util.tree_leaves_with_path(converted.generator.params)
    expected = jax.tree_util.tree_leaves_with_path(world.generator.params)
    assert [path for path, _ in leaves] == [path for path, _ in expected] and len(leaves) > 20
    for (path, a), (_, b) in zip(leaves, expected, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_world_of_converted_parts_certifies_without_torch(world, converted_dir):
    """With ``import torch`` failing, the converted world loads (no torch, no cbcert.convert or
    training imported) and gives the upstream world's logits and Monte Carlo counts exactly."""
    models = ("std", "cbm", "proto")
    code = f"""
import json, sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
import jax, numpy as np
from cbcert.engine.noise import Gaussian
from cbcert.engine.sampler import count_classes
from cbcert.worlds.directory import load_world_dir
world = load_world_dir({str(converted_dir)!r})
z = jax.random.normal(jax.random.key(0), (3, 12))
logits = jax.jit(world.latent_apply({models!r}))(world.params, z)
counts = count_classes(world.latent_apply({models!r}), world.params, z, Gaussian(),
                       jax.random.key(1), 16, scale=0.5, num_classes=2)
assert sys.modules["torch"] is None
assert not [m for m in sys.modules if m.startswith(("cbcert.convert", "cbcert.training"))]
print(json.dumps({{"logits": np.asarray(logits).tolist(), "counts": np.asarray(counts).tolist()}}))
"""
    child = json.loads(run_python(code).strip().splitlines()[-1])
    z = jax.random.normal(jax.random.key(0), (3, 12))
    logits = jax.jit(world.latent_apply(models))(world.params, z)
    counts = count_classes(world.latent_apply(models), world.params, z, Gaussian(),
                           jax.random.key(1), 16, scale=0.5, num_classes=2)
    np.testing.assert_array_equal(np.asarray(child["logits"], np.float32), logits)
    np.testing.assert_array_equal(child["counts"], counts)
    assert np.asarray(counts).sum() == 3 * 3 * 16


def test_preprocess_resizes_then_normalises():
    pre = Preprocess(size=(4, 6), mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))
    out = pre(jnp.full((1, 2, 3, 3), 0.75))
    assert out.shape == (1, 4, 6, 3)
    np.testing.assert_allclose(out[0, 0, 0], [1.0, 0.5, 0.25], atol=1e-6)
    same = Preprocess(size=None, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    np.testing.assert_array_equal(same(jnp.ones((1, 2, 2, 3))), jnp.ones((1, 2, 2, 3)))


# The latent run takes the automatic chunk (the probe on a world directory); the others name a
# chunk no larger than their smallest stage, so that the agreement pool, PREDICT and ESTIMATE run
# one compiled step instead of one per stage size (each a ResNet-18 program: ~3 s to compile).
@pytest.mark.parametrize("command,scale", [("latent", ["--sigma", "0.2"]),
                                           ("concept", ["--rho", "0.2", "--chunk-size", "8"])])
def test_cli_runs_on_a_world_directory(world_dir, tmp_path, command, scale):
    out = tmp_path / "run"
    result = CliRunner().invoke(cli.main, [command, *scale, "--inputs", "2", "--n", "20",
                                           "--n0", "5", "--batch", "2", "--models", "std,cbm",
                                           "--world", str(world_dir),
                                           "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2
    assert {r["model"] for r in records} == {"std", "cbm"}
    assert all(r["true_label"] is None for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["models"]) == {"std", "cbm"}
    # std and cbm compute the same logits: same smoothed predictions on the same noise.
    by_model = {m: [r["prediction"] for r in records if r["model"] == m] for m in ("std", "cbm")}
    assert by_model["std"] == by_model["cbm"]


def test_a_world_directory_explains_by_its_pcbm_head_and_pixpnet_readout(world, world_dir,
                                                                         tmp_path):
    """The directory world's explanation heads reproduce their models' logits (cbm: ``r Wᵀ +
    b``; proto: ``s Wᵀ``), and `certify explain` runs on it: stability and certificates for
    cbm and proto, no known answer and no counterfactuals (a world directory has no class
    rule), the table printed."""
    params = world.params
    z = jax.random.normal(jax.random.key(0), (8, world.generator.latent_dim))
    images = world.latent_images(params, z)
    logits = np.asarray(world.classify(params["clf"], images, ("cbm", "proto")), np.float64)
    r = np.asarray(world.concept_scores(params["clf"], images), np.float64)
    w, b = (np.asarray(a, np.float64) for a in world.concept_head(params["clf"]))
    np.testing.assert_allclose(r @ w.T + b, logits[:, 0], rtol=1e-4, atol=1e-4)
    s = np.asarray(world.prototypes(params["clf"], images), np.float64)
    w, owner = world.prototype_head(params["clf"])
    np.testing.assert_allclose(s @ np.asarray(w, np.float64).T, logits[:, 1], rtol=1e-4,
                               atol=1e-4)
    assert np.asarray(owner).shape == (4,) and world.metadata["concept_head_models"] == ["cbm"]
    out = tmp_path / "explain"
    result = CliRunner().invoke(cli.main, ["explain", "--world", str(world_dir), "--models",
                                           "cbm,proto", "--inputs", "2", "--n0", "5", "--n",
                                           "10", "--figure-inputs", "1", "--chunk-size", "8",
                                           "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "top-k overlap after an ε shift" in result.output
    records = [json.loads(line) for line in (out / "explanations.jsonl").read_text().splitlines()]
    assert sorted(r["model"] for r in records) == ["cbm", "cbm", "proto", "proto"]
    for r in records:
        assert r["true_label"] is None and "f1" not in r and "counterfactuals" not in r
        assert len(r["certified"]) == len(r["cited"]) >= 1
        if r["model"] == "cbm":  # the PCBM's own concept bank (K = 2 here), not the CB-AE's
            assert {c["name"] for c in r["cited"]} <= {"concept 0", "concept 1"}


def _with_concept_bank(world_dir, root, names, manifest):
    """A copy of the world directory (links to its parts) whose cbm PCBM's concept bank is named
    ``names``, with ``manifest`` as its world.json."""
    root.mkdir()
    for part in world_dir.iterdir():
        if part.name not in ("world.json", "cbm"):
            (root / part.name).symlink_to(part)
    cbm, _ = registry.load_module(world_dir / "cbm")
    registry.save_module(root / "cbm", "pcbm", cbm, {"sources": {}, "concept_names": names})
    (root / "world.json").write_text(json.dumps(manifest))
    return root


def _explain_cbm(root, out, inputs: int) -> list[dict]:
    """`certify explain` on the world directory ``root`` (small sizes): its cbm records.

    proto is explained too: the run then compiles the programs of the first explanation test
    above (cbm and proto, same chunk; a concept bank's names are not part of them), not cbm-only
    variants of them (~20 s of compilation on a 2-core VM)."""
    result = CliRunner().invoke(cli.main, ["explain", "--world", str(root), "--models",
                                           "cbm,proto", "--inputs", str(inputs), "--n0", "5",
                                           "--n", "10", "--figure-inputs", "0", "--chunk-size",
                                           "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "explanations.jsonl").read_text().splitlines()]
    assert sorted({r["model"] for r in records}) == ["cbm", "proto"]
    return [r for r in records if r["model"] == "cbm"]


def test_a_world_directory_edits_the_cited_concepts_its_generator_names(world_dir, tmp_path):
    """A PCBM whose concept bank names a CB-AE concept ("b") gets counterfactual edits of that
    concept on a world directory (an unnamed one, "zzz", is not edited), verified by the
    CB-AE's own read-out E(D(c')), which for these random weights is far from exact: edits
    are rejected; no class rule, so consistency is undefined (null) while faithfulness is
    scored."""
    root = _with_concept_bank(world_dir, tmp_path / "named", ["b", "zzz"], MANIFEST)
    world = load_world_dir(root)
    assert world.generator.concept_names[1] == "b"
    np.testing.assert_array_equal(explanations.edit_mapping(world), [1, -1])
    out = tmp_path / "explain"
    records = _explain_cbm(root, out, inputs=6)
    edits = [e for r in records for e in r["counterfactuals"]["single"]]
    assert edits and {e["concept"] for e in edits} == {0}  # "b" is PCBM concept 0
    assert all(e["should_change"] is None and e["consistent"] is None for e in edits)
    assert all("f1" not in r for r in records)  # no class rule: no known answer
    summary = json.loads((out / "summary.json").read_text())["models"]["cbm"]
    assert summary["single_edits"]["attempted"] == len(edits)
    assert summary["single_edits"]["discarded"] == sum(not e["valid"] for e in edits) > 0
    assert summary["single_consistent"] is None and "f1" not in summary


def test_a_concept_classifier_verifies_edits_on_the_edited_image(world_dir, tmp_path):
    """With ``concept_classifier`` in world.json, an edit is valid iff the classifier's reading
    of the edited image is its reading of the clean image with the targets flipped
    (recomputed here: a directory's editor is the pair swap); a classifier whose outputs are
    not the generator's concepts is refused naming the key."""
    from cbcert.concepts import flip_pairs
    from cbcert.runs.pool import agreement_pool

    root = _with_concept_bank(world_dir, tmp_path / "cc-world", ["b", "a"],
                              {**MANIFEST, "concept_classifier": "cc"})
    torch.save(torch_resnet("resnet18", 3, seed=4).state_dict(), root / "cc.pth")
    convert("resnet18", root / "cc.pth", root / "cc")
    world = load_world_dir(root)
    records = _explain_cbm(root, tmp_path / "explain", inputs=4)
    gen, params = world.generator, world.params
    z = jnp.asarray(agreement_pool(world, 0, 4, chunk_size=8).latents)  # the run's chunk
    c = gen.concepts(params["gen"], z)

    def read(concepts):
        return np.asarray(world.concept_readout(params["clf"], gen.image_from_concepts(
            params["gen"], concepts)))

    clean, mapping = read(c), explanations.edit_mapping(world)
    checked = 0
    for row, r in enumerate(records):
        for edit in r["counterfactuals"]["single"]:
            targets = np.zeros((1, 3), bool)
            targets[0, mapping[edit["concept"]]] = True
            after = read(flip_pairs(c[row][None], jnp.asarray(targets), 3))
            assert edit["valid"] == bool((after == (clean[row] ^ targets)).all())
            checked += 1
    assert checked >= 4
    (root / "world.json").write_text(json.dumps({**MANIFEST, "concept_classifier": "std"}))
    with pytest.raises(ValueError, match="concept_classifier outputs 2 logits; the generator "
                                         "has 3 concepts"):
        load_world_dir(root)


def test_cbmh_is_explained_by_the_cbm_head_only_if_it_shares_the_bottleneck(world_dir):
    """PCBM-h keeps the PCBM's backbone, CAVs and head and adds a residual: then the cbm's
    concept head explains both; a cbmh with another CAV does not share it."""
    from cbcert.worlds.directory import _concept_head_models

    cbm, _ = registry.load_module(world_dir / "cbm")
    config = PCBMConfig(backbone="resnet18", backbone_classes=len(CLASSES),
                        num_concepts=len(CLASSES), head_outputs=len(CLASSES),
                        residual_outputs=len(CLASSES))
    cbmh = random_module(lambda rngs: PCBM(config, rngs=rngs), 5)
    for name in ("backbone", "head"):
        nnx.update(getattr(cbmh, name), nnx.state(getattr(cbm, name)))
    for name in ("cavs", "intercepts", "norms"):
        getattr(cbmh, name).set_value(getattr(cbm, name)[...])
    params = {"cbm": nnx.state(cbm), "cbmh": nnx.state(cbmh)}
    assert _concept_head_models(params) == ["cbm", "cbmh"]
    cbmh.cavs.set_value(cbmh.cavs[...].at[0, 0].add(1.0))
    assert _concept_head_models({**params, "cbmh": nnx.state(cbmh)}) == ["cbm"]
    assert _concept_head_models({"cbm": params["cbm"]}) == ["cbm"]


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update(colour="red"), "unknown key 'colour' in top level"),
    (lambda m: m["generator"].update(psi=0.5), "unknown key 'psi' in generator"),
    (lambda m: m["generator"].update(pickle="missing.pkl"),
     "generator.pickle='missing.pkl': no such file"),
    (lambda m: m["classifiers"].update(cbm="nowhere"), "classifiers.cbm='nowhere': no such"),
    (lambda m: m["classifiers"].pop("std"), "missing key 'std' in classifiers"),
    (lambda m: m["generator"].update(truncation_psi=1.5), "truncation_psi=1.5; allowed: (0.0"),
    (lambda m: m["preprocess"].update(std=[1, 0, 1]), "preprocess.std=[1, 0, 1]"),
    (lambda m: m.update(format_version=2), "format_version=2"),
    (lambda m: m["generator"].update(class_index=0),
     "generator.class_index=0; g.pkl is an unconditional StyleGAN2 (c_dim=0): remove the key"),
    (lambda m: m["generator"].update(class_index=-1), "generator.class_index=-1; allowed: "
                                                      "integers >= 0"),
    (lambda m: m["generator"].update(class_index=[]), "generator.class_index=[]; allowed: an "
                                                      "integer >= 0, or a list of 1 to 256"),
    (lambda m: m["generator"].update(class_index=[1, 1]), "generator.class_index=[1, 1]; "
                                                          "allowed: an integer >= 0, or a list"),
    (lambda m: m["generator"].update(class_index=[0, 1]),
     "generator.class_index=[0, 1]; g.pkl is an unconditional StyleGAN2 (c_dim=0): remove the "
     "key"),
    (lambda m: m["generator"].update(converted="std"),
     "generator has both 'converted' and 'pickle'; name either the converted directory or the "
     "upstream files"),
    (lambda m: m["cbae"].update(converted="std"), "cbae has both 'converted' and 'checkpoint'"),
    (lambda m: m.update(generator={"kind": "stylegan2", "converted": "std", "network": "G"}),
     "generator has both 'converted' and 'network'"),
    (lambda m: m.update(generator={"kind": "stylegan2", "converted": "std"}),
     "generator.converted='std' is kind='resnet18'; expected a `certify convert stylegan2` "
     "directory"),
    (lambda m: m.update(generator={"kind": "stylegan2"}),
     "missing key 'pickle' in generator (required: pickle; or 'converted'"),
    (lambda m: m.update(cbae={"converted": "proto"}),
     "cbae.converted='proto' is kind='pixpnet'; expected a `certify convert cbae` directory"),
    (lambda m: m.update(cbae={"config": "cbae.yaml"}),
     "missing key 'checkpoint' in cbae (required: checkpoint, config; or 'converted'"),
    (lambda m: m.update(generator={"kind": "biggan", "weights": "g.pkl", "config": "cbae.yaml",
                                   "class_index": 0}),
     "unknown key 'checkpoint' in cbae (allowed: trained)"),
])
def test_manifest_errors_exit_2_naming_the_key(world_dir, tmp_path, edit, message):
    path = with_manifest(tmp_path, world_dir, edit)
    result = CliRunner().invoke(cli.main, ["latent", "--sigma", "0.1", "--world", path,
                                           "--out", str(tmp_path / "x"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "--world" in result.output and message in " ".join(result.output.split())


def test_a_manifest_too_deep_or_too_large_is_refused_naming_it(world_dir, tmp_path):
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "world.json").write_text("[" * 100_000)
    result = CliRunner().invoke(cli.main, ["latent", "--sigma", "0.1", "--world", str(deep),
                                           "--out", str(tmp_path / "x"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert f"{deep / 'world.json'}: not valid JSON (nested too deeply)" in " ".join(
        result.output.split())
    (deep / "world.json").write_bytes(b'{"name": "\xff"}')
    with pytest.raises(ValueError, match="world.json: not valid JSON .*utf-8"):
        read_manifest(deep)
    # Checked as it is read: loading would resize every image to 100000 × 224.
    huge = with_manifest(tmp_path / "huge", world_dir,
                         lambda m: m["preprocess"].update(size=[100000, 224]))
    with pytest.raises(ConfigError, match=r"world.json: preprocess.size=\[100000, 224\]; expected "
                                          r"null or \[height, width\], integers in \[1, 4096\]"
                       ) as caught:
        read_manifest(huge)
    assert caught.value.key == "preprocess.size"  # the world.json key; the CLI says --world


def test_a_directory_without_manifest_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no world.json") as caught:
        read_manifest(tmp_path)
    assert caught.value.key == "world"


def test_roles_and_class_counts_are_checked(world_dir, tmp_path):
    wrong_role = with_manifest(tmp_path / "a", world_dir,
                               lambda m: m["classifiers"].update(cbm="proto"))
    with pytest.raises(ValueError, match="classifiers.cbm is kind='pixpnet'"):
        load_world_dir(wrong_role)
    three = with_manifest(tmp_path / "b", world_dir,
                          lambda m: m.update(class_names=["a", "b", "c"]))
    with pytest.raises(ValueError, match="outputs 2 logits but class_names has 3"):
        load_world_dir(three)



def reference_mapping(reference, z, classes, c_dim):
    """The upstream mapping of ``z[B, 12]`` with the one-hot labels of ``classes[B]``, flattened
    to ``w[B, num_ws · w_dim]``: ``(float64 twin, float32)`` for `assert_parity`."""
    label = torch.nn.functional.one_hot(torch.as_tensor(np.asarray(classes)), c_dim).float()
    reference64 = sg_ref.float64_twin(
        reference, z_dim=12, w_dim=DW, resolution=RESOLUTION, channels=sg_ref.CHANNELS,
        clamp=sg_ref.CLAMP, mapping_layers=2, seed=0, c_dim=c_dim)
    with torch.no_grad():
        ws32 = reference.mapping(z, 0.7, None, c=label)
        ws64 = reference64.mapping(z.double(), 0.7, None, c=label.double())
    return ws64.numpy().reshape(len(z), -1), ws32.numpy().reshape(len(z), -1)


def test_conditional_stylegan2_world_takes_a_class_index(world_dir, tmp_path):
    """A conditional pickle (c_dim=3) needs generator.class_index; g1 feeds its one-hot label."""
    def world(name, **extra):
        root = with_manifest(tmp_path / name, world_dir,
                             lambda m: m["generator"].update(pickle="gc.pkl", **extra))
        reference = write_stylegan2_pickle(tmp_path / name / "gc.pkl", c_dim=3)
        return root, reference

    root, reference = world("ok", class_index=1)
    generator = build_generator(read_manifest(root))
    z = torch.randn(2, 12, generator=torch.Generator().manual_seed(0))
    w = generator.g1(generator.params, jnp.asarray(z.numpy()))
    assert_parity(w, *reference_mapping(reference, z, [1, 1], 3), "conditional g1")
    assert generator.concept_names == ("a", "b", "c")
    for name, extra, message in [
            ("missing", {}, "missing key 'class_index' in generator; gc.pkl is a conditional "
                            "StyleGAN2 (c_dim=3): choose a class in 0..2"),
            ("range", {"class_index": 3}, "generator.class_index=3; allowed: 0..2 (gc.pkl has "
                                          "c_dim=3)")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            build_generator(read_manifest(world(name, **extra)[0]))


# A permutation, so that a class position k and the class it asks for differ.
TEN_CLASSES = [9, 0, 4, 7, 1, 8, 2, 6, 3, 5]


@pytest.fixture(scope="module")
def ten_class_dirs(world_dir, tmp_path_factory):
    """A 10-class conditional StyleGAN2 world (``class_index`` a list) and, with the same
    pickle, the one-class world of class 4."""
    root = tmp_path_factory.mktemp("ten")
    reference = write_stylegan2_pickle(root / "gc10.pkl", c_dim=10)
    dirs = {}
    for name, index in (("multi", TEN_CLASSES), ("one", 4)):
        def edit(m, index=index):
            m["generator"].update(pickle="gc10.pkl", class_index=index)
        dirs[name] = with_manifest(root / name, world_dir, edit)
        (root / name / "gc10.pkl").symlink_to(root / "gc10.pkl")
    return dirs, reference


def test_a_ten_class_conditional_world_renders_the_class_it_was_asked_for(ten_class_dirs):
    """Each input ``[z ; k]`` of a 10-class world is mapped with the one-hot of
    ``TEN_CLASSES[k]`` (checked against the upstream mapping network), its z is the one-class
    world's z for the same seed, and every class is asked for."""
    from cbcert.runs.pool import pool_latents

    dirs, reference = ten_class_dirs
    multi, one = load_world_dir(dirs["multi"]), load_world_dir(dirs["one"])
    assert multi.generator.classes == tuple(TEN_CLASSES) and multi.generator.input_dim == 13
    assert one.generator.classes == () and one.generator.input_dim == 12
    inputs = pool_latents(multi, 0, 0, 200)  # [200, 13]
    np.testing.assert_array_equal(inputs[:, :12], pool_latents(one, 0, 0, 200))
    positions = inputs[:, 12].astype(int)
    np.testing.assert_array_equal(inputs[:, 12], positions)
    # Fixed seed; a class missing from 200 uniform draws has probability < 10 · 0.9²⁰⁰ < 1e-8.
    assert set(positions) == set(range(10))

    rows = inputs[:20]
    asked = np.asarray(TEN_CLASSES)[positions[:20]]
    w = multi.generator.g1(multi.generator.params, jnp.asarray(rows))
    assert_parity(w, *reference_mapping(reference, torch.as_tensor(rows[:, :12]), asked, 10),
                  "10-class g1")
    # The images of the inputs asking for class 4 are the one-class world's images.
    four = positions == TEN_CLASSES.index(4)
    np.testing.assert_allclose(
        jax.jit(multi.latent_images)(multi.params, jnp.asarray(inputs[four])),
        jax.jit(one.latent_images)(one.params, jnp.asarray(inputs[four, :12])), atol=1e-6)


def test_noise_and_attacks_on_a_multi_class_world_move_z_only(ten_class_dirs):
    """Smoothing counts of ``[z ; k]`` equal the one-class world's counts of z (same keys:
    the noise acts on z exactly as there), and the attack runner's APGD moves z only."""
    from cbcert.attacks.apgd import apgd
    from cbcert.runs.pool import pool_latents

    dirs, _ = ten_class_dirs
    multi, one = load_world_dir(dirs["multi"]), load_world_dir(dirs["one"])
    inputs = pool_latents(multi, 0, 0, 200)
    idx = np.flatnonzero(inputs[:, 12] == TEN_CLASSES.index(4))[:3]
    noise = multi.noise(Gaussian(), "latent")
    assert noise.size == 12 and one.noise(Gaussian(), "latent") == Gaussian()
    models = ("std", "cbm")
    counts = count_classes(multi.latent_apply(models), multi.params, inputs[idx], noise,
                           jax.random.key(1), 32, scale=0.5, num_classes=2, indices=idx,
                           chunk_size=8)
    single = count_classes(one.latent_apply(models), one.params, inputs[idx, :12], Gaussian(),
                           jax.random.key(1), 32, scale=0.5, num_classes=2, indices=idx,
                           chunk_size=8)
    np.testing.assert_array_equal(counts, single)

    from cbcert.runs import attacker
    from cbcert.runs.attack import AttackJob

    seen = []

    def spy(*args, **kwargs):
        x_adv, info = apgd(*args, **kwargs)
        seen.append((np.asarray(args[1]), np.asarray(x_adv)))
        return x_adv, info

    job = AttackJob(space="latent", eps=(2.0,), norm="l2", iters=5, models=("std",), batch=4)
    x0 = inputs[:4]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attacker, "apgd", spy)
        fields = attacker.Attacker(multi, job, chunk_size=4).attack(
            "std", 2.0, x0, np.zeros(4, np.int64), np.arange(4))
    (start, x_adv), = seen
    np.testing.assert_array_equal(start, x0)
    np.testing.assert_array_equal(x_adv[:, 12], x0[:, 12])
    norms = np.linalg.norm(x_adv[:, :12] - x0[:, :12], axis=1)
    assert np.all(norms <= 2.0 + 1e-5) and np.all(norms > 0)
    np.testing.assert_allclose(fields["perturbation_norm"], norms, rtol=1e-5)


def test_multi_class_world_runs_the_latent_commands(ten_class_dirs, tmp_path):
    """`certify latent` and the perturb runner (ε shifts, σ noise) run on a 10-class world
    (their noise is the one tested above; the attack runner is tested above, its CLI run
    costs ~100 s of compilation)."""
    from cbcert.runs import perturb
    from cbcert.runs.pool import agreement_pool

    dirs, _ = ten_class_dirs
    result = CliRunner().invoke(cli.main, [
        "latent", "--sigma", "0.2", "--n", "20", "--n0", "5", "--inputs", "2", "--models",
        "std,cbm", "--world", dirs["multi"], "--chunk-size", "8", "--quiet", "--out",
        str(tmp_path / "latent")])
    assert result.exit_code == 0, result.output
    world = load_world_dir(dirs["multi"])
    pool = agreement_pool(world, 0, 2, chunk_size=8)  # the run's chunk: its compiled step
    asked = [TEN_CLASSES[int(k)] for k in pool.latents[:, 12]]
    records = _jsonl(tmp_path / "latent" / "records.jsonl")
    assert len(records) == 4 and {(r["index"], r["generator_class"]) for r in records} == set(
        zip(pool.indices.tolist(), asked, strict=True))
    job = perturb.PerturbJob(eps=(0.5,), tau=(), sigma=(0.2,), models=("std", "cbm"),
                             num_subsets=2, subset_size=2, num_inputs=2, batch=2)
    perturb.run(world, job, tmp_path / "perturb", chunk_size=8)
    for name in ("eps0.5", "sigma0.2"):
        records = _jsonl(tmp_path / "perturb" / f"{name}.jsonl")
        assert [r["generator_class"] for r in records] == asked


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_biggan_world_has_no_concepts(world_dir, tmp_path):
    torch.manual_seed(0)
    parts = tmp_path / "biggan"
    parts.mkdir()
    torch.save(TorchBigGAN(BIGGAN_FIELDS).eval().state_dict(), parts / "pytorch_model.bin")
    (parts / "config.json").write_text(json.dumps(BIGGAN_FIELDS))
    for name in ("ok", "bad"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "biggan").symlink_to(parts)

    def biggan(manifest, class_index=3):
        manifest.pop("cbae")
        manifest["generator"] = {"kind": "biggan", "weights": "biggan/pytorch_model.bin",
                                 "config": "biggan/config.json", "class_index": class_index,
                                 "truncation": 0.5}

    world = load_world_dir(with_manifest(tmp_path / "ok", world_dir, biggan))
    assert world.generator.num_concepts == 0 and world.metadata["concepts"] is False
    z = jax.ShapeDtypeStruct((2, BIGGAN_FIELDS["z_dim"]), jnp.float32)
    assert jax.eval_shape(world.latent_apply(("std", "cbm")), world.params, z).shape == (2, 2, 2)
    with pytest.raises(ValueError, match="class_index=5"):
        load_world_dir(with_manifest(tmp_path / "bad", world_dir,
                                     lambda m: biggan(m, class_index=5)))


def test_train_cbae_on_a_stylegan2_world_fits_its_w_plus(world_dir, tmp_path):
    """A StyleGAN2 world without a CB-AE has no concepts (latent commands only); the CB-AE
    trainer (`certify train cbae`'s run; its CLI is exercised on the BigGAN world below) trains
    one on its w+ (num_ws copies of w, as upstream's), which plugs in with "cbae": {"trained":
    ...} and is refused on another truncation. The labeler is a cheap function of the image
    (two concept logits): what is new here is the generator, not the labeler."""
    from cbcert.training.cbae import CBAETrainConfig
    from cbcert.training.cbae_run import run
    from cbcert.worlds.manifest import read_manifest

    plain = with_manifest(tmp_path / "plain", world_dir, lambda m: m.pop("cbae"))
    bare = load_world_dir(plain)
    assert bare.generator.concept_names == () and bare.metadata["concepts"] is False
    num_ws = bare.generator.num_ws
    assert num_ws > 1

    def labeler(x):  # x[B, H, W, 3] -> two concept logits
        return 8.0 * jnp.stack([x.mean(axis=(1, 2, 3)) - 0.5, x[..., 0].mean(axis=(1, 2)) - 0.5],
                               axis=-1)

    out = tmp_path / "cbae"
    identity = {"generator": generator_identity(read_manifest(plain))}
    manifest = run(bare.generator, labeler, ("x", "y"), CBAETrainConfig(steps=1, batch_size=4),
                   out, identity=identity, eval_samples=4, log=lambda s: None)
    assert manifest["config"]["num_ws"] == num_ws
    assert manifest["config"]["latent_dim"] * num_ws == jax.eval_shape(
        lambda z: bare.generator.g1(bare.generator.params, z),
        jax.ShapeDtypeStruct((1, bare.generator.latent_dim), jnp.float32)).shape[1]
    assert manifest["identity"]["generator"]["kind"] == "stylegan2"

    def plug(m, psi=0.7):
        m["cbae"] = {"trained": "cbae"}
        m["generator"]["truncation_psi"] = psi

    trained = with_manifest(tmp_path / "trained", world_dir, plug)
    (tmp_path / "trained" / "cbae").symlink_to(out)
    loaded = load_world_dir(trained)
    assert loaded.generator.concept_names == ("x", "y") and loaded.metadata["concepts"] is True
    other = with_manifest(tmp_path / "other", world_dir, lambda m: plug(m, psi=0.5))
    (tmp_path / "other" / "cbae").symlink_to(out)
    with pytest.raises(ValueError, match="truncation_psi=0.7, this world's has 0.5"):
        load_world_dir(other)


def test_train_cbae_then_certify_concepts_on_the_biggan_world(world_dir, resnet18_dir,
                                                             tmp_path):
    """The RIVAL-10 arm of docs/real-data.md in small: an attribute labeler trained on a
    synthetic RIVAL-10 layout (three attributes, `certify train classifier --target attributes
    --attributes`) pseudo-labels `certify train cbae` on a BigGAN world; plugged in with
    "cbae": {"trained": ...} the world gains K concepts and `certify concept` runs on it;
    other generators are refused."""
    from cbcert.datasets.synthetic import write_rival10_layout

    torch.manual_seed(1)
    parts = tmp_path / "parts"
    parts.mkdir()
    torch.save(TorchBigGAN(BIGGAN_FIELDS).eval().state_dict(), parts / "pytorch_model.bin")
    (parts / "config.json").write_text(json.dumps(BIGGAN_FIELDS))
    rival10 = write_rival10_layout(tmp_path / "RIVAL10", images_per_class=1, image_size=32)
    (tmp_path / "concepts.txt").write_text("wings\nwheels\nlong\n")
    result = CliRunner().invoke(cli.main, [
        "train", "classifier", "--init", str(resnet18_dir), "--dataset", f"rival10:{rival10}",
        "--target", "attributes", "--attributes", str(tmp_path / "concepts.txt"), "--steps",
        "2", "--batch-size", "4", "--image-size", "32", "--out", str(parts / "concepts"),
        "--quiet"])
    assert result.exit_code == 0, result.output
    torch.save(torch_resnet("resnet18", 2, seed=4).state_dict(), parts / "two.pth")
    convert("resnet18", parts / "two.pth", parts / "two")

    def biggan(manifest, class_index=3, cbae=None):
        manifest.pop("cbae")
        manifest["generator"] = {"kind": "biggan", "weights": "parts/pytorch_model.bin",
                                 "config": "parts/config.json", "class_index": class_index,
                                 "truncation": 0.5}
        if cbae is not None:
            manifest["cbae"] = {"trained": cbae}

    def world(name, **kw):
        root = with_manifest(tmp_path / name, world_dir, lambda m: biggan(m, **kw))
        (tmp_path / name / "parts").symlink_to(parts)
        return root

    plain = world("plain")
    train = ["train", "cbae", "--world", plain, "--concept-classifier", str(parts / "concepts"),
             "--steps", "3", "--batch-size", "4", "--eval-samples", "8", "--quiet"]
    cbae_dir = tmp_path / "plain" / "cbae"
    result = CliRunner().invoke(cli.main, [*train, "--concepts", "a,b,c", "--out",
                                           str(cbae_dir)])
    assert result.exit_code == 0, result.output
    assert "intervention_success" in result.output

    trained = world("trained", cbae="cbae")
    (tmp_path / "trained" / "cbae").symlink_to(cbae_dir)
    loaded = load_world_dir(trained)
    assert loaded.generator.concept_names == ("a", "b", "c")
    assert loaded.generator.num_unsup == 10 and loaded.metadata["concepts"] is True
    out = tmp_path / "run"
    result = CliRunner().invoke(cli.main, ["concept", "--rho", "0.2", "--inputs", "2", "--n",
                                           "20", "--n0", "5", "--batch", "2", "--models",
                                           "std,cbm", "--world", trained, "--chunk-size", "8",
                                           "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert len((out / "records.jsonl").read_text().splitlines()) == 4

    other = world("other", class_index=4, cbae="cbae")
    (tmp_path / "other" / "cbae").symlink_to(cbae_dir)
    with pytest.raises(ValueError, match="class_index=3, this world's has 4"):
        load_world_dir(other)

    for args, flag, message in [
        (["--concepts", "a,b", "--out", str(tmp_path / "x")], "--concepts",
         "outputs 3 logits but --concepts names 2"),
        (["--concepts", "a,b,c", "--out", str(tmp_path / "x"), "--threshold", "1.5"],
         "--threshold", "threshold=1.5; allowed: in [0.5, 1)"),
        (["--concepts", "a,b,c", "--out", str(cbae_dir)], "--out",
         "already holds a trained CB-AE"),
    ]:
        result = CliRunner().invoke(cli.main, [*train, *args])
        assert result.exit_code == 2, result.output
        assert flag in result.output and message in " ".join(result.output.split())
    result = CliRunner().invoke(cli.main, ["train", "cbae", "--world", str(world_dir),
                                           "--concept-classifier", str(parts / "two"),
                                           "--concepts", "a,b", "--out", str(tmp_path / "y")])
    assert result.exit_code == 2 and "already has a CB-AE" in result.output
    result = CliRunner().invoke(cli.main, ["train", "cbae", "--world", trained,
                                           "--concept-classifier", str(parts / "two"),
                                           "--concepts", "a,b", "--out", str(tmp_path / "y")])
    assert result.exit_code == 2 and "already has a CB-AE" in result.output

    # The same BigGAN converted once: same images, and the CB-AE trained on the files fits it
    # (its converter recorded their sha256); the converted params sha256 joins the identity.
    result = CliRunner().invoke(cli.main, ["convert", "biggan", str(parts / "pytorch_model.bin"),
                                           str(parts / "bg"), "--config",
                                           str(parts / "config.json")])
    assert result.exit_code == 0, result.output
    bg = checkpoint.read_manifest(parts / "bg")

    def converted_world(name, class_index=3, cbae=cbae_dir):
        def edit(manifest):
            biggan(manifest, class_index, cbae="cbae")
            manifest["generator"] = {"kind": "biggan", "converted": "parts/bg",
                                     "class_index": class_index, "truncation": 0.5}

        root = with_manifest(tmp_path / name, world_dir, edit)
        (tmp_path / name / "parts").symlink_to(parts)
        (tmp_path / name / "cbae").symlink_to(cbae)
        return root

    conv = converted_world("conv")
    assert generator_identity(read_manifest(conv)) == {
        "kind": "biggan", "weights_sha256": checkpoint.sha256_file(parts / "pytorch_model.bin"),
        "config_sha256": checkpoint.sha256_file(parts / "config.json"),
        "params_sha256": bg["params_sha256"], "class_index": 3, "truncation": 0.5}
    conv_world = load_world_dir(conv)
    z = jax.random.normal(jax.random.key(0), (2, BIGGAN_FIELDS["z_dim"]))
    np.testing.assert_array_equal(jax.jit(conv_world.latent_apply(("std",)))(conv_world.params, z),
                                  jax.jit(loaded.latent_apply(("std",)))(loaded.params, z))
    with pytest.raises(ValueError, match="class_index=3, this world's has 4"):
        load_world_dir(converted_world("conv_other", class_index=4))
    # A CB-AE trained on the converted generator records only its params sha256: it fits the
    # converted world, not the upstream files (nothing to compare) nor other params.
    only = tmp_path / "only_params"
    shutil.copytree(cbae_dir, only)
    manifest = json.loads((only / "manifest.json").read_text())
    manifest["identity"]["generator"] = {"kind": "biggan", "params_sha256": bg["params_sha256"],
                                         "class_index": 3, "truncation": 0.5}
    (only / "manifest.json").write_text(json.dumps(manifest))
    assert load_world_dir(converted_world("conv_only", cbae=only)).generator.num_concepts == 3
    files_only = world("files_only", cbae="cbae")
    (tmp_path / "files_only" / "cbae").symlink_to(only)
    with pytest.raises(ValueError, match="trained on a generator with weights_sha256=None"):
        load_world_dir(files_only)
    manifest["identity"]["generator"]["params_sha256"] = "0" * 64
    (only / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="with params_sha256='0{64}', this world's has"):
        load_world_dir(converted_world("conv_bad", cbae=only))


def run_latent(world: str, out) -> tuple[int, str]:
    """``certify latent`` on a world, small enough to finish fast if the world loads."""
    result = CliRunner().invoke(cli.main, ["latent", "--sigma", "0.1", "--inputs", "1", "--n", "10",
                                           "--n0", "5", "--batch", "2", "--models", "std,cbm",
                                           "--world", world, "--out", str(out), "--quiet"])
    output = result.output + ("".join(traceback.format_exception(result.exception))
                              if result.exit_code == 1 else "")
    return result.exit_code, output


@pytest.mark.parametrize("section,key,target,message", [
    ("generator", "pickle", "g.pkl", "paths must stay inside the world directory"),
    ("cbae", "config", "cbae.yaml", "paths must stay inside the world directory"),
    ("classifiers", "std", "std", "paths must stay inside the world directory"),
    ("generator", "pickle", "/g.pkl", "paths must be relative to the world directory"),
])
def test_manifest_paths_cannot_leave_the_world_directory(world_dir, tmp_path, section, key,
                                                         target, message):
    """``../`` reaching a real file outside (here: the original world's parts) is refused."""
    root = tmp_path / "copy"
    outside = (str(world_dir / target.lstrip("/")) if target.startswith("/")
               else os.path.relpath(world_dir / target, root))
    path = with_manifest(root, world_dir, lambda m: m[section].update({key: outside}))
    assert os.path.exists(root / outside)  # a real file: only the rule keeps it out
    code, output = run_latent(path, tmp_path / "run")
    assert code == 2, output
    flat = " ".join(output.split())
    assert "Traceback" not in output and f"{section}.{key}={outside!r}; {message}" in flat


class AugmentPipe(sg_ref.Persistent):
    """A persistent network that is not a generator (NVlabs snapshots' ``augment_pipe``)."""

    def __init__(self):
        self.p = 0.0


@pytest.mark.parametrize("network,message", [
    ("D", "generator.network='D': g2.pkl holds a NoneType there, not a StyleGAN2 generator; "
          "its generators: 'G', 'G_ema'"),
    ("augment_pipe", "generator.network='augment_pipe': g2.pkl holds a "
                     "training.networks.AugmentPipe there"),
    ("training_set_kwargs", "generator.network='training_set_kwargs': g2.pkl holds a "
                            "EasyDict there"),
    ("note", "generator.network='note': g2.pkl holds a str there"),
    ("<not a network>", "generator.network='<not a network>': g2.pkl has no such key, not a "
                        "StyleGAN2 generator; its generators: 'G', 'G_ema'"),
    (7, "generator.network=7; expected the key of a generator in the pickle"),
])
def test_network_must_name_a_generator(world_dir, tmp_path, network, message):
    root = with_manifest(tmp_path / "w", world_dir,
                         lambda m: m["generator"].update(pickle="g2.pkl", network=network))
    write_stylegan2_pickle(tmp_path / "w" / "g2.pkl", extra={
        "augment_pipe": AugmentPipe(), "note": "<not a network>",
        "training_set_kwargs": sg_ref.EasyDict(resolution=RESOLUTION)})
    code, output = run_latent(root, tmp_path / "run")
    assert code == 2, output
    assert "Traceback" not in output and message in " ".join(output.split())
