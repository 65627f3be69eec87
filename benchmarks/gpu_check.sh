#!/usr/bin/env bash
# The GPU checks, as one prepared command for a machine with CUDA (on one H100 the tests
# took 73 s on 4 xdist workers, and the benchmark of two models about 140 s before the
# preconditioner's Gaussian fit ran on CUDA, over 190 s after it): the device tests with
# `cuda` among their devices, then every implicit loss's SVI step on the GPU against AutoNormal and, where
# JAX and NumPyro are installed, NumPyro on JAX's GPU platform
# (benchmarks/results/gpu_steps.md holds the first runs' numbers, gpu_steps_1e628f5.md the
# latest).
#
#   PYRO_IMPLICIT_DATA=/path/to/data OUT=/path/to/results bash benchmarks/gpu_check.sh
#
# Needs pyro-ppl and the checkout importable (PYTHONPATH), the Boston data under
# $PYRO_IMPLICIT_DATA/uci/bostonHousing and the waveform data under $PYRO_IMPLICIT_DATA/sivi.
set -u
OUT=${OUT:-.}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
# -p no:benchmark: where pytest-benchmark is installed, its warning that xdist disables it
# is an error under the project's warnings-as-errors (an INTERNALERROR before any test)
timeout "${TEST_S:-300}" "$PYTHON" -m pytest -q -p no:cacheprovider -p no:benchmark -n 4 \
    tests/test_devices.py \
    2>&1 | tee "$OUT/test_devices_cuda.txt" | tail -n 20
cd benchmarks || exit 1
NUMPYRO=()
if "$PYTHON" -c "import numpyro, jax" 2>/dev/null; then
    NUMPYRO=(--numpyro-python "$PYTHON")
fi
timeout "${BENCH_S:-400}" "$PYTHON" compiled_score.py --only-losses --device cuda \
    --loss-particles 100 --calls 200 --repeats 2 \
    --models "${MODELS:-hierarchical_logistic,boston_bnn}" \
    --losses "${LOSSES:-autonormal,kivi-fx,stein-fx,asvgd-fx,gpvi-fx,sivi-fx,livi-fx}" \
    ${NUMPYRO[@]+"${NUMPYRO[@]}"} --out "$OUT/gpu_steps.md" > "$OUT/gpu_steps.log" 2>&1
echo "benchmark exit status $?"
tail -n 40 "$OUT/gpu_steps.log"
