"""Typed, frozen experiment configs loaded from YAML presets in ``configs/``.

An `ExperimentConfig` has one section per command: ``world`` (which generated inputs),
``latent`` (Gaussian latent smoothing), ``concept`` (Bernoulli / fixed-count concept-flip
smoothing), ``perturb`` (empirical PFR/CFR/DFS protocol) and ``attack`` (APGD). Defaults follow
SPEC §3–§5. Named presets work like flax gemma's ``TransformerConfig.from_version_name``:
``ExperimentConfig.from_preset_name("smoke")``; a YAML file may start from one with a top-level
``preset: <name>`` key and override individual keys::

    preset: default
    world: {seed: 0, num_inputs: 1000}
    latent: {sigmas: [0.12, 0.25, 0.5], alpha: 0.001}

Several worlds (``worlds:``, a list) make a multi-world experiment: every world runs the same
cells, each world entry naming a preset or a world directory and optionally overriding the
``world`` keys and any section for that world alone (`WorldEntry`)::

    world: {seed: 0, num_inputs: 400}
    worlds:
      - default
      - {preset: similar5, family: class similarity}
      - {preset: k8, family: vocabulary, perturb: {tau: [1, 2, 5, 7]}}

Every section validates itself on construction (types, ranges, ``n0 <= n``), so a config that
exists is valid. The same range rules are exposed to the CLI through `validate` and
`validate_sample_sizes`, so a flag and a YAML key can never disagree about what is allowed.
Errors are `ConfigError` (a ``ValueError``) naming the file, section, key, value and the
allowed values.

Size: over the module budget by the world-entry parsing, which belongs with the sections it
merges.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from cbcert.certify.schedule import SEQUENTIAL_KEYS, check_settings
from cbcert.schema import ConfigError, Section, rule, short_repr, shorten, validate_sample_sizes

_MODELS = ("std", "cbm", "proto")
_CELL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# Keys added after sweep directories existed, with their defaults: written to manifests only
# when set, so an older sweep still resumes and the reference run stays byte-identical.
_SCHEDULE_DEFAULTS = types.MappingProxyType(
    {"schedule": "fixed", **dict.fromkeys(SEQUENTIAL_KEYS), "subsets": 0, "subset_size": 0})
_INTEGER_KEYS = ("first_checkpoint",)


class _LaterKeys:
    """A section with keys added after sweep directories existed (``_later_keys``: key →
    default as `to_dict` writes it): written to manifests only when set, so an older sweep
    still resumes and the reference run stays byte-identical."""

    _later_keys: Mapping[str, Any] = types.MappingProxyType({})

    def to_dict(self) -> dict[str, Any]:
        """`Section.to_dict` without the later keys left at their defaults (``_later_keys``)."""
        later = self._later_keys
        return {k: v for k, v in super().to_dict().items() if k not in later or v != later[k]}


class _Schedule(_LaterKeys):
    """The certification schedule keys of a section (``schedule``, `SEQUENTIAL_KEYS`)."""

    _later_keys: Mapping[str, Any] = _SCHEDULE_DEFAULTS

    def _check_schedule(self) -> None:
        for key in SEQUENTIAL_KEYS:  # None or a number; Section's checks know no optionals
            value = getattr(self, key)
            integer = key in _INTEGER_KEYS
            if value is None or (isinstance(value, int) and not isinstance(value, bool)):
                if value is not None and not integer:
                    object.__setattr__(self, key, float(value))
                continue
            if isinstance(value, float) and not integer:
                continue
            kind = "an integer" if integer else "a number"
            detail = f"expected {kind} or null, got {type(value).__name__} {short_repr(value)}"
            raise ConfigError(f"key '{key}': {detail}", key=key, value=value, detail=detail)
        check_settings(self.schedule, **{key: getattr(self, key) for key in SEQUENTIAL_KEYS})


@dataclass(frozen=True)
class WorldConfig(Section):
    """Which generated inputs: generator/classifier world preset, root seed, pool size."""

    preset: str = "default"
    seed: int = field(default=0, metadata=rule("seed"))
    num_inputs: int = field(default=1000, metadata=rule("count"))


@dataclass(frozen=True)
class LatentConfig(_Schedule, Section):
    """Gaussian latent smoothing (SPEC §4): σ values, Monte Carlo sizes, confidence, schedule.

    ``schedule: sequential`` certifies with anytime-valid checkpoints up to ``n``
    (`cbcert.certify.sequential`), tuned by ``target_radius``, ``radius_tolerance``,
    ``first_checkpoint``, ``checkpoint_ratio``, ``final_alpha_share`` (null = default/off).
    ``subsets``, ``subset_size`` (0 = off): SmAcc, ACR and the radius of correct inputs also as
    mean ± sd over random subsets of the certified inputs, with paired tests between models.
    """

    sigmas: tuple[float, ...] = field(default=(0.1,), metadata=rule("sigma", nonempty=True))
    n0: int = field(default=100, metadata=rule("samples"))
    n: int = field(default=1000, metadata=rule("samples"))
    alpha: float = field(default=0.001, metadata=rule("alpha"))
    two_class: bool = False
    models: tuple[str, ...] = field(default=_MODELS, metadata={"nonempty": True})
    schedule: Literal["fixed", "sequential", "anytime"] = "fixed"
    target_radius: float | None = None
    radius_tolerance: float | None = None
    first_checkpoint: int | None = None
    checkpoint_ratio: float | None = None
    final_alpha_share: float | None = None
    subsets: int = 0
    subset_size: int = 0

    def __post_init__(self) -> None:
        self._check_schedule()
        super().__post_init__()
        validate_sample_sizes(self.n0, self.n, n0_label="key 'n0'", n_label="key 'n'")


@dataclass(frozen=True)
class ConceptConfig(_Schedule, Section):
    """Concept-flip smoothing (SPEC §4): Bernoulli ρ values and fixed flip counts m.

    ``two_class``, the schedule keys and ``subsets``/``subset_size`` as in `LatentConfig`.
    """

    _later_keys = types.MappingProxyType({**_SCHEDULE_DEFAULTS, "two_class": False})

    rhos: tuple[float, ...] = field(default=(0.2,), metadata=rule("rho", nonempty=True))
    flips: tuple[int, ...] = field(default=(), metadata=rule("count"))
    n0: int = field(default=100, metadata=rule("samples"))
    n: int = field(default=1000, metadata=rule("samples"))
    alpha: float = field(default=0.001, metadata=rule("alpha"))
    models: tuple[str, ...] = field(default=_MODELS, metadata={"nonempty": True})
    two_class: bool = False
    schedule: Literal["fixed", "sequential", "anytime"] = "fixed"
    target_radius: float | None = None
    radius_tolerance: float | None = None
    first_checkpoint: int | None = None
    checkpoint_ratio: float | None = None
    final_alpha_share: float | None = None
    subsets: int = 0
    subset_size: int = 0

    def __post_init__(self) -> None:
        self._check_schedule()
        super().__post_init__()
        validate_sample_sizes(self.n0, self.n, n0_label="key 'n0'", n_label="key 'n'")


@dataclass(frozen=True)
class PerturbConfig(_LaterKeys, Section):
    """Empirical protocol (SPEC §3): latent budgets ε, concept budgets τ, smoothing-noise
    budgets σ (latent Gaussian) and ρ (Bernoulli concept flips), k subsets of n; ``explain``:
    also the concept model's explanation stability (`cbcert.runs.explanations`)."""

    eps: tuple[float, ...] = field(default=(0.05, 0.1, 0.3, 0.5, 0.8), metadata=rule("eps"))
    tau: tuple[int, ...] = field(default=(1, 2, 5, 10), metadata=rule("count"))
    subsets: int = field(default=5, metadata=rule("subsets"))
    subset_size: int = field(default=200, metadata=rule("count"))
    samples: int = field(default=1, metadata=rule("samples"))
    ball: bool = False
    sigma: tuple[float, ...] = field(default=(), metadata=rule("sigma"))
    rho: tuple[float, ...] = field(default=(), metadata=rule("rho"))
    explain: bool = False

    _later_keys = types.MappingProxyType({"sigma": [], "rho": [], "explain": False})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.eps or self.tau or self.sigma or self.rho):
            raise ConfigError("keys 'eps', 'tau', 'sigma' and 'rho': at least one budget is "
                              "needed, all empty")


@dataclass(frozen=True)
class AttackConfig(_LaterKeys, Section):
    """APGD-CE through generator and classifier (SPEC §5).

    A config may hold several attack sections (``attack:`` a list of mappings, each over the
    preset's defaults), e.g. vanilla and smoothed × latent and concept; ``name`` (default
    ``auto``: from space and smoothing, ``attack-latent``, ``attack-concept-smoothed-rho0.2``)
    tells apart sections that would get the same cell name.
    """

    space: Literal["latent", "concept"] = "latent"
    eps: tuple[float, ...] = field(default=(0.01, 0.03), metadata=rule("eps", nonempty=True))
    norm: Literal["linf", "l2"] = "linf"
    iters: int = field(default=100, metadata=rule("count"))
    restarts: int = field(default=1, metadata=rule("count"))
    smoothed: bool = False
    # Noise samples per gradient of the smoothed classifier's expected softmax (EOT).
    eot: int = field(default=8, metadata=rule("samples"))
    # Agreement inputs attacked (APGD is far costlier per input than certification).
    inputs: int = field(default=64, metadata=rule("count"))
    # Smoothing scale of smoothed attacks: σ for space latent, ρ for space concept; PREDICT
    # then uses the n and alpha of the latent or concept section.
    sigma: float = field(default=0.25, metadata=rule("sigma"))
    rho: float = field(default=0.2, metadata=rule("rho"))
    # Cell name of this section ("auto": derived from space and smoothing).
    name: str = "auto"
    # Record cbm/proto explanations at the clean and adversarial points (base attacks).
    explain: bool = False

    _later_keys = types.MappingProxyType({"name": "auto", "explain": False})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _CELL_NAME.fullmatch(self.name) or self.name in ("report", "manifest.json"):
            detail = (f"got {short_repr(self.name)}; a directory name of letters, digits, '.', "
                      "'_', '-' (at most 100, not 'report')")
            raise ConfigError(f"key 'name': {detail}", key="name", value=self.name,
                              detail=detail)


@dataclass(frozen=True)
class ClassesConfig(Section):
    """Class similarity (``certify world classes``): class-centroid distances of f_std's
    features over ``samples`` pool latents (a ``classes`` cell of a sweep)."""

    samples: int = field(default=400, metadata=rule("samples"))


@dataclass(frozen=True)
class ExplainConfig(Section):
    """Explanations (``certify explain``, `cbcert.runs.explain`): top-k explanations of the
    concept models and the prototype network on ``inputs`` agreement inputs, their stability
    after an ε shift and τ flips, certified concept signs / prototype membership (σ, R =
    ``radius`` or σ/4, n0, n, α; with ``rho`` also under concept flips at Hamming radius
    ``flip_radius``), known-answer quality and counterfactual edits of the concept models (an
    ``explain`` cell of a sweep; known answer and counterfactuals on built-in worlds)."""

    models: tuple[str, ...] = field(default=("cbm", "cbmh", "proto"),
                                    metadata={"nonempty": True})
    inputs: int = field(default=100, metadata=rule("count"))
    eps: float = field(default=0.3, metadata=rule("eps"))
    tau: int = field(default=1, metadata=rule("count"))
    sigma: float = field(default=0.1, metadata=rule("sigma"))
    radius: float | None = None
    n0: int = field(default=100, metadata=rule("samples"))
    n: int = field(default=1000, metadata=rule("samples"))
    alpha: float = field(default=0.001, metadata=rule("alpha"))
    top_k: int = field(default=5, metadata=rule("count"))
    figure_inputs: int = 4
    rho: float | None = None
    flip_radius: int = field(default=1, metadata=rule("count"))


@dataclass(frozen=True)
class AnalysisConfig(Section):
    """How `certify report` reads a run's findings (`cbcert.report.family`), fixed in the
    config before the run: the run-wide two-sided significance ``level``, and the equivalence
    margins of the two one-sided tests — ``rate_margin`` for accuracies and flip rates (a
    fraction: 0.02 = 2 points) and ``radius_margin`` for mean certified radii (a fraction of
    the standard model's R̄). Only a TOST that passes within them supports "no difference"."""

    level: float = field(default=0.05, metadata=rule("fraction"))
    rate_margin: float = field(default=0.02, metadata=rule("fraction"))
    radius_margin: float = field(default=0.05, metadata=rule("fraction"))


_SECTIONS: Mapping[str, type[Section]] = types.MappingProxyType(
    {
        "world": WorldConfig,
        "latent": LatentConfig,
        "concept": ConceptConfig,
        "perturb": PerturbConfig,
        "attack": AttackConfig,
        "classes": ClassesConfig,
        "explain": ExplainConfig,
        "analysis": AnalysisConfig,
    }
)
# Sections written to manifests only when they differ from their defaults (added later).
_LATER_SECTIONS = ("classes", "explain", "analysis")
_ENTRY_KEYS = ("name", "family", "preset", "seed", "num_inputs")
# Sections that hold for the whole run, never one world's entry.
_RUN_WIDE = ("analysis",)


@dataclass(frozen=True)
class WorldEntry:
    """One world of a multi-world experiment.

    Attributes:
      name: its directory under the sweep (default: the preset, or the world directory's
        name); unique within the experiment.
      family: the group it is compared within in cross-world figures (e.g. ``class
        similarity``, ``vocabulary``); default ``""`` (one family).
      config: the whole single-world experiment it runs (the file's sections with this
        entry's overrides; its ``world.preset`` is the preset or directory).
    """

    name: str
    family: str
    config: ExperimentConfig

    def to_dict(self) -> dict[str, Any]:
        """``name``, ``family`` and every resolved section (what a manifest pins)."""
        sections = self.config.to_dict()
        sections.pop("name")
        return {"name": self.name, "family": self.family, **sections}


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: one typed section per command (all sections always present)."""

    name: str = "default"
    world: WorldConfig = WorldConfig()
    latent: LatentConfig = LatentConfig()
    concept: ConceptConfig = ConceptConfig()
    perturb: PerturbConfig = PerturbConfig()
    attack: AttackConfig | tuple[AttackConfig, ...] = AttackConfig()
    classes: ClassesConfig = ClassesConfig()
    explain: ExplainConfig = ExplainConfig()
    analysis: AnalysisConfig = AnalysisConfig()
    worlds: tuple[WorldEntry, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"key 'name': expected a non-empty string, got "
                              f"{short_repr(self.name)}", key="name", value=self.name)
        if isinstance(self.attack, tuple) and len(self.attack) == 1:
            object.__setattr__(self, "attack", self.attack[0])
        for section, cls in _SECTIONS.items():
            value = getattr(self, section)
            if section == "attack" and isinstance(value, tuple) and value and all(
                    isinstance(v, cls) for v in value):
                continue
            if not isinstance(value, cls):
                raise ConfigError(
                    f"section '{section}': expected {cls.__name__}, "
                    f"got {type(getattr(self, section)).__name__}"
                )
        if not (isinstance(self.worlds, tuple)
                and all(isinstance(w, WorldEntry) for w in self.worlds)):
            raise ConfigError("key 'worlds': expected a tuple of WorldEntry")

    @property
    def attacks(self) -> tuple[AttackConfig, ...]:
        """Every attack section (one, or the list the file gives)."""
        return self.attack if isinstance(self.attack, tuple) else (self.attack,)

    def for_world(self, entry: WorldEntry) -> ExperimentConfig:
        """The single-world experiment of one of ``worlds`` (the sweep's name kept)."""
        return replace(entry.config, name=self.name)

    def check_sections(self, sections: tuple[str, ...]) -> None:
        """Checks across sections, for the sections a sweep runs only.

        An attack-only file is not refused for the perturb defaults it never uses.
        """
        for name in ("latent", "concept"):
            section = getattr(self, name)
            if name in sections and (section.subsets or section.subset_size):
                try:
                    _check_subsets(section.subsets, section.subset_size, self.world.num_inputs)
                except ConfigError as error:
                    raise error.within(f"section '{name}', ") from None
        if "perturb" in sections and self.perturb.subset_size > self.world.num_inputs:
            raise ConfigError(
                f"section 'perturb', key 'subset_size': {self.perturb.subset_size} exceeds "
                f"world.num_inputs={self.world.num_inputs}; the agreement set cannot be larger "
                "than the pool"
            )

    @classmethod
    def from_preset_name(cls, preset: str) -> ExperimentConfig:
        """A named preset (`PRESETS`), like gemma's ``TransformerConfig.from_version_name``."""
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {short_repr(preset)} (known: {', '.join(PRESETS)})")
        return PRESETS[preset]()

    @classmethod
    def from_dict(cls, data: Any) -> ExperimentConfig:
        """Build from a mapping shaped like the YAML files (see `load_config`)."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a mapping at the top level, got {type(data).__name__}")
        allowed = ["preset", "name", *_SECTIONS, "worlds"]
        for key in data:
            if key not in allowed:
                raise ConfigError(f"unknown section {short_repr(key)} "
                                  f"(allowed: {', '.join(allowed)})")
        preset = data.get("preset", "default")
        if not isinstance(preset, str):
            raise ConfigError(f"key 'preset': expected str, got {type(preset).__name__} "
                              f"{short_repr(preset)}")
        base = cls.from_preset_name(preset)
        sections = {}
        for section, section_cls in _SECTIONS.items():
            overrides = data.get(section, {})
            defaults = getattr(base, section)
            if section == "attack" and isinstance(overrides, list):
                sections[section] = _attack_list(overrides, base.attacks[0])
                continue
            if section == "attack":
                defaults = base.attacks[0]
            merged = {**defaults.to_dict(), **_mapping(overrides, section)}
            sections[section] = section_cls.from_dict(merged, section=section)
        worlds = _world_entries(data) if "worlds" in data else ()
        return cls(name=data.get("name", base.name), worlds=worlds, **sections)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict for the run manifest; ``from_dict(to_dict())`` round-trips (one
        attack section is a mapping, as before several were allowed; several are a list;
        ``classes`` and ``explain`` at their defaults and an empty ``worlds`` are left out, as
        before they existed)."""
        out = {"name": self.name, **{s: getattr(self, s).to_dict() for s in _SECTIONS
                                     if s != "attack" and s not in _LATER_SECTIONS}}
        attacks = [a.to_dict() for a in self.attacks]
        out["attack"] = attacks[0] if len(attacks) == 1 else attacks
        for section in _LATER_SECTIONS:
            if getattr(self, section) != _SECTIONS[section]():
                out[section] = getattr(self, section).to_dict()
        if self.worlds:
            out["worlds"] = [w.to_dict() for w in self.worlds]
        return out


def _world_entries(data: Mapping[str, Any]) -> tuple[WorldEntry, ...]:
    """The ``worlds:`` list of a config file: each entry a preset / world directory string or
    a mapping of ``name``, ``family``, world keys (``preset``, ``seed``, ``num_inputs`` or a
    ``world:`` mapping) and section overrides, merged over the file's sections."""
    items = data["worlds"]
    if not isinstance(items, list) or not items:
        raise ConfigError(f"key 'worlds': expected a non-empty list of presets, world "
                          f"directories or mappings, got {short_repr(items)}", key="worlds",
                          value=items)
    base = {k: v for k, v in data.items() if k != "worlds"}
    entries: list[WorldEntry] = []
    for i, item in enumerate(items):
        where = f"worlds[{i}]"
        if isinstance(item, str):
            item = {"preset": item}
        item = dict(_mapping(item, where))
        per_world = (*_ENTRY_KEYS, *(s for s in _SECTIONS if s not in _RUN_WIDE))
        unknown = [k for k in item if k not in per_world]
        if unknown:
            why = (" — the analysis reads the whole run as one family; set it at the top level"
                   if unknown[0] in _RUN_WIDE else "")
            raise ConfigError(f"{where}: unknown key {short_repr(unknown[0])} (allowed: "
                              f"{', '.join(per_world)}){why}")
        world = {**_mapping(base.get("world", {}), "world"),
                 **_mapping(item.pop("world", {}), f"{where}.world"),
                 **{k: item.pop(k) for k in ("preset", "seed", "num_inputs") if k in item}}
        if not isinstance(world.get("preset"), str) or not world["preset"]:
            raise ConfigError(f"{where}: no world; give a preset name or a world directory "
                              "(e.g. '- similar5' or '- {preset: worlds/mine}')")
        name = item.pop("name", None) or Path(world["preset"]).name
        family = item.pop("family", "")
        if not isinstance(family, str):
            raise ConfigError(f"{where}, key 'family': expected a string, got "
                              f"{short_repr(family)}")
        if (not isinstance(name, str) or not _CELL_NAME.fullmatch(name)
                or name in ("report", "manifest.json")):
            raise ConfigError(f"{where}, key 'name': got {short_repr(name)}; a directory name "
                              "of letters, digits, '.', '_', '-' (at most 100, not 'report')")
        if name in {e.name for e in entries}:
            raise ConfigError(f"{where}: world name {name!r} is already taken by another "
                              "entry; give this one a distinct 'name'")
        merged = {**base, "world": world}
        for section, overrides in item.items():
            if section == "attack" or isinstance(overrides, list):
                merged[section] = overrides
            else:
                merged[section] = {**_mapping(base.get(section, {}), section),
                                   **_mapping(overrides, f"{where}.{section}")}
        try:
            config = ExperimentConfig.from_dict(merged)
        except ConfigError as error:
            raise ConfigError(f"{where} ({name}): {error}") from None
        entries.append(WorldEntry(name, family, config))
    return tuple(entries)


def _attack_list(items: list, defaults: AttackConfig) -> tuple[AttackConfig, ...]:
    """Several attack sections: each mapping over the preset's attack defaults."""
    if not items:
        raise ConfigError("section 'attack': an empty list; give one mapping or a list of them")
    return tuple(AttackConfig.from_dict({**defaults.to_dict(), **_mapping(item, f"attack[{i}]")},
                                        section=f"attack[{i}]")
                 for i, item in enumerate(items))


def _check_subsets(num_subsets: int, subset_size: int, num_inputs: int) -> None:
    """The certification subsets of a section (`runs.certify.check_subsets`), named by key."""
    from cbcert.runs.certify import check_subsets

    try:
        check_subsets(num_subsets, subset_size, num_inputs)
    except ConfigError as error:
        key = "subsets" if error.key == "num_subsets" else error.key
        raise ConfigError(f"key '{key}': {error.detail}", key=key, value=error.value,
                          allowed=error.allowed, detail=error.detail) from None


def _mapping(data: Any, section: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"section '{section}': expected a mapping, got {type(data).__name__} {short_repr(data)}"
        )
    return data


def _smoke() -> ExperimentConfig:
    """Seconds on a laptop CPU: tiny pools and sample counts, for tests and first runs."""
    return ExperimentConfig(
        name="smoke",
        world=WorldConfig(num_inputs=32),
        latent=LatentConfig(n0=10, n=100),
        concept=ConceptConfig(n0=10, n=100, flips=(1,)),
        perturb=PerturbConfig(eps=(0.1, 0.5), tau=(1, 2), subsets=2, subset_size=8),
        attack=AttackConfig(eps=(0.03,), iters=10),
    )


PRESETS: Mapping[str, Callable[[], ExperimentConfig]] = types.MappingProxyType(
    {"default": ExperimentConfig, "smoke": _smoke}
)


def load_config(path: str | Path) -> ExperimentConfig:
    """Load and validate an experiment YAML file; errors are prefixed with the file path."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise ConfigError(f"{path}: cannot read config file ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start}); save it as UTF-8") \
            from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({shorten(str(error))})") from None
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deeply") from None
    try:
        return ExperimentConfig.from_dict(data)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
