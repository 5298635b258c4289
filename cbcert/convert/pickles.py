"""Read pickles that hold whole objects without importing or running the code that wrote them.

``RestrictedUnpickler`` resolves only an allow-list of globals: plain containers, numpy array
and scalar reconstruction, torch's tensor-rebuild functions (replaced by numpy equivalents) and
caller-named classes, which become inert ``PickledObject`` stand-ins recording their state.
Any other global (``os.system``, an unknown class, ...) raises ``ValueError`` naming it.

``load_torch_zip`` reads a ``torch.save`` file (zip format, PyTorch >= 1.6) this way, so a
whole-module checkpoint such as post-hoc-cbm's ``torch.save(posthoc_layer, path)`` is read
without torch and without the upstream repository.
"""

from __future__ import annotations

import codecs
import collections
import pathlib
import pickle
import zipfile
from collections.abc import Iterable
from typing import Any

import numpy as np

try:
    from numpy._core import multiarray
except ImportError:  # numpy < 2
    from numpy.core import multiarray


class PickledObject:
    """Inert stand-in for an object of an allowed class.

    Keeps what the pickle gives it: ``state`` (BUILD), ``items`` (dict subclasses' SETITEMS) and
    ``elements`` (list subclasses' APPENDS).
    """

    pickled_class = "?"

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("items", {})[key] = value

    def append(self, value: Any) -> None:
        self.__dict__.setdefault("elements", []).append(value)

    def extend(self, values: Iterable[Any]) -> None:
        for value in values:
            self.append(value)

    def __repr__(self) -> str:
        return f"<pickled {self.pickled_class}>"


def _stand_in(qualified: str) -> type[PickledObject]:
    return type(qualified.rsplit(".", 1)[-1], (PickledObject,), {"pickled_class": qualified})


class _StorageType:
    """Stand-in for ``torch.FloatStorage`` & co: only carries the element dtype."""

    def __init__(self, dtype: Any):
        self.dtype = np.dtype(dtype)


def _storage_types() -> dict[str, _StorageType]:
    import ml_dtypes  # installed with jax

    dtypes = {"Float": np.float32, "Double": np.float64, "Half": np.float16,
              "BFloat16": ml_dtypes.bfloat16, "Long": np.int64, "Int": np.int32,
              "Short": np.int16, "Char": np.int8, "Byte": np.uint8, "Bool": np.bool_}
    return {f"{name}Storage": _StorageType(dtype) for name, dtype in dtypes.items()}


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple[int, ...],
                    stride: tuple[int, ...], *_ignored: Any) -> np.ndarray:
    """numpy version of ``torch._utils._rebuild_tensor_v2``: a strided view, copied."""
    if not size:
        return storage[offset : offset + 1].reshape(()).copy()  # 0-d array, not a numpy scalar
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=tuple(size),
        strides=tuple(s * storage.itemsize for s in stride))
    return view.copy()


def _rebuild_parameter(data: np.ndarray, *_ignored: Any) -> np.ndarray:
    """``torch._utils._rebuild_parameter``: a parameter is its data here."""
    return data


def _base_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "defaultdict"): collections.defaultdict,
        ("builtins", "list"): list,
        ("builtins", "dict"): dict,
        ("builtins", "int"): int,
        ("builtins", "float"): float,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("__builtin__", "set"): set,
        ("_codecs", "encode"): codecs.encode,  # protocol-2 pickles spell bytes this way
        ("numpy", "dtype"): np.dtype,
        ("numpy", "ndarray"): np.ndarray,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    }
    for core in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(core, "_reconstruct")] = multiarray._reconstruct
        allowed[(core, "scalar")] = multiarray.scalar
    for name, storage in _storage_types().items():
        allowed[("torch", name)] = storage
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only allow-listed globals (see module docstring).

    Args:
      file: binary file object.
      stand_ins: fully qualified class names (``"models.pcbm_utils.PosthocLinearCBM"``) to
        materialise as ``PickledObject`` stand-ins.
      source: file name used in error messages.
      storages: ``key -> bytes`` of a torch zip archive (for ``persistent_load``), or None.
      byteorder: ``"little"`` or ``"big"``, byte order of the storages.
    """

    def __init__(self, file, stand_ins: Iterable[str], source: str,
                 storages: dict[str, bytes] | None = None, byteorder: str = "little"):
        super().__init__(file)
        self._allowed = _base_globals()
        for qualified in stand_ins:
            module, _, name = qualified.rpartition(".")
            self._allowed[(module, name)] = _stand_in(qualified)
        self._source = source
        self._storages = storages
        self._byteorder = byteorder
        self._loaded: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise ValueError(f"{self._source}: refusing to load global {module}.{name} (not a "
                             "known tensor, container or checkpoint class)") from None

    def persistent_load(self, pid: Any) -> np.ndarray:
        if self._storages is None or not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise ValueError(f"{self._source}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise ValueError(f"{self._source}: storage {key!r} has unsupported type "
                             f"{storage_type!r}")
        if key not in self._loaded:
            if key not in self._storages:
                raise ValueError(f"{self._source}: storage {key!r} missing from the archive")
            dtype = storage_type.dtype.newbyteorder("<" if self._byteorder == "little" else ">")
            array = np.frombuffer(self._storages[key], dtype=dtype, count=numel)
            self._loaded[key] = array.astype(storage_type.dtype)
        return self._loaded[key]


def load_pickle(path: str | pathlib.Path, stand_ins: Iterable[str] = ()) -> Any:
    """Unpickle a plain pickle file with ``RestrictedUnpickler``."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"path={str(path)!r}; no such file")
    with open(path, "rb") as handle:
        try:
            return RestrictedUnpickler(handle, stand_ins, str(path)).load()
        except (pickle.UnpicklingError, EOFError) as err:
            raise ValueError(f"{path}: not a readable pickle ({err})") from err


def load_torch_zip(path: str | pathlib.Path, stand_ins: Iterable[str] = ()) -> Any:
    """Object saved by ``torch.save`` (zip format), with tensors as numpy arrays.

    Raises:
      ValueError: not a zip-format torch file (e.g. saved with
        ``_use_new_zipfile_serialization=False``), or a refused global.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"path={str(path)!r}; no such file")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a zip-format torch.save file; re-save it with a "
                         "PyTorch >= 1.6 default torch.save")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise ValueError(f"{path}: expected one data.pkl in the archive, found {pickles}")
        root = pickles[0][: -len("data.pkl")]
        storages = {n[len(root) + len("data/"):]: archive.read(n)
                    for n in names if n.startswith(root + "data/")}
        byteorder = (archive.read(root + "byteorder").decode().strip()
                     if root + "byteorder" in names else "little")
        with archive.open(pickles[0]) as handle:
            return RestrictedUnpickler(handle, stand_ins, str(path), storages, byteorder).load()
