"""cbcert's one checkpoint format (``cbcert.io``): round trips, refusal of damaged checkpoints
before orbax reads them, bounded messages, the kind registry, directories written by earlier
releases (``tests/data/legacy``, written by the previous ``write_converted`` / ``save``), and
loading without torch."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from processes import run_python

from cbcert.concepts import swap_pairs
from cbcert.generators.cbae import CBAE, CBAEConfig
from cbcert.io import checkpoint, registry

LEGACY = Path(__file__).parent / "data" / "legacy"
CBAE_CONFIG = CBAEConfig(latent_dim=4, num_ws=2, concept_names=("a", "b"), num_unsup=1)


@pytest.fixture()
def saved(tmp_path):
    params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": {"c": np.ones(4, np.int32)}}
    manifest = checkpoint.save(tmp_path / "ckpt", params,
                               {"kind": "test", "config": {"width": 3}, "note": 1})
    return tmp_path / "ckpt", params, manifest


def _largest_file(path: Path) -> Path:
    return max((p for p in (path / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def test_round_trip_and_manifest_fields(saved):
    path, params, written = saved
    loaded, manifest = checkpoint.load(path, params)
    np.testing.assert_array_equal(loaded["a"], params["a"])
    np.testing.assert_array_equal(loaded["b"]["c"], params["b"]["c"])
    assert manifest == written == checkpoint.read_manifest(path)
    assert manifest["format_version"] == checkpoint.FORMAT_VERSION == 2
    assert (manifest["kind"], manifest["config"], manifest["note"]) == ("test", {"width": 3}, 1)
    assert manifest["params_sha256"] == checkpoint.params_sha256(params)
    on_disk = sorted(p.relative_to(path / "params").as_posix()
                     for p in (path / "params").rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == on_disk and len(on_disk) >= 3
    assert manifest["files"][on_disk[0]] == checkpoint.sha256_file(path / "params" / on_disk[0])


def test_params_hash_covers_paths_dtypes_shapes_and_values():
    base = {"a": np.zeros((2, 2), np.float32), "b": np.ones(3, np.float32)}
    digest = checkpoint.params_sha256(base)
    variants = [{**base, "a": base["a"].astype(np.float64)}, {**base, "a": np.zeros(4, np.float32)},
                {"a": base["a"], "c": base["b"]}, {**base, "b": np.array([1, 1, 2], np.float32)}]
    assert len({digest, *map(checkpoint.params_sha256, variants)}) == 5
    module = CBAE(CBAE_CONFIG, rngs=nnx.Rngs(0))
    state = nnx.split(module)[1]
    assert (checkpoint.params_sha256(module) == checkpoint.params_sha256(state)
            == checkpoint.params_sha256(nnx.to_pure_dict(state)))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_is_refused_before_orbax_reads_it(saved, damage):
    path, params, _ = saved
    victim = _largest_file(path)
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
    name = victim.relative_to(path / "params").as_posix()
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"corrupted: \['{name}'\]\); re-create it"):
        checkpoint.load(path, params)


def test_missing_and_unexpected_files_are_refused(saved):
    path, params, _ = saved
    (path / "params" / "stray.bin").write_bytes(b"x")
    with pytest.raises(checkpoint.CheckpointError, match=r"unexpected: \['stray.bin'\]"):
        checkpoint.load(path, params)
    (path / "params" / "stray.bin").unlink()
    (path / "params" / "link").symlink_to(_largest_file(path))
    with pytest.raises(checkpoint.CheckpointError, match=r"unexpected: \['link'\]"):
        checkpoint.read_manifest(path)
    (path / "params" / "link").unlink()
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    manifest["files"]["ghost.bin"] = "0" * 64
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match=r"missing: \['ghost.bin'\]"):
        checkpoint.load(path, params)


def test_many_bad_files_are_counted_not_all_listed(saved):
    path, _, _ = saved
    for i in range(40):
        (path / "params" / f"stray{i:02d}.bin").write_bytes(b"x")
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.read_manifest(path)
    assert "and 35 more" in str(err.value) and "stray39" not in str(err.value)


def test_altered_params_hash_is_refused(saved):
    path, params, manifest = saved
    text = (path / checkpoint.MANIFEST).read_text()
    (path / checkpoint.MANIFEST).write_text(text.replace(manifest["params_sha256"], "0" * 64))
    with pytest.raises(checkpoint.CheckpointError,
                       match="params sha256 [0-9a-f]{64} does not match the manifest's 0{64}"):
        checkpoint.load(path, params)


def test_restoring_into_another_structure_is_refused(saved):
    path, params, _ = saved
    with pytest.raises(checkpoint.CheckpointError, match="cannot restore the parameters"):
        checkpoint.load(path, {"a": params["a"], "z": params["b"]["c"]})


@pytest.mark.parametrize("content,message", [
    (None, "no manifest.json; not a cbcert checkpoint"),
    ("{", "manifest.json is not valid JSON"),
    ("[1, 2]", "damaged manifest.json, expected a JSON object"),
    ("[" * 100_000, "manifest.json is not valid JSON \\(nested too deeply\\)"),
    (json.dumps({"format_version": 3}), "format_version=3; this cbcert reads versions 1 and 2"),
    (json.dumps({"format_version": "x" * 10_000}), "this cbcert reads versions 1 and 2"),
    (json.dumps({"format_version": 2, "kind": "k", "config": {}, "params_sha256": "abc",
                 "files": {}}), "damaged manifest.json, params_sha256='abc'"),
    (json.dumps({"format_version": 2, "kind": "k", "config": ["y" * 10_000],
                 "params_sha256": "0" * 64, "files": {}}), "damaged manifest.json, config="),
])
def test_unreadable_manifests_are_named_in_bounded_messages(tmp_path, content, message):
    if content is not None:
        (tmp_path / checkpoint.MANIFEST).write_text(content)
    with pytest.raises(checkpoint.CheckpointError, match=message) as err:
        checkpoint.load(tmp_path, {})
    assert str(tmp_path) in str(err.value) and len(str(err.value)) < 600


def test_save_refuses_bad_manifests_and_existing_checkpoints(saved, tmp_path):
    path, params, _ = saved
    for manifest, message in [({"config": {}}, "kind=None"), ({"kind": "k"}, "config=None"),
                              ({"kind": "k", "config": {}, "files": {}}, "'files' is written")]:
        with pytest.raises(checkpoint.CheckpointError, match=message):
            checkpoint.save(tmp_path / "new", params, manifest)
    assert not (tmp_path / "new").exists()
    with pytest.raises(checkpoint.CheckpointError, match="already holds a checkpoint"):
        checkpoint.save(path, params, {"kind": "test", "config": {}})
    other = {"a": np.zeros(2, np.float32)}
    checkpoint.save(path, other, {"kind": "test", "config": {}}, replace=True)
    loaded, _ = checkpoint.load(path, other)
    np.testing.assert_array_equal(loaded["a"], other["a"])


def test_module_round_trip_through_the_registry(tmp_path):
    module = CBAE(CBAE_CONFIG, rngs=nnx.Rngs(1))
    written = registry.save_module(tmp_path / "cbae", "cbae", module, {"sources": {}})
    assert written["config"] == {"latent_dim": 4, "num_ws": 2, "concept_names": ["a", "b"],
                                 "num_unsup": 1}
    loaded, manifest = registry.load_module(tmp_path / "cbae")
    assert loaded.config == CBAE_CONFIG and manifest == written
    w = jax.random.normal(jax.random.key(0), (3, 8))
    np.testing.assert_array_equal(loaded.encode(w), module.encode(w))
    apply_fn, params, _ = registry.load_converted(tmp_path / "cbae")
    np.testing.assert_array_equal(jax.jit(apply_fn)(params, w), module.encode(w))
    with pytest.raises(checkpoint.CheckpointError, match="kind='pcbm' does not fit a CBAE"):
        registry.save_module(tmp_path / "x", "pcbm", module, {})


def test_registry_refuses_unknown_kinds_and_configs(tmp_path):
    module = CBAE(CBAE_CONFIG, rngs=nnx.Rngs(1))
    for name, manifest, message in [
            ("kind", {"kind": "cbae-progress", "config": {}},
             "kind='cbae-progress' is not a model"),
            ("extra", {"kind": "cbae", "config": {"latent_dim": 4, "colour": 1}},
             r"config keys \['colour', 'latent_dim'\] do not match CBAEConfig fields"),
            ("value", {"kind": "cbae", "config": {"latent_dim": 0, "num_ws": 2,
                                                  "concept_names": ["a"], "num_unsup": 1}},
             "damaged config for kind='cbae' \\(latent_dim=0; must be >= 1\\)")]:
        checkpoint.save(tmp_path / name, module, manifest)
        with pytest.raises(checkpoint.CheckpointError, match=message):
            registry.load_module(tmp_path / name)


def test_generators_have_no_single_input_function(tmp_path):
    from cbcert.generators.stylegan2.config import StyleGAN2Config
    from cbcert.generators.stylegan2.network import StyleGAN2

    config = StyleGAN2Config(z_dim=4, w_dim=4, img_resolution=4, img_channels=3, channels=(4,),
                             mapping_layers=1)
    registry.save_module(tmp_path / "g", "stylegan2", StyleGAN2(config, rngs=nnx.Rngs(0)), {})
    module, _ = registry.load_module(tmp_path / "g")
    assert module.config == config  # channels came back as a tuple
    with pytest.raises(checkpoint.CheckpointError, match="is a generator .* use load_module"):
        registry.load_converted(tmp_path / "g")


def _encode_error_bound(module: CBAE, w: np.ndarray) -> np.ndarray:
    """A priori bound on ``|float32 module.encode(w) − exact|``, elementwise ``[B, 2K + U]``.

    Forward error analysis (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1),
    carried through the layers in float64 with e = the bound on the incoming error and
    u = 2⁻²⁴, γ_k = k u / (1 − k u), whatever order or vector width a CPU sums in:
    mean over the num_ws latents: e = γ_{num_ws+1} mean|w|; Linear ``x W + b`` with n inputs:
    e' = (e + γ_{n+1} (|x| + e)) |W| + γ_{n+1} |b|; LeakyReLU: e' = e + u |y| (1-Lipschitz, one
    rounding of the slope product); inference BatchNorm ``(x − m) a + β`` with
    a = scale / sqrt(var + eps): e' = |a| e + 8 u (|a| (|x| + e + |m|) + |β|) (at most 8
    roundings however XLA folds it, rsqrt included); the pair swap is exact.
    """
    from cbcert.generators.cbae import BN_EPS, LEAKY_SLOPE

    u = np.finfo(np.float32).eps / 2
    gamma = lambda k: k * u / (1 - k * u)
    f64 = lambda p: np.asarray(p[...], np.float64)
    config = module.config
    ws = np.asarray(w, np.float64).reshape(w.shape[0], config.num_ws, config.latent_dim)
    x = ws.mean(axis=1)  # [B, dw]
    e = gamma(config.num_ws + 1) * np.abs(ws).mean(axis=1)

    def linear(layer, x, e):
        kernel, bias = f64(layer.kernel), f64(layer.bias)
        g = gamma(kernel.shape[0] + 1)
        return x @ kernel + bias, (e + g * (np.abs(x) + e)) @ np.abs(kernel) + g * np.abs(bias)

    for block in module.encoder:
        x, e = linear(block.linear, x, e)
        x = np.where(x > 0, x, LEAKY_SLOPE * x)
        e = e + u * np.abs(x)
        norm = block.norm
        a = f64(norm.scale) / np.sqrt(f64(norm.var) + BN_EPS)
        mean, beta = f64(norm.mean), f64(norm.bias)
        e = np.abs(a) * e + 8 * u * (np.abs(a) * (np.abs(x) + e + np.abs(mean)) + np.abs(beta))
        x = (x - mean) * a + beta
    _, e = linear(module.encoder_out, x, e)
    order = np.asarray(swap_pairs(np.arange(e.shape[1]), config.num_concepts))  # a permutation
    return e[:, order]


@pytest.mark.float_bits
def test_directories_of_the_previous_release_still_load(tmp_path):
    expected = json.loads((LEGACY / "expected.json").read_text())
    module, manifest = registry.load_module(LEGACY / "converted_v1")
    assert manifest["format_version"] == 1 and "files" not in manifest
    w = np.asarray(expected["w"], np.float32)
    # The stored outputs are a float32 evaluation on another CPU: equal to this one up to both
    # evaluations' rounding (expected.json's "encode_valid_to"), not bit for bit.
    difference = np.abs(np.asarray(module.encode(w), np.float64) - np.asarray(expected["encode"]))
    bound = 2 * _encode_error_bound(module, w)
    assert (difference <= bound).all(), (difference, bound)
    assert checkpoint.params_sha256(module) == expected["params_sha256"]
    params = {"a": np.zeros((2, 3), np.float32), "b": {"c": np.zeros(4, np.int32)}}
    loaded, manifest = checkpoint.load(LEGACY / "builtin_format1", params)
    assert manifest["format"] == 1 and manifest["note"] == 1
    np.testing.assert_array_equal(loaded["a"], np.arange(6, dtype=np.float32).reshape(2, 3))
    # What each legacy format recorded is still checked.
    copy = tmp_path / "converted_v1"
    shutil.copytree(LEGACY / "converted_v1", copy)
    text = (copy / checkpoint.MANIFEST).read_text()
    (copy / checkpoint.MANIFEST).write_text(text.replace(expected["params_sha256"], "f" * 64))
    with pytest.raises(checkpoint.CheckpointError, match="params sha256 .* does not match"):
        registry.load_module(copy)
    copy = tmp_path / "builtin_format1"
    shutil.copytree(LEGACY / "builtin_format1", copy)
    victim = _largest_file(copy)
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(checkpoint.CheckpointError, match="corrupted"):
        checkpoint.load(copy, params)


def test_io_loads_without_torch():
    """``import torch`` fails in the child; ``cbcert.io`` still imports and loads a model, and
    neither torch nor ``cbcert.convert`` gets imported."""
    out = run_python(f"""
import sys
sys.modules["torch"] = None  # `import torch` now raises ImportError
from cbcert.io import checkpoint, registry
module, manifest = registry.load_module({str(LEGACY / "converted_v1")!r})
assert sys.modules["torch"] is None
assert not [m for m in sys.modules if m.startswith("cbcert.convert")]
print(manifest["kind"], module.config.latent_dim)
""")
    assert out.split() == ["cbae", "4"]
