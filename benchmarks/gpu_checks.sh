#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one pass, for a machine that has one and its own
# CUDA build of torch (python3, with pytest and psutil): the tests marked `cuda`, then the
# GPU benchmarks. Each step has its own time limit and the next one runs whatever the
# last gave; what each printed lands in $OUT (default ./gpu-out), one file per step.
#
#   OUT=/some/dir benchmarks/gpu_checks.sh     # all steps (about 10 min at most)
#   benchmarks/gpu_checks.sh tests             # only the cuda tests (5 min at most)
#   benchmarks/gpu_checks.sh bench             # only the benchmarks (6 min at most)
#
# rallypoint is installed (no dependencies) into a venv that sees the machine's packages,
# so the GPU's own torch is the one used; CI never runs this.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
PY=${PYTHON:-python3}
VENV=${GPU_VENV:-/tmp/rallypoint-gpu-venv}
mkdir -p "$OUT"
export RES_OPTIONS="timeout:1 attempts:1"

if [[ ! -x $VENV/bin/python ]]; then
    "$PY" -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install --quiet --no-deps --no-build-isolation -e . || true
fi
RUN="$VENV/bin/python"
if ! "$RUN" -c "import rallypoint, sys; sys.exit(not rallypoint.__file__.startswith('$PWD/'))" \
    2>/dev/null; then
    echo "gpu_checks: rallypoint is not installed from here; using PYTHONPATH=src" >&2
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi

step() {  # step NAME SECONDS COMMAND...: run it, keep its output, say how it ended
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - started)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi -L; "$RUN" -c "import torch; print(torch.__version__, torch.version.cuda)"; } \
    >"$OUT/machine.txt" 2>&1

what=${1:-all}
[[ $what == bench ]] || step cuda-tests 300 "$RUN" -m pytest -m cuda -p no:cacheprovider -q -rs \
    tests/rpc/cuda tests/supervise/test_inprocess_restart_cuda.py \
    tests/supervise/test_numa_binding.py tests/observe/test_flight_nccl.py \
    tests/elastic/test_launcher_health.py tests/elastic/test_elastic_burn_in.py
[[ $what == tests ]] && exit 0

step restart-gpu 140 "$RUN" benchmarks/restart_gpu.py --repeat 2
step rpc-cuda 90 "$RUN" benchmarks/rpc.py --only cuda --quick
step launch-cuda 120 "$RUN" benchmarks/launch.py --sizes 16 --cuda-sizes 8 --repeat 2 \
    --skip-recovery
