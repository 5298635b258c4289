"""stylegan2-ada-pytorch network pickles (``network-snapshot-*.pkl``) -> ``StyleGAN2``.

NVlabs pickles whole modules: every network class is wrapped by ``torch_utils.persistence``,
whose ``__reduce__`` stores ``(_reconstruct_persistent_obj, (meta,))`` with ``meta`` holding
the class's *source code* (``module_src``), its name and the instance ``__dict__``. A normal
``pickle.load`` would execute that source. ``load_snapshot`` never does: it resolves
``_reconstruct_persistent_obj`` to an inert ``PersistentObject`` (class name + state, source
dropped unread), ``dnnlib.util.EasyDict`` to a ``PickledObject``, tensors (pickled as
``torch.storage._load_from_bytes`` blobs in torch's legacy format) to numpy arrays, and refuses
every other global (see ``cbcert.convert.pickles.RestrictedUnpickler``). torch is not needed.

``G_ema``'s parameters and persistent buffers are then flattened into state_dict keys
(``synthesis.b8.conv0.affine.weight``, ...) and poured into ``StyleGAN2`` through one strict
key table; the config comes from the stored attributes and tensor shapes.

Synthesis architectures: "skip" (the StyleGAN2 default), "orig" and "resnet", read from the
``architecture`` attribute every ``SynthesisBlock`` stores. NVlabs builds all blocks with one
architecture; a pickle whose blocks differ is refused, naming the first block that differs.
Conditional generators (``c_dim > 0``) convert as well (``mapping.embed``); the label is chosen
when the model is wrapped as a ``Generator`` (``stylegan2_generator(..., class_index=k)``).
"""

from __future__ import annotations

import io
import math
import pathlib
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np

from cbcert.convert.common import (
    Entry,
    Table,
    fill_module,
    linear_entries,
)
from cbcert.convert.pickles import RestrictedUnpickler, StorageType
from cbcert.generators.stylegan2.config import ARCHITECTURES, StyleGAN2Config
from cbcert.generators.stylegan2.network import StyleGAN2
from cbcert.io.registry import abstract

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch's legacy (non-zip) serialisation magic number
_EASYDICT = "dnnlib.util.EasyDict"


class PersistentObject:
    """Inert stand-in for an object of a ``@persistence.persistent_class`` (never executed).

    Attributes:
      class_name: upstream class name, e.g. ``"training.networks.SynthesisLayer"``.
      state: the instance ``__dict__`` (for a ``torch.nn.Module``: ``_parameters``,
        ``_buffers``, ``_modules`` and plain attributes).
    """

    def __init__(self, meta: Any):
        if not isinstance(meta, dict) or meta.get("type") != "class" or "state" not in meta:
            raise ValueError("persistent object with unexpected metadata (expected "
                             "type='class' with a state)")
        self.class_name = str(meta.get("class_name"))
        self.state = meta["state"] if meta["state"] is not None else {}

    def attr(self, name: str) -> Any:
        """A stored attribute; ValueError naming it (and the class) if absent."""
        if not isinstance(self.state, dict) or name not in self.state:
            raise ValueError(f"{self.class_name}: stored attribute {name!r} is missing; not a "
                             "stylegan2-ada-pytorch network")
        return self.state[name]

    def __repr__(self) -> str:
        return f"<persistent {self.class_name}>"


class _PendingStorage:
    def __init__(self, key: str, dtype: np.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _LegacyStorageUnpickler(RestrictedUnpickler):
    """Main pickle of a legacy ``torch.save`` blob: storages become ``_PendingStorage``."""

    def persistent_load(self, pid: Any) -> _PendingStorage:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise ValueError(f"{self._source}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel, view = pid
        if view is not None or not isinstance(storage_type, StorageType):
            raise ValueError(f"{self._source}: unsupported storage {key!r} ({storage_type!r}, "
                             f"view {view!r})")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"{self._source}: storage {key!r} declares {numel!r} elements; "
                             "allowed: integers >= 0")
        return _PendingStorage(str(key), storage_type.dtype, numel)


def _load_storage_bytes(blob: bytes, source: str) -> np.ndarray:
    """numpy array of one storage saved by torch's legacy serialiser (``_load_from_bytes``).

    Layout: pickles of the magic number, the protocol version and system info, the pickled
    storage (a persistent id), the list of storage keys, then per key an int64 element count
    followed by the raw little-endian data.
    """
    handle = io.BytesIO(blob)

    def header() -> Any:
        return RestrictedUnpickler(handle, (), source).load()

    if header() != _LEGACY_MAGIC:
        raise ValueError(f"{source}: tensor blob is not in torch's legacy format")
    header()  # protocol version
    info = header()
    if isinstance(info, dict) and not info.get("little_endian", True):
        raise ValueError(f"{source}: big-endian tensor data is not supported")
    pending = _LegacyStorageUnpickler(handle, (), source).load()
    keys = header()
    if not isinstance(pending, _PendingStorage) or list(keys) != [pending.key]:
        raise ValueError(f"{source}: tensor blob holds {keys!r}, expected one storage")
    count = int.from_bytes(handle.read(8), "little")
    if count != pending.numel:
        raise ValueError(f"{source}: storage {pending.key!r} has {count} elements, "
                         f"expected {pending.numel}")
    data = handle.read(count * pending.dtype.itemsize)
    if len(data) != count * pending.dtype.itemsize:
        raise ValueError(f"{source}: storage {pending.key!r} of {count} elements holds only "
                         f"{len(data)} bytes")
    return np.frombuffer(data, dtype=pending.dtype.newbyteorder("<"), count=count).astype(
        pending.dtype)


class _SnapshotUnpickler(RestrictedUnpickler):
    """``RestrictedUnpickler`` plus NVlabs' persistence reconstructor and tensor blobs."""

    def __init__(self, file, source: str):
        super().__init__(file, (_EASYDICT,), source)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch_utils.persistence", "_reconstruct_persistent_obj"):
            return PersistentObject
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda blob: _load_storage_bytes(blob, self._source)
        return super().find_class(module, name)


def load_snapshot(path: str | pathlib.Path) -> dict[str, Any]:
    """The top-level dict of a stylegan2-ada-pytorch ``.pkl`` (networks as ``PersistentObject``).

    Raises:
      ValueError: no such file, not a pickle, or a global outside the allow-list (named).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"path={str(path)!r}; no such file")
    with open(path, "rb") as handle:
        try:
            data = _SnapshotUnpickler(handle, str(path)).load()
        except (pickle.UnpicklingError, EOFError) as err:
            raise ValueError(f"{path}: not a readable pickle ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict of networks, got {type(data).__name__}")
    return data


def module_tensors(obj: PersistentObject, prefix: str = "") -> dict[str, np.ndarray]:
    """``state_dict()`` of a pickled module: parameters and persistent buffers, recursively."""
    if not isinstance(obj, PersistentObject):
        raise ValueError(f"{prefix or 'root'}: {obj!r} is not a pickled network module")
    out: dict[str, np.ndarray] = {}
    skip = obj.state.get("_non_persistent_buffers_set", set())
    for group in ("_parameters", "_buffers"):
        for name, tensor in obj.attr(group).items():
            if tensor is not None and not (group == "_buffers" and name in skip):
                out[prefix + name] = np.asarray(tensor)
    for name, child in obj.attr("_modules").items():
        if child is not None:
            out.update(module_tensors(child, f"{prefix}{name}."))
    return out


def _shape(obj: PersistentObject, name: str) -> tuple[int, ...]:
    """Shape of a stored parameter or buffer; ValueError naming it if absent."""
    for group in ("_parameters", "_buffers"):
        tensor = obj.attr(group).get(name)
        if tensor is not None:
            return tuple(np.shape(tensor))
    raise ValueError(f"{obj.class_name}: tensor {name!r} is missing")


def _child(obj: PersistentObject, name: str) -> PersistentObject:
    modules = obj.attr("_modules")
    if name not in modules:
        raise ValueError(f"{obj.class_name}: submodule {name!r} is missing")
    return modules[name]


def config_from_pickle(g: PersistentObject) -> StyleGAN2Config:
    """``StyleGAN2Config`` of a pickled ``Generator`` from its attributes and tensor shapes.

    Raises:
      ValueError: an architecture other than "orig", "skip" or "resnet", blocks with different
        architectures, a "resnet" skip layer that is not NVlabs' (1×1, no bias, 2× up, linear,
        no clamp), mixed conv clamps or noise settings, or a mapping learning-rate multiplier
        that differs between layers.
    """
    mapping, synthesis = _child(g, "mapping"), _child(g, "synthesis")
    resolution = int(g.attr("img_resolution"))
    log2 = int(math.log2(resolution))
    blocks = [_child(synthesis, f"b{2**i}") for i in range(2, log2 + 1)]
    layers = [_child(b, "conv1") for b in blocks] + [_child(b, "conv0") for b in blocks[1:]]
    channels = tuple(_shape(_child(b, "conv1"), "weight")[0] for b in blocks)
    architecture = _architecture(blocks)
    if architecture == "resnet":
        for i in range(1, len(blocks)):
            _check_skip(blocks[i], channels[i - 1], channels[i])
    rgb_blocks = blocks if architecture == "skip" else blocks[-1:]
    clamps = {layer.attr("conv_clamp") for layer in layers}
    clamps |= {_child(b, "torgb").attr("conv_clamp") for b in rgb_blocks}
    noises = {bool(layer.attr("use_noise")) for layer in layers}
    if len(clamps) != 1 or len(noises) != 1:
        raise ValueError(f"conv_clamp values {clamps} / use_noise values {noises} differ "
                         "between layers; expected one setting for the whole network")
    fcs = [m for m in mapping.attr("_modules") if m.startswith("fc")]
    lr = float(_child(mapping, "fc0").attr("bias_gain"))
    for name in fcs:
        if not math.isclose(float(_child(mapping, name).attr("bias_gain")), lr):
            raise ValueError(f"mapping.{name}: bias_gain differs from fc0's ({lr}); "
                             "expected one lr_multiplier")
    c_dim = int(g.attr("c_dim"))
    fc0_shape = _shape(_child(mapping, "fc0"), "weight")
    filter_shape = _shape(blocks[-1], "resample_filter")
    clamp = clamps.pop()
    config = StyleGAN2Config(
        z_dim=int(g.attr("z_dim")), w_dim=int(g.attr("w_dim")), img_resolution=resolution,
        img_channels=int(g.attr("img_channels")), channels=channels, c_dim=c_dim,
        mapping_layers=len(fcs), mapping_features=int(fc0_shape[0]),
        embed_features=_shape(_child(mapping, "embed"), "weight")[0] if c_dim else None,
        lr_multiplier=lr, conv_clamp=None if clamp is None else float(clamp),
        filter_size=int(filter_shape[0]), use_noise=noises.pop(),
        has_w_avg=mapping.attr("_buffers").get("w_avg") is not None, architecture=architecture)
    if int(g.attr("num_ws")) != config.num_ws:
        raise ValueError(f"num_ws={g.attr('num_ws')} stored, but the synthesis network "
                         f"needs {config.num_ws}")
    return config


def _architecture(blocks: list[PersistentObject]) -> str:
    """The one synthesis architecture of all blocks; ValueError naming an odd block."""
    first = blocks[0].attr("architecture")
    for block in blocks:
        arch = block.attr("architecture")
        where = f"synthesis.b{block.attr('resolution')} ({block.class_name})"
        if arch not in ARCHITECTURES:
            raise ValueError(f"{where}: architecture={arch!r}; supported: "
                             f"{', '.join(map(repr, ARCHITECTURES))}")
        if arch != first:
            raise ValueError(f"{where}: architecture={arch!r}, but synthesis.b4 has {first!r}; "
                             "blocks with different architectures are not supported (NVlabs "
                             "builds every block with the same one)")
    return first


def _check_skip(block: PersistentObject, cin: int, cout: int) -> None:
    """A "resnet" block's ``skip`` must be NVlabs' ``Conv2dLayer(cin, cout, kernel_size=1,
    bias=False, up=2)``: linear, unclamped, 2× up-sampling (the port hard-codes that)."""
    skip = _child(block, "skip")
    where = f"synthesis.b{block.attr('resolution')}.skip"
    shape = _shape(skip, "weight")
    if shape != (cout, cin, 1, 1):
        raise ValueError(f"{where}.weight: shape {shape}, expected {(cout, cin, 1, 1)} (a 1×1 "
                         "conv from the previous block's channels)")
    expected = {"up": 2, "down": 1, "activation": "linear", "conv_clamp": None}
    for name, value in expected.items():
        if skip.attr(name) != value:
            raise ValueError(f"{where}: {name}={skip.attr(name)!r}; the resnet skip branch must "
                             f"have {name}={value!r}")
    if skip.attr("_parameters").get("bias") is not None:
        raise ValueError(f"{where}: has a bias; the resnet skip branch has none")


def stylegan2_table(config: StyleGAN2Config) -> Table:
    """NVlabs ``G_ema.state_dict()`` key -> NNX path of ``StyleGAN2``."""
    table: Table = {}
    if config.c_dim:
        linear_entries(table, "mapping.embed", ("mapping", "embed"))
    for i in range(config.mapping_layers):
        linear_entries(table, f"mapping.fc{i}", ("mapping", "fc", i))
    if config.has_w_avg:
        table["mapping.w_avg"] = Entry(("mapping", "w_avg"))
    skip_arch = config.architecture == "skip"
    last = len(config.block_resolutions) - 1
    for i, res in enumerate(config.block_resolutions):
        key, path = f"synthesis.b{res}", ("blocks", i)
        # The block filter up-samples the running image: only "skip" blocks after the 4x4 one.
        table[f"{key}.resample_filter"] = (Entry((*path, "resample_filter"))
                                           if i > 0 and skip_arch else Entry(None, "ignore"))
        if i == 0:
            table[f"{key}.const"] = Entry((*path, "const"))
        else:
            _layer_entries(table, f"{key}.conv0", (*path, "conv0"), config, filter_used=True)
        _layer_entries(table, f"{key}.conv1", (*path, "conv1"), config, filter_used=False)
        if skip_arch or i == last:
            _affine_conv_entries(table, f"{key}.torgb", (*path, "torgb"))
        if i > 0 and config.architecture == "resnet":
            table[f"{key}.skip.weight"] = Entry((*path, "skip", "kernel"), "conv")
            table[f"{key}.skip.resample_filter"] = Entry((*path, "skip", "resample_filter"))
    return table


def _affine_conv_entries(table: Table, key: str, path: tuple) -> None:
    linear_entries(table, f"{key}.affine", (*path, "affine"))
    table[f"{key}.weight"] = Entry((*path, "kernel"), "conv")
    table[f"{key}.bias"] = Entry((*path, "bias"))


def _layer_entries(table: Table, key: str, path: tuple, config: StyleGAN2Config,
                   filter_used: bool) -> None:
    _affine_conv_entries(table, key, path)
    # Every SynthesisLayer registers the filter; only the up-sampling one reads it.
    table[f"{key}.resample_filter"] = (Entry((*path, "resample_filter")) if filter_used
                                       else Entry(None, "ignore"))
    if config.use_noise:
        table[f"{key}.noise_const"] = Entry((*path, "noise_const"))
        table[f"{key}.noise_strength"] = Entry((*path, "noise_strength"))


def _two_d_filters(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Separable (1-D) stored filters as their 2-D outer product ``f fᵀ``; others unchanged.

    NVlabs stores a 1-D filter when it is applied separably (per axis, same taps and gain
    split evenly), which is the same linear map as the outer product applied in 2-D.
    """
    out = dict(tensors)
    for key, value in tensors.items():
        if key.endswith("resample_filter") and np.ndim(value) == 1:
            out[key] = np.outer(value, value)
    return out


def abstract_stylegan2(config: StyleGAN2Config) -> StyleGAN2:
    """Shape-only ``StyleGAN2``."""
    return abstract(lambda rngs: StyleGAN2(config, rngs=rngs))


def config_from_manifest(fields: Mapping[str, Any]) -> StyleGAN2Config:
    """Inverse of ``dataclasses.asdict(config)`` after a JSON round trip (lists -> tuples)."""
    return StyleGAN2Config(**{**fields, "channels": tuple(fields["channels"])})


def stylegan2_from_state_dict(config: StyleGAN2Config, tensors: Mapping[str, np.ndarray]
                              ) -> StyleGAN2:
    """``StyleGAN2`` filled from ``G_ema.state_dict()``-style tensors.

    Raises:
      ValueError: naming every unknown, missing or mis-shaped key.
    """
    return fill_module(abstract_stylegan2(config), _two_d_filters(tensors),
                       stylegan2_table(config), "stylegan2")


def stylegan2_from_pickle(g: PersistentObject) -> StyleGAN2:
    """``StyleGAN2`` from a pickled ``Generator`` (strict: every tensor accounted for)."""
    return stylegan2_from_state_dict(config_from_pickle(g), module_tensors(g))


def _is_generator(value: Any) -> bool:
    # NVlabs' persistence stores the bare class name ("Generator"); accept a qualified one too.
    return (isinstance(value, PersistentObject)
            and value.class_name.rsplit(".", 1)[-1] == "Generator")


def load_stylegan2(path: str | pathlib.Path, network: str = "G_ema",
                   setting: str = "network") -> StyleGAN2:
    """Read ``network`` (default the EMA generator ``G_ema``) of a stylegan2-ada-pytorch pickle.

    Args:
      path: the ``.pkl``.
      network: key of the generator in the pickle's dict (``G_ema`` or ``G``).
      setting: how the caller's user spelled ``network`` (e.g. ``"world.json: generator.network"``),
        for error messages.

    Raises:
      ValueError: an unreadable pickle, or ``network`` not naming a pickled ``Generator`` (the
        message lists the generators the pickle holds).
    """
    data = load_snapshot(path)
    if not _is_generator(data.get(network)):
        generators = ", ".join(repr(str(k)) for k, v in data.items() if _is_generator(v))
        if network not in data:
            found = "has no such key"
        else:
            value = data[network]
            kind = (value.class_name if isinstance(value, PersistentObject)
                    else type(value).__name__)
            found = f"holds a {kind} there"
        raise ValueError(f"{setting}={network!r}: {pathlib.Path(path).name} {found}, not a "
                         f"StyleGAN2 generator; its generators: {generators or 'none'}")
    return stylegan2_from_pickle(data[network])

