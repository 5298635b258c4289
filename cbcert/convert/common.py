"""Strict key-table machinery shared by the PyTorch -> Flax NNX converters.

A converter builds its Flax module abstractly (``nnx.eval_shape``: shapes only, no weights),
writes ONE explicit table ``torch key -> Entry(nnx path, transform)`` and calls
``fill_module``. Anything the table and the checkpoint disagree on -- a checkpoint key the table
does not know, a table key the checkpoint lacks, a tensor whose (transformed) shape differs from
the module's -- is collected and reported in one ``ValueError`` naming every offending key
(the habit of flax gemma's ``helpers.py`` and big_vision's ``merge_params``).

torch is imported lazily, only inside ``load_torch_state_dict``.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

Transform = Literal["conv", "linear", "copy", "squeeze_hw", "column", "ignore"]
Path = tuple[str | int, ...]

_MAX_LISTED = 25  # keys listed per error category; the count is always given


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one checkpoint tensor goes.

    Attributes:
      path: key path inside ``nnx.split(module)[1]``; ``None`` for ``transform="ignore"``.
      transform: ``"conv"`` (OIHW -> HWIO), ``"linear"`` ([out, in] -> [in, out]), ``"copy"``,
        ``"squeeze_hw"`` (``[P, D, 1, 1] -> [P, D]``), ``"column"`` (``[K, 1] -> [K]``) or
        ``"ignore"`` (bookkeeping buffers such as ``num_batches_tracked`` that do not affect
        the outputs).
      optional: the key may be absent from the checkpoint (only for ignored buffers).
    """

    path: Path | None
    transform: Transform = "copy"
    optional: bool = False


Table = dict[str, Entry]


def conv_entries(table: Table, key: str, path: Path, bias: bool = False) -> None:
    """Add ``torch.nn.Conv2d`` weights (``key.weight`` [O, I, kh, kw]) at ``path``."""
    table[f"{key}.weight"] = Entry((*path, "kernel"), "conv")
    if bias:
        table[f"{key}.bias"] = Entry((*path, "bias"))


def linear_entries(table: Table, key: str, path: Path, bias: bool = True) -> None:
    """Add ``torch.nn.Linear`` weights (``key.weight`` [out, in]) at ``path``."""
    table[f"{key}.weight"] = Entry((*path, "kernel"), "linear")
    if bias:
        table[f"{key}.bias"] = Entry((*path, "bias"))


def batch_norm_entries(table: Table, key: str, path: Path) -> None:
    """Add ``torch.nn.BatchNorm2d`` parameters and running statistics at ``path``."""
    table[f"{key}.weight"] = Entry((*path, "scale"))
    table[f"{key}.bias"] = Entry((*path, "bias"))
    table[f"{key}.running_mean"] = Entry((*path, "mean"))
    table[f"{key}.running_var"] = Entry((*path, "var"))
    table[f"{key}.num_batches_tracked"] = Entry(None, "ignore", optional=True)


def nested(table: Table, key_prefix: str, path_prefix: Path) -> Table:
    """``table`` for a submodule: torch keys get ``key_prefix``, NNX paths ``path_prefix``."""
    return {key_prefix + key: dataclasses.replace(
                entry, path=None if entry.path is None else (*path_prefix, *entry.path))
            for key, entry in table.items()}


def _apply_transform(transform: Transform, array: np.ndarray) -> np.ndarray:
    if transform == "conv" and array.ndim == 4:
        return array.transpose(2, 3, 1, 0)  # [O, I, kh, kw] -> [kh, kw, I, O]
    if transform == "linear" and array.ndim == 2:
        return array.T  # [out, in] -> [in, out]
    if transform == "squeeze_hw" and array.ndim == 4 and array.shape[2:] == (1, 1):
        return array[:, :, 0, 0]
    if transform == "column" and array.ndim == 2 and array.shape[1] == 1:
        return array[:, 0]
    # A tensor of the wrong rank passes through unchanged and is reported as mis-shaped.
    return array


def _listing(title: str, items: list[str], note: str = "") -> str:
    shown = items[:_MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}){note}:\n    " + "\n    ".join(shown) + more


def _key_problems(tensors: Mapping[str, Any], table: Table) -> list[str]:
    unknown = sorted(set(tensors) - set(table))
    missing = sorted(k for k, e in table.items() if k not in tensors and not e.optional)
    problems = []
    if unknown:
        problems.append(_listing("unknown keys", unknown,
                                 " in the checkpoint, not in the architecture"))
    if missing:
        problems.append(_listing("missing keys", missing,
                                 " needed by the architecture, absent from the checkpoint"))
    return problems


def fill_module(abstract: nnx.Module, tensors: Mapping[str, np.ndarray], table: Table,
                what: str) -> nnx.Module:
    """Concrete copy of ``abstract`` (``nnx.eval_shape``) with every leaf taken from ``tensors``.

    Args:
      abstract: module whose variables are ``jax.ShapeDtypeStruct``.
      tensors: checkpoint, ``torch key -> array`` (any float dtype; cast to the module's dtype,
        float64 heads become float32).
      table: the one mapping ``torch key -> Entry``.
      what: name used in error messages (e.g. ``"resnet50"``).

    Raises:
      ValueError: one message listing every unknown, missing and mis-shaped key (checkpoint
        side), or every module variable the table leaves unfilled (a converter bug).
    """
    graphdef, state = nnx.split(abstract)
    targets = dict(nnx.to_flat_state(state))
    filled: dict[Path, np.ndarray] = {}
    misshaped, unmapped = [], []
    for key, entry in table.items():
        if entry.transform == "ignore" or key not in tensors:
            continue
        source = np.asarray(tensors[key])
        array = _apply_transform(entry.transform, source)
        if entry.path not in targets:
            unmapped.append(f"{key} -> {entry.path}")
            continue
        target = targets[entry.path].get_value()
        if tuple(array.shape) != tuple(target.shape):
            misshaped.append(f"{key}: checkpoint shape {tuple(source.shape)}, architecture "
                             f"expects {_torch_shape(entry.transform, target.shape)}")
            continue
        filled[entry.path] = array.astype(target.dtype)
    problems = _key_problems(tensors, table)
    if misshaped:
        problems.append(_listing("mis-shaped keys", misshaped))
    unfilled = sorted(str(p) for p in set(targets) - set(filled))
    if not problems:  # a table that disagrees with its own module is a converter bug
        if unmapped:
            problems.append(_listing("table entries pointing nowhere (converter bug)", unmapped))
        if unfilled:
            problems.append(_listing("module variables no key fills (converter bug)", unfilled))
    if problems:
        raise ValueError(f"{what}: checkpoint does not match the architecture\n"
                         + "\n".join(problems))
    for path, variable in targets.items():
        variable.set_value(jax.device_put(filled[path]))
    return nnx.merge(graphdef, nnx.from_flat_state(targets))


def _torch_shape(transform: Transform, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The module's shape written in the checkpoint's layout, for error messages."""
    if transform == "conv" and len(shape) == 4:
        return (shape[3], shape[2], shape[0], shape[1])
    if transform == "linear" and len(shape) == 2:
        return (shape[1], shape[0])
    if transform == "squeeze_hw":
        return (*shape, 1, 1)
    if transform == "column":
        return (*shape, 1)
    return tuple(shape)


def load_torch_state_dict(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Tensors of a PyTorch checkpoint as numpy arrays, loaded with ``weights_only=True``.

    Accepts a plain ``state_dict`` or a dict holding one under ``"state_dict"`` (PyTorch
    Lightning). Nothing from the file is executed: torch's weights-only unpickler refuses
    arbitrary classes.
    """
    import torch  # lazily: torch is only needed to read .pt/.pth/.ckpt files

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint_path={str(path)!r}; no such file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError/RuntimeError subclasses
        raise ValueError(f"checkpoint_path={str(path)!r}: cannot read it as a weights-only "
                         f"PyTorch checkpoint ({type(err).__name__}: {err})") from err
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ValueError(f"checkpoint_path={str(path)!r}: expected a state_dict (a mapping of "
                         f"names to tensors), got {type(obj).__name__}")
    out = {}
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"checkpoint_path={str(path)!r}: entry {key!r} is a "
                             f"{type(value).__name__}, not a tensor")
        out[key] = value.detach().cpu().numpy()
    return out
