"""Settings and their checks: the one place a user quantity's allowed range is written.

`RULES` names every numeric setting's range (σ, ρ, α, ε, sample counts, seeds, ...);
`validate` checks a value against one and raises `ConfigError` carrying the setting's key, the
value and the allowed range. `Section` makes a frozen dataclass validate and coerce its fields
on construction (types, ranges, unknown keys), which the experiment configs
(`cbcert.runs.config`) and the run jobs build on. Only the CLI turns a key into a flag name.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import stat
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

_SHOWN = 200  # characters of a value quoted in a message

def shorten(text: Any, limit: int = _SHOWN) -> str:
    """Bounded text for messages: ``text`` (a string, or any value's ``repr``) cut to ``limit``."""
    text = text if isinstance(text, str) else repr(text)
    return text if len(text) <= limit else f"{text[: limit - 20]}… ({len(text)} characters)"


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for messages: ``"a FIFO"``, ``"a directory"``, ..."""
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISLNK, "a symbolic link"),
             (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    return next((kind for test, kind in kinds if test(mode)), "not a file")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 120, 120


def value_name(value: float) -> str:
    """The exact text of a budget or scale in a file or directory name.

    ``format(value, "g")`` (6 significant digits: ``0.1``, ``1e-05``, ``2``) where that reads
    back as the same number, else ``repr`` (``0.1000001``), so two different values never share
    a name (σ = 0.1 and 0.1000001 once shared ``latent-sigma0.1``).
    """
    short = format(value, "g")
    return short if float(short) == value else repr(float(value))


def short_repr(value: Any) -> str:
    """Bounded ``repr`` for messages, in bounded time: a 280-byte YAML of nested aliases is a
    billion-element value whose plain repr once made a 254 MB message."""
    return shorten(_REPR.repr(value))


class ConfigError(ValueError):
    """An invalid setting: a ``key``, the ``value`` given and what is ``allowed``.

    ``str(error)`` is the whole message (``"<where>key 'n': got 0, allowed range [1, inf)"``);
    ``detail`` is the part after the label (``"got 0, allowed range [1, inf)"``), so a front end
    can name the setting its own way: the CLI turns ``key`` into a flag (``--n``) and prints
    ``detail``, a config file names the section and key. Library code never names flags.
    """

    def __init__(self, message: str, *, key: str | None = None, value: Any = None,
                 allowed: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.key, self.value, self.allowed = key, value, allowed
        self.detail = detail if detail is not None else message

    def within(self, where: str) -> ConfigError:
        """The same error located inside ``where`` (a file, a section): prefix the message."""
        return ConfigError(f"{where}{self}", key=self.key, value=self.value,
                           allowed=self.allowed, detail=self.detail)


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
        # A share strictly between 0 and 1 (a significance level, an equivalence margin).
        "fraction": Rule(0.0, 1.0, low_open=True, high_open=True),
        "eps": _FLOAT32_SCALE,
        "count": Rule(1, integer=True),
        # Monte Carlo samples per input: the engine numbers samples with int32 (SPEC §7).
        "samples": Rule(1, 2**31 - 1, integer=True),
        # A standard deviation over subsets needs at least two of them.
        "subsets": Rule(2, integer=True),
        # Valid for both numpy SeedSequence and jax.random.key.
        "seed": Rule(0, 2**32 - 1, integer=True),
    }
)


def validate(rule: str, value: Any, *, key: str, label: str | None = None) -> None:
    """Check ``value`` against ``RULES[rule]``; raise `ConfigError` for ``key`` otherwise.

    Every range check of a user quantity goes through here: flags, config keys and job fields
    all enforce the same `RULES`. ``label`` (default ``key 'KEY'``) starts the message.
    """
    if rule not in RULES:
        raise ConfigError(f"unknown rule {rule!r} (known: {', '.join(sorted(RULES))})")
    allowed = RULES[rule]
    label = label or f"key '{key}'"
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not is_number or (allowed.integer and not isinstance(value, int)):
        expected = allowed.describe() if allowed.integer else f"a number in {allowed.describe()}"
        detail = f"expected {expected}, got {short_repr(value)}"
    elif not allowed.allows(value):
        detail = f"got {short_repr(value)}, allowed range {allowed.describe()}"
    else:
        return
    raise ConfigError(f"{label}: {detail}", key=key, value=value, allowed=allowed.describe(),
                      detail=detail)


def validate_sample_sizes(n0: int, n: int, *, n0_label: str = "n0", n_label: str = "n") -> None:
    """The rule ``n0 <= n`` for Monte Carlo selection / estimation samples (SPEC §4).

    Cohen et al.'s ``n0`` selection and ``n`` estimation samples are separate draws, so the
    certificate stays sound for ``n0 > n``; we reject it because it is always a typo (the
    selection only picks the top class and needs far fewer samples than the bound).
    """
    validate("samples", n0, key="n0")
    validate("samples", n, key="n")
    if n0 > n:
        detail = f"{n0_label}={n0} exceeds {n_label}={n}; allowed range 1 <= n0 <= n"
        raise ConfigError(detail, key="n0", value=n0, allowed="1 <= n0 <= n", detail=detail)


def rule(name: str, **metadata: Any) -> dict[str, Any]:
    """Field metadata of a `Section` field checked against ``RULES[name]``."""
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
    detail = f"expected {_type_name(tp)}, got {type(value).__name__} {short_repr(value)}{hint}"
    raise ConfigError(f"key '{key}': {detail}", key=key.split("[")[0], value=value,
                      detail=detail)


class Section:
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
                    raise _field_error(f.name, value, "needs at least one value, got []")
                if len(set(value)) != len(value):
                    raise _field_error(f.name, value,
                                       f"repeated values in {short_repr(list(value))}")
            if "rule" in f.metadata:
                for i, item in enumerate(items):
                    label = f"{f.name}[{i}]" if isinstance(value, tuple) else f.name
                    validate(f.metadata["rule"], item, key=f.name, label=f"key '{label}'")
            if isinstance(value, str) and not value:
                raise _field_error(f.name, value, "must be a non-empty string")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, not tuples) for YAML/JSON run manifests."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, *, section: str) -> typing.Self:
        """Build the section from a mapping; unknown keys are errors naming the allowed ones."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"section '{section}': expected a mapping, got {type(data).__name__} "
                f"{short_repr(data)}"
            )
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in allowed:
                raise ConfigError(
                    f"unknown key {short_repr(key)} in section '{section}' "
                    f"(allowed: {', '.join(allowed)})"
                )
        try:
            return cls(**data)
        except ConfigError as error:
            raise error.within(f"section '{section}', ") from None


def _field_error(name: str, value: Any, detail: str) -> ConfigError:
    return ConfigError(f"key '{name}': {detail}", key=name, value=value, detail=detail)


def _plain(value: Any) -> Any:
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
