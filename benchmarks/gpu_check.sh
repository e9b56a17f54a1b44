#!/usr/bin/env bash
# GPU check (≤ 6 minutes on one H200): the Triton kernel tests compiled on
# CUDA (with the one-pass token_stats grid), the distributed tests on NCCL, the GPU benchmark (with
# the one-pass rows) and the linear_kl rows (bench_gpu.py --linear). Prints everything and writes
# its logs, CSV and markdown under benchmarks/results/gpu/.
# Run from the repository root: bash benchmarks/gpu_check.sh   (PYTHON=... to pick the interpreter)
set -u
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=benchmarks/results/gpu
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # klpenalty from this checkout, not installed
# step limits sum to 390 s (6.5 min worst case; typical runs are shorter)
status=0

echo "== environment"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gpus', torch.cuda.device_count())"
$PY -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" = "0" ]; then echo "no CUDA device: nothing to check"; exit 2; fi

echo "== kernel tests on CUDA (tests/ops/test_triton.py, compiled, no interpreter)"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/ops/test_triton.py --durations=5 2>&1 | tee "$OUT/test_triton.log"
[ "${PIPESTATUS[0]}" = "0" ] || status=1

echo "== distributed tests with NCCL (tests/distributed: one rank per GPU, groups of 2 and 4 as far as"
echo "   there are GPUs, else a single rank on one GPU; the checks that compare ranks skip there)"
timeout 60 $PY -m pytest -q -p no:cacheprovider tests/distributed -ra 2>&1 | tee "$OUT/test_distributed.log"
[ "${PIPESTATUS[0]}" = "0" ] || status=1

echo "== benchmark (benchmarks/bench_gpu.py; its last rows: KL + log-probs + entropy, three calls vs one token_stats call)"
timeout 150 $PY benchmarks/bench_gpu.py --repeats 5 --out "$OUT" 2>&1 | tee "$OUT/bench_gpu.log"
[ "${PIPESTATUS[0]}" = "0" ] || status=1
echo "== linear_kl benchmark (benchmarks/bench_gpu.py --linear)"
timeout 60 $PY benchmarks/bench_gpu.py --linear --repeats 5 --warmup 1 --out "$OUT" 2>&1 | tee "$OUT/bench_gpu_linear.log"
[ "${PIPESTATUS[0]}" = "0" ] || status=1
echo "== done (status $status); results in $OUT"
exit $status
