#!/usr/bin/env bash
# The prepared accelerator benchmark (issue 19): full-size generator → ResNet-50 pipelines with
# random weights, the engine in fp32 and bf16 against the PyTorch loop (fp32 at batches 8-512,
# channels_last and bf16 autocast at its best batch), on one GPU (or TPU) machine, in under
# 8 minutes. Prints samples/s, MFU against the measured matmul peaks, the first call
# (compilation) apart, peak device memory, bf16-vs-fp32 label agreement on 10^4 samples and
# the versions. Everything goes to stdout; nothing is written.
#
#   bash benchmarks/accelerator.sh                  # on the accelerator machine, from the repo
#   CBCERT_BENCH_SCALE=tiny bash benchmarks/accelerator.sh   # its CPU test (tests/test_benchmarks.py)
#
# Environment: CBCERT_BENCH_SCALE (full | reduced | tiny; default full), PYTHON (default
# python3), CBCERT_BENCH_LIMIT (seconds for each pipeline; default 225, so both end in 8 min),
# CBCERT_BENCH_THREADS (CPU threads; default all), CBCERT_BENCH_ARGS (more options for
# benchmarks/generator_throughput.py, e.g. "--rounds 1"). No install: the repository is put on
# PYTHONPATH, and jax, flax and torch must already be importable (the GPU image has them).
set -uo pipefail
cd "$(dirname "$0")/.."
scale=${CBCERT_BENCH_SCALE:-full}
python=${PYTHON:-python3}
limit=${CBCERT_BENCH_LIMIT:-225}
threads=${CBCERT_BENCH_THREADS:-$(nproc)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# JAX must not take 75 % of the GPU up front: PyTorch runs in the same process, and the peak
# memory JAX reports should be what the engine used.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# A rerun on the same machine (e.g. after a time-out) skips the compilations already done.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/cbcert-jax-cache}

echo "accelerator benchmark, $(date -u '+%Y-%m-%d %H:%M UTC'), scale $scale, $(uname -m)," \
     "$(nproc) CPUs, git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
else
    echo "no nvidia-smi: no NVIDIA GPU here (a CPU run measures the script, not a chip)"
fi
"$python" - <<'EOF' || { echo "the benchmark needs jax, flax and torch importable"; exit 2; }
import jax, flax, torch
print(f"python {__import__('platform').python_version()}, jax {jax.__version__} "
      f"({jax.default_backend()}: {jax.devices()}), flax {flax.__version__}, torch "
      f"{torch.__version__} (cuda {torch.cuda.is_available()})")
EOF

status=0
for pipeline in stylegan2 biggan; do
    # One time limit per pipeline: a slow compilation of one cannot take the other's output.
    timeout --signal=INT "$limit" "$python" benchmarks/generator_throughput.py --scale "$scale" \
        --pipeline "$pipeline" --dtype both --threads "$threads" --rounds 2 ${CBCERT_BENCH_ARGS:-}
    code=$?
    if [ "$code" -ne 0 ]; then
        echo "$pipeline: exit code $code$([ "$code" -eq 124 ] && echo " (over ${limit} s)")"
        status=1
    fi
done
exit "$status"
