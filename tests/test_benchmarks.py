"""The prepared accelerator benchmark (`benchmarks/accelerator.sh`) runs end to end on a CPU.

The script is meant for a GPU machine, where a failure costs scarce device time; here it runs at
the ``tiny`` scale (32 px generators, ResNet-50 at 32 px, one timing round) so that a broken
import, a parity failure (the script exits non-zero when JAX and PyTorch disagree) or a missing
report line shows up in CI, not on the accelerator. Timings are not asserted (they are
measurements, not behaviour).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = ("StyleGAN2 + CB-AE", "BigGAN-deep")


@pytest.fixture(scope="module")
def tiny_run():
    # One thread: the suite's other pytest worker keeps the second core busy, and PyTorch's
    # OpenMP threads spin-wait on a busy core (BigGAN tiny: 2-4 samples/s with two threads on a
    # loaded 2-core machine, ~120 with one; the whole script 157 s -> 66 s).
    env = {**os.environ, "CBCERT_BENCH_SCALE": "tiny", "CBCERT_BENCH_THREADS": "1",
           "CBCERT_BENCH_ARGS": "--rounds 1 --agreement 32", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "accelerator.sh")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    return done


def test_the_script_exits_zero_and_prints_versions(tiny_run):
    assert tiny_run.returncode == 0, tiny_run.stdout[-4000:] + tiny_run.stderr[-4000:]
    assert "scale tiny" in tiny_run.stdout
    assert re.search(r"jax \d+\.\d+.*flax \d+\.\d+.*torch \d+\.\d+", tiny_run.stdout)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_each_pipeline_reports_every_contender(tiny_run, pipeline):
    sections = tiny_run.stdout.split("\n\n")
    found = [s for s in sections if s.startswith(f"{pipeline}:")]
    assert len(found) == 1, tiny_run.stdout[-4000:]
    section = found[0]
    assert "parity (4 noisy latents)" in section
    assert re.search(r"forward pass: \d+\.\d+ GFLOP/sample", section)
    for contender in ("torch fp32, batch 8 ", "torch channels_last", "engine fp32 ",
                      "engine bf16 "):
        line = next((ln for ln in section.splitlines() if ln.strip().startswith(contender)),
                    None)
        assert line is not None, (contender, section)
        assert re.search(r"\d+ samples/s +MFU \d+\.\d%", line), line
    assert re.search(r"engine bf16 .*first call \d+\.\d s", section)
    assert re.search(r"process peak RSS \(both frameworks\): \d+\.\d\d GiB", section)
    # 32 samples requested over the 2 inputs: 16 each, all compared.
    agreement = re.search(r"bf16 vs fp32 argmax agreement .*: (\d+)/(\d+) = ", section)
    assert agreement is not None and int(agreement.group(2)) == 32, section
    assert 0 <= int(agreement.group(1)) <= 32
    best = r"best engine \(engine (fp32|bf16)\) vs best PyTorch \(torch .*\): x\d"
    assert re.search(best, section)


def run_benchmark(script: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> <args>`` from the repository root, output captured."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=timeout)


def test_bad_options_are_refused_naming_them():
    done = run_benchmark("generator_throughput.py", "--rounds", "0", timeout=120)
    assert done.returncode == 2
    assert "--rounds=0" in done.stderr


def test_conv_layers_checks_every_path_against_torch_and_reports_the_gap():
    """`conv_layers.py` at 32 px, batch 1: every ResNet-50 convolution shape, each JAX path
    compared with PyTorch (the script exits 1 on a mismatch), one row per shape, the totals."""
    done = run_benchmark("conv_layers.py", "--batch", "1", "--size", "32", "--rounds", "1",
                         "--threads", "1", "--min-seconds", "0", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [ln for ln in done.stdout.splitlines() if re.match(r"\s*\d+\s+\d+\s+[137]\s+[12]\s", ln)]
    # 23 distinct shapes: the stem, and per stage 1x1/3x3/1x1 (+ the strided variants and
    # the projection) — ResNet-50 at 32 px has the same shapes list as at 224 px.
    assert len(rows) == 23, done.stdout
    assert sum(int(ln.split()[5]) for ln in rows) == 53  # 1 stem + 16 blocks x 3 + 4 shortcuts
    assert re.search(r"whole network .* torch/engine x\d+\.\d\d", done.stdout)
    assert re.search(r"float32 matmul 2048\^3, GFLOP/s: xla \d+, torch \d+", done.stdout)


def test_conv_layers_times_the_world_nets_shapes():
    """`conv_layers.py --net world`: the built-in world classifiers' 10 distinct convolution
    shapes (11 convolutions: stem, 2 + 3 + 3 in the stages, 2 prototype add-ons), each path
    checked against torch (exit 1 on a mismatch)."""
    done = run_benchmark("conv_layers.py", "--net", "world", "--batch", "1", "--size", "32",
                         "--rounds", "1", "--threads", "1", "--min-seconds", "0", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("built-in world classifiers convolutions at 32 px")
    rows = [ln for ln in done.stdout.splitlines() if re.match(r"\s*\d+\s+\d+\s+[13]\s+[12]\s", ln)]
    assert len(rows) == 10, done.stdout
    assert sum(int(ln.split()[5]) for ln in rows) == 11
    assert {int(ln.split()[4]) for ln in rows} == {32, 16, 8}, done.stdout


def test_conv_layers_refuses_bad_options_naming_them():
    done = run_benchmark("conv_layers.py", "--batch", "0", timeout=120)
    assert done.returncode == 2
    assert "--batch=0" in done.stderr


def test_compiler_options_compiles_both_ways_and_compares_outputs():
    """`compiler_options.py` on the built-in world: both compile times, the per-call speed
    ratio and the output comparison are printed; the two compilations' logits pick the same
    class for all 16 samples x 4 classifiers (their difference is float rounding, 2e-4 of
    logits of ~26 on the machines measured, far below the logit gaps)."""
    done = run_benchmark("compiler_options.py", "--cases", "world", "--rounds", "1",
                         "--seconds", "0.05", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("world:")), None)
    assert line is not None, done.stdout
    assert re.search(r"compile \d+\.\d\d s -> \d+\.\d\d s \(speed-up x\d+\.\d\d\)", line), line
    assert re.search(r"speed x\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d over 1 rounds\)", line), line
    assert re.search(r"max \|Δ logits\| \d\.\de[-+]\d\d of ", line), line
    assert "argmax agreement 64/64" in line, line


def test_compiler_options_refuses_bad_options_naming_them():
    done = run_benchmark("compiler_options.py", "--rounds", "0", timeout=120)
    assert done.returncode == 2
    assert "--rounds=0" in done.stderr


def test_main_job_times_the_command_by_stage_and_the_nets_against_pytorch():
    """`main_job.py` on a 1-input main command: every stage line with its compile time, the
    estimation rate, the world's parity with its PyTorch twin (argmax agreement on every
    head) and the engine's ratio to PyTorch's best batch; bf16 only where lscpu shows units;
    the shared pass of the models against one pass per model, with identical counts."""
    done = run_benchmark("main_job.py", "--inputs", "1", "--rounds", "1", "--seconds", "0.05",
                         "--num", "32", "--batches", "8", "16", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"CPU: .*ISA flags: ", out), out
    assert re.search(r"`certify latent --sigma 0\.1 --quiet --inputs 1 --units-at-once 1`: "
                     r"\d+\.\d s in all, \d+\.\d s of it XLA compilation", out), out
    for stage in ("pool", "inputs", "selection", "estimation", "bounds", "the rest"):
        assert re.search(rf"^   {stage} +\d+\.\d\d s  \(compile +\d+\.\d\d s", out, re.M), stage
    assert re.search(r"estimation: 1000 samples of 3 models, \d+ samples/s", out), out
    assert re.search(r"as users run it \(batches two at a time on CPU\): \d+\.\d s, against "
                     r"\d+\.\d s one at a time, both after .*: x\d+\.\d\d", out), out
    parity = next(ln for ln in out.splitlines() if "parity (fp32" in ln)
    assert "std 100.00%, cbm 100.00%, proto 100.00%" in parity, parity
    assert re.search(r"engine fp32 +\d+ samples/s   x\d+\.\d\d \(.*\) vs PyTorch's best fp32 "
                     r"batch, chunk \d+", out), out
    bf16_units = "no bf16 units" not in out
    assert ("engine bf16 vs engine fp32" in out) == bf16_units, out
    # Part 3: the models' shared pass against one pass per model, same votes either way.
    assert re.search(r"^   one pass, all models +\d+ samples/s$", out, re.M), out
    assert re.search(r"^   one pass per model +\d+ samples/s$", out, re.M), out
    assert re.search(r"sharing saves x\d+\.\d\d .*; counts identical per model: True", out), out


def test_sequential_refuses_a_tolerance_that_is_not_positive():
    done = run_benchmark("sequential.py", "--tolerances", "1", "0", timeout=120)
    assert done.returncode == 2
    assert "--tolerances=[1.0, 0.0]" in done.stderr, done.stderr


def test_main_job_refuses_bad_options_naming_them():
    for args, flag in ((["--inputs", "0"], "--inputs=0"), (["--batches", "8", "0"], "--batches=0")):
        done = run_benchmark("main_job.py", *args, timeout=120)
        assert done.returncode == 2
        assert flag in done.stderr, done.stderr


def test_attack_units_times_both_ways_and_checks_the_points_agree():
    """`attack_units.py --quick`: one at a time and two at once timed, their ratio printed,
    and the adversarial points compared (the script exits 1 if they differ)."""
    done = run_benchmark("attack_units.py", "--quick", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"CPU .+, \d+ logical CPUs", out), out
    assert re.search(r"one at a time: +\d+\.\d\d s", out) and re.search(
        r"2 at once: +\d+\.\d\d s", out), out
    assert re.search(r"2 at once vs one at a time: x\d+\.\d\d", out), out
    assert "adversarial points identical: yes" in out
    refused = run_benchmark("attack_units.py", "--units", "1", timeout=120)
    assert refused.returncode == 2 and "--units=1" in refused.stderr, refused.stderr
