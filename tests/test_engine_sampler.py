import inspect
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import processes
import pytest
import scipy.stats

from cbcert.engine import chunks, continuous, keys, memory, noise, sampler, sharding, validity

D, H, C = 8, 2, 4
WEIGHTS = np.asarray(jax.random.normal(jax.random.key(1), (D, H, C)))
INPUTS = np.asarray(jax.random.normal(jax.random.key(2), (5, D)))
KEY = keys.stream_key(jax.random.key(0), keys.STREAM_ESTIMATE)


def linear_heads(params, x):
    return jnp.einsum("bd,dhc->bhc", x, params)  # [B, H, C]


def _counts(inputs=INPUTS, scale=0.7, num_samples=50, fn=linear_heads, **kwargs):
    return sampler.count_classes(
        fn, WEIGHTS, inputs, noise.Gaussian(), KEY, num_samples, scale=scale, num_classes=C,
        **kwargs
    )


def test_counts_shape_and_totals():
    counts = _counts(chunk_size=64)
    assert counts.shape == (5, H, C) and counts.dtype == np.int64
    np.testing.assert_array_equal(counts.sum(axis=-1), 50)


@pytest.mark.float_bits
@pytest.mark.parametrize("chunk_size", [7, 1000, None])
def test_counts_are_identical_for_any_chunk_size(chunk_size):
    np.testing.assert_array_equal(_counts(chunk_size=chunk_size), _counts(chunk_size=64))


def test_counts_of_a_subset_match_the_full_run():
    full = _counts(chunk_size=64)
    subset = [4, 1, 3]
    part = _counts(inputs=INPUTS[subset], indices=subset, chunk_size=7)
    np.testing.assert_array_equal(part, full[subset])


def test_counts_match_a_per_sample_reference():
    counts = _counts(num_samples=20, chunk_size=64)
    for n in range(5):
        sample_keys = [keys.sample_key(KEY, n, j) for j in range(20)]
        noisy = jnp.stack([noise.Gaussian().perturb(k, INPUTS[n], jnp.float32(0.7))
                           for k in sample_keys])
        labels = np.asarray(jnp.argmax(linear_heads(WEIGHTS, noisy), -1))  # [20, H]
        for h in range(H):
            np.testing.assert_array_equal(counts[n, h], np.bincount(labels[:, h], minlength=C))


def test_raw_and_typed_keys_give_the_same_counts():
    typed = _counts(chunk_size=64)
    raw = sampler.count_classes(linear_heads, WEIGHTS, INPUTS, noise.Gaussian(),
                                jax.random.key_data(KEY), 50, scale=0.7, num_classes=C,
                                chunk_size=64)
    np.testing.assert_array_equal(typed, raw)


def test_linear_classifier_matches_closed_form():
    # For f(x) = 1[w·x > 0], P[f(x + σε) = 1] = Φ(w·x / (σ‖w‖)) (Cohen et al. 2019, §3.1).
    w = np.array([1.0, -2.0, 0.5], np.float32)
    x = np.array([[0.3, 0.1, 0.2], [-0.2, 0.0, 0.1], [1.0, 1.0, 1.0]], np.float32)
    sigma, n = 0.5, 4000

    def binary(params, z):
        score = z @ params  # [B]
        return jnp.stack([jnp.zeros_like(score), score], -1)[:, None, :]  # [B, 1, 2]

    counts = sampler.count_classes(binary, w, x, noise.Gaussian(), KEY, n, scale=sigma,
                                   num_classes=2, chunk_size=512)
    p = scipy.stats.norm.cdf(x @ w / (sigma * np.linalg.norm(w)))
    # Binomial sd <= sqrt(0.25/4000) = 0.0079; 0.04 is > 5 sd (failure probability < 1e-6).
    np.testing.assert_allclose(counts[:, 0, 1] / n, p, atol=0.04)


def test_one_trace_per_configuration():
    traced = chex.assert_max_traces(n=1)(lambda params, x: linear_heads(params, x))
    first = sampler.count_classes(traced, WEIGHTS, INPUTS, noise.Gaussian(), KEY, 30, scale=0.3,
                                  num_classes=C, chunk_size=16)
    # A new scale, other inputs, another N and another sample count reuse the same step.
    sampler.count_classes(traced, WEIGHTS, INPUTS[:2], noise.Gaussian(), KEY, 70, scale=0.9,
                          num_classes=C, chunk_size=16, indices=[3, 4])
    again = sampler.count_classes(traced, WEIGHTS, INPUTS, noise.Gaussian(), KEY, 30, scale=0.3,
                                  num_classes=C, chunk_size=16)
    np.testing.assert_array_equal(first, again)


def test_automatic_chunk_compiles_at_most_twice_and_respects_memory():
    traces = []

    def counted(params, x):
        traces.append(x.shape[0])
        return linear_heads(params, x)

    small = _counts(fn=counted, max_memory=4096)
    first_run = len(traces)
    _counts(fn=counted, max_memory=4096, scale=0.2)
    # The probe compile, then the chunk it picked (the same shape if it picked the probe size).
    assert len(traces) == first_run <= 2 and traces[0] == memory.PROBE_PAIRS_PER_DEVICE
    assert memory.MIN_CHUNK_PER_DEVICE <= traces[-1] < 64  # 4 KiB cannot hold 64 pairs
    np.testing.assert_array_equal(small, _counts(chunk_size=64))


def test_a_run_whose_chunk_is_the_probe_size_compiles_once():
    """5 inputs x 3 samples = 15 pairs: the probe takes 16 pairs per device, the whole run
    fits one chunk of 16, so the run executes the probe's program (one trace, one compile),
    and the counts equal those of a fixed chunk."""
    traces = []

    def counted(params, x):
        traces.append(x.shape[0])
        return linear_heads(params, x)

    counts = _counts(fn=counted, num_samples=3)
    assert traces == [memory.probe_pairs(15, 1)] == [16]
    np.testing.assert_array_equal(counts, _counts(num_samples=3, chunk_size=4))
    _counts(fn=counted, num_samples=3, scale=0.2)  # the same configuration: nothing new
    assert traces == [16]


def test_probe_pairs_rounds_the_run_up_to_a_power_of_two_at_most_the_cap():
    assert [memory.probe_pairs(n, 1) for n in (1, 2, 3, 9, 16, 17, 10**6)] == [
        8, 8, 8, 16, 16, 16, 16]
    assert memory.probe_pairs(20, 4) == 8 and memory.probe_pairs(10**6, 8) == 16
    assert memory.PROBE_PAIRS_PER_DEVICE == 16


def test_a_requested_chunk_is_capped_at_the_run_and_small_runs_pad_up_to_it():
    # --chunk-size 8: runs of 2 and 5 pairs run one chunk of 8 (the same program as the run's
    # larger stages); 10**9 is capped at the run rounded up to a power of two.
    assert [memory.capped_chunk_size(8, n, 1) for n in (2, 5, 8, 40)] == [8, 8, 8, 8]
    assert memory.capped_chunk_size(7, 3, 1) == 7  # as requested when it is small
    assert memory.capped_chunk_size(10**9, 10, 1) == 16
    assert memory.capped_chunk_size(10**9, 3, 2) == 16  # 8 pairs on each of 2 devices
    assert memory.capped_chunk_size(10**9, 10**6, 1) == 2**20
    traces = []

    def counted(params, x):
        traces.append(x.shape[0])
        return linear_heads(params, x)

    small = _counts(fn=counted, inputs=INPUTS[:1], num_samples=2, chunk_size=8)
    _counts(fn=counted, inputs=INPUTS, num_samples=8, chunk_size=8)
    assert traces == [8]  # 2 pairs padded to the 8 of the larger run: one program
    np.testing.assert_array_equal(small, _counts(inputs=INPUTS[:1], num_samples=2, chunk_size=1))


def test_auto_chunk_size_rounds():
    assert memory.auto_chunk_size(100.0, 10_000, 1000, 1) == 64
    assert memory.auto_chunk_size(100.0, 12_800, 1000, 1) == 128
    assert memory.auto_chunk_size(1.0, 2**30, 300, 1) == 512
    assert memory.auto_chunk_size(1.0, 2**30, 10**9, 4) == memory.MAX_CHUNK_PER_DEVICE * 4
    assert memory.auto_chunk_size(1e9, 10, 1000, 8) == memory.MIN_CHUNK_PER_DEVICE * 8
    # A run smaller than MIN_CHUNK_PER_DEVICE pairs pads up to it (one program for all such).
    assert memory.auto_chunk_size(1e9, 10, 3, 1) == memory.MIN_CHUNK_PER_DEVICE == 8
    assert memory.auto_chunk_size(1.0, 2**30, 3, 2) == 16


def test_compute_bound_floor_of_the_automatic_chunk():
    mib = 2**20
    # 1.28 MiB per pair (StyleGAN2-64 -> ResNet-50): 8 MiB holds 6 pairs -> floor 8, or 32.
    assert memory.auto_chunk_size(1.28 * mib, 8 * mib, 1000, 1) == 8
    assert memory.auto_chunk_size(1.28 * mib, 8 * mib, 1000, 1, compute_bound=True) == 32
    assert memory.auto_chunk_size(1.28 * mib, 8 * mib, 1000, 2, compute_bound=True) == 64
    # 20 MiB per pair: 32 pairs would exceed COMPUTE_BOUND_MAX_MEMORY; 12 fit -> 8.
    assert memory.auto_chunk_size(20 * mib, 8 * mib, 1000, 1, compute_bound=True) == 8
    # A floor, never a cap: the memory rule's larger chunk and the run's size still decide.
    assert memory.auto_chunk_size(1000.0, 8 * mib, 10**6, 1, compute_bound=True) == 8192
    assert memory.auto_chunk_size(1.28 * mib, 8 * mib, 10, 1, compute_bound=True) == 16


DEEP_WEIGHTS = np.asarray(jax.random.normal(jax.random.key(3), (256, 256))) / 16


def _first_chunk(fn, max_memory=None):
    chunks = []
    sampler.count_classes(fn, DEEP_WEIGHTS, np.zeros((2, 16384), np.float32), noise.Gaussian(),
                          KEY, 32, scale=0.1, num_classes=4, max_memory=max_memory,
                          progress=lambda done, total: chunks.append(done))
    return chunks[0]


def _deep(params, x):  # 16 matmul layers on 64 rows of 256: ~400 FLOPs per byte per pair
    h = x.reshape(x.shape[0], 64, 256)
    for _ in range(16):
        h = jnp.tanh(h @ params)
    return h[:, 0, None, :4]


def _elementwise(params, x):  # ~5 FLOPs per byte: memory-bound
    h = x
    for _ in range(4):
        h = jnp.tanh(h) * 1.5
    return h.reshape(x.shape[0], 1, -1)[:, :, :4]


def test_compute_bound_steps_get_larger_chunks_only_with_the_default_cpu_budget(monkeypatch):
    """Both steps cost ~0.3 MiB per pair, so the 8 MiB rule gives 16 pairs; the deep one
    (~400 FLOP/B from XLA's cost analysis) gets 32 with the default CPU budget when the run is
    long enough to repay a second compilation (here: the threshold lowered to this run's
    ~9 GFLOP), and the memory rule again when the caller names a budget."""
    if jax.default_backend() != "cpu":
        pytest.skip("the compute-bound floor applies to the CPU default budget only")
    monkeypatch.setattr(memory, "COMPUTE_BOUND_MIN_RUN_FLOPS", 1e9)
    assert _first_chunk(_deep) == 32
    assert _first_chunk(_deep, max_memory=8 * 2**20) == 16
    assert _first_chunk(_elementwise) == 16


def test_a_compute_bound_run_too_short_to_repay_a_compilation_keeps_the_probe(monkeypatch):
    """64 pairs of ~134 MFLOP (~9 GFLOP) are far below 10^12 FLOPs: the run keeps the probe's
    16 pairs and executes the probe's program (one compilation of the step)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the compute-bound floor applies to the CPU default budget only")
    compiled = []
    probe = memory.probe_step

    def counting(*args, **kwargs):
        cost, program = probe(*args, **kwargs)
        compiled.append(cost.flops)
        return cost, program

    monkeypatch.setattr(memory, "probe_step", counting)
    assert _first_chunk(_deep) == 16
    assert not memory.repays_second_compilation(compiled[0], 64, 1)
    assert memory.repays_second_compilation(compiled[0], 10**4, 1)
    assert not memory.repays_second_compilation(compiled[0], 10**4, 2)
    assert not memory.repays_second_compilation(0.0, 10**9, 1)  # no cost analysis: never


def test_concept_noise_counts_are_deterministic():
    k = 3
    concepts = np.asarray(jax.random.normal(jax.random.key(5), (4, 2 * k + 2)))
    weights = np.asarray(jax.random.normal(jax.random.key(6), (2 * k + 2, 1, 3)))
    # FixedFlips is covered on 8 devices in test_engine_sharding.py.
    runs = [
        sampler.count_classes(linear_heads, weights, concepts, noise.BernoulliFlips(k), KEY,
                              40, scale=0.3, num_classes=3, chunk_size=size)
        for size in (7, 64)
    ]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert (runs[0].max(axis=-1) < 40).any()  # the flips do change some predictions


def test_map_samples_sees_the_noise_of_count_classes():
    def fn(params, clean, noisy):
        return {"label": jnp.argmax(linear_heads(params, noisy), -1),
                "shift": jnp.linalg.norm(noisy - clean, axis=-1)}

    out = sampler.map_samples(fn, WEIGHTS, INPUTS, noise.SphereShift(), KEY, 30, scale=0.25,
                              chunk_size=7)
    assert out["label"].shape == (5, 30, H) and out["shift"].shape == (5, 30)
    np.testing.assert_allclose(out["shift"], 0.25, rtol=1e-5)
    counts = sampler.count_classes(linear_heads, WEIGHTS, INPUTS, noise.SphereShift(), KEY, 30,
                                   scale=0.25, num_classes=C, chunk_size=64)
    for h in range(H):
        rebuilt = np.stack([np.bincount(row, minlength=C) for row in out["label"][:, :, h]])
        np.testing.assert_array_equal(rebuilt, counts[:, h])
    part = sampler.map_samples(fn, WEIGHTS, INPUTS[[2]], noise.SphereShift(), KEY, 30, scale=0.25,
                               indices=[2], chunk_size=64)
    np.testing.assert_array_equal(part["label"][0], out["label"][2])


def test_sample_labels_are_the_votes_count_classes_counts_on_its_compiled_step():
    def heads(params, x):  # its own function: a fresh jitted step for this test
        return linear_heads(params, x)

    counts = sampler.count_classes(heads, WEIGHTS, INPUTS, noise.Gaussian(), KEY, 30, scale=0.7,
                                   num_classes=C, chunk_size=16)
    step = chunks.jitted_step(chunks.argmax_body(heads, C), noise.Gaussian(),
                              sharding.default_mesh(), "threefry2x32", None)
    assert step._cache_size() == 1
    labels = sampler.sample_labels(heads, WEIGHTS, INPUTS, noise.Gaussian(), KEY, 30, scale=0.7,
                                   num_classes=C, chunk_size=16)
    assert step._cache_size() == 1  # the same program, not a second compilation
    assert labels.shape == (5, 30, H) and labels.dtype == np.int32
    rebuilt = (labels[..., None] == np.arange(C)).sum(axis=1)  # [N, H, C]
    np.testing.assert_array_equal(rebuilt, counts)
    # A non-finite logit is NO_VOTE here (count_classes raises on it); bad inputs are refused.
    nan_head = lambda p, x: linear_heads(p, x).at[:, 1].set(jnp.nan)  # noqa: E731
    votes = sampler.sample_labels(nan_head, WEIGHTS, INPUTS, noise.Gaussian(), KEY, 4, scale=0.7,
                                  num_classes=C)
    assert (votes[:, :, 1] == validity.NO_VOTE).all() and (votes[:, :, 0] >= 0).all()
    with pytest.raises(validity.NonFiniteError):
        sampler.sample_labels(heads, WEIGHTS, np.full_like(INPUTS, np.nan), noise.Gaussian(),
                              KEY, 4, scale=0.7, num_classes=C)
    with pytest.raises(ValueError, match="num_classes=0"):
        sampler.sample_labels(heads, WEIGHTS, INPUTS, noise.Gaussian(), KEY, 4, scale=0.7,
                              num_classes=0)


def test_bfloat16_hook_casts_the_model_input():
    seen = []

    def fn(params, x):
        seen.append(x.dtype)
        return linear_heads(params.astype(x.dtype), x).astype(jnp.float32)

    counts = _counts(fn=fn, chunk_size=64, dtype=jnp.bfloat16)
    assert seen == [jnp.bfloat16]
    np.testing.assert_array_equal(counts.sum(-1), 50)


def test_progress_callback_reports_every_chunk():
    calls = []
    _counts(chunk_size=64, num_samples=30, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(64, 150), (128, 150), (150, 150)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_samples": 0}, "num_samples=0"),
        ({"num_samples": 2.5}, "num_samples=2.5"),
        ({"inputs": np.zeros((0, D))}, "inputs has shape"),
        ({"indices": [0, 1]}, "indices has shape"),
        ({"indices": [0, 1, 2, 3, -1]}, "indices range over \\[-1, 3\\]"),
        ({"chunk_size": 0}, "chunk_size=0"),
        ({"max_memory": -5}, "max_memory=-5"),
        ({"scale": -1.0}, "sigma=-1.0"),
        ({"fn": lambda p, x: linear_heads(p, x)[:, 0]}, "apply_fn must return logits"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _counts(**kwargs)


def test_bad_num_classes_and_key():
    with pytest.raises(ValueError, match="num_classes=0"):
        sampler.count_classes(linear_heads, WEIGHTS, INPUTS, noise.Gaussian(), KEY, 5, scale=0.1,
                              num_classes=0)
    with pytest.raises(ValueError, match="key has shape"):
        sampler.count_classes(linear_heads, WEIGHTS, INPUTS, noise.Gaussian(),
                              jnp.zeros(2, jnp.float32), 5, scale=0.1, num_classes=C)


def _poisoned(params, x):
    """``linear_heads`` with head 1's logits NaN where x0 > 50 and +inf where x0 < -50."""
    logits = linear_heads(params, x)  # [B, H, C]
    bad = jnp.where(x[:, :1] > 50, jnp.nan, jnp.where(x[:, :1] < -50, jnp.inf, 0.0))  # [B, 1]
    return logits.at[:, 1].add(bad)


POISONED_INPUTS = INPUTS.copy()
POISONED_INPUTS[1, 0], POISONED_INPUTS[3, 0] = 100.0, -100.0  # σ = 0.7 never brings them back


@pytest.mark.parametrize("sequential", [False, True], ids=["count_classes", "continuous"])
def test_non_finite_logits_are_no_votes_and_are_refused(sequential):
    """A NaN or inf logit is no vote (argmax would count NaNs as class 0): both samplers raise
    `NonFiniteError` naming the samples, the global input indices and the heads concerned."""
    indices = np.arange(10, 15)
    with pytest.raises(validity.NonFiniteError) as err:
        if sequential:
            _sequential(checkpoints=(5, 10), inputs=POISONED_INPUTS, fn=_poisoned,
                        indices=indices, chunk_size=64)
        else:
            _counts(inputs=POISONED_INPUTS, fn=_poisoned, num_samples=10, indices=indices,
                    chunk_size=64)
    assert err.value.inputs == (11, 13) and err.value.heads == (1,)
    if not sequential:  # one chunk holds all 50 pairs
        assert (err.value.samples, err.value.chunk) == (20, 50)
        assert "NaN or inf logits on 20 of 50 noisy samples" in str(err.value)
    assert "inputs [11, 13], heads [1]" in str(err.value)


@pytest.mark.parametrize("sequential", [False, True], ids=["count_classes", "continuous"])
def test_non_finite_inputs_are_refused_before_sampling(sequential):
    """NaN/inf inputs are refused even when the model maps them to finite logits."""
    inputs = INPUTS.copy()
    inputs[2, 3], inputs[4, 0] = np.nan, -np.inf

    def finite(params, x):
        return jnp.zeros((x.shape[0], H, C))

    match = r"2 inputs \(indices \[2, 4\]\) hold NaN or inf"
    with pytest.raises(validity.NonFiniteError, match=match) as err:
        if sequential:
            _sequential(inputs=inputs, fn=finite, chunk_size=64)
        else:
            _counts(inputs=inputs, fn=finite, chunk_size=64)
    assert err.value.inputs == (2, 4) and err.value.samples == 0


@pytest.mark.parametrize("dtype", [jnp.int8, "int32", "bool", "nope"])
def test_compute_dtype_must_be_floating(dtype):
    """Integer samples would round the noise away; a bad dtype is named, not traced."""
    with pytest.raises(TypeError, match=r"dtype=.*floating"):
        _counts(dtype=dtype, chunk_size=64)


# --- continuous batching (cbcert.engine.continuous) -------------------------------------------

CHECKPOINTS = (5, 10, 20, 50)


def _decisive(rows, k, counts):
    """Stops an input once head 0's top class holds 60 % of its votes (data-dependent)."""
    del rows, k
    return counts[:, 0].max(-1) > 0.6 * counts[:, 0].sum(-1)


def _sequential(checkpoints=CHECKPOINTS, decide=_decisive, inputs=INPUTS, fn=linear_heads,
                **kwargs):
    return continuous.count_classes_sequential(fn, WEIGHTS, inputs, noise.Gaussian(), KEY,
                                               checkpoints, decide, scale=0.7, num_classes=C,
                                                   **kwargs)


@pytest.mark.parametrize("chunk_size", [7, 64, 1000, None])
def test_continuous_with_one_checkpoint_equals_count_classes(chunk_size):
    result = _sequential(checkpoints=(50,), decide=lambda r, k, c: np.zeros(len(r), bool),
                         chunk_size=chunk_size)
    np.testing.assert_array_equal(result.counts, _counts(chunk_size=64))
    np.testing.assert_array_equal(result.samples, 50)


def test_continuous_counts_are_the_first_samples_of_each_input():
    result = _sequential(chunk_size=7)
    assert set(result.samples) > {CHECKPOINTS[0]}  # some inputs stop early, some do not
    assert len(set(result.samples)) > 1
    for n, samples in enumerate(result.samples):
        alone = sampler.count_classes(linear_heads, WEIGHTS, INPUTS[n : n + 1], noise.Gaussian(),
                                      KEY, int(samples), scale=0.7, num_classes=C, indices=[n],
                                      chunk_size=5)  # one shape for every n_k: one compile
        np.testing.assert_array_equal(result.counts[n], alone[0])


@pytest.mark.float_bits
@pytest.mark.parametrize("chunk_size", [1, 3, 64, 1000, None])
def test_continuous_is_identical_for_any_chunk_size_and_subset(chunk_size):
    reference = _sequential(chunk_size=7)
    other = _sequential(chunk_size=chunk_size)
    np.testing.assert_array_equal(other.counts, reference.counts)
    np.testing.assert_array_equal(other.samples, reference.samples)
    # A resumed run certifies a subset of the inputs under their global indices.
    subset = [4, 1, 3]
    part = _sequential(inputs=INPUTS[subset], indices=subset, chunk_size=chunk_size)
    np.testing.assert_array_equal(part.counts, reference.counts[subset])
    np.testing.assert_array_equal(part.samples, reference.samples[subset])


def _counted_exactly(checkpoints, decide):
    """``decide`` that first checks each input arrives with exactly ``checkpoints[k]`` labels."""

    def checked(rows, k, counts):
        got = counts[:, 0].sum(-1)
        assert (got == checkpoints[k]).all(), f"checkpoint {k}: rows {rows} counted {got}"
        return decide(rows, k, counts)

    return checked


@pytest.mark.float_bits
@pytest.mark.parametrize("num_inputs, chunk_sizes", [(40, (8, 16, 64, 4096)),
                                                     (4096, (512, 4096))])
def test_continuous_chunks_holding_two_checkpoints_decide_each_at_its_own(num_inputs,
                                                                          chunk_sizes):
    # A chunk larger than the first checkpoint holds inputs reaching checkpoint k beside inputs
    # reaching k + 1: one that continues past k in that read-back must not be decided at k + 1
    # before its samples are back (regression: a chunk of 16 with checkpoints 8, 16, …).
    checkpoints = (8, 16, 32, 64)
    inputs = np.asarray(jax.random.normal(jax.random.key(3), (num_inputs, D)))
    decide = _counted_exactly(checkpoints, _decisive)
    results = [_sequential(checkpoints=checkpoints, decide=decide, inputs=inputs, chunk_size=c)
               for c in chunk_sizes]
    assert len(set(results[0].samples)) >= 3  # inputs continue past two checkpoints
    for chunk, result in zip(chunk_sizes[1:], results[1:], strict=True):
        np.testing.assert_array_equal(result.counts, results[0].counts, err_msg=str(chunk))
        np.testing.assert_array_equal(result.samples, results[0].samples, err_msg=str(chunk))


def test_continuous_decides_at_every_checkpoint_and_reports_each_input_once():
    seen, finished = [], []

    def decide(rows, k, counts):
        seen.extend((int(r), k, int(total)) for r, total in zip(rows, counts[:, 0].sum(-1),
                                                                 strict=True))
        return _decisive(rows, k, counts)

    def done(rows, counts, samples, seconds):
        finished.extend(zip(rows.tolist(), samples.tolist(), strict=True))
        np.testing.assert_array_equal(counts.sum(-1), np.repeat(samples[:, None], H, axis=1))
        assert (seconds > 0).all()

    result = _sequential(decide=decide, finished=done, chunk_size=8)
    assert all(total == CHECKPOINTS[k] for _, k, total in seen)
    for n in range(len(INPUTS)):
        levels = [k for r, k, _ in seen if r == n]
        assert levels == list(range(CHECKPOINTS.index(result.samples[n]) + 1))
    assert sorted(finished) == [(n, int(s)) for n, s in enumerate(result.samples)]
    assert result.seconds.sum() > 0


def test_continuous_fills_freed_slots_with_waiting_inputs(monkeypatch):
    # 40 inputs that all stop at n_1 = 5: 200 pairs run in 8 full chunks of 25 -- a stopped
    # input's place goes to the next one, no chunk is padded.
    valid = []
    dispatch = continuous._Scheduler._dispatch

    def spy(self, rows, samples, size):
        valid.append(size)
        return dispatch(self, rows, samples, size)

    monkeypatch.setattr(continuous._Scheduler, "_dispatch", spy)
    inputs = np.repeat(INPUTS, 8, axis=0)
    result = _sequential(inputs=inputs, decide=lambda r, k, c: np.ones(len(r), bool),
                         chunk_size=25)
    np.testing.assert_array_equal(result.samples, CHECKPOINTS[0])
    np.testing.assert_array_equal(result.counts.sum(-1), CHECKPOINTS[0])
    assert valid == [25] * 8


def test_continuous_reuses_the_samplers_compilation():
    traced = chex.assert_max_traces(n=1)(lambda params, x: linear_heads(params, x))
    sampler.count_classes(traced, WEIGHTS, INPUTS, noise.Gaussian(), KEY, 30, scale=0.3,
                          num_classes=C, chunk_size=16)
    _sequential(fn=traced, chunk_size=16)


def test_continuous_rejects_bad_checkpoints_and_decisions():
    with pytest.raises(ValueError, match="strictly increasing"):
        _sequential(checkpoints=(10, 10))
    with pytest.raises(ValueError, match="decide returned shape"):
        _sequential(decide=lambda r, k, c: np.ones(len(r) + 1, bool), chunk_size=8)


CONTINUOUS_CHILD = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from cbcert.engine import continuous, keys, noise
W = np.asarray(jax.random.normal(jax.random.key(1), (8, 2, 4)))
X = np.asarray(jax.random.normal(jax.random.key(2), (5, 8)))
KEY = keys.stream_key(jax.random.key(0), keys.STREAM_ESTIMATE)
heads = lambda p, x: jnp.einsum("bd,dhc->bhc", x, p)
decide = lambda rows, k, c: c[:, 0].max(-1) > 0.6 * c[:, 0].sum(-1)
devices = np.asarray(jax.devices())
out = {}
for count, chunk in ((2, 7), (8, 64), (8, 3)):
    r = continuous.count_classes_sequential(heads, W, X, noise.Gaussian(), KEY,
                                            (5, 10, 20, 50), decide, scale=0.7, num_classes=4,
                                            chunk_size=chunk,
                                            mesh=Mesh(devices[:count], ("data",)))
    out[f"{count} devices, chunk {chunk}"] = [r.counts.tolist(), r.samples.tolist()]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_continuous_is_identical_on_2_and_8_devices():
    child = processes.start_python(CONTINUOUS_CHILD, num_devices=8)
    reference = _sequential(chunk_size=7)
    stdout = processes.wait_python(child, timeout=240)
    line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
    runs = json.loads(line[len("RESULT "):])
    assert len(runs) == 3
    for name, (counts, samples) in runs.items():
        np.testing.assert_array_equal(counts, reference.counts, err_msg=name)
        np.testing.assert_array_equal(samples, reference.samples, err_msg=name)


def test_batch_within_memory_is_the_largest_power_of_two_in_budget_and_skips_a_pinned_probe():
    """The probe (8 inputs, one trace) gives a power of two >= 8 inputs of ~1 KiB each within a
    64 KiB budget; the result is clipped to [minimum, maximum] (a million-fold ``factor`` fits
    one input: the minimum); a clip range that admits one value is the answer without
    compiling anything (no trace)."""
    traces = []

    def fn(params, x):
        traces.append(x.shape[0])
        return jnp.tanh(x @ params).sum(axis=1)

    params = jnp.ones((256, 256), jnp.float32)
    fits = memory.batch_within_memory(fn, params, (256,), jnp.float32, max_memory=64 * 2**10)
    assert traces == [8] and fits >= 8 and fits & (fits - 1) == 0
    assert memory.batch_within_memory(fn, params, (256,), jnp.float32, max_memory=64 * 2**10,
                                      minimum=2, maximum=4) == 4
    assert memory.batch_within_memory(fn, params, (256,), jnp.float32, max_memory=64 * 2**10,
                                      factor=10**6, minimum=2, maximum=4) == 2
    del traces[:]
    assert memory.batch_within_memory(fn, params, (256,), jnp.float32, minimum=4,
                                      maximum=4) == 4
    assert memory.batch_within_memory(fn, params, (256,), jnp.float32, minimum=4,
                                      maximum=2) == 4
    assert traces == []


@pytest.mark.parametrize("fn", [sampler.count_classes, sampler.map_samples,
                                continuous.count_classes_sequential],
                         ids=lambda fn: fn.__name__)
def test_the_scale_is_keyword_only_at_the_engine_boundary(fn):
    """One name for σ/ρ/m/ε at the engine's public functions, and never by position: the
    scale used to sit between ``noise`` and ``key``, where a positional value would be read as
    another argument."""
    parameters = inspect.signature(fn).parameters
    assert "param" not in parameters
    assert parameters["scale"].kind is inspect.Parameter.KEYWORD_ONLY
    assert parameters["scale"].default is inspect.Parameter.empty


def test_a_positional_scale_is_refused():
    with pytest.raises(TypeError):
        sampler.count_classes(linear_heads, WEIGHTS, INPUTS, noise.Gaussian(), 0.7, KEY, 5,
                              num_classes=C)
