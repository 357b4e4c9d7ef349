#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one pass, for a machine that has one and its own
# CUDA build of torch (python3, with pytest and psutil): the tests marked `cuda`, then the
# GPU benchmarks. Each step has its own time limit and the next one runs whatever the
# last gave; what each printed lands in $OUT (default ./gpu-out), one file per step.
#
#   OUT=/some/dir benchmarks/gpu_checks.sh     # all steps (about 12 min at most)
#   benchmarks/gpu_checks.sh tests             # the cuda tests
#   benchmarks/gpu_checks.sh bench             # the benchmarks
#   benchmarks/gpu_checks.sh rpc-cuda-costs restart-gpu   # the steps named, as below
#   (cuda-restart: only the in-process restart's cuda tests, which cuda-other runs too)
#
# On an H100 (16 CPUs) the cuda RPC tests took about 5 s a test one at a time (260 s); they
# now run 6 at a time (they share the GPU; 16 CPUs), except the memory test, which reads
# the device's free memory and runs alone. cuda-other took about 100 s, restart-gpu 72 s
# for two variants (three now) and rpc-cuda 25 s.  At most 8 files come back from a
# device call: machine.txt, summary.txt and one per step, so name at most 6 steps a call.
#
# rallypoint runs from this checkout (PYTHONPATH=src) on the machine's own python3, whose
# CUDA torch is the one used (a venv made from it would not see its packages); CI never
# runs this.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export RES_OPTIONS="timeout:1 attempts:1"

RUN=$PY  # the machine's own interpreter (its CUDA torch, pytest, psutil)
if ! "$RUN" -c "import rallypoint, sys; sys.exit(not rallypoint.__file__.startswith('$PWD/'))" \
    2>/dev/null; then
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi

step() {  # step NAME SECONDS COMMAND...: run it, keep its output, say how it ended
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    # SIGINT at the limit: pytest then still prints what failed and why (KILL 20 s later)
    timeout -s INT -k 20 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - started)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi -L; "$RUN" -c "import torch; print(torch.__version__, torch.version.cuda)"; } \
    >"$OUT/machine.txt" 2>&1

wanted=" ${*:-all} "
wanted=${wanted/ all / tests bench }
wanted=${wanted/ tests / cuda-rpc cuda-rpc-memory cuda-other }
wanted=${wanted/ bench / rpc-cuda-costs restart-gpu rpc-cuda launch-cuda }
want() { [[ $wanted == *" $1 "* ]]; }
PYTEST=("$RUN" -m pytest -m cuda -p no:cacheprovider -v -rfEs --tb=short
    --timeout 90 --durations=10)

want rpc-cuda-costs && step rpc-cuda-costs 150 "$RUN" benchmarks/rpc_cuda_costs.py --phases
want cuda-rpc && step cuda-rpc 200 "${PYTEST[@]}" -n 6 --dist load -k "not memory_growth" \
    tests/rpc/cuda
want cuda-rpc-memory && step cuda-rpc-memory 90 "${PYTEST[@]}" -rP -k memory_growth tests/rpc/cuda
want cuda-restart && step cuda-restart 200 "${PYTEST[@]}" -rP \
    tests/supervise/test_inprocess_restart_cuda.py
want cuda-other && step cuda-other 220 "${PYTEST[@]}" -rP tests/supervise/test_inprocess_restart_cuda.py \
    tests/supervise/test_numa_binding.py tests/observe/test_flight_nccl.py \
    tests/elastic/test_launcher_health.py tests/elastic/test_elastic_burn_in.py tests/ft/test_ft_nccl.py
want restart-gpu && step restart-gpu 200 "$RUN" benchmarks/restart_gpu.py --repeat 2
want rpc-cuda && step rpc-cuda 90 "$RUN" benchmarks/rpc.py --only cuda --quick
want launch-cuda && step launch-cuda 200 "$RUN" benchmarks/launch.py --sizes 16 --cuda-sizes 8 \
    --repeat 2 --skip-recovery
exit 0
