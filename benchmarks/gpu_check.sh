#!/usr/bin/env bash
# GPU check in at most BUDGET seconds (480 s: the step limits below), in this order, the result
# files first: the GPU benchmark (bench_gpu.py, which prints Python, torch, Triton and the GPU
# first), the linear_kl rows (bench_gpu.py --linear), the Triton kernel tests compiled on CUDA
# (tests/ops/test_triton.py) and the distributed tests on NCCL. Everything goes under
# $RES = $OUT when it is set, else benchmarks/results/gpu: bench_gpu.{csv,md},
# bench_gpu_linear.{csv,md} (rows appended as they are measured, so a step stopped at its limit
# keeps its rows), gpu_check.log (all output) and summary.txt, which is also printed last. Each
# step is stopped at its limit, so the script ends within BUDGET and a few seconds with its
# summary printed: whatever runs it with a time limit of its own should allow that much.
# Run from the repository root: bash benchmarks/gpu_check.sh   (PYTHON=... picks the interpreter;
# BENCH_ARGS / LINEAR_ARGS: extra arguments of the two benchmark steps, e.g. smaller shapes)
set -u
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
RES=${OUT:-benchmarks/results/gpu}
mkdir -p "$RES"
LOG="$RES/gpu_check.log"
SUMMARY="$RES/summary.txt"
: >"$LOG"
: >"$SUMMARY"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # klpenalty from this checkout, not installed
export PYTHONUNBUFFERED=1

# Step limits in seconds; a stopped step gets KILL_AFTER more before SIGKILL. The four limits
# and their kill grace sum to BUDGET. Each step's limit is also cut to what is left of BUDGET
# after the reserved limits of the steps after it, so the whole check never runs past BUDGET.
BUDGET=480
KILL_AFTER=2
T_BENCH=220
T_LINEAR=80
T_KERNEL=120          # with pytest-xdist (-n 4): ~140 cold compilations on 4 workers
T_KERNEL_SERIAL=250   # without it: whatever is left of BUDGET, at most this
T_DIST=52
START=$SECONDS
status=0

# step NAME NOMINAL RESERVED_AFTER CMD...: run CMD under its limit, log it, note the result.
step() {
    local name=$1 nominal=$2 reserved=$3
    shift 3
    local left=$(( BUDGET - (SECONDS - START) - reserved - KILL_AFTER ))
    local limit=$(( nominal < left ? nominal : left ))
    echo "== $name (limit ${limit} s)" | tee -a "$LOG"
    if [ "$limit" -lt 1 ]; then
        echo "$name: not run, the budget is spent" | tee -a "$LOG"
        printf '%-10s rc=%-4s %4ss of %4ss\n' "$name" "skip" 0 0 >>"$SUMMARY"
        status=1
        last_rc=skip
        return
    fi
    local t0=$SECONDS
    timeout -k "$KILL_AFTER" "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    last_rc=$rc
    [ "$rc" = "0" ] || status=1
    if [ "$rc" = "124" ] || [ "$rc" = "137" ]; then
        echo "$name: stopped at its limit (${limit} s)" | tee -a "$LOG"
    fi
    printf '%-10s rc=%-4s %4ss of %4ss\n' "$name" "$rc" $(( SECONDS - t0 )) "$limit" >>"$SUMMARY"
}

# the benchmark prints Python, torch, Triton and the GPU first; without a CUDA device it exits 2
step bench "$T_BENCH" $(( T_LINEAR + T_KERNEL + T_DIST + 3 * KILL_AFTER )) \
    $PY benchmarks/bench_gpu.py --repeats 5 --compile-budget 90 --out "$RES" ${BENCH_ARGS:-}
if [ "$last_rc" = "2" ] && grep -q "no CUDA device here" "$LOG"; then
    echo "no CUDA device: nothing to check" | tee -a "$LOG"
    exit 2
fi
step linear "$T_LINEAR" $(( T_KERNEL + T_DIST + 2 * KILL_AFTER )) \
    $PY benchmarks/bench_gpu.py --linear --repeats 5 --warmup 1 --out "$RES" ${LINEAR_ARGS:-}

if $PY -c "import xdist" >/dev/null 2>&1; then
    KERNEL_LIMIT=$T_KERNEL; KERNEL_ARGS=(-n 4)
else
    KERNEL_LIMIT=$T_KERNEL_SERIAL; KERNEL_ARGS=()
fi
step kernels "$KERNEL_LIMIT" $(( T_DIST + KILL_AFTER )) \
    $PY -m pytest -q -p no:cacheprovider tests/ops/test_triton.py --durations=5 "${KERNEL_ARGS[@]}"
# tests/distributed: one rank per GPU, groups of 2 and 4 as far as there are GPUs, else a single
# rank on one GPU (the checks that compare ranks skip there)
step distributed "$T_DIST" 0 \
    $PY -m pytest -q -p no:cacheprovider tests/distributed -ra

# The summary, printed last (so that the end of the output holds it): the result tables, the
# test outcomes, then the steps and the status.
{
    echo
    echo "== summary"
    for f in bench_gpu.md bench_gpu_linear.md; do
        [ -f "$RES/$f" ] && { cat "$RES/$f"; echo; }
    done
    echo "tests:"
    grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|errors?)' "$LOG" | tail -n 20
    echo "steps:"
    cat "$SUMMARY"
    echo "== status $status, $(( SECONDS - START )) s of $BUDGET s; files in $RES"
} >"$RES/summary.tmp"
mv "$RES/summary.tmp" "$SUMMARY"
cat "$SUMMARY"
exit $status
