"""What the trainers' compiled programs share: states as templates, one gradient step, a cache.

The classifier, PixPNet and CB-AE trainers each build jitted programs that close over a
module's graph and settings and take its arrays as arguments. Here are the pieces they all
use:

* `abstract` and `filled`: a module state reduced to shapes and dtypes (what a program may
  close over without holding arrays), and a copy of a state holding given values;
* `gradient_step`: the jitted ``(params, stats, opt_state, x, y) -> (params, stats,
  opt_state, loss, accuracy)`` of a loss with auxiliary statistics and accuracy;
* `ProgramCache`: the last programs built, by what they close over, so that a resumed run or
  a second run in the same process (the library API, the tests) reuses their compilation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import jax
import optax
from flax import nnx

from cbcert.engine import compiler


def abstract(state: nnx.State) -> nnx.State:
    """``state`` with every array replaced by its ``jax.ShapeDtypeStruct`` (shape and dtype)."""
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)


def filled(template: nnx.State, pure: dict) -> nnx.State:
    """A copy of ``template`` (fresh Variables, the module is untouched) holding ``pure``."""
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, pure)
    return state


def gradient_step(loss_fn: Callable, opt: optax.GradientTransformation) -> Callable:
    """The jitted step of ``loss_fn`` under ``opt``.

    ``loss_fn(params, stats, x, y) -> (loss, (stats', accuracy))``; the step is
    ``(params, stats, opt_state, x, y) -> (params + updates, stats', opt_state', loss,
    accuracy)`` with ``updates, opt_state' = opt.update(∇_params loss, opt_state, params)``
    (``optax.apply_updates``: the optimiser's updates already point downhill).
    """

    @compiler.jit
    def step(params, stats, opt_state, x, y):
        (loss, (stats, accuracy)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, stats, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss, accuracy

    return step


class ProgramCache:
    """The last ``size`` programs built, by key (least recently used goes first)."""

    def __init__(self, size: int):
        self.size = size
        self._programs: OrderedDict = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        """The program cached under ``key``, built by ``build()`` on a miss."""
        if key not in self._programs:
            self._programs[key] = build()
            while len(self._programs) > self.size:
                self._programs.popitem(last=False)
        self._programs.move_to_end(key)
        return self._programs[key]


__all__ = ["ProgramCache", "abstract", "filled", "gradient_step"]
