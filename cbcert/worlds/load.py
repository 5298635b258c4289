"""One entry point for every kind of world: ``load_world(name)`` (the CLI's ``--world``)."""

from __future__ import annotations

from pathlib import Path

from cbcert.schema import ConfigError
from cbcert.worlds.world import World


def load_world(name: str, *, classifier: str | Path | None = None,
               normalize: str = "imagenet") -> World:
    """The world ``name`` names, as `World` (generator + classifiers as pure functions).

    * ``pixels:IMAGES``: pixel-space smoothing of a user's images (``.npz`` or a PNG folder)
      with ``classifier``, a converted torchvision resnet*/densenet* directory, and the
      ``normalize`` statistics (``imagenet``, ``cifar10``, ``none``): `cbcert.worlds.pixels`;
    * an existing directory: a world directory with a ``world.json``
      (`cbcert.worlds.directory`);
    * anything else: a built-in preset (``default``, ``k8``, ``k16``, ``px64``, …) with its
      trained weights (`cbcert.worlds.builtin`).

    >>> import cbcert
    >>> world = cbcert.load_world("default")
    >>> world.name, world.model_names, world.num_classes
    ('builtin:default', ('std', 'cbm', 'cbmh', 'proto'), 10)

    Raises:
      ValueError: naming the preset, file or key at fault (missing weights, a damaged
        world.json, bad images, …); a `ConfigError` carries the setting's key: ``classifier``
        or ``normalize`` (pixels worlds), or the world.json key at fault (world directories,
        `cbcert.worlds.manifest`).
    """
    if name.startswith("pixels:"):
        from cbcert.worlds.pixels import load_pixel_world

        return load_pixel_world(name.removeprefix("pixels:"), classifier, normalize)
    if classifier is not None:
        raise ConfigError(f"classifier={classifier!s} applies to pixels:IMAGES worlds only; "
                          f"{name!r} brings its own classifiers", key="classifier",
                          value=str(classifier), allowed="None for this world")
    if Path(name).is_dir():
        from cbcert.worlds.directory import load_world_dir

        return load_world_dir(name)
    from cbcert.worlds.builtin import load_builtin

    return load_builtin(name)
