#!/usr/bin/env bash
# One device call for the seesaw MLA kernel's tiles in pieces (`mla_attention_triton(pieces=)`, forty-sixth session):
# its GPU tests (bitwise the kernel that waits for whole tiles, pages 16 / 64, with the value split too), then, if they
# pass, the bench of the 18 cases (batch 1 / 16, prefix 1k / 4k / 32k, 9 / 33 / 65 nodes; page 64) with
# pieces off and on, and of batch 1 at 1k / 4k as 8 layers back to back. About 6 minutes. Logs and JSONL under $OUT
# (bench/results/run when unset); run from the repo root and set DDTREE_COMMIT (the device's .git is stale).
# T_TESTS / T_BENCH / T_LAYERS: section limits; TESTS=0 skips the tests.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/pieces_gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/pieces_gpu.txt"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${T_TESTS:-240}" python -m pytest tests/kernels/test_mla_attention_gpu.py -q -x -rs --durations=5 \
    -k pieces 2>&1 | tee "$OUT/tests_pieces.log" | tail -8 || exit 1
fi
timeout "${T_BENCH:-300}" python bench/bench_mla_attention.py --no-peers --impl gluon_seesaw --pieces off on \
  --out "$OUT/mla_attention_pieces.jsonl" 2>&1 | tee "$OUT/bench_mla_pieces.log" || status=1
timeout "${T_LAYERS:-120}" python bench/bench_mla_attention.py --no-peers --impl gluon_seesaw --pieces off on \
  --batch 1 --prefix 1024 4096 --tree 9 65 --layers 8 --out "$OUT/mla_attention_pieces.jsonl" 2>&1 \
  | tee -a "$OUT/bench_mla_pieces.log" || status=1
echo "exit $status" | tee -a "$OUT/pieces_gpu.txt"
exit $status
