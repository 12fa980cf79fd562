#!/usr/bin/env bash
# One device call for the seesaw MLA kernel's value-column split (`mla_attention_triton(vsplit=)`, forty-fifth
# session): its GPU tests (bitwise the unsplit kernel: a warpgroup MMA's sum over the keys at N = 64 / 128 against 256),
# then, if they pass, the bench of small launches (batch 1, 1k / 4k prefixes, 9-65 nodes; one layer and 8 back to
# back) at vsplit 1 / 2 / 4 / auto, and of batch 16 at 1 / auto (auto must leave a launch that fills the GPU alone).
# About 5 minutes (the tests' compiles take most of two). Logs and JSONL under $OUT (bench/results/run when unset);
# run from the repo root and set DDTREE_COMMIT (the device's .git is stale). T_TESTS / T_BENCH: section limits.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/vsplit_gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/vsplit_gpu.txt"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${T_TESTS:-240}" python -m pytest tests/kernels/test_mla_attention_gpu.py -q -x -rs --durations=5 \
    -k value_split 2>&1 | tee "$OUT/tests_vsplit.log" | tail -8 || exit 1
fi
timeout "${T_BENCH:-200}" python bench/bench_mla_attention.py --no-peers --impl gluon_seesaw --vsplit 1 2 4 auto \
  --batch 1 --prefix 1024 4096 --tree 9 33 65 --layers 8 --out "$OUT/mla_attention_vsplit.jsonl" 2>&1 \
  | tee "$OUT/bench_mla_vsplit.log" || status=1
timeout "${T_BENCH16:-120}" python bench/bench_mla_attention.py --no-peers --impl gluon_seesaw --vsplit 1 auto \
  --batch 16 --prefix 1024 4096 --tree 9 65 --out "$OUT/mla_attention_vsplit.jsonl" 2>&1 \
  | tee -a "$OUT/bench_mla_vsplit.log" || status=1
echo "exit $status" | tee -a "$OUT/vsplit_gpu.txt"
exit $status
