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

Every section validates itself on construction (types, ranges, ``n0 <= n``), so a config that
exists is valid. The same range rules are exposed to the CLI through `validate` and
`validate_sample_sizes`, so a flag and a YAML key can never disagree about what is allowed.
Errors are `ConfigError` (a ``ValueError``) naming the file, section, key, value and the
allowed values.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from cbcert.runs.directory import shorten

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 120, 120


def _short(value: Any) -> str:
    """Bounded ``repr`` for messages, in bounded time: a 280-byte YAML of nested aliases is a
    billion-element value whose plain repr once made a 254 MB message."""
    return shorten(_REPR.repr(value))


class ConfigError(ValueError):
    """An invalid experiment setting; the message names the key or flag, value and range."""


@dataclass(frozen=True)
class Rule:
    """Allowed range of a numeric setting: ``low (<|<=) value (<|<=) high``, optionally integer."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def allows(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and above and below

    def describe(self) -> str:
        left = "(" if self.low_open else "["
        right = ")" if self.high_open or math.isinf(self.high) else "]"
        kind = "integer in " if self.integer else ""
        return f"{kind}{left}{_number(self.low)}, {_number(self.high)}{right}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


# Noise scales are drawn in float32: outside [1e-30, 1e30] a scale either flushes to zero or
# overflows (σ = 1e308 "certified" NaN samples), so such values are refused, not sampled.
_FLOAT32_SCALE = Rule(1e-30, 1e30)

RULES: Mapping[str, Rule] = types.MappingProxyType(
    {
        "sigma": _FLOAT32_SCALE,
        "rho": Rule(0.0, 0.5, low_open=True, high_open=True),
        "alpha": Rule(0.0, 1.0, low_open=True, high_open=True),
        "eps": _FLOAT32_SCALE,
        "count": Rule(1, integer=True),
        # Monte Carlo samples per input: the engine numbers samples with int32 (SPEC §7).
        "samples": Rule(1, 2**31 - 1, integer=True),
        # The paired t-test over subsets needs at least two of them.
        "subsets": Rule(2, integer=True),
        # Valid for both numpy SeedSequence and jax.random.key.
        "seed": Rule(0, 2**32 - 1, integer=True),
    }
)


def validate(rule: str, value: Any, *, label: str) -> None:
    """Check ``value`` against ``RULES[rule]``; raise `ConfigError` naming ``label`` otherwise.

    The CLI calls this for its flags (``validate("sigma", sigma, label="--sigma")``); config
    sections call it for their fields, so both enforce the same ranges.
    """
    if rule not in RULES:
        raise ConfigError(f"unknown rule {rule!r} (known: {', '.join(sorted(RULES))})")
    allowed = RULES[rule]
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not is_number or (allowed.integer and not isinstance(value, int)):
        expected = allowed.describe() if allowed.integer else f"a number in {allowed.describe()}"
        raise ConfigError(f"{label}: expected {expected}, got {_short(value)}")
    if not allowed.allows(value):
        raise ConfigError(f"{label}: got {_short(value)}, allowed range {allowed.describe()}")


def validate_sample_sizes(n0: int, n: int, *, n0_label: str = "n0", n_label: str = "n") -> None:
    """The CLI's rule ``n0 <= n`` for Monte Carlo selection / estimation samples (SPEC §4).

    Cohen et al.'s ``n0`` selection and ``n`` estimation samples are separate draws, so the
    certificate stays sound for ``n0 > n``; we reject it because it is always a typo (the
    selection only picks the top class and needs far fewer samples than the bound).
    """
    validate("samples", n0, label=n0_label)
    validate("samples", n, label=n_label)
    if n0 > n:
        raise ConfigError(f"{n0_label}={n0} exceeds {n_label}={n}; allowed range 1 <= n0 <= n")


def _rule(name: str, **metadata: Any) -> dict[str, Any]:
    return {"rule": name, **metadata}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return tp.__name__


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check a YAML/Python value against a field annotation; lists become tuples."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is tuple:
        if isinstance(value, list | tuple):
            item_type = typing.get_args(tp)[0]
            return tuple(_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    hint = ""
    if tp is float and isinstance(value, str):
        hint = " (YAML reads exponents without a dot, e.g. 1e-3, as text; write 1.0e-3)"
    raise ConfigError(
        f"key '{key}': expected {_type_name(tp)}, got {type(value).__name__} "
        f"{_short(value)}{hint}"
    )


class _Section:
    """Coerces and validates the fields of a frozen dataclass section on construction.

    Field metadata: ``rule`` (a key of `RULES`, applied to each item of a list),
    ``nonempty`` (lists that need at least one item). Lists may not repeat items.
    """

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(getattr(self, f.name), hints[f.name], f.name)
            object.__setattr__(self, f.name, value)
            items = value if isinstance(value, tuple) else (value,)
            if isinstance(value, tuple):
                if f.metadata.get("nonempty") and not value:
                    raise ConfigError(f"key '{f.name}': needs at least one value, got []")
                if len(set(value)) != len(value):
                    raise ConfigError(f"key '{f.name}': repeated values in {_short(list(value))}")
            if "rule" in f.metadata:
                for i, item in enumerate(items):
                    label = f"{f.name}[{i}]" if isinstance(value, tuple) else f.name
                    validate(f.metadata["rule"], item, label=f"key '{label}'")
            if isinstance(value, str) and not value:
                raise ConfigError(f"key '{f.name}': must be a non-empty string")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, not tuples) for YAML/JSON run manifests."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, *, section: str) -> typing.Self:
        """Build the section from a mapping; unknown keys are errors naming the allowed ones."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"section '{section}': expected a mapping, got {type(data).__name__} "
                f"{_short(data)}"
            )
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in allowed:
                raise ConfigError(
                    f"unknown key {_short(key)} in section '{section}' "
                    f"(allowed: {', '.join(allowed)})"
                )
        try:
            return cls(**data)
        except ConfigError as error:
            raise ConfigError(f"section '{section}', {error}") from None


def _plain(value: Any) -> Any:
    if isinstance(value, _Section):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


_MODELS = ("std", "cbm", "proto")


@dataclass(frozen=True)
class WorldConfig(_Section):
    """Which generated inputs: generator/classifier world preset, root seed, pool size."""

    preset: str = "default"
    seed: int = field(default=0, metadata=_rule("seed"))
    num_inputs: int = field(default=1000, metadata=_rule("count"))


@dataclass(frozen=True)
class LatentConfig(_Section):
    """Gaussian latent smoothing (SPEC §4): σ values, Monte Carlo sizes, confidence."""

    sigmas: tuple[float, ...] = field(default=(0.1,), metadata=_rule("sigma", nonempty=True))
    n0: int = field(default=100, metadata=_rule("samples"))
    n: int = field(default=1000, metadata=_rule("samples"))
    alpha: float = field(default=0.001, metadata=_rule("alpha"))
    two_class: bool = False
    models: tuple[str, ...] = field(default=_MODELS, metadata={"nonempty": True})

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_sample_sizes(self.n0, self.n, n0_label="key 'n0'", n_label="key 'n'")


@dataclass(frozen=True)
class ConceptConfig(_Section):
    """Concept-flip smoothing (SPEC §4): Bernoulli ρ values and fixed flip counts m."""

    rhos: tuple[float, ...] = field(default=(0.2,), metadata=_rule("rho", nonempty=True))
    flips: tuple[int, ...] = field(default=(), metadata=_rule("count"))
    n0: int = field(default=100, metadata=_rule("samples"))
    n: int = field(default=1000, metadata=_rule("samples"))
    alpha: float = field(default=0.001, metadata=_rule("alpha"))
    models: tuple[str, ...] = field(default=_MODELS, metadata={"nonempty": True})

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_sample_sizes(self.n0, self.n, n0_label="key 'n0'", n_label="key 'n'")


@dataclass(frozen=True)
class PerturbConfig(_Section):
    """Empirical protocol (SPEC §3): latent budgets ε, concept budgets τ, k subsets of n."""

    eps: tuple[float, ...] = field(default=(0.05, 0.1, 0.3, 0.5, 0.8), metadata=_rule("eps"))
    tau: tuple[int, ...] = field(default=(1, 2, 5, 10), metadata=_rule("count"))
    subsets: int = field(default=5, metadata=_rule("subsets"))
    subset_size: int = field(default=200, metadata=_rule("count"))
    samples: int = field(default=1, metadata=_rule("samples"))
    ball: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.eps and not self.tau:
            raise ConfigError("keys 'eps' and 'tau': at least one budget is needed, both empty")


@dataclass(frozen=True)
class AttackConfig(_Section):
    """APGD-CE through generator and classifier (SPEC §5)."""

    space: Literal["latent", "concept"] = "latent"
    eps: tuple[float, ...] = field(default=(0.01, 0.03), metadata=_rule("eps", nonempty=True))
    norm: Literal["linf", "l2"] = "linf"
    iters: int = field(default=100, metadata=_rule("count"))
    restarts: int = field(default=1, metadata=_rule("count"))
    smoothed: bool = False
    # Noise samples per gradient of the smoothed classifier's expected softmax (EOT).
    eot: int = field(default=8, metadata=_rule("samples"))
    # Agreement inputs attacked (APGD is far costlier per input than certification).
    inputs: int = field(default=64, metadata=_rule("count"))
    # Smoothing scale of smoothed attacks: σ for space latent, ρ for space concept; PREDICT
    # then uses the n and alpha of the latent or concept section.
    sigma: float = field(default=0.25, metadata=_rule("sigma"))
    rho: float = field(default=0.2, metadata=_rule("rho"))


_SECTIONS: Mapping[str, type[_Section]] = types.MappingProxyType(
    {
        "world": WorldConfig,
        "latent": LatentConfig,
        "concept": ConceptConfig,
        "perturb": PerturbConfig,
        "attack": AttackConfig,
    }
)


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: one typed section per command (all sections always present)."""

    name: str = "default"
    world: WorldConfig = WorldConfig()
    latent: LatentConfig = LatentConfig()
    concept: ConceptConfig = ConceptConfig()
    perturb: PerturbConfig = PerturbConfig()
    attack: AttackConfig = AttackConfig()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"key 'name': expected a non-empty string, got {_short(self.name)}")
        for section, cls in _SECTIONS.items():
            if not isinstance(getattr(self, section), cls):
                raise ConfigError(
                    f"section '{section}': expected {cls.__name__}, "
                    f"got {type(getattr(self, section)).__name__}"
                )

    def check_sections(self, sections: tuple[str, ...]) -> None:
        """Checks across sections, for the sections a sweep runs only.

        An attack-only file is not refused for the perturb defaults it never uses.
        """
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
            raise ConfigError(f"unknown preset {_short(preset)} (known: {', '.join(PRESETS)})")
        return PRESETS[preset]()

    @classmethod
    def from_dict(cls, data: Any) -> ExperimentConfig:
        """Build from a mapping shaped like the YAML files (see `load_config`)."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a mapping at the top level, got {type(data).__name__}")
        allowed = ["preset", "name", *_SECTIONS]
        for key in data:
            if key not in allowed:
                raise ConfigError(f"unknown section {_short(key)} (allowed: {', '.join(allowed)})")
        preset = data.get("preset", "default")
        if not isinstance(preset, str):
            raise ConfigError(f"key 'preset': expected str, got {type(preset).__name__} "
                              f"{_short(preset)}")
        base = cls.from_preset_name(preset)
        sections = {}
        for section, section_cls in _SECTIONS.items():
            overrides = data.get(section, {})
            merged = {**getattr(base, section).to_dict(), **_mapping(overrides, section)}
            sections[section] = section_cls.from_dict(merged, section=section)
        return cls(name=data.get("name", base.name), **sections)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict for the run manifest; ``from_dict(to_dict())`` round-trips."""
        return {"name": self.name, **{s: getattr(self, s).to_dict() for s in _SECTIONS}}


def _mapping(data: Any, section: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"section '{section}': expected a mapping, got {type(data).__name__} {_short(data)}"
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
