"""APGD-CE / APGD-DLR (Croce & Hein, ICML 2020) in pure JAX.

Auto-PGD is projected gradient ascent with momentum whose step size is halved at
checkpoints when the loss stopped improving. This module follows the public
structure of the authors' reference implementation (AutoAttack,
``autopgd_base.py``): the random start, the two-stage projected momentum step, the
checkpoint schedule, the oscillation/stall test and the restart from the best point
are all reproduced, with the per-example bookkeeping done by masks so that shapes are
fixed and each restart runs inside one ``jax.jit`` (between restarts the host only picks
the rows still to attack).

Every example is attacked on its own: its random starts come from its own key, and
restarts after the first run only on the examples still robust, gathered into a smaller
batch (see :func:`apgd`), so an example's result does not depend on the rest of its
batch.

The perturbed space is arbitrary (a generator latent, a concept representation, an
image): ``logits_fn`` maps a batch of points of that space to class logits, and the
box constraint ``[lower, upper]`` is optional.

Size: one algorithm in one file (~600 lines): the step, the checkpoint rule, the restart
bookkeeping and the compacted restart batches share the per-example state of a single jitted
loop; split apart, each piece would need the whole state to be read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import Partial

from cbcert.engine import compiler

NORMS = ("linf", "l2")
LOSSES = ("ce", "dlr")

MOMENTUM = 0.75  # alpha in the paper: weight of the new step vs the previous move
RHO = 0.75  # fraction of loss-increasing steps below which the step size is halved
INITIAL_STEP_FACTOR = 2.0  # eta^(0) = 2 eps
# Smallest batch a restart runs on. XLA's CPU kernels may round a row's results
# differently for a batch of 1 or 2 than for 4, 8 or 16 (so on the built-in world's
# networks), which would make an example's result depend on how many others are left.
MIN_RESTART_BATCH = 4
# The reference guards every normalisation and the DLR denominator with this constant.
_TINY = 1e-12


class APGDInfo(NamedTuple):
    """Per-example outcome of :func:`apgd`, every field of shape ``[B]``.

    loss: the attack loss (CE or DLR) at the returned point.
    fooled: ``argmax logits_fn(x_adv) != y`` (unless ``attack_all``, inputs misclassified
        before the attack count as fooled and are returned unchanged).
    perturbation_norm: ``||x_adv - x0||`` in the attack norm (max-abs for ``linf``,
        Euclidean for ``l2``), over all event axes.
    restarts: number of restarts that attacked the input (int32): restart ``r`` attacks
        exactly the inputs that restarts ``0..r-1`` did not fool; 0 for inputs
        misclassified at ``x0`` (unless ``attack_all``).
    prediction: ``argmax logits_fn(x_adv)`` (int32), from the same logits as ``loss`` and
        ``fooled`` (so ``fooled == (prediction != y)``).
    """

    loss: jax.Array
    fooled: jax.Array
    perturbation_norm: jax.Array
    restarts: jax.Array
    prediction: jax.Array


def checkpoint_schedule(n_iter: int) -> tuple[int, ...]:
    """Iteration counts ``w_j`` after which APGD checks its step size.

    The paper's schedule is ``w_j = ceil(p_j N)`` with ``p_0 = 0``, ``p_1 = 0.22`` and
    ``p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)``. The reference computes it in
    integers: a first window of ``max(int(0.22 N), 1)`` iterations, each next window
    ``max(int(0.03 N), 1)`` shorter, never shorter than ``max(int(0.06 N), 1)``. This
    function follows the reference; for ``N = 100`` both give
    ``(22, 41, 57, 70, 80, 87, 93, 99)``.

    Args:
      n_iter: number of iterations ``N`` (>= 1).

    Returns:
      Increasing checkpoint iteration counts, all ``<= n_iter``.
    """
    _check_positive_int("n_iter", n_iter)
    window = max(int(0.22 * n_iter), 1)
    min_window = max(int(0.06 * n_iter), 1)
    shrink = max(int(0.03 * n_iter), 1)
    checkpoints = []
    done = window
    while done <= n_iter:
        checkpoints.append(done)
        window = max(window - shrink, min_window)
        done += window
    return tuple(checkpoints)


def _checkpoint_tables(n_iter: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-iteration constants: is iteration i a checkpoint, and its window length.

    Returns ``(is_checkpoint[n_iter] bool, window[n_iter] float32)`` where
    ``window[i]`` is the number of iterations since the previous checkpoint when
    iteration ``i`` (0-based) ends one, 0 otherwise.
    """
    is_checkpoint = np.zeros(n_iter, dtype=bool)
    window = np.zeros(n_iter, dtype=np.float32)
    previous = 0
    for count in checkpoint_schedule(n_iter):
        is_checkpoint[count - 1] = True
        window[count - 1] = count - previous
        previous = count
    return is_checkpoint, window


def cross_entropy_loss(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Per-example cross-entropy ``-log softmax(logits)_y``: ``[B, C], [B] -> [B]``."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(log_probs, y[:, None], axis=-1)[:, 0]


def dlr_loss(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Per-example Difference-of-Logits-Ratio loss (Croce & Hein 2020, eq. 5).

    ``DLR(z, y) = -(z_y - max_{i != y} z_i) / (z_pi1 - z_pi3)`` where ``z_pi1 >= z_pi2 >=
    z_pi3`` are the sorted logits; it is invariant to shifts and rescaling of the
    logits. Positive exactly when the input is misclassified. Needs ``C >= 3``.

    Args:
      logits: ``[B, C]`` with ``C >= 3``.
      y: ``[B]`` integer labels.

    Returns:
      ``[B]`` loss values.
    """
    num_classes = logits.shape[-1]
    if num_classes < 3:
        raise ValueError(
            f"loss='dlr' needs at least 3 classes, got logits with C={num_classes}; use loss='ce'"
        )
    onehot = jax.nn.one_hot(y, num_classes, dtype=bool)
    z_y = jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)
    z_other = jnp.max(jnp.where(onehot, -jnp.inf, logits), axis=-1)
    sorted_logits = jnp.sort(logits, axis=-1)
    scale = sorted_logits[:, -1] - sorted_logits[:, -3] + _TINY
    return -(z_y - z_other) / scale


_LOSS_FNS = {"ce": cross_entropy_loss, "dlr": dlr_loss}


def _per_example(values: jax.Array, ndim: int) -> jax.Array:
    """Reshape ``[B]`` to ``[B, 1, ..., 1]`` so it broadcasts over ``ndim - 1`` event axes."""
    return values.reshape(values.shape + (1,) * (ndim - 1))


def _norm(v: jax.Array, norm: str) -> jax.Array:
    """Per-example norm over all event axes: ``[B, *event] -> [B]``."""
    flat = v.reshape(v.shape[0], -1)
    if norm == "linf":
        return jnp.max(jnp.abs(flat), axis=-1)
    return jnp.sqrt(jnp.sum(flat**2, axis=-1))


def _normalize(v: jax.Array, norm: str) -> jax.Array:
    """``v / (||v|| + 1e-12)`` per example, as the reference normalises (zero stays zero)."""
    return v / _per_example(_norm(v, norm) + _TINY, v.ndim)


def _clip_box(x, lower, upper):
    """Clip to the optional box ``[lower, upper]`` (``None`` = unbounded side)."""
    if lower is None and upper is None:
        return x
    return jnp.clip(x, lower, upper)


def _project(x, x0, eps, norm, lower, upper):
    """Project ``x[B, *event]`` onto the ``eps``-ball around ``x0``, then onto the box.

    L2 rescales the perturbation radially, ``x0 + d/(||d|| + 1e-12) * min(eps, ||d||)``,
    exactly as the reference does. Clipping to a box that contains ``x0`` afterwards
    only shrinks each coordinate of the perturbation, so the result stays in the ball.
    """
    if norm == "linf":
        ball = jnp.clip(x, x0 - eps, x0 + eps)
    else:
        delta = x - x0
        radius = jnp.minimum(eps, _norm(delta, "l2"))
        ball = x0 + _normalize(delta, "l2") * _per_example(radius, x.ndim)
    return _clip_box(ball, lower, upper)


def _random_start(keys, x0, eps, norm, lower, upper):
    """Reference random start: a point on the ``eps``-sphere of the attack norm.

    L-inf: ``u ~ U[-1, 1]^d`` rescaled to max-abs ``eps``; L2: ``u ~ N(0, I)`` rescaled
    to Euclidean norm ``eps``. Then clipped to the box. Example ``i`` draws ``u`` from
    ``keys[i]`` alone. Coordinates the box pins (``lower == upper``, e.g. a conditional
    generator's class position) get no component, so the start is on the sphere of the
    free coordinates.
    """
    event = x0.shape[1:]
    if norm == "linf":
        draw = lambda k: jax.random.uniform(k, event, x0.dtype, minval=-1.0, maxval=1.0)
    else:
        draw = lambda k: jax.random.normal(k, event, x0.dtype)
    direction = jax.vmap(draw)(keys)  # [B, *event]
    if lower is not None and upper is not None:
        direction = jnp.where(lower == upper, 0.0, direction)
    return _clip_box(x0 + eps * _normalize(direction, norm), lower, upper)


def _momentum_step(x, x_prev, grad, step_size, momentum, x0, eps, norm, lower, upper):
    """One APGD update (Croce & Hein 2020, eq. 2), for the whole batch.

    ``z = P(x + eta * s(grad))`` with ``s = sign`` (L-inf) or ``grad/||grad||`` (L2), then
    ``x_new = P(x + a (z - x) + (1 - a)(x - x_prev))`` with ``a = momentum``.

    Shapes: ``x, x_prev, grad, x0 [B, *event]``; ``step_size [B]``; ``momentum`` scalar.
    """
    direction = jnp.sign(grad) if norm == "linf" else _normalize(grad, "l2")
    z = _project(x + _per_example(step_size, x.ndim) * direction, x0, eps, norm, lower, upper)
    moved = x + (z - x) * momentum + (x - x_prev) * (1.0 - momentum)
    return _project(moved, x0, eps, norm, lower, upper)


class _RunState(NamedTuple):
    """Per-example state of one APGD run (``B`` leading axis everywhere)."""

    x: jax.Array  # current iterate [B, *event]
    x_prev: jax.Array  # iterate before the last step, for the momentum term
    grad: jax.Array  # loss gradient at x
    x_best: jax.Array  # highest-loss iterate so far
    grad_best: jax.Array
    loss_best: jax.Array  # [B]
    correct_best: jax.Array  # [B] bool: x_best is classified correctly
    x_found: jax.Array  # last misclassified iterate (valid only where ~robust)
    robust: jax.Array  # [B] bool: no iterate misclassified yet
    step_size: jax.Array  # [B]
    loss_prev: jax.Array  # [B] loss of the previous iterate
    n_increase: jax.Array  # [B] loss increases since the last checkpoint
    loss_best_at_check: jax.Array  # [B]
    reduced_at_check: jax.Array  # [B] bool: step size halved at the last checkpoint


def _run_parts(loss_and_grad, x0, y, eps, x_start, norm, n_iter, lower, upper):
    """``(placeholder, body)`` of one APGD run from ``x_start[B, *event]``: ``body(i, s)`` is
    pass ``i`` of ``n_iter + 1`` (pass 0 evaluates the start point, pass ``i >= 1`` takes
    step ``i``), so the loss and its gradient are computed at one place in the program rather
    than twice (start and steps), which halves what XLA compiles for the classifier's
    backward pass; ``placeholder`` has the state's shapes and dtypes (pass 0 overwrites it).
    """
    is_checkpoint, window = _checkpoint_tables(n_iter)
    batch = x0.shape[0]

    def start_state(loss, logits, grad) -> _RunState:
        correct = jnp.argmax(logits, axis=-1) == y
        return _RunState(
            x=x_start,
            x_prev=x_start,
            grad=grad,
            x_best=x_start,
            grad_best=grad,
            loss_best=loss,
            correct_best=correct,
            x_found=x_start,
            robust=correct,
            step_size=jnp.full((batch,), INITIAL_STEP_FACTOR, x0.dtype) * eps,
            # The reference compares the first iterate's loss with an all-zero history
            # buffer, not with the loss at the start point; kept for faithfulness.
            loss_prev=jnp.zeros_like(loss),
            n_increase=jnp.zeros((batch,), jnp.int32),
            loss_best_at_check=loss,
            # "Reduced at the previous checkpoint" starts true so that the stall test
            # cannot fire at the first checkpoint, as in the reference.
            reduced_at_check=jnp.ones((batch,), bool),
        )

    def step_state(i, s: _RunState, x_new, loss, logits, grad) -> _RunState:
        """The state after step ``i`` (0-based) moved ``s.x`` to ``x_new``."""
        correct = jnp.argmax(logits, axis=-1) == y
        expand = lambda m: _per_example(m, x0.ndim)
        improved = loss > s.loss_best
        x_best = jnp.where(expand(improved), x_new, s.x_best)
        grad_best = jnp.where(expand(improved), grad, s.grad_best)
        loss_best = jnp.where(improved, loss, s.loss_best)
        n_increase = s.n_increase + (loss > s.loss_prev).astype(jnp.int32)

        at_check = jnp.asarray(is_checkpoint)[i]
        oscillating = n_increase <= jnp.asarray(window)[i] * RHO
        stalled = ~s.reduced_at_check & (s.loss_best_at_check >= loss_best)
        halve = oscillating | stalled
        back_to_best = at_check & halve
        return _RunState(
            x=jnp.where(expand(back_to_best), x_best, x_new),
            x_prev=s.x,
            grad=jnp.where(expand(back_to_best), grad_best, grad),
            x_best=x_best,
            grad_best=grad_best,
            loss_best=loss_best,
            correct_best=jnp.where(improved, correct, s.correct_best),
            x_found=jnp.where(expand(~correct), x_new, s.x_found),
            robust=s.robust & correct,
            step_size=jnp.where(back_to_best, s.step_size / 2.0, s.step_size),
            loss_prev=loss,
            n_increase=jnp.where(at_check, 0, n_increase),
            loss_best_at_check=jnp.where(at_check, loss_best, s.loss_best_at_check),
            reduced_at_check=jnp.where(at_check, halve, s.reduced_at_check),
        )

    def body(i, s: _RunState) -> _RunState:
        step = jnp.maximum(i - 1, 0)  # 0-based step of pass i >= 1
        momentum = jnp.where(step > 0, MOMENTUM, 1.0).astype(x0.dtype)
        x_step = _momentum_step(
            s.x, s.x_prev, s.grad, s.step_size, momentum, x0, eps, norm, lower, upper
        )
        x_new = jnp.where(i == 0, x_start, x_step)
        (loss, logits), grad = loss_and_grad(x_new)
        first, later = start_state(loss, logits, grad), step_state(step, s, x_new, loss, logits,
                                                                    grad)
        return jax.tree.map(lambda a, b: jnp.where(i == 0, a, b), first, later)

    # Pass 0 overwrites every field; the placeholder only fixes shapes and dtypes.
    zeros = lambda shape: jnp.zeros(shape.shape, shape.dtype)
    (loss0, logits0), grad0 = jax.tree.map(zeros, jax.eval_shape(loss_and_grad, x_start))
    placeholder = start_state(loss0, logits0, grad0)
    return placeholder, body


class _Best(NamedTuple):
    """What the restarts keep per example (``B`` leading axis everywhere)."""

    robust: jax.Array  # [B] bool: attack this example in the next restart
    x_adv: jax.Array  # first misclassified iterate found (base mode, where ~robust)
    x_best: jax.Array  # highest-loss iterate over the restarts so far
    loss_best: jax.Array  # [B]
    restarts: jax.Array  # [B] int32: restarts that attacked the example


def _merge(best: _Best, run: _RunState, active: jax.Array, attack_all: bool) -> _Best:
    """Fold one run into ``best`` for the ``active`` examples; the others keep theirs.

    Base mode follows the reference: the first restart that fools an example wins and the
    example is not attacked again. With ``attack_all`` the highest-loss point is kept and an
    example is attacked again while the attacked function classifies that point correctly.
    """
    expand = lambda m: _per_example(m, best.x_best.ndim)
    better = active & (run.loss_best > best.loss_best)
    if attack_all:
        robust = jnp.where(better, run.correct_best, best.robust)
        x_adv = best.x_adv
    else:
        newly_fooled = active & ~run.robust
        robust = best.robust & ~newly_fooled
        x_adv = jnp.where(expand(newly_fooled), run.x_found, best.x_adv)
    return _Best(
        robust=robust,
        x_adv=x_adv,
        x_best=jnp.where(expand(better), run.x_best, best.x_best),
        loss_best=jnp.where(better, run.loss_best, best.loss_best),
        restarts=best.restarts + active.astype(jnp.int32),
    )


def _restart_sizes(batch: int) -> tuple[int, ...]:
    """Batch sizes a restart may run on: powers of two from ``MIN_RESTART_BATCH``, and ``B``."""
    sizes, size = [], MIN_RESTART_BATCH
    while size < batch:
        sizes.append(size)
        size *= 2
    return (*sizes, batch)


def _bound_rows(bound, rows, x0_ndim, batch):
    """Rows of a box bound broadcastable to ``x0`` (a bound without a batch axis as is)."""
    if bound is None or bound.ndim < x0_ndim or bound.shape[0] != batch:
        return bound
    return bound[rows]


def _clean(logits_fn, x0, y, *, loss):
    """Jitted: ``argmax logits_fn(x0) == y`` (``[B]`` bool), with the shape checks at trace time."""
    clean_logits = logits_fn(x0)
    batch = x0.shape[0]
    if clean_logits.ndim != 2 or clean_logits.shape[0] != batch:
        raise ValueError(
            f"logits_fn must map x0 of shape {x0.shape} to logits [B={batch}, C], "
            f"got shape {clean_logits.shape}"
        )
    _LOSS_FNS[loss](clean_logits, y)  # shape checks (DLR class count) at trace time
    return jnp.argmax(clean_logits, axis=-1) == y


def _restart_rows(logits_fn, x0, y, lower, upper, rows, loss):
    """The rows ``rows[S]`` of a restart: ``(loss_and_grad, x0[rows], y[rows], lower, upper)``,
    ``loss_and_grad(x) -> ((per-example loss [S], logits [S, C]), gradient)``."""
    loss_fn = _LOSS_FNS[loss]
    batch = x0.shape[0]
    y_r = y[rows]
    take = getattr(logits_fn, "take_rows", None)
    fn = logits_fn if take is None else take(rows)

    def total_loss(x):
        logits = fn(x)
        per_example = loss_fn(logits, y_r)
        return jnp.sum(per_example), (per_example, logits)

    grad_fn = jax.grad(total_loss, has_aux=True)

    def loss_and_grad(x):
        grad, aux = grad_fn(x)
        return aux, grad

    return (loss_and_grad, x0[rows], y_r, _bound_rows(lower, rows, x0.ndim, batch),
            _bound_rows(upper, rows, x0.ndim, batch))


def _restart_start(logits_fn, x0, y, eps, keys, r, lower, upper, rows, *, norm, n_iter, loss):
    """Jitted: restart ``r``'s random start on the rows ``rows[S]`` and the placeholder
    state its pass 0 overwrites."""
    loss_and_grad, x0_r, y_r, lower_r, upper_r = _restart_rows(logits_fn, x0, y, lower, upper,
                                                               rows, loss)
    restart_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys[rows], r)
    x_start = _random_start(restart_keys, x0_r, eps, norm, lower_r, upper_r)
    placeholder, _ = _run_parts(loss_and_grad, x0_r, y_r, eps, x_start, norm, n_iter, lower_r,
                                upper_r)
    return x_start, placeholder


def _restart_pass(logits_fn, x0, y, eps, lower, upper, rows, x_start, i, state, *, norm,
                  n_iter, loss):
    """Jitted: pass ``i`` (traced) of a restart on the rows ``rows[S]``: one loss and gradient
    of ``logits_fn`` and the state update (`_run_parts`)."""
    loss_and_grad, x0_r, y_r, lower_r, upper_r = _restart_rows(logits_fn, x0, y, lower, upper,
                                                               rows, loss)
    _, body = _run_parts(loss_and_grad, x0_r, y_r, eps, x_start, norm, n_iter, lower_r,
                         upper_r)
    return body(i, state)


def _restart_merge(best, run, rows, valid, *, attack_all):
    """Jitted: a restart's final state ``run`` on the rows ``rows[S]`` folded into ``best``
    (``valid[S]`` marks the slots that hold an example to attack)."""
    batch = best.robust.shape[0]
    merged = _merge(jax.tree.map(lambda v: v[rows], best), run, valid, attack_all)
    # Out-of-range indices (padding slots) are dropped by the scatter.
    target = jnp.where(valid, rows, batch)
    return jax.tree.map(lambda v, m: v.at[target].set(m, mode="drop"), best, merged)


def _restart(
    logits_fn, x0, y, eps, keys, r, lower, upper, best, rows, valid,
    *, norm, n_iter, loss, attack_all
):
    """Restart ``r`` of APGD on the rows ``rows[S]`` of the batch, folded into ``best``.

    ``valid[S]`` marks the slots that hold an example to attack; the others repeat a valid row
    and their results are dropped. The first run is the call with ``rows = arange(B)`` and
    ``valid`` = the examples to attack, so a restart on the whole batch runs the same programs.
    Each of the ``n_iter + 1`` passes is its own call of one jitted program (`_restart_pass`,
    one compilation per slot count ``S``; ``r``, ``i`` and every value are traced), driven from
    the host: XLA:CPU runs a network's gradient slower inside a ``while`` loop than as a
    top-level program (the built-in world's at batch 32: 118 against 528 samples/s, 4.5x;
    ResNet-18 at 64 px, batch 16: 136 against 189; forward passes alone showed no
    difference; jax 0.10.2, 2026-12-05), and a call costs well under a millisecond against
    tens for a pass. Called with traced arguments (``apgd`` inside ``jax.jit``), the same three
    pieces are traced in place, the passes in one ``fori_loop``.
    """
    static = dict(norm=norm, n_iter=n_iter, loss=loss)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(
            (logits_fn, x0, y, eps, keys, r, lower, upper, best, rows, valid))):
        x_start, state = _restart_start(logits_fn, x0, y, eps, keys, r, lower, upper, rows,
                                        **static)
        state = jax.lax.fori_loop(
            0, n_iter + 1, lambda i, s: _restart_pass(logits_fn, x0, y, eps, lower, upper, rows,
                                                      x_start, i, s, **static), state)
        return _restart_merge(best, state, rows, valid, attack_all=attack_all)
    x_start, state = _start_jit(logits_fn, x0, y, eps, keys, r, lower, upper, rows, **static)
    for i in range(n_iter + 1):
        state = _pass_jit(logits_fn, x0, y, eps, lower, upper, rows, x_start, np.int32(i),
                          state, **static)
    return _merge_jit(best, state, rows, valid, attack_all=attack_all)


def _finish(logits_fn, x0, y, best, *, norm, loss, attack_all):
    """Jitted: the returned points and their :class:`APGDInfo` from the restarts' ``best``."""
    expand = lambda m: _per_example(m, x0.ndim)
    x_out = best.x_best if attack_all else jnp.where(expand(best.robust), best.x_best, best.x_adv)
    final_logits = logits_fn(x_out)
    prediction = jnp.argmax(final_logits, axis=-1).astype(jnp.int32)
    info = APGDInfo(
        loss=_LOSS_FNS[loss](final_logits, y),
        fooled=prediction != y,
        perturbation_norm=_norm(x_out - x0, norm),
        restarts=best.restarts,
        prediction=prediction,
    )
    return x_out, info


_clean_jit = compiler.jit(_clean, static_argnames=("loss",))
_start_jit = compiler.jit(_restart_start, static_argnames=("norm", "n_iter", "loss"))
_pass_jit = compiler.jit(_restart_pass, static_argnames=("norm", "n_iter", "loss"))
_merge_jit = compiler.jit(_restart_merge, static_argnames=("attack_all",))
_finish_jit = compiler.jit(_finish, static_argnames=("norm", "loss", "attack_all"))


def _attack(
    logits_fn, x0, y, eps, keys, lower, upper, *, norm, n_iter, n_restarts, loss, attack_all
):
    """:func:`apgd` after its checks: the restarts, each a host loop over jitted passes
    (`_restart`).

    Restart ``r >= 1`` runs on the still-robust examples only, gathered (on the host) into the
    smallest batch of ``_restart_sizes(B)`` that holds them, so only the sizes a call needs are
    compiled, and a restart on the whole batch reuses the first run's program.
    """
    batch = x0.shape[0]
    static = dict(norm=norm, n_iter=n_iter, loss=loss, attack_all=attack_all)
    clean_correct = _clean_jit(logits_fn, x0, y, loss=loss)
    robust = jnp.ones((batch,), bool) if attack_all else clean_correct
    best = _Best(
        robust=robust,
        x_adv=x0,
        x_best=x0,
        loss_best=jnp.full(y.shape, -jnp.inf, x0.dtype),
        restarts=jnp.zeros((batch,), jnp.int32),
    )
    # The first restart runs on the whole batch: nearly every example is still to attack.
    best = _restart(logits_fn, x0, y, eps, keys, np.int32(0), lower, upper, best,
                        np.arange(batch, dtype=np.int32), robust, **static)
    sizes = _restart_sizes(batch)
    for r in range(1, n_restarts):
        still = np.asarray(best.robust)
        n = int(still.sum())
        if n == 0:  # nothing left to attack, now or in any later restart
            break
        size = next(s for s in sizes if s >= n)
        order = np.argsort(~still, kind="stable")  # still-robust rows first
        slot = np.arange(size)
        rows = np.where(slot < n, order[:size], order[0]).astype(np.int32)
        best = _restart(logits_fn, x0, y, eps, keys, np.int32(r), lower, upper, best,
                            rows, slot < n, **static)
    return _finish_jit(logits_fn, x0, y, best, norm=norm, loss=loss, attack_all=attack_all)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_eps(eps) -> None:
    """Reject a non-positive concrete ``eps``; a traced ``eps`` cannot be checked here."""
    if isinstance(eps, jax.core.Tracer):
        return
    values = np.asarray(eps)
    if values.ndim != 0:
        raise ValueError(f"eps must be a scalar, got shape {values.shape}")
    if not np.isfinite(values) or values <= 0:
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")


def _example_keys(key, batch: int) -> jax.Array:
    """``[B]`` typed keys: ``key`` itself if it holds one per example, else ``fold_in(key, i)``."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # raw uint32[..., 2] keys
    if key.shape == ():
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(batch))
    if key.shape != (batch,):
        raise ValueError(
            f"key must be one PRNG key or one per example [B={batch}], got shape {key.shape}"
        )
    return key


def apgd(
    logits_fn: Callable[[jax.Array], jax.Array],
    x0: jax.Array,
    y: jax.Array,
    *,
    eps,
    norm: str,
    key: jax.Array,
    n_iter: int = 100,
    n_restarts: int = 1,
    loss: str = "ce",
    lower=None,
    upper=None,
    attack_all: bool = False,
) -> tuple[jax.Array, APGDInfo]:
    """Untargeted APGD attack (Croce & Hein, ICML 2020), L-inf or L2.

    Maximises ``loss(logits_fn(x), y)`` over ``||x - x0|| <= eps`` (and
    ``lower <= x <= upper`` when given) with Auto-PGD: momentum 0.75, initial step
    ``2 eps``, step size halved at the checkpoints of :func:`checkpoint_schedule` when
    at most ``0.75`` of the steps since the previous checkpoint increased the loss, or
    when neither the step size nor the best loss changed since it; after halving,
    the iterate restarts from the best point. Each of ``n_restarts`` runs starts from a
    fresh random point on the ``eps``-sphere, example ``i``'s from key
    ``fold_in(key_i, r)`` in restart ``r``. As in the reference, restart ``r >= 1``
    attacks only the examples still robust: they are gathered into a batch of the
    smallest size in ``4, 8, 16, ..., B`` that holds them (padding repeats one of them),
    and the restart is skipped when none is left; examples the attack has fooled keep
    their result.

    Example ``i``'s result depends only on ``x0[i]``, ``y[i]`` and ``key_i``, not on the
    rest of the batch, provided ``logits_fn`` treats rows independently (and the
    backend's arithmetic for a row does not depend on the batch size).

    Jitted programs per (``logits_fn``, shapes, ``norm``, ``n_iter``, ``loss``,
    ``attack_all``, presence of bounds): the clean prediction; a restart's start, its pass
    (one loss and gradient and the state update: the host calls it ``n_iter + 1`` times,
    since XLA:CPU runs gradients slower inside a ``while`` loop; `_restart`) and its
    merge into the best points; and the returned point's logits. ``eps``, ``key`` and the
    bounds' values are traced. Restarts ``r >= 1`` compile the restart's programs once more
    for each smaller batch size they need (a restart on the whole batch reuses the first
    run's). The host reads the
    still-robust mask between restarts, so ``apgd`` itself is called eagerly, not under
    ``jax.jit``. ``logits_fn`` is compared by identity, so define it once; arrays it should
    take as traced inputs can be bound with ``jax.tree_util.Partial(fn, *arrays)``.

    Args:
      logits_fn: pure function ``x[B, *event] -> logits[B, C]`` (generator and
        classifier composed; parameters closed over or bound with ``Partial``), row
        ``i`` of the output a function of row ``i`` of ``x`` only. A pytree that binds
        per-example arrays (like :func:`cbcert.attacks.smoothed.smoothed_logits_fn`'s
        noise keys) must define ``take_rows(rows[b]) -> logits_fn`` for the examples
        ``rows``, so that restarts can run on a subset.
      x0: ``[B, *event]`` clean points of the perturbed space.
      y: ``[B]`` integer labels to move away from.
      eps: radius of the ball, a scalar > 0.
      norm: ``'linf'`` or ``'l2'`` (over all event axes of each example).
      key: PRNG key for the random starts: one key (example ``i`` then uses
        ``key_i = fold_in(key, i)``, which depends on its position in the batch) or
        ``[B]`` keys, ``key_i = key[i]``.
      n_iter: iterations per restart (>= 1).
      n_restarts: number of random restarts (>= 1).
      loss: ``'ce'`` (cross-entropy, APGD-CE) or ``'dlr'`` (APGD-DLR, needs C >= 3).
      lower, upper: optional box bounds broadcastable to ``x0`` (``None`` = unbounded).
      attack_all: attack every example whatever ``logits_fn`` predicts, and return its
        highest-loss iterate; an example is attacked again in the next restart while
        ``logits_fn`` classifies that point correctly. For a ``logits_fn`` that only
        estimates the classifier finally judged (a smoothed classifier's EOT estimate),
        whose misclassification of ``x0`` or of an iterate proves nothing. False (the
        reference): examples misclassified at ``x0`` are returned unchanged, and a
        fooled example keeps the first misclassified iterate.

    Returns:
      ``(x_adv, info)``: ``x_adv[B, *event]`` is the first misclassified iterate found
      for fooled inputs and the highest-loss iterate for robust ones (``x0`` itself
      for inputs already misclassified), or the highest-loss iterate of every input
      with ``attack_all``; ``info`` is an :class:`APGDInfo`.
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    _check_positive_int("n_iter", n_iter)
    _check_positive_int("n_restarts", n_restarts)
    _check_eps(eps)
    x0 = jnp.asarray(x0)
    y = jnp.asarray(y)
    if x0.ndim < 2 or y.shape != x0.shape[:1]:
        raise ValueError(
            f"x0 must be [B, *event] with B >= 1 event axis and y [B]; "
            f"got x0 {x0.shape}, y {y.shape}"
        )
    if not jnp.issubdtype(y.dtype, jnp.integer):
        raise ValueError(f"y must hold integer labels, got dtype {y.dtype}")
    if n_restarts > 1 and any(isinstance(v, jax.core.Tracer) for v in (x0, y, eps, key)):
        raise ValueError(
            "apgd with n_restarts > 1 picks each restart's rows on the host: call it outside "
            "jax.jit / vmap (each restart is jitted inside)"
        )
    if not isinstance(logits_fn, Partial) and not hasattr(logits_fn, "take_rows"):
        logits_fn = Partial(logits_fn)
    keys = _example_keys(jnp.asarray(key), x0.shape[0])
    eps = jnp.asarray(eps, x0.dtype)
    bounds = tuple(None if b is None else jnp.asarray(b, x0.dtype) for b in (lower, upper))
    return _attack(
        logits_fn,
        x0,
        y,
        eps,
        keys,
        *bounds,
        norm=norm,
        n_iter=int(n_iter),
        n_restarts=int(n_restarts),
        loss=loss,
        attack_all=bool(attack_all),
    )
