#!/usr/bin/env bash
# One device call for the co-located transport on the GPU (about 3 minutes): the CUDA IPC tests (tests
# marked gpu in test_transports.py, test_shared_region.py and test_gpu_transport.py), then
# bench_transport.py at C=1 and C=32 on cuda. Logs and JSONL go to $OUT (bench/results/run when unset);
# run from the repo root. Section time limits: T_TESTS / T_BENCH (seconds); extra bench flags: BENCH_ARGS.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
python -c "import torch, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'grpcio', grpc.__version__)" \
  | tee -a "$OUT/gpu.txt"
timeout "${T_TESTS:-150}" python -m pytest -q -rs -m gpu --durations=8 tests/unit/test_transports.py \
  tests/unit/test_shared_region.py tests/integration/test_gpu_transport.py 2>&1 | tee "$OUT/transport_tests.log"
tests=$?
timeout "${T_BENCH:-240}" python bench/bench_transport.py --device cuda --concurrency 1 32 --steps 30 --warmup 5 \
  --time-budget-s 100 --out "$OUT/transport.jsonl" $BENCH_ARGS 2>&1 | tee "$OUT/bench_transport.log"
bench=$?
echo "tests exit $tests, bench exit $bench" | tee -a "$OUT/gpu.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
