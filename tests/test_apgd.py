"""Tests for cbcert.attacks.apgd (APGD-CE / APGD-DLR)."""

import collections
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbcert.attacks import apgd as apgd_lib
from cbcert.attacks.apgd import apgd, checkpoint_schedule, dlr_loss

# float32 rounding of x0 + delta - x0: a few ulps of the coordinates (|x| <~ 4).
BALL_RTOL = 1e-6
BALL_ATOL = 2e-6


def _mlp(seed, d_in=8, hidden=32, classes=5):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    w1 = jax.random.normal(k1, (d_in, hidden)) / math.sqrt(d_in)
    w2 = jax.random.normal(k2, (hidden, classes)) / math.sqrt(hidden)
    b2 = 0.1 * jax.random.normal(k3, (classes,))
    return lambda x: jnp.tanh(x @ w1) @ w2 + b2


def _inputs(logits_fn, seed, n=48, d_in=8):
    x = jax.random.normal(jax.random.key(seed), (n, d_in))
    return x, jnp.argmax(logits_fn(x), axis=-1)


MLP = _mlp(0)
X, Y = _inputs(MLP, 1)


def _paper_schedule(n_iter):
    """w_j = ceil(p_j N) from the paper's recursion (rounded to kill float noise)."""
    p = [0.0, 0.22]
    while p[-1] + max(p[-1] - p[-2] - 0.03, 0.06) <= 1.0:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    return tuple(math.ceil(round(pj * n_iter, 9)) for pj in p[1:])


def test_checkpoint_schedule_matches_paper_and_reference_for_100_iterations():
    expected = (22, 41, 57, 70, 80, 87, 93, 99)  # the reference's checkpoints
    assert checkpoint_schedule(100) == expected
    assert _paper_schedule(100) == expected


def test_checkpoint_schedule_small_n_iter():
    # Windows of max(int(0.22 N), 1) = 1 iteration, shrinking to at least 1.
    assert checkpoint_schedule(1) == (1,)
    assert checkpoint_schedule(10) == (2, 3, 4, 5, 6, 7, 8, 9, 10)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_perturbation_stays_in_ball_and_box(norm):
    lower, upper = -1.5, 1.5
    x0 = jnp.clip(X, lower, upper)
    for eps in (0.05, 0.5, 2.0):
        x_adv, info = apgd(
            MLP,
            x0,
            Y,
            eps=eps,
            norm=norm,
            key=jax.random.key(2),
            n_iter=30,
            n_restarts=2,
            lower=lower,
            upper=upper,
        )
        delta = np.asarray(x_adv - x0)
        norms = np.abs(delta).max(axis=1) if norm == "linf" else np.linalg.norm(delta, axis=1)
        assert np.all(norms <= eps * (1 + BALL_RTOL) + BALL_ATOL)
        np.testing.assert_allclose(info.perturbation_norm, norms, rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(x_adv) >= lower) and np.all(np.asarray(x_adv) <= upper)
        # The attack works at all: something is fooled at the largest radius.
    assert info.fooled.mean() > 0.5


def _linear_binary(seed, d_in=6):
    w = jax.random.normal(jax.random.key(seed), (d_in, 2))
    b = jnp.array([0.3, -0.3])
    return w, b, (lambda x: x @ w + b)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_linear_model_reaches_closed_form_minimal_margin(norm):
    # Two-class linear model: CE grows as the margin m(x) = (w_y - w_o).x + b_y - b_o
    # shrinks, and min_{||d|| <= eps} m(x0 + d) = m(x0) - eps ||w_y - w_o||_* (dual
    # norm: L1 for linf, L2 for l2), reached at d = -eps sign(w_diff) or
    # d = -eps w_diff / ||w_diff||.
    w, b, f = _linear_binary(3)
    x0 = jax.random.normal(jax.random.key(4), (64, 6))
    y = jnp.argmax(f(x0), axis=-1)
    w_diff = jnp.where(y[:, None] == 0, (w[:, 0] - w[:, 1])[None], (w[:, 1] - w[:, 0])[None])
    b_diff = jnp.where(y == 0, b[0] - b[1], b[1] - b[0])
    margin0 = jnp.sum(x0 * w_diff, axis=1) + b_diff
    dual = jnp.sum(jnp.abs(w_diff), 1) if norm == "linf" else jnp.linalg.norm(w_diff, axis=1)
    eps = 0.2
    x_adv, info = apgd(f, x0, y, eps=eps, norm=norm, key=jax.random.key(5))
    margin_adv = jnp.sum(x_adv * w_diff, axis=1) + b_diff
    expected = margin0 - eps * dual
    robust = np.asarray(expected > 1e-3)
    fooled_expected = np.asarray(expected < -1e-3)
    # Above a margin of ~6 the float32 CE (< 3e-3) no longer resolves the last digits
    # of the margin, so the best-loss point is checked where the loss is informative.
    resolved = robust & np.asarray(expected < 6.0)
    assert resolved.sum() > 10 and fooled_expected.sum() > 10  # both regimes exercised
    # Robust inputs: the returned best-loss point attains the minimal margin.
    np.testing.assert_allclose(margin_adv[resolved], expected[resolved], rtol=0, atol=1e-4)
    # Exactly the inputs whose minimal margin is negative are fooled.
    np.testing.assert_array_equal(np.asarray(info.fooled)[robust], False)
    np.testing.assert_array_equal(np.asarray(info.fooled)[fooled_expected], True)
    if norm == "l2":
        # The margin gap is eps ||w_diff|| (1 - cos), so a 1e-4 gap allows 1 - cos ~ 2e-4.
        direction = (x_adv - x0)[resolved] / eps
        cosine = jnp.sum(direction * -w_diff[resolved], axis=1) / dual[resolved]
        assert float(cosine.min()) > 0.999


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_robust_accuracy_non_increasing_in_eps(norm):
    scale = 1.0 if norm == "linf" else 2.5
    accuracies = []
    for eps in (0.0125, 0.025, 0.05, 0.1, 0.2, 0.4):
        _, info = apgd(MLP, X, Y, eps=eps * scale, norm=norm, key=jax.random.key(6), n_iter=50)
        accuracies.append(float(1.0 - info.fooled.mean()))
    assert accuracies[0] > 0.8 and accuracies[-1] < 0.2, accuracies
    assert all(a >= b for a, b in itertools.pairwise(accuracies)), accuracies


def test_more_restarts_fool_a_superset():
    # Restart 0 uses fold_in(key, 0) whatever n_restarts, so later restarts can only add.
    kwargs = dict(eps=0.05, norm="linf", key=jax.random.key(7), n_iter=20)
    _, one = apgd(MLP, X, Y, n_restarts=1, **kwargs)
    _, four = apgd(MLP, X, Y, n_restarts=4, **kwargs)
    assert np.all(np.asarray(four.fooled) >= np.asarray(one.fooled))
    assert np.all(np.asarray(four.loss)[~np.asarray(four.fooled)] >= -1e-6)


def test_results_follow_the_example_key_not_the_batch():
    # Per-example keys: permuting the batch (and its keys) permutes the results exactly,
    # and a single key is the batch of keys fold_in(key, i).
    keys = jax.random.split(jax.random.key(20), 48)
    perm = np.random.default_rng(0).permutation(48)
    kwargs = dict(eps=0.1, norm="l2", n_iter=10, n_restarts=2)
    x_adv, info = apgd(MLP, X, Y, key=keys, **kwargs)
    x_perm, info_perm = apgd(MLP, X[perm], Y[perm], key=keys[perm], **kwargs)
    np.testing.assert_array_equal(x_perm, np.asarray(x_adv)[perm])
    for field in info._fields:
        np.testing.assert_array_equal(getattr(info_perm, field), getattr(info, field)[perm])
    assert 0 < info.fooled.sum() < 48  # both outcomes present
    key = jax.random.key(21)
    folded = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(48))
    np.testing.assert_array_equal(
        apgd(MLP, X, Y, key=key, **kwargs)[0], apgd(MLP, X, Y, key=folded, **kwargs)[0]
    )


def test_restarts_attack_only_the_inputs_still_robust():
    # n_iter = 1 keeps the attack weak, so restart 1 fools one more input on this seed.
    kwargs = dict(eps=0.3, norm="linf", key=jax.random.key(7), n_iter=1)
    runs = [apgd(MLP, X, Y, n_restarts=n, **kwargs) for n in (1, 2)]
    rows = []

    def counted(x):
        jax.debug.callback(lambda n: rows.append(int(n)), x.shape[0])  # rows of this call
        return MLP(x)

    x_adv, info = apgd(counted, X, Y, n_restarts=3, **kwargs)
    jax.effects_barrier()
    # Robust before restart r: all inputs (Y is the clean prediction), then those the
    # first r restarts did not fool (restart r uses fold_in(key_i, r) whatever n_restarts).
    still_robust = [np.ones(48, bool)] + [~np.asarray(run.fooled) for _, run in runs]
    counts = [int(s.sum()) for s in still_robust]
    assert counts[0] > counts[1] > counts[2] > 0, counts  # every restart has work
    restarts = np.asarray(info.restarts)
    for r, robust in enumerate(still_robust):
        np.testing.assert_array_equal(restarts > r, robust)
    # Restarts 1 and 2 run on the smallest of 4, 8, ..., 48 rows holding their inputs;
    # each run evaluates logits_fn at the start and after each of its n_iter steps.
    bucket = lambda n: min(s for s in (4, 8, 16, 32, 48) if s >= n)
    expected = collections.Counter({48: 1 + 2 + 1})  # clean, restart 0, returned point
    for n in counts[1:]:
        expected[bucket(n)] += 2
    assert collections.Counter(rows) == expected
    # Inputs fooled by restart 0 keep its result.
    fooled = ~still_robust[1]
    np.testing.assert_array_equal(np.asarray(x_adv)[fooled], np.asarray(runs[0][0])[fooled])
    np.testing.assert_array_equal(
        np.asarray(info.loss)[fooled], np.asarray(runs[0][1].loss)[fooled]
    )


def _boundary_case():
    # f(x) = [0, x_0 - 0.2]: class 0 left of x_0 = 0.2; the first two inputs start on
    # the wrong side (label 0, x_0 > 0.2), the last two on the right one.
    f = lambda x: jnp.stack([jnp.zeros_like(x[:, 0]), 10.0 * (x[:, 0] - 0.2)], axis=-1)
    x0 = jnp.array([[0.3, 0.0], [0.5, 1.0], [0.0, 0.0], [-1.0, 0.0]])
    return f, x0, jnp.zeros(4, jnp.int32)


def test_attack_all_attacks_inputs_misclassified_at_x0():
    f, x0, y = _boundary_case()
    kwargs = dict(eps=0.5, norm="l2", key=jax.random.key(22), n_iter=20, n_restarts=2)
    x_ref, info_ref = apgd(f, x0, y, **kwargs)
    np.testing.assert_array_equal(x_ref[:2], x0[:2])  # the reference: left unchanged
    np.testing.assert_array_equal(info_ref.restarts, [0, 0, 1, 2])
    x_adv, info = apgd(f, x0, y, attack_all=True, **kwargs)
    # Every input moves towards its highest-loss point x0 + eps e_0 (the loss grows with
    # x_0 and ignores x_1); 20 L2 steps reach it to ~1e-4 (1 - cos ~ 1e-5 in direction).
    np.testing.assert_allclose(x_adv[:, 0], x0[:, 0] + 0.5, atol=1e-4)
    np.testing.assert_array_equal(info.fooled, [True, True, True, False])
    # The prediction at the returned point, from the logits "fooled" and "loss" come from.
    np.testing.assert_array_equal(info.prediction, [1, 1, 1, 0])
    np.testing.assert_array_equal(info.prediction, np.argmax(f(x_adv), axis=-1))
    assert info.prediction.dtype == jnp.int32
    # Restart 1 re-attacks only the input whose best point is still classified correctly.
    np.testing.assert_array_equal(info.restarts, [1, 1, 1, 2])


def test_misclassified_inputs_are_returned_unchanged():
    y_wrong = (Y + 1) % 5
    x_adv, info = apgd(MLP, X, y_wrong, eps=0.3, norm="l2", key=jax.random.key(8), n_iter=5)
    np.testing.assert_array_equal(x_adv, X)
    assert bool(info.fooled.all())
    np.testing.assert_array_equal(info.perturbation_norm, 0.0)


def test_single_compile_per_configuration():
    # eps, keys and the bounds' values are traced: a later call compiles only for a restart
    # batch size that no earlier call needed (restart r >= 1 runs on the smallest of 4, 8, ...,
    # B rows that holds the inputs still robust, each size compiled when first needed).
    traces = []

    def counted(x):
        traces.append(x.shape[0])
        return MLP(x)

    kwargs = dict(norm="l2", n_iter=10, n_restarts=2, lower=-3.0, upper=3.0)
    apgd(counted, X, Y, eps=0.1, key=jax.random.key(0), **kwargs)
    seen = set(traces)
    assert len(seen) > 0
    for eps, key, x0, box in ((0.7, 1, X, 3.0), (0.2, 2, X + 0.1, 4.0)):
        before = len(traces)
        apgd(counted, x0, Y, eps=eps, key=jax.random.key(key),
             **{**kwargs, "lower": -box, "upper": box})
        assert not seen & set(traces[before:]), (seen, traces[before:])
        seen |= set(traces[before:])
    assert X.shape[0] in seen


def test_linf_step_size_halves_at_every_checkpoint_when_loss_is_flat():
    # Linear model, L-inf: the first sign step lands on the loss-maximising corner of
    # the ball and every later iterate stays there, so no step after the first
    # increases the loss and each of the 8 checkpoints of N = 100 halves eta.
    w, b, f = _linear_binary(9)
    x0 = jax.random.normal(jax.random.key(10), (16, 6))
    y = jnp.argmax(f(x0), axis=-1)

    def loss_and_grad(x):
        def total(z):
            per = apgd_lib.cross_entropy_loss(f(z), y)
            return per.sum(), (per, f(z))

        grad, aux = jax.grad(total, has_aux=True)(x)
        return aux, grad

    def run_fn(keys):  # one run of N = 100 steps from a random start, as one loop
        eps = jnp.float32(0.1)
        x_start = apgd_lib._random_start(keys, x0, eps, "linf", None, None)
        placeholder, body = apgd_lib._run_parts(loss_and_grad, x0, y, eps, x_start, "linf",
                                                100, None, None)
        return jax.lax.fori_loop(0, 101, body, placeholder)

    run_fn = jax.jit(run_fn)
    run = run_fn(jax.random.split(jax.random.key(11), 16))
    np.testing.assert_allclose(run.step_size, 2 * 0.1 / 2**8, rtol=1e-6)


def test_dlr_loss_sign_and_invariance():
    logits = jnp.array([[3.0, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, -1.0]])
    y = jnp.array([0, 0])
    loss = dlr_loss(logits, y)
    np.testing.assert_allclose(loss, [-(3 - 1) / (3 - 0), (2 - 0) / (2 - 0)], rtol=1e-6)
    np.testing.assert_allclose(dlr_loss(4.0 * logits + 7.0, y), loss, rtol=1e-5)


def test_apgd_dlr_runs_and_fools():
    _, info = apgd(MLP, X, Y, eps=0.4, norm="linf", key=jax.random.key(12), loss="dlr", n_iter=30)
    assert info.fooled.mean() > 0.8
    # DLR is positive exactly on misclassified points.
    np.testing.assert_array_equal(np.asarray(info.loss) > 0, np.asarray(info.fooled))


def test_dlr_needs_three_classes():
    _, _, f = _linear_binary(13)
    x0 = jnp.zeros((4, 6))
    with pytest.raises(ValueError, match="at least 3 classes"):
        apgd(f, x0, jnp.zeros(4, jnp.int32), eps=0.1, norm="l2", key=jax.random.key(0), loss="dlr")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(eps=0.0), "eps must be a finite number > 0"),
        (dict(eps=-0.1), "eps must be a finite number > 0"),
        (dict(eps=float("nan")), "eps must be a finite number > 0"),
        (dict(n_iter=0), "n_iter must be an integer >= 1"),
        (dict(n_restarts=0), "n_restarts must be an integer >= 1"),
        (dict(norm="l1"), r"norm must be one of \('linf', 'l2'\)"),
        (dict(loss="hinge"), r"loss must be one of \('ce', 'dlr'\)"),
    ],
)
def test_invalid_arguments(kwargs, match):
    args = dict(eps=0.1, norm="linf", key=jax.random.key(0))
    with pytest.raises(ValueError, match=match):
        apgd(MLP, X, Y, **{**args, **kwargs})


def test_key_shape_mismatch():
    with pytest.raises(ValueError, match=r"key must be one PRNG key or one per example \[B=48\]"):
        apgd(MLP, X, Y, eps=0.1, norm="linf", key=jax.random.split(jax.random.key(0), 3))


def test_label_shape_mismatch():
    with pytest.raises(ValueError, match="x0 must be"):
        apgd(MLP, X, Y[:3], eps=0.1, norm="linf", key=jax.random.key(0))


def test_restarts_under_jit_are_refused_with_a_clear_error():
    # Restarts r >= 1 gather the still-robust rows on the host; one run needs no host read.
    attack = lambda x, n: apgd(MLP, x, Y, eps=0.1, norm="l2", key=jax.random.key(0), n_iter=2,
                               n_restarts=n)[0]
    with pytest.raises(ValueError, match="n_restarts > 1 .* outside jax.jit"):
        jax.jit(lambda x: attack(x, 2))(X)
    # One program inlining the three: the same attack up to float32 rounding.
    np.testing.assert_allclose(jax.jit(lambda x: attack(x, 1))(X), attack(X, 1), atol=1e-5)
