"""A world whose generator records the batch size of every call that reaches it."""

import dataclasses

from cbcert.worlds.world import World


def spy_world(world: World,
              record=lambda x: x.shape[0]) -> tuple[World, list[tuple[str, object]]]:
    """``(world', seen)``: ``world'`` computes exactly what ``world`` does, and every traced
    call of ``g1`` or ``g2`` appends ``(name, record(x))`` to ``seen`` -- by default the batch
    (jit traces once per shape, so ``seen`` lists every batch shape the generator was ever
    compiled for); ``record=lambda x: x.dtype`` gives the dtypes it was traced for."""
    seen: list[tuple[str, object]] = []
    gen = world.generator

    def spy(name, fn):
        def wrapped(params, x):
            seen.append((name, record(x)))
            return fn(params, x)
        return wrapped

    spied = dataclasses.replace(gen, g1=spy("g1", gen.g1), g2=spy("g2", gen.g2))
    fields = {f.name: getattr(world, f.name) for f in dataclasses.fields(World)}
    return World(**{**fields, "generator": spied}), seen
