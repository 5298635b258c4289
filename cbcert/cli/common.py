"""What every command shares: consoles, the key → flag mapping, option factories, world loading.

Library code raises `cbcert.schema.ConfigError` carrying the setting's ``key``; `bad_input`
turns it into click's exit-2 error naming the command's flag for that key (and the engine's
`NonFiniteError`, NaN or inf inputs or logits, into one naming ``--world``). Option defaults come
from the job dataclasses of `cbcert.runs` (`default_of`), so a flag and the library cannot
disagree on a default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from cbcert.engine.validity import NonFiniteError
from cbcert.runs.directory import check_writable
from cbcert.schema import ConfigError, validate

# Off a terminal rich would wrap tables at 80 columns; logs and pipes get wide tables.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)

# Library keys whose flag is not ``--`` + the key with dashes (per command where they differ).
FLAGS = {"num_inputs": "--inputs", "num_subsets": "--subsets", "world": "--world",
         "out": "--out", "chunk_size": "--chunk-size", "max_memory": "--max-memory"}


def flag_of(key: str | None, flags: Mapping[str, str] | None = None) -> str | None:
    """The flag of a library ``key``: ``flags`` (the command's), then `FLAGS`, then ``--key``."""
    if key is None:
        return None
    return {**FLAGS, **(flags or {})}.get(key, "--" + key.replace("_", "-"))


@contextlib.contextmanager
def bad_input(flags: Mapping[str, str] | None = None) -> Iterator[None]:
    """Turn a `ConfigError` from the library into exit 2 naming the flag of its key, and a
    `NonFiniteError` (the world's models or inputs gave NaN or inf) into one naming --world."""
    try:
        yield
    except ConfigError as err:
        raise click.BadParameter(err.detail, param_hint=flag_of(err.key, flags)) from None
    except NonFiniteError as err:
        raise click.BadParameter(str(err), param_hint=flag_of("world", flags)) from None


def check(rule: str, value: Any, flag: str) -> None:
    """Check a flag's value against a `cbcert.schema.RULES` rule (exit 2 naming ``flag``)."""
    with bad_input({"value": flag}):
        validate(rule, value, key="value", label=flag)


def check_at_least(*checks: tuple[str, int, int]) -> None:
    """Each ``(flag, value, low)`` must have ``value >= low`` (exit 2 naming the flag, the
    value and the allowed range)."""
    for flag, value, low in checks:
        if value < low:
            raise click.BadParameter(f"got {value}, allowed range [{low}, ∞)", param_hint=flag)


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of the dataclass ``cls`` (the one source of defaults)."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


def names(value: str) -> tuple[str, ...]:
    """Comma-separated names (``--models std,cbm``) as a tuple, blanks dropped."""
    return tuple(m.strip() for m in value.split(",") if m.strip())


def budgets(value: str, flag: str, parse: Callable[[str], Any]) -> tuple:
    """Comma-separated budgets (empty: none of this kind); ranges are checked by the job."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    try:
        return tuple(parse(item) for item in items)
    except ValueError:
        kind = "integers" if parse is int else "numbers"
        raise click.BadParameter(f"expected comma-separated {kind}, got {value!r}",
                                 param_hint=flag) from None


def writable_out(out: Path) -> Path:
    """``--out`` checked before any work: not under a file, writable."""
    with bad_input():
        check_writable(out)
    return out


def writable_file(path: Path, flag: str) -> Path:
    """A file a command writes when it ends, checked before any work: its folder must exist
    and be writable (exit 2 naming ``flag`` and the folder), so that a typo in the folder does
    not surface only after the job."""
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        problem = "does not exist" if not folder.exists() else "is not a writable directory"
        raise click.BadParameter(f"{path}: the folder {folder} {problem}", param_hint=flag)
    return path


def load_world(name: str, *, classifier: Path | None = None, normalize: str = "imagenet"):
    """The world ``--world`` names (`cbcert.worlds.load.load_world`): ``pixels:IMAGES`` (with
    ``--classifier``), a world directory (``world.json``) or a built-in preset.

    Missing, damaged or mismatched weights, manifests and images are bad input: exit 2 naming
    --world (or --classifier for the classifier of a pixels world).
    """
    from cbcert.worlds.load import load_world as load

    if classifier is not None and not name.startswith("pixels:"):
        raise click.BadParameter(f"--classifier applies to --world pixels:IMAGES only; {name!r} "
                                 "brings its own classifiers", param_hint="--classifier")
    try:
        return load(name, classifier=classifier, normalize=normalize)
    except ConfigError as err:  # the key is the classifier, normalize, or a part of the world
        hint = flag_of(err.key) if err.key in ("classifier", "normalize") else "--world"
        raise click.BadParameter(str(err), param_hint=hint) from None
    except ValueError as err:  # missing or damaged weights, bad images
        raise click.BadParameter(str(err), param_hint="--world") from None


def load_agreement_world(name: str, models: tuple[str, ...], *, concepts: bool = False,
                         classifier: Path | None = None, normalize: str = "imagenet",
                         pixels: bool = False):
    """A world for a command on the std/cbm agreement set, checked against ``--models``.

    ``concepts``: the command perturbs concepts, so the world needs a concept bottleneck.
    ``pixels``: the command accepts a ``pixels:IMAGES`` world (fixed inputs, no agreement set);
    other commands refuse one.
    """
    if name.startswith("pixels:") and not pixels:
        raise click.BadParameter(f"{name}: pixels worlds work with certify latent and certify "
                                 "predict --space latent only", param_hint="--world")
    world = load_world(name, classifier=classifier, normalize=normalize)
    with bad_input():
        world.check_models(models)
    if concepts and world.generator.num_concepts == 0:
        raise click.BadParameter(f"{world.name} has no concept bottleneck (no CB-AE): "
                                 "concept-space commands are unavailable", param_hint="--world")
    if world.dataset is None and ("std" not in world.model_names
                                  or "cbm" not in world.model_names):
        raise click.BadParameter("the agreement set needs a world with 'std' and 'cbm' models",
                                 param_hint="--world")
    return world


def memory_options(fn):
    """``--chunk-size`` and ``--max-memory``: every generator/classifier call stays within them."""
    options = [
        click.option("--chunk-size", type=int, default=None,
                     help="Samples per device step (default: from --max-memory)."),
        click.option("--max-memory", type=int, default=None,
                     help="Bytes per device a chunk may use (default: a quarter of the device "
                          "memory; 8 MiB on CPU, at least 32 samples per step for "
                          "compute-bound models)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def units_option(what: str):
    """``--units-at-once N``: the run's independent ``what`` run N at a time in threads
    (`cbcert.runs.units`); checked with `check_units`."""
    return click.option("--units-at-once", "units", type=int, default=None,
                        help=f"{what} run at once, each in its own thread (default: 2 on CPU, "
                             "1 on accelerators; the same records either way under the default "
                             "--max-memory, which an explicit one is split between).")


def check_units(units: int | None) -> None:
    if units is not None:
        check("count", units, "--units-at-once")


def check_memory(chunk_size: int | None, max_memory: int | None) -> None:
    if chunk_size is not None:
        check("count", chunk_size, "--chunk-size")
    if max_memory is not None:
        check("count", max_memory, "--max-memory")


def world_option(help_text: str = "Built-in world preset (default, k8, k16, px64, similar5, …) "
                 "or a world directory with a world.json."):
    return click.option("--world", "world_name", default="default", show_default=True,
                        help=help_text)
