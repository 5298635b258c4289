"""Read pickles that hold whole objects without importing or running the code that wrote them.

``RestrictedUnpickler`` resolves only an allow-list of globals: plain containers, numpy array
and scalar reconstruction, torch's tensor-rebuild functions (replaced by numpy equivalents) and
caller-named classes, which become inert ``PickledObject`` stand-ins recording their state.
Any other global (``os.system``, an unknown class, ...) raises ``ValueError`` naming it.

``load_torch_zip`` reads a ``torch.save`` file (zip format, PyTorch >= 1.6) this way, so a
whole-module checkpoint such as post-hoc-cbm's ``torch.save(posthoc_layer, path)`` is read
without torch and without the upstream repository.

Untrusted input: every number the file gives is checked before memory is touched, as torch's
``as_strided`` checks do. A tensor view must lie inside its storage (offset >= 0, sizes >= 0,
strides >= 0, last element < storage length, storage a 1-D array of a torch storage dtype);
``numpy.ndarray`` is only a type tag for numpy's own reconstruction, never called on raw bytes.
In a zip archive a storage member is read only up to the byte size its storage declares
(elements × item size, which the member's header must repeat), ``data.pkl`` only up to
``MAX_PICKLE_BYTES``, and unreferenced members are never inflated, so a zip bomb cannot grow
past what the pickle declares; each storage and each tensor holds at most ``MAX_TENSOR_BYTES``.
Nor can many of them add up: a `ByteBudget` caps what one file makes the loader hold in all
(inflated ``data.pkl``, storages, tensor copies) at ``BYTES_PER_FILE_BYTE`` times the file's size
plus ``BUDGET_SLACK_BYTES``, and never more than ``MAX_TOTAL_BYTES``; it is charged before each
allocation.
A file breaking any rule, or any malformed pickle, raises ``ValueError`` naming the file and
the problem.

Size: one safety boundary (the allow-list, the zip reader and its byte budget), kept in one
module so that it is reviewed as one.
"""

from __future__ import annotations

import codecs
import collections
import functools
import io
import math
import pathlib
import pickle
import zipfile
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

try:
    from numpy._core import multiarray
except ImportError:  # numpy < 2
    from numpy.core import multiarray

MAX_PICKLE_BYTES = 1 << 30  # a torch.save data.pkl: tensors live in data/, the pickle is KBs
MAX_TENSOR_BYTES = 1 << 30  # one storage or tensor; the supported checkpoints' largest is ~10 MB
# What one file may make the loader hold in all. torch.save stores its storages uncompressed, so
# a genuine file holds about its own size twice (storages, then the tensors copied out of them);
# a deflated member can claim ~1000 times its size, a stride-0 view any size.
MAX_TOTAL_BYTES = 1 << 31
BYTES_PER_FILE_BYTE = 16
BUDGET_SLACK_BYTES = 64 << 20
_MAX_DIMS = 64  # numpy's limit on array dimensions

# Malformed pickles surface as any of these from inside ``pickle.Unpickler.load``.
_MALFORMED = (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError, KeyError,
              OverflowError, MemoryError, RecursionError, zipfile.BadZipFile, zlib.error)


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


class StorageType:
    """Stand-in for ``torch.FloatStorage`` & co: only carries the element dtype."""

    def __init__(self, dtype: Any):
        self.dtype = np.dtype(dtype)

    def __repr__(self) -> str:
        return f"<storage type {self.dtype}>"


@functools.cache
def _storage_types() -> dict[str, StorageType]:
    import ml_dtypes  # installed with jax

    dtypes = {"Float": np.float32, "Double": np.float64, "Half": np.float16,
              "BFloat16": ml_dtypes.bfloat16, "Long": np.int64, "Int": np.int32,
              "Short": np.int16, "Char": np.int8, "Byte": np.uint8, "Bool": np.bool_}
    return {f"{name}Storage": StorageType(dtype) for name, dtype in dtypes.items()}


class ByteBudget:
    """Bytes one file may make the loader hold in all, charged before each allocation.

    ``limit = min(MAX_TOTAL_BYTES, BYTES_PER_FILE_BYTE · file_size + BUDGET_SLACK_BYTES)``.

    Args:
      source: file name used in error messages.
      file_size: the file's size in bytes.
    """

    def __init__(self, source: str, file_size: int):
        self.source, self.file_size = source, file_size
        self.limit = min(MAX_TOTAL_BYTES, BYTES_PER_FILE_BYTE * file_size + BUDGET_SLACK_BYTES)
        self.held = 0

    def take(self, nbytes: int, what: str) -> None:
        """Charge ``nbytes`` for ``what``; `ValueError` naming the totals if over the limit."""
        if self.held + nbytes > self.limit:
            raise ValueError(
                f"{self.source}: {what} would bring what the file holds to {self.held + nbytes} "
                f"bytes in all; at most {self.limit} for a file of {self.file_size} bytes "
                f"({BYTES_PER_FILE_BYTE} × its size + {BUDGET_SLACK_BYTES} bytes, never more "
                f"than MAX_TOTAL_BYTES = {MAX_TOTAL_BYTES})")
        self.held += nbytes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if not (isinstance(value, tuple | list) and all(_is_int(v) for v in value)):
        raise ValueError(f"tensor {name}={value!r}; expected a tuple of integers")
    if len(value) > _MAX_DIMS:
        raise ValueError(f"tensor {name} has {len(value)} dimensions; at most {_MAX_DIMS}")
    return tuple(value)


def checked_view(storage: Any, offset: Any, size: Any, stride: Any,
                 budget: ByteBudget | None = None) -> np.ndarray:
    """Copy of the view ``(offset, size, stride)`` of a storage, after checking it lies inside.

    The rules are torch's (``as_strided`` / ``checkInBoundsForStorage``), in Python integers so
    nothing overflows: ``storage`` a 1-D C-contiguous array of a torch storage dtype, ``offset``
    an integer >= 0, ``size`` and ``stride`` equally long tuples of integers >= 0 and, unless the
    view is empty, ``offset + Σ (size_i − 1)·stride_i < len(storage)``; the copy holds at most
    ``MAX_TENSOR_BYTES``, charged to ``budget`` (if given) before it is made.

    Raises:
      ValueError: the rule broken, with the offending numbers.
    """
    known = {t.dtype for t in _storage_types().values()}
    if not (isinstance(storage, np.ndarray) and storage.ndim == 1
            and storage.flags.c_contiguous and storage.dtype in known):
        what = (f"an array of shape {storage.shape} and dtype {storage.dtype}"
                if isinstance(storage, np.ndarray) else type(storage).__name__)
        raise ValueError(f"tensor storage is {what}; expected a 1-D array of a torch storage "
                         "type")
    if not _is_int(offset) or offset < 0:
        raise ValueError(f"tensor storage offset={offset!r}; allowed: integers >= 0")
    size, stride = _int_tuple("size", size), _int_tuple("stride", stride)
    if len(size) != len(stride):
        raise ValueError(f"tensor size {size} and stride {stride} differ in length")
    if any(n < 0 for n in size) or any(s < 0 for s in stride):
        raise ValueError(f"tensor size {size}, stride {stride}; negative entries are not allowed")
    numel = math.prod(size)
    if numel == 0:  # like torch: an empty view reads nothing, whatever its offset
        return np.empty(size, storage.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= len(storage):
        raise ValueError(f"tensor view (offset {offset}, size {size}, stride {stride}) reaches "
                         f"element {last} of a storage of {len(storage)} elements")
    if numel * storage.itemsize > MAX_TENSOR_BYTES:
        raise ValueError(f"tensor of size {size} would hold {numel * storage.itemsize} bytes; "
                         f"at most {MAX_TENSOR_BYTES}")
    if budget is not None:
        budget.take(numel * storage.itemsize, f"tensor of size {size}")
    # A dimension of size 1 never steps, so its stride (any value, in torch) is not used.
    strides = tuple(s * storage.itemsize if n > 1 else 0 for n, s in zip(size, stride, strict=True))
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=size, strides=strides).copy()


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_ignored: Any,
                    budget: ByteBudget | None = None) -> np.ndarray:
    """numpy version of ``torch._utils._rebuild_tensor_v2`` (see ``checked_view``)."""
    return checked_view(storage, offset, size, stride, budget)


def _rebuild_parameter(data: np.ndarray, *_ignored: Any) -> np.ndarray:
    """``torch._utils._rebuild_parameter``: a parameter is its data here."""
    return data


class _NDArrayTag:
    """What ``numpy.ndarray`` resolves to: the type tag numpy's pickles pass to ``_reconstruct``.

    Calling the real class on pickled arguments (``ndarray(shape, object, buffer)``) would turn
    raw bytes into object pointers, so the tag refuses to be called.
    """

    def __call__(self, *args: Any) -> None:
        raise ValueError("refusing to call numpy.ndarray (numpy pickles only name it)")


_NDARRAY = _NDArrayTag()


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """numpy's ``_reconstruct`` for plain arrays only (the state arrives with BUILD)."""
    if subtype is not _NDARRAY:
        raise ValueError(f"refusing to reconstruct an array of type {subtype!r}")
    return multiarray._reconstruct(np.ndarray, shape, dtype)


def _encode(text: Any, encoding: str) -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it: ``str`` to ``bytes`` via latin-1."""
    if not isinstance(text, str) or codecs.lookup(encoding).name != "iso8859-1":
        raise ValueError(f"refusing _codecs.encode with encoding {encoding!r}")
    return codecs.encode(text, encoding)


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
        ("_codecs", "encode"): _encode,  # protocol-2 pickles spell bytes this way
        ("numpy", "dtype"): np.dtype,
        ("numpy", "ndarray"): _NDARRAY,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    }
    for core in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(core, "_reconstruct")] = _reconstruct
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
      read_storage: for a torch zip archive (``persistent_load``), ``(key, nbytes) -> bytes``
        returning exactly the ``nbytes`` bytes of storage ``key`` or raising ``ValueError``;
        None for plain pickles.
      byteorder: ``"little"`` or ``"big"``, byte order of the storages.
      budget: charged with every storage read and every tensor copied (`ByteBudget`); None
        caps only each one (``MAX_TENSOR_BYTES``).
    """

    def __init__(self, file, stand_ins: Iterable[str], source: str,
                 read_storage: Callable[[str, int], bytes] | None = None,
                 byteorder: str = "little", budget: ByteBudget | None = None):
        super().__init__(file)
        self._allowed = _base_globals()
        if budget is not None:
            self._allowed[("torch._utils", "_rebuild_tensor_v2")] = functools.partial(
                _rebuild_tensor, budget=budget)
        self._budget = budget
        for qualified in stand_ins:
            module, _, name = qualified.rpartition(".")
            self._allowed[(module, name)] = _stand_in(qualified)
        self._source = source
        self._read_storage = read_storage
        self._byteorder = byteorder
        self._loaded: dict[str, np.ndarray] = {}

    def load(self) -> Any:
        """Unpickle; any malformed or refused content raises ``ValueError`` naming the file."""
        try:
            return super().load()
        except ValueError as err:
            if str(err).startswith(f"{self._source}:"):
                raise
            raise ValueError(f"{self._source}: {err}") from None
        except _MALFORMED as err:
            raise ValueError(f"{self._source}: not a readable pickle "
                             f"({type(err).__name__}: {err})") from None

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise ValueError(f"{self._source}: refusing to load global {module}.{name} (not a "
                             "known tensor, container or checkpoint class)") from None

    def persistent_load(self, pid: Any) -> np.ndarray:
        if self._read_storage is None or not (isinstance(pid, tuple) and len(pid) == 5
                                              and pid[0] == "storage"):
            raise ValueError(f"{self._source}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, StorageType) or not isinstance(key, str):
            raise ValueError(f"{self._source}: storage {key!r} has unsupported type "
                             f"{storage_type!r}")
        if not _is_int(numel) or numel < 0:
            raise ValueError(f"{self._source}: storage {key!r} declares {numel!r} elements; "
                             "allowed: integers >= 0")
        dtype = storage_type.dtype
        if numel * dtype.itemsize > MAX_TENSOR_BYTES:
            raise ValueError(f"{self._source}: storage {key!r} declares {numel} elements "
                             f"({numel * dtype.itemsize} bytes); at most {MAX_TENSOR_BYTES} bytes")
        if key in self._loaded:
            array = self._loaded[key]
            if array.dtype != dtype or len(array) != numel:
                raise ValueError(f"{self._source}: storage {key!r} is referenced as {numel} "
                                 f"{dtype} and as {len(array)} {array.dtype} elements")
            return array
        if self._budget is not None:
            self._budget.take(numel * dtype.itemsize, f"storage {key!r}")
        data = self._read_storage(key, numel * dtype.itemsize)
        order = "<" if self._byteorder == "little" else ">"
        array = np.frombuffer(data, dtype=dtype.newbyteorder(order), count=numel)
        self._loaded[key] = array.astype(dtype)
        return self._loaded[key]


def load_pickle(path: str | pathlib.Path, stand_ins: Iterable[str] = ()) -> Any:
    """Unpickle a plain pickle file with ``RestrictedUnpickler``.

    Raises:
      ValueError: no such file, a malformed pickle, a refused global or an invalid tensor view.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"path={str(path)!r}; no such file")
    with open(path, "rb") as handle:
        return RestrictedUnpickler(handle, stand_ins, str(path)).load()


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, nbytes: int,
                 source: str) -> bytes:
    """Exactly ``nbytes`` bytes of a member, never inflating more than ``nbytes + 1``."""
    try:
        with archive.open(info) as handle:
            data = handle.read(nbytes + 1)
    except (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError) as err:
        raise ValueError(f"{source}: archive member {info.filename} is unreadable ({err})"
                         ) from None
    if len(data) != nbytes:
        found = "more than" if len(data) > nbytes else "only"
        raise ValueError(f"{source}: archive member {info.filename} holds {found} "
                         f"{min(len(data), nbytes)} bytes, expected {nbytes}")
    return data


def load_torch_zip(path: str | pathlib.Path, stand_ins: Iterable[str] = ()) -> Any:
    """Object saved by ``torch.save`` (zip format), with tensors as numpy arrays.

    Reads at most ``MAX_PICKLE_BYTES`` of ``data.pkl`` and, of each ``data/<key>`` member, the
    bytes its storage declares; all of it together with the tensors copied out of the storages
    within one `ByteBudget` of the file (module docstring).

    Raises:
      ValueError: not a zip-format torch file (e.g. saved with
        ``_use_new_zipfile_serialization=False``), a refused global, a storage whose member is
        missing or of another size, an invalid tensor view, or more bytes in all than the
        file's `ByteBudget`.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"path={str(path)!r}; no such file")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a zip-format torch.save file; re-save it with a "
                         "PyTorch >= 1.6 default torch.save")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"{path}: not a readable zip archive ({err})") from None
    with archive:
        names = set(archive.namelist())
        pickles = sorted(n for n in names if n.endswith("/data.pkl") or n == "data.pkl")
        if len(pickles) != 1:
            raise ValueError(f"{path}: expected one data.pkl in the archive, found {pickles}")
        root = pickles[0][: -len("data.pkl")]
        info = archive.getinfo(pickles[0])
        if info.file_size > MAX_PICKLE_BYTES:
            raise ValueError(f"{path}: {info.filename} declares {info.file_size} bytes; at most "
                             f"{MAX_PICKLE_BYTES} (cbcert.convert.pickles.MAX_PICKLE_BYTES)")
        budget = ByteBudget(str(path), path.stat().st_size)
        budget.take(info.file_size, info.filename)
        data_pkl = _read_member(archive, info, info.file_size, str(path))
        byteorder = "little"
        if root + "byteorder" in names:
            info = archive.getinfo(root + "byteorder")
            raw = _read_member(archive, info, min(info.file_size, 16), str(path))
            byteorder = raw.decode("ascii", "replace").strip()
            if byteorder not in ("little", "big"):
                raise ValueError(f"{path}: {info.filename}={byteorder!r}; expected little or big")

        def read_storage(key: str, nbytes: int) -> bytes:
            name = f"{root}data/{key}"
            if name not in names:
                raise ValueError(f"{path}: storage {key!r} missing from the archive")
            member = archive.getinfo(name)
            if member.file_size != nbytes:
                raise ValueError(f"{path}: archive member {name} declares {member.file_size} "
                                 f"bytes but its storage holds {nbytes}")
            return _read_member(archive, member, nbytes, str(path))

        return RestrictedUnpickler(io.BytesIO(data_pkl), stand_ins, str(path), read_storage,
                                   byteorder, budget).load()
