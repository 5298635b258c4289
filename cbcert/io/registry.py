"""The kind registry: which module a checkpoint holds, and how to rebuild it without torch.

A checkpoint's ``kind`` (``cbcert.io.checkpoint``) names a ``Kind``: its frozen config
dataclass (the manifest's ``config`` holds its fields), its Flax NNX module class (built as
``module(config, rngs=...)``) and, for models with one input, the body of its pure function
``apply_fn(params, x)``. Kinds:

* torchvision ``resnet*`` / ``densenet*`` (``RESNET_NAMES``, ``DENSENET_NAMES``):
  ``x[B, H, W, 3] -> logits[B, C]``;
* ``pcbm`` (PCBM / PCBM-h on a torchvision or pytorchcv backbone, e.g. ``resnet18_cub``:
  the backbone is inside the PCBM's params): ``x[B, H, W, 3] -> logits[B, C]``;
* ``pixpnet``: ``x[B, H, W, 3] -> logits[B, C]``;
* ``world-classifiers`` (the built-in world's nets): ``x[B, H, W, 3] -> logits[B, 4, C]``
  (heads std, cbm, cbmh, proto);
* ``cbae``: ``w[B, num_ws · dw] -> c[B, 2K + U]`` (the encoder E);
* ``stylegan2``, ``biggan``: generators, no single-input function; ``load_module`` returns the
  module for ``cbcert.generators`` to wrap.

Everything here reads checkpoints only: it imports neither torch nor ``cbcert.convert``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from cbcert.generators.biggan import BigGAN, BigGANConfig
from cbcert.generators.cbae import CBAE, CBAEConfig
from cbcert.generators.stylegan2.config import StyleGAN2Config
from cbcert.generators.stylegan2.network import StyleGAN2
from cbcert.io import checkpoint
from cbcert.io.checkpoint import CheckpointError
from cbcert.models.densenet import DENSENET_PRESETS, DenseNet, DenseNetConfig
from cbcert.models.pcbm import PCBM, PCBMConfig
from cbcert.models.pixpnet import PixPNet, PixPNetConfig
from cbcert.models.resnet import RESNET_PRESETS, ResNet, ResNetConfig
from cbcert.models.world_classifiers import NetConfig, WorldClassifiers
from cbcert.schema import shorten

Method = Callable[[Any, jax.Array], jax.Array]  # (module, x) -> y


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a checkpoint kind holds.

    Attributes:
      config: the frozen config dataclass; ``manifest["config"]`` holds exactly its fields.
      module: the NNX module class, built as ``module(config, rngs=...)``.
      apply: ``(module, x) -> y``, the body of the pure ``apply_fn`` (module docstring), or
        None for a generator.
    """

    config: type
    module: type[nnx.Module]
    apply: Method | None


def _call(module: Any, x: jax.Array) -> jax.Array:
    return module(x)


RESNET_NAMES = tuple(sorted(RESNET_PRESETS))
DENSENET_NAMES = tuple(sorted(DENSENET_PRESETS))
KINDS: dict[str, Kind] = {
    **{name: Kind(ResNetConfig, ResNet, _call) for name in RESNET_NAMES},
    **{name: Kind(DenseNetConfig, DenseNet, _call) for name in DENSENET_NAMES},
    "pcbm": Kind(PCBMConfig, PCBM, _call),
    "pixpnet": Kind(PixPNetConfig, PixPNet, _call),
    "world-classifiers": Kind(NetConfig, WorldClassifiers, lambda m, x: m.heads(x)),
    "cbae": Kind(CBAEConfig, CBAE, lambda m, w: m.encode(w)),
    "stylegan2": Kind(StyleGAN2Config, StyleGAN2, None),
    "biggan": Kind(BigGANConfig, BigGAN, None),
}


class _StatelessKeys:
    """Key source for shape-only construction: every draw returns the same key.

    ``nnx.Rngs`` updates a counter variable on every draw; under ``nnx.eval_shape`` each update
    builds a tracer error message whose cost grows with the trace, which makes abstract
    construction quadratic in the number of layers (3 s instead of 0.7 s for DenseNet-161).
    Shapes do not depend on the keys, so a constant key is exact here.
    """

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract(build: Callable[[Any], nnx.Module]) -> nnx.Module:
    """Shape-only module ``build(rngs)`` (variables are ``jax.ShapeDtypeStruct``; nothing drawn)."""
    return nnx.eval_shape(lambda: build(_StatelessKeys()))


def pure_apply(module: nnx.Module, method: Method = _call
               ) -> tuple[Callable[[nnx.State, jax.Array], jax.Array], nnx.State]:
    """Split ``module`` once into a pure ``apply_fn(params, x)`` and its ``params`` pytree.

    ``apply_fn(params, x) = method(nnx.merge(graphdef, params), x)``; jit it with plain
    ``jax.jit``. The graph definition is closed over (static), the params are a pytree of
    arrays that shard and donate like any other.
    """
    graphdef, params = nnx.split(module)

    def apply_fn(params: nnx.State, x: jax.Array) -> jax.Array:
        return method(nnx.merge(graphdef, params), x)

    return apply_fn, params


def _as_tuples(value: Any) -> Any:
    """JSON turns config tuples into lists; frozen configs want them back as tuples."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def config_from_manifest(kind: str, fields: Any, where: str = "manifest") -> Any:
    """The config dataclass of ``kind`` from its JSON fields (lists become tuples).

    Raises:
      CheckpointError: an unknown kind, fields that are not exactly the dataclass's, or values
        the config refuses (``where`` prefixes the message).
    """
    if kind not in KINDS:
        raise CheckpointError(f"{where}: kind={shorten(repr(kind), 80)}; "
                              f"allowed: {', '.join(KINDS)}")
    config_class = KINDS[kind].config
    names = {f.name for f in dataclasses.fields(config_class)}
    if not isinstance(fields, dict) or set(fields) != names:
        found = sorted(fields) if isinstance(fields, dict) else fields
        raise CheckpointError(f"{where}: config keys {shorten(repr(found))} do not match "
                              f"{config_class.__name__} fields {sorted(names)}")
    try:
        return config_class(**{k: _as_tuples(v) for k, v in fields.items()})
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: damaged config for kind={kind!r} "
                              f"({shorten(str(err))})") from None


def save_module(directory: str | Path, kind: str, module: nnx.Module, metadata: dict[str, Any],
                *, replace: bool = False) -> dict[str, Any]:
    """Write ``module`` as a checkpoint of ``kind``; ``config`` is ``asdict(module.config)``.

    ``metadata`` (``sources``, ``metrics``, …) goes into the manifest. Returns the manifest.

    Raises:
      CheckpointError: ``module`` is not of the kind's class, or ``checkpoint.save`` refuses.
    """
    if kind not in KINDS or not isinstance(module, KINDS[kind].module):
        raise CheckpointError(f"kind={shorten(repr(kind), 80)} does not fit a "
                              f"{type(module).__name__}; allowed kinds: {', '.join(KINDS)}")
    config = dataclasses.asdict(module.config)
    return checkpoint.save(directory, module, {"kind": kind, "config": config, **metadata},
                           replace=replace)


def load_module(directory: str | Path) -> tuple[nnx.Module, dict[str, Any]]:
    """The NNX module of a checkpoint (every method: ``embed``, ``encode``, ``map``…) and its
    manifest; files and params hashes are checked.

    Raises:
      CheckpointError: anything ``checkpoint.load`` refuses, a kind that is not a module kind,
        or a config that does not fit the kind.
    """
    directory = Path(directory).absolute()
    manifest = checkpoint.read_manifest(directory)
    where = shorten(str(directory))
    kind = manifest.get("kind")
    if kind not in KINDS:
        raise CheckpointError(f"{where}: manifest kind={shorten(repr(kind), 80)} is not a model; "
                              f"allowed: {', '.join(KINDS)}")
    config = config_from_manifest(kind, manifest.get("config"), where)
    graphdef, state = nnx.split(abstract(lambda rngs: KINDS[kind].module(config, rngs=rngs)))
    params, _ = checkpoint.load(directory, nnx.to_pure_dict(state), manifest)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state), manifest


def load_converted(directory: str | Path) -> tuple[
        Callable[[nnx.State, jax.Array], jax.Array], nnx.State, dict[str, Any]]:
    """``(apply_fn, params, manifest)`` of a model checkpoint.

    ``apply_fn(params, x)`` is pure (wrap it in ``jax.jit``); what it maps is the kind's (module
    docstring), e.g. ``x[B, H, W, 3] -> logits[B, C]`` for a classifier.

    Raises:
      CheckpointError: anything ``load_module`` refuses, or a generator kind (no single-input
        function: use ``load_module``).
    """
    module, manifest = load_module(directory)
    method = KINDS[manifest["kind"]].apply
    if method is None:
        raise CheckpointError(f"{shorten(str(directory))}: kind={manifest['kind']!r} is a "
                              "generator with no single-input function; use load_module")
    apply_fn, params = pure_apply(module, method)
    return apply_fn, params, manifest
