#!/usr/bin/env bash
# One device call for the transports at Kimi K2.6 shapes (about 5 minutes on an H200): the GPU tests of the
# transports, a random-weight K2.6 pair (5 target layers, ~43 GB in /tmp), then bench_transport.py at C = 1 and 32.
# Run from the repo root; logs and JSONL go to $OUT (bench/results/run when unset). Extra bench flags: BENCH_ARGS;
# TESTS=0 skips the tests; K26=DIR reuses a pair already there.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
python -c "import torch, triton, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'grpcio', grpc.__version__)" \
  | tee -a "$OUT/gpu.txt"
tests=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${T_TESTS:-200}" python -m pytest -q -rs -m gpu --durations=5 tests/unit/test_transports.py \
    tests/unit/test_shared_region.py tests/unit/test_tree_verdicts.py tests/unit/test_doorbell.py \
    tests/integration/test_gpu_transport.py 2>&1 | tee "$OUT/gpu_tests.log"
  tests=$?
fi
K26=${K26:-/tmp/k26}
[ -d "$K26/target" ] || { time python -m gateway.cli init-random --preset kimi-k2.6 --layers 5 --out "$K26" ; } 2>&1 | tail -3
timeout "${T_BENCH:-300}" python bench/bench_transport.py --pair "$K26" --concurrency 1 32 --steps 60 --warmup 6 \
  --out "$OUT/transport_k26.jsonl" $BENCH_ARGS 2>&1 | tee "$OUT/bench_transport_k26.log"
bench=$?
echo "tests exit $tests, bench exit $bench" | tee -a "$OUT/gpu.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
