"""Tests of cbcert.runs.config: YAML loading, strict keys and types, ranges, presets, round trip."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from cbcert.runs import config
from cbcert.runs.config import ConfigError, ExperimentConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return path


def test_defaults_follow_spec():
    cfg = ExperimentConfig()
    assert cfg.perturb.eps == (0.05, 0.1, 0.3, 0.5, 0.8)
    assert cfg.perturb.tau == (1, 2, 5, 10)
    assert (cfg.perturb.subsets, cfg.perturb.subset_size) == (5, 200)
    assert (cfg.latent.n0, cfg.latent.n, cfg.latent.alpha) == (100, 1000, 0.001)
    assert (cfg.concept.n0, cfg.concept.n, cfg.concept.alpha) == (100, 1000, 0.001)
    assert cfg.attack.eps == (0.01, 0.03)
    assert (cfg.attack.iters, cfg.attack.norm, cfg.attack.space) == (100, "linf", "latent")


@pytest.mark.parametrize("name", ["empirical", "certify_latent", "certify_concept"])
def test_shipped_presets_load_and_round_trip(name):
    cfg = config.load_config(CONFIGS / f"{name}.yaml")
    assert cfg.name == name
    manifest = json.loads(json.dumps(cfg.to_dict()))
    assert ExperimentConfig.from_dict(manifest) == cfg


def test_yaml_overrides_keys_and_keeps_other_defaults(tmp_path):
    path = _write(tmp_path, "latent:\n  sigmas: [0.25, 1]\n  n: 2000\n")
    cfg = config.load_config(path)
    assert cfg.latent.sigmas == (0.25, 1.0)
    assert isinstance(cfg.latent.sigmas[1], float)
    assert cfg.latent.n == 2000 and cfg.latent.n0 == 100
    assert cfg.perturb == config.PerturbConfig()


def test_preset_key_starts_from_named_preset(tmp_path):
    cfg = config.load_config(_write(tmp_path, "preset: smoke\nlatent: {n: 200}\n"))
    smoke = ExperimentConfig.from_preset_name("smoke")
    assert cfg.latent.n == 200 and cfg.latent.n0 == smoke.latent.n0
    assert cfg.perturb == smoke.perturb and cfg.name == "smoke"
    with pytest.raises(ConfigError, match="unknown preset 'huge' \\(known: default, smoke\\)"):
        ExperimentConfig.from_preset_name("huge")


def test_empty_file_gives_defaults(tmp_path):
    assert config.load_config(_write(tmp_path, "")) == ExperimentConfig()


def test_unknown_key_names_file_section_and_allowed(tmp_path):
    path = _write(tmp_path, "latent:\n  sigma: [0.1]\n")
    with pytest.raises(ConfigError) as error:
        config.load_config(path)
    assert str(error.value) == (
        f"{path}: unknown key 'sigma' in section 'latent' "
        "(allowed: sigmas, n0, n, alpha, two_class, models, schedule, target_radius, "
        "radius_tolerance, first_checkpoint, checkpoint_ratio, final_alpha_share, subsets, "
        "subset_size)"
    )


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"x\.yaml: unknown section 'certify' \(allowed: preset"):
        config.load_config(_write(tmp_path, "certify: {}\n"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("latent: {n0: abc}", "section 'latent', key 'n0': expected int, got str 'abc'"),
        ("latent: {n0: 10.5}", "key 'n0': expected int, got float 10.5"),
        ("latent: {two_class: 1}", "key 'two_class': expected bool, got int 1"),
        ("latent: {sigmas: 0.1}", "key 'sigmas': expected list of float, got float 0.1"),
        ("perturb: {tau: [1, true]}", r"key 'tau\[1\]': expected int, got bool True"),
        ("latent: {alpha: 1e-3}", "got str '1e-3' \\(YAML reads exponents"),
        ("attack: {norm: l1}", "key 'norm': expected 'linf' \\| 'l2', got str 'l1'"),
        ("attack: [1, 2]", r"section 'attack\[0\]': expected a mapping, got int 1"),
    ],
)
def test_wrong_types_name_key_value_and_expected_type(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        config.load_config(_write(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("latent: {sigmas: [0.1, -0.5]}",
         r"key 'sigmas\[1\]': got -0.5, allowed range \[1e-30, 1e\+30\]"),
        ("latent: {sigmas: [1.0e+308]}", r"key 'sigmas\[0\]': got 1e\+308, allowed range"),
        ("latent: {n: 2147483648}", r"key 'n': got 2147483648, allowed range integer in \[1, "),
        ("concept: {rhos: [0.5]}", r"key 'rhos\[0\]': got 0.5, allowed range \(0, 0.5\)"),
        ("concept: {alpha: 0.0}", r"key 'alpha': got 0.0, allowed range \(0, 1\)"),
        ("concept: {flips: [0]}", r"key 'flips\[0\]': got 0, allowed range integer in \[1, inf\)"),
        ("latent: {n0: 2000}", "key 'n0'=2000 exceeds key 'n'=1000"),
        ("perturb: {subsets: 1}", r"key 'subsets': got 1, allowed range integer in \[2, inf\)"),
        ("perturb: {eps: [], tau: []}", "at least one budget is needed"),
        ("latent: {sigmas: []}", "key 'sigmas': needs at least one value"),
        ("perturb: {tau: [1, 1]}", r"key 'tau': repeated values in \[1, 1\]"),
        ("world: {seed: -1}", r"key 'seed': got -1, allowed range integer in \[0, 4294967295\]"),
    ],
)
def test_out_of_range_values_name_key_and_range(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        config.load_config(_write(tmp_path, text))


def test_cross_section_checks_apply_to_the_sections_run(tmp_path):
    """An attack-only file is not refused for the perturb defaults it never runs."""
    cfg = config.load_config(_write(tmp_path, "world: {num_inputs: 100}\nattack: {inputs: 8}"))
    cfg.check_sections(("attack",))
    with pytest.raises(ConfigError, match="'subset_size': 200 exceeds world.num_inputs=100"):
        cfg.check_sections(("attack", "perturb"))


def test_messages_stay_short_for_huge_values(tmp_path):
    """Nine levels of YAML aliases make a 1e9-element value from ~300 bytes; the message quoting
    it must stay bounded (it once reached 254 MB)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    text = "\n".join(lines) + "\nlatent: {sigmas: *a8}\n"
    assert len(text.encode()) < 1000
    with pytest.raises(ConfigError) as error:
        config.load_config(_write(tmp_path, text))
    assert len(str(error.value)) < 1000


def test_non_utf8_config_names_the_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes(b"latent: {sigmas: [0.1]}\n# \xff\xfe\n")
    with pytest.raises(ConfigError, match="x.yaml: not UTF-8"):
        config.load_config(path)


def test_invalid_yaml_and_missing_file_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match="x.yaml: not valid YAML"):
        config.load_config(_write(tmp_path, "latent: [1,\n"))
    with pytest.raises(ConfigError, match="nope.yaml: cannot read config file"):
        config.load_config(tmp_path / "nope.yaml")




def test_configs_are_frozen_and_replace_revalidates():
    cfg = ExperimentConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.latent.n = 5
    with pytest.raises(ConfigError, match="key 'alpha': got 2.0"):
        dataclasses.replace(cfg.latent, alpha=2.0)
    assert config.LatentConfig(sigmas=[0.5]).sigmas == (0.5,)


def test_manifest_is_plain_yaml():
    dumped = yaml.safe_dump(ExperimentConfig.from_preset_name("smoke").to_dict())
    assert ExperimentConfig.from_dict(yaml.safe_load(dumped)).name == "smoke"


def test_schedule_keys_reach_the_cells_and_stay_out_of_old_manifests(tmp_path):
    from cbcert.runs.sweep import plan_cells

    reference = config.load_config(Path(__file__).parents[1] / "configs" / "reference.yaml")
    assert not {"schedule", "target_radius"} & set(reference.to_dict()["latent"])
    assert "two_class" not in reference.to_dict()["concept"]  # a later key, left at its default
    cfg = config.load_config(_write(tmp_path, (
        "latent: {schedule: sequential, target_radius: 1, first_checkpoint: 16}\n"
        "concept: {two_class: true, schedule: sequential, radius_tolerance: 0.5}\n")))
    assert cfg.latent.target_radius == 1.0 and isinstance(cfg.latent.target_radius, float)
    assert ExperimentConfig.from_dict(cfg.to_dict()) == cfg
    jobs = {cell.name: cell.job for cell in plan_cells(cfg, ("latent", "concept"))}
    latent, concept = jobs["latent-sigma0.1"], jobs["concept-rho0.2"]
    assert (latent.schedule, latent.target_radius, latent.first_checkpoint) == (
        "sequential", 1.0, 16)
    assert concept.two_class and concept.radius_tolerance == 0.5


@pytest.mark.parametrize("text,message", [
    ("latent: {target_radius: 0.5}", "key 'target_radius': got 0.5, which only the sequential"),
    ("concept: {schedule: adaptive}",
     "key 'schedule': got 'adaptive', allowed: fixed, sequential, anytime"),
    ("latent: {schedule: sequential, first_checkpoint: 2.5}",
     "key 'first_checkpoint': expected an integer or null, got float 2.5"),
    ("concept: {schedule: sequential, checkpoint_ratio: 1}",
     "key 'checkpoint_ratio': expected a number in (1, 1e6], got 1.0"),
])
def test_bad_schedule_keys_name_section_and_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load_config(_write(tmp_path, text + "\n"))


WORLDS = """\
preset: smoke
name: mw
world: {seed: 3, num_inputs: 16}
latent: {sigmas: [0.25], n: 50}
perturb: {tau: [1, 2, 10]}
worlds:
  - default
  - {preset: k8, family: vocabulary, num_inputs: 12, perturb: {tau: [1, 2]}}
  - {preset: some/dir/mine, name: mine, latent: {n: 80}}
"""


def test_worlds_entries_merge_the_file_sections_and_round_trip(tmp_path):
    cfg = config.load_config(_write(tmp_path, WORLDS))
    assert [(w.name, w.family) for w in cfg.worlds] == [
        ("default", ""), ("k8", "vocabulary"), ("mine", "")]
    default, k8, mine = (cfg.for_world(w) for w in cfg.worlds)
    assert default.world == config.WorldConfig(preset="default", seed=3, num_inputs=16)
    assert (k8.world.num_inputs, k8.world.seed, k8.perturb.tau) == (12, 3, (1, 2))
    assert k8.latent == default.latent and k8.perturb.eps == default.perturb.eps
    assert (mine.world.preset, mine.latent.n, mine.latent.sigmas) == ("some/dir/mine", 80, (0.25,))
    assert default.perturb.tau == (1, 2, 10) and not default.worlds
    assert {c.name for c in (default, k8, mine)} == {"mw"}
    manifest = json.loads(json.dumps(cfg.to_dict()))
    assert [w["name"] for w in manifest["worlds"]] == ["default", "k8", "mine"]
    assert ExperimentConfig.from_dict(manifest) == cfg


def test_a_config_without_worlds_or_classes_keeps_its_manifest_form():
    """Sweeps written before both keys existed must still resume (manifest pinned)."""
    assert set(ExperimentConfig().to_dict()) == {"name", "world", "latent", "concept", "perturb",
                                                 "attack"}
    cfg = ExperimentConfig.from_dict({"classes": {"samples": 64}})
    assert cfg.to_dict()["classes"] == {"samples": 64}


@pytest.mark.parametrize("entries, match", [
    ("[]", r"key 'worlds': expected a non-empty list"),
    ("[{family: x}]", r"worlds\[0\]: no world; give a preset name"),
    ("[default, default]", r"worlds\[1\]: world name 'default' is already taken"),
    ("[{preset: default, name: report}]", r"worlds\[0\], key 'name': got 'report'"),
    ("[{preset: default, colour: red}]", r"worlds\[0\]: unknown key 'colour'"),
    ("[{preset: default, family: 3}]", r"worlds\[0\], key 'family': expected a string"),
    ("[default, {preset: k8, latent: {n: 0}}]", r"worlds\[1\] \(k8\): .*key 'n'"),
])
def test_bad_world_entries_name_the_entry(tmp_path, entries, match):
    with pytest.raises(ConfigError, match=match):
        config.load_config(_write(tmp_path, f"preset: smoke\nworlds: {entries}\n"))
