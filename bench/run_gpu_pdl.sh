#!/usr/bin/env bash
# One device call for programmatic dependent launch in the one-token layer (`kernels/pdl.py`, opt-in): its GPU tests
# (`-m gpu`; the files' CPU tests need the interpreter): the GEMM chain bitwise with and without PDL, eager and from a
# CUDA graph; kimi-mini's verify forward and greedy DDTree == AR with it. Then, only if they pass, the verify step with PDL
# off and on for each case (8 K2.6 layers on a GPU of 100 GB or more, else 6; STEP_ARGS adds options). Logs and JSONL
# under $OUT (bench/results/run when unset). Run from the repo root; set DDTREE_COMMIT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
python -c "import torch, triton; print(torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', \
triton.__version__)" | tee "$OUT/gpu.txt"
timeout "${T_TESTS:-200}" python -m pytest -q -rs -x -m gpu -k pdl tests/kernels/test_matmul.py tests/unit/test_cuda_graphs.py \
  2>&1 | tee "$OUT/tests_pdl.log" || exit 1
layers=$(python -c "import torch; print(8 if torch.cuda.get_device_properties(0).total_memory >= 100e9 else 6)")
# shellcheck disable=SC2086
timeout "${T_STEP:-300}" python bench/bench_verify_step.py --layers "$layers" --invariant on --batch 1 16 \
  --trees 1 9 33 --pdl off on --out "$OUT/verify_step_pdl.jsonl" $STEP_ARGS 2>&1 | tee "$OUT/bench_verify_step_pdl.log"
