#!/usr/bin/env bash
# One device call for programmatic dependent launch in the one-token layer (`kernels/pdl.py`, opt-in): its GPU tests
# (`-m gpu`; the files' CPU tests need the interpreter): the GEMM chain bitwise with and without PDL, eager and from a
# CUDA graph; kimi-mini's verify forward and greedy DDTree == AR with it. Then, only if they pass, the verify step with PDL
# off and on for each case (8 K2.6 layers on a GPU of 100 GB or more, else 6; STEP_ARGS adds options). Logs and JSONL
# under $OUT (bench/results/run when unset). Run from the repo root; set DDTREE_COMMIT. SUITE=1 instead runs, with
# DDTREE_PDL=1, the GPU tests of every file whose kernels PDL touches or that runs the engine on the GPU (SUITE_FILES;
# carry `.whl/`: the transport tests import the wheels the image lacks) and nothing else: ~10 minutes in all on an
# H100 (the thirty-fourth session's took two calls), so SUITE_K selects a part (a pytest -k expression), T_SUITE its
# time limit.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
python -c "import torch, triton; print(torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', \
triton.__version__)" | tee "$OUT/gpu.txt"
if [ "${SUITE:-0}" != 0 ]; then
  # shellcheck source=bench/_wheels.sh
  . bench/_wheels.sh
  SUITE_FILES=${SUITE_FILES:-"tests/kernels/test_matmul.py tests/kernels/test_rmsnorm_kernel.py tests/unit/test_cuda_graphs.py \
tests/unit/test_gpu_exact.py tests/unit/test_draft_graphs.py tests/unit/test_transports_gpu.py tests/unit/test_tree_verdicts.py \
tests/integration/test_gpu_transport.py tests/kernels/test_mla_attention_gpu.py"}
  # shellcheck disable=SC2086
  DDTREE_PDL=1 timeout "${T_SUITE:-560}" python -m pytest -q -rs -m gpu --durations=10 ${SUITE_K:+-k "$SUITE_K"} \
    $SUITE_FILES 2>&1 | tee "$OUT/gpu_tests_pdl_on.log"
  exit
fi
timeout "${T_TESTS:-200}" python -m pytest -q -rs -x -m gpu -k pdl tests/kernels/test_matmul.py tests/unit/test_cuda_graphs.py \
  2>&1 | tee "$OUT/tests_pdl.log" || exit 1
layers=$(python -c "import torch; print(8 if torch.cuda.get_device_properties(0).total_memory >= 100e9 else 6)")
# shellcheck disable=SC2086
timeout "${T_STEP:-300}" python bench/bench_verify_step.py --layers "$layers" --invariant on --batch 1 16 \
  --trees 1 9 33 --pdl off on --out "$OUT/verify_step_pdl.jsonl" $STEP_ARGS 2>&1 | tee "$OUT/bench_verify_step_pdl.log"
