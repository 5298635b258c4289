"""The public Python API (`cbcert.api`, exported from `cbcert`): doctests, results against the
certificate kernels, and identity with the CLI's records on the same settings."""

import doctest
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

import cbcert
import cbcert.api
import cbcert.worlds.load
from cbcert.certify.cohen import certify_counts, predict_counts
from cbcert.certify.l2 import L2Radius
from cbcert.certify.schedule import Schedule
from cbcert.cli import main
from cbcert.engine.keys import Stream
from cbcert.engine.validity import NonFiniteError
from cbcert.runs.directory import RECORDS
from cbcert.runs.pool import agreement_pool, space_inputs
from cbcert.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
API_PAGE = ROOT / "docs" / "api.md"


def test_module_doctests_run():
    for module in (cbcert.api, cbcert.worlds.load):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_api_page_runs_as_a_doctest():
    """The Python API page is a doctest (every ``>>>`` line in docs/api.md)."""
    assert API_PAGE.read_text().count(">>> ") >= 5
    result = doctest.testfile(str(API_PAGE), module_relative=False)
    assert result.attempted >= 5 and result.failed == 0


def test_readme_api_example_runs_as_a_doctest():
    """The README's ten-line API example is a doctest (every ``>>>`` line in README.md)."""
    assert README.read_text().count(">>> ") >= 5
    result = doctest.testfile(str(README), module_relative=False)
    assert result.attempted >= 5 and result.failed == 0


def test_public_names_are_exported():
    for name in ("smooth", "gaussian", "bernoulli", "fixed_flips", "load_world",
                 "load_converted", "ABSTAIN", "Smoothed", "Noise"):
        assert name in dir(cbcert) and getattr(cbcert, name) is not None
    assert cbcert.ABSTAIN == -1
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cbcert.nope  # noqa: B018


def _linear(params, x):
    return x @ params["w"]


PARAMS = {"w": jnp.array([[1.0, -1.0, 0.0], [0.0, 0.5, 1.0]])}


def test_certify_equals_the_kernels_on_the_api_counts():
    """certify = certify_counts(selection counts, estimation counts) with the same streams."""
    smoothed = cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.4))
    x = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.3, 0.3], [0.0, 0.0]])
    key = jax.random.key(5)
    cert = smoothed.certify(x, key, n0=30, n=400, alpha=0.01)
    select = smoothed.counts(x, key, 30, stream=Stream.SELECT)
    estimate = smoothed.counts(x, key, 400)
    assert select.shape == estimate.shape == (4, 3) and (estimate.sum(-1) == 400).all()
    expected = certify_counts(select, estimate, 0.01, L2Radius(0.4))
    for field in ("prediction", "count_top", "count_runner_up", "p_lower", "p_upper"):
        np.testing.assert_array_equal(getattr(cert, field), getattr(expected, field))
    np.testing.assert_array_equal(np.isnan(cert.radius), np.isnan(expected.radius))
    assert (cert.prediction[:2] == [0, 2]).all()  # far from every boundary: decided
    pred = smoothed.predict(x, key, n=400, alpha=0.01)
    np.testing.assert_array_equal(pred.prediction, predict_counts(estimate, 0.01).prediction)


def test_heads_share_samples_and_one_head_equals_its_own_function():
    """A [B, H, C] function gives [N, H] fields; each head equals the single-head function."""
    def two_heads(params, x):
        logits = _linear(params, x)
        return jnp.stack([logits, -logits], axis=1)

    x = jnp.array([[1.0, 0.0], [0.2, 0.1]])
    key = jax.random.key(2)
    both = cbcert.smooth(two_heads, PARAMS, cbcert.gaussian(0.3)).certify(x, key, 20, 200, 0.01)
    one = cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.3)).certify(x, key, 20, 200, 0.01)
    assert both.prediction.shape == (2, 2)
    np.testing.assert_array_equal(both.prediction[:, 0], one.prediction)
    np.testing.assert_array_equal(both.count_top[:, 0], one.count_top)


def test_sequential_schedule_reports_samples_and_stops_early():
    smoothed = cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.2))
    x = jnp.array([[2.0, 0.0], [0.0, 2.0]])
    cert = smoothed.certify(x, jax.random.key(0), 50, 4000, 0.001, schedule="sequential",
                            target_radius=0.3)
    assert cert.stop_reason.tolist() == ["success", "success"]
    assert (cert.samples < 4000).all() and (cert.radius >= 0.3).all()
    pred = smoothed.predict(x, jax.random.key(0), 4000, 0.001, schedule="sequential")
    assert pred.prediction.tolist() == [0, 2] and (pred.samples < 4000).all()
    anytime = smoothed.certify(x, jax.random.key(0), 50, 4000, 0.001, schedule="anytime",
                               target_radius=0.3)
    assert anytime.stop_reason.tolist() == ["success", "success"]
    assert (anytime.samples < cert.samples).all() and (anytime.radius >= 0.3).all()
    with pytest.raises(ValueError, match="anytime"):
        smoothed.predict(x, jax.random.key(0), 4000, 0.001, schedule="anytime")


def test_bernoulli_noise_flips_concept_pairs():
    """ρ-flips of c[2K+U]: a function reading concept 0's state; the Hamming certificate."""
    def reads_state(params, c):  # class 1 iff concept 0 is present (c0+ > c0-)
        del params
        present = (c[:, 0] > c[:, 1]).astype(jnp.float32)
        return jnp.stack([1.0 - present, present], axis=-1)

    c = jnp.array([[2.0, -2.0, 1.0, -1.0], [-2.0, 2.0, 1.0, -1.0]])  # K = 2, U = 0
    smoothed = cbcert.smooth(reads_state, {}, cbcert.bernoulli(0.1, 2))
    cert = smoothed.certify(c, jax.random.key(1), 50, 500, 0.001)
    assert cert.prediction.tolist() == [1, 0]
    counts = smoothed.counts(c, jax.random.key(1), 2000)
    flip_rate = counts[0, 0] / 2000  # concept 0 flipped: ≈ ρ = 0.1
    assert abs(flip_rate - 0.1) < 0.03  # 4.5 sd of Binomial(2000, 0.1): failure prob < 1e-5


def test_bad_arguments_are_named():
    with pytest.raises(ConfigError, match="sigma"):
        cbcert.gaussian(-1.0)
    with pytest.raises(ConfigError, match="rho"):
        cbcert.bernoulli(0.7, 3)
    with pytest.raises(ConfigError, match="num_concepts"):
        cbcert.bernoulli(0.1, 0)
    with pytest.raises(ConfigError, match="flips"):
        cbcert.fixed_flips(4, 3)
    with pytest.raises(TypeError, match="cbcert.gaussian"):
        cbcert.smooth(_linear, PARAMS, 0.25)
    smoothed = cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.3), num_classes=4)
    with pytest.raises(ValueError, match="num_classes=4 but apply_fn returns 3 logits"):
        smoothed.certify(jnp.ones((1, 2)), jax.random.key(0), 10, 100, 0.01)
    with pytest.raises(ValueError, match="schedule='adaptive'"):
        cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.3)).predict(
            jnp.ones((1, 2)), jax.random.key(0), 100, 0.01, schedule="adaptive")


def _nan_logits(params, x):
    return jnp.full((x.shape[0], 3), jnp.nan)


def _inf_logits(params, x):
    return jnp.zeros((x.shape[0], 3)).at[:, 2].set(jnp.inf)


def test_nan_logits_are_refused_not_certified_as_class_0():
    """Issue 30.2 as reported: all-NaN logits were votes for class 0 (argmax of NaNs), so the
    smoothed classifier certified class 0 at radius 0.137."""
    smoothed = cbcert.smooth(lambda p, x: jnp.full((x.shape[0], 3), jnp.nan), {},
                             cbcert.gaussian(0.25))
    with pytest.raises(NonFiniteError, match=r"NaN or inf logits on 20 of 20 noisy samples "
                                             r"of a chunk \(inputs \[0, 1\], heads \[0\]\)"):
        smoothed.certify(jnp.zeros((2, 8)), jax.random.key(0), n0=10, n=20, alpha=0.001)


@pytest.mark.parametrize("schedule", ["fixed", "sequential"])
def test_non_finite_logits_and_inputs_are_refused_by_every_method(schedule):
    """predict and certify, Gaussian and Bernoulli noise, fixed and sequential schedules."""
    key, x = jax.random.key(0), jnp.zeros((2, 8))  # c[2K] with K = 4 for the flips
    for noise in (cbcert.gaussian(0.25), cbcert.bernoulli(0.1, 4)):
        for fn in (_nan_logits, _inf_logits):
            smoothed = cbcert.smooth(fn, {}, noise)
            with pytest.raises(NonFiniteError, match="NaN or inf logits") as err:
                smoothed.certify(x, key, 4, 64, 0.1, schedule=schedule)
            assert err.value.inputs == (0, 1)
            with pytest.raises(NonFiniteError, match="NaN or inf logits"):
                smoothed.predict(x, key, 64, 0.1, schedule=schedule)
    finite = cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.25))
    with pytest.raises(NonFiniteError, match=r"1 input \(indices \[7\]\) holds NaN or inf"):
        finite.certify(jnp.array([[0.0, 1.0], [jnp.nan, 0.0]]), key, 4, 64, 0.1,
                       schedule=schedule, indices=[3, 7])


@pytest.mark.parametrize("dtype", ["int8", jnp.int32, "bool", "float8"])
def test_sample_dtype_must_be_floating(dtype):
    """Issue 30.4: ``dtype="int8"`` rounded the noisy samples to integers and still certified
    Gaussian radii; a non-floating (or unknown) dtype is refused when smoothing."""
    with pytest.raises(TypeError, match=r"dtype=.*allowed: a floating dtype"):
        cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.5), dtype=dtype)
    for ok in ("bfloat16", jnp.float16, None):
        cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.5), dtype=ok)


def test_a_schedule_must_spend_exactly_the_alpha_given():
    """Issue 30.4: a `Schedule` at total level 0.6 certified at alpha = 0.001 without a word.
    Its levels must sum to alpha; `Schedule.geometric(n, alpha)` equals ``"sequential"``."""
    smoothed = cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.5), chunk_size=16)
    x, key = jnp.array([[3.0, 0.0]]), jax.random.key(0)
    for wrong in (Schedule.geometric(1000, 0.6), Schedule.geometric(1000, 0.0005)):
        with pytest.raises(ValueError, match=r"schedule's levels sum to .* but alpha = 0.001"):
            smoothed.certify(x, key, 10, 1000, 0.001, schedule=wrong)
        with pytest.raises(ValueError, match=r"schedule's levels sum to .* but alpha = 0.001"):
            smoothed.predict(x, key, 1000, 0.001, schedule=wrong)
    given = smoothed.certify(x, key, 10, 200, 0.001, schedule=Schedule.geometric(200, 0.001))
    named = smoothed.certify(x, key, 10, 200, 0.001, schedule="sequential")
    assert given.radius.tolist() == named.radius.tolist()


def test_stopping_rules_need_the_sequential_schedule():
    """Issue 30.4: ``target_radius`` (and ``radius_tolerance``) were ignored by the fixed
    schedule; they are refused there, naming the setting."""
    smoothed = cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.5))
    for key in ("target_radius", "radius_tolerance"):
        with pytest.raises(ConfigError, match=f"{key}=0.3: only the sequential schedule") as err:
            smoothed.certify(jnp.ones((1, 2)), jax.random.key(0), 10, 100, 0.01, **{key: 0.3})
        assert err.value.key == key


def test_bfloat16_inputs_certify_at_the_bfloat16_sigma():
    """Issue 30.4: noise is drawn in the inputs' dtype, so bf16 inputs get σ rounded to bf16
    (0.7 -> 0.69921875) and radii must use min(typed, drawn) = 0.69921875, as float32 inputs
    use float32(0.7) = 0.699999988."""
    smoothed = cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.7), chunk_size=16)
    for dtype, drawn in ((jnp.bfloat16, 0.69921875), (jnp.float32, float(np.float32(0.7)))):
        cert = smoothed.certify(jnp.array([[30.0, 0.0]], dtype), jax.random.key(0), 10, 100,
                                0.001)
        assert cert.prediction.tolist() == [0]
        np.testing.assert_array_equal(cert.radius, L2Radius(drawn).radius(cert.p_lower, None))


def _records(path):
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (path / RECORDS).read_text().splitlines()]


CASES = [
    ("latent", ["--sigma", "0.12"], "gaussian", 0.12, {}),
    ("concept", ["--rho", "0.2", "--two-class"], "bernoulli", 0.2, {"two_class": True}),
    ("latent", ["--sigma", "0.12", "--schedule", "sequential", "--target-radius", "0.1"],
     "gaussian", 0.12, {"schedule": "sequential", "target_radius": 0.1}),
]


@pytest.mark.parametrize(("command", "flags", "kind", "scale", "options"), CASES,
                         ids=["latent", "concept-two-class", "latent-sequential"])
def test_api_and_cli_give_identical_records(tmp_path, command, flags, kind, scale, options):
    """`certify latent/concept` and `Smoothed.certify` on the same inputs, seed and settings."""
    out = tmp_path / "run"
    args = [command, *flags, "--inputs", "5", "--n0", "20", "--n", "300", "--seed", "3",
            "--models", "std,cbm", "--out", str(out), "--quiet"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = _records(out)

    world = cbcert.load_world("default")
    space = "latent" if kind == "gaussian" else "concept"
    pool = agreement_pool(world, 3, 5, space=space)
    x = space_inputs(world, pool.latents, space)
    noise = (cbcert.gaussian(scale) if kind == "gaussian"
             else cbcert.bernoulli(scale, world.generator.num_concepts))
    smoothed = cbcert.smooth(world.apply(space, ("std", "cbm")), world.params, noise)
    cert = smoothed.certify(x, jax.random.key(3), n0=20, n=300, alpha=0.001,
                            indices=pool.indices, **options)
    assert cert.prediction.shape == (5, 2)
    expected = []
    for r in range(5):
        for h, model in enumerate(("std", "cbm")):
            got = next(rec for rec in records
                       if rec["index"] == pool.indices[r] and rec["model"] == model)
            assert got["prediction"] == cert.prediction[r, h]
            assert got["count_top"] == cert.count_top[r, h]
            assert got["count_runner_up"] == cert.count_runner_up[r, h]
            assert got["p_lower"] == cert.p_lower[r, h]
            radius = cert.radius[r, h]
            assert got["radius"] == (None if np.isnan(radius) else radius)
            if options.get("schedule") == "sequential":
                assert got["samples"] == cert.samples[r, h]
                assert got["stop_reason"] == cert.stop_reason[r, h]
            expected.append(got)
    assert len(expected) == len(records) == 10
    assert any(r["radius"] is not None for r in records)  # something was certified


def test_api_examples_name_only_public_api():
    """The API page's and the README's examples import nothing private (what users copy must
    stay supported)."""
    for page in (API_PAGE, README):
        lines = re.findall(r">>> (.*)", page.read_text())
        assert len(lines) >= 5, page
        for line in lines:
            assert "._" not in line and "cbcert.runs" not in line, (page.name, line)


def test_the_scale_is_checked_once_when_the_noise_is_built(monkeypatch):
    """`Noise` is the API's edge: its scale meets the user rule there, once; `Smoothed`'s
    PREDICT/CERTIFY (fixed and sequential) and the engine below trust it."""
    from cbcert.certify import smoothing

    calls = []
    original = smoothing.validate
    monkeypatch.setattr(smoothing, "validate",
                        lambda *args, **kwargs: (calls.append(args), original(*args, **kwargs)))
    smoothed = cbcert.smooth(_linear, PARAMS, cbcert.gaussian(0.3))
    x = jnp.ones((2, 2))
    smoothed.certify(x, jax.random.key(0), 10, 100, 0.01)
    smoothed.certify(x, jax.random.key(0), 10, 100, 0.01, schedule="sequential")
    smoothed.predict(x, jax.random.key(1), 100, 0.01)
    assert len(calls) == 1



def test_the_one_path_takes_the_scale_by_keyword():
    """`certify_heads`, `predict_heads` and `drive_trackers` take the scale as ``scale=`` only,
    like the engine below them."""
    import inspect

    from cbcert.certify import monte_carlo

    for fn in (monte_carlo.certify_heads, monte_carlo.predict_heads, monte_carlo.drive_trackers):
        parameter = inspect.signature(fn).parameters["scale"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, fn.__name__
