#!/usr/bin/env bash
# One device call for the seesaw MLA kernel's fold in its last program (`mla_attention_triton(combine="last")`,
# forty-seventh session): its GPU tests (bitwise the combine launch, a second launch and a CUDA-graph replay), then,
# if they pass, the bench of the 18 cases (batch 1 and 16; 1k / 4k / 32k; 9 / 33 / 65 nodes) with the
# combine launch and with the last program folding, batch 1 also as 8 layers back to back, and batch 16 at 1k / 4k
# again with a serving pool's block table (131072 keys: 16 chunk slots a tile, most of them empty programs). About
# 6 minutes. Logs and JSONL under $OUT (bench/results/run when unset); run from the repo root and set DDTREE_COMMIT
# (the device's .git is stale). T_TESTS / T_BENCH / T_BENCH1 / T_WIDE: section limits; TESTS=0 skips the tests.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/last_gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/last_gpu.txt"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${T_TESTS:-240}" python -m pytest tests/kernels/test_mla_attention_gpu.py -q -x -rs --durations=5 \
    -k "last_combine or default_kernel" 2>&1 | tee "$OUT/tests_last.log" | tail -8 || exit 1
fi
timeout "${T_BENCH:-200}" python bench/bench_mla_attention.py --no-peers --impl gluon_seesaw --combine launch last \
  --batch 16 --prefix 1024 4096 32768 --tree 9 33 65 --out "$OUT/mla_attention_last.jsonl" 2>&1 \
  | tee "$OUT/bench_mla_last.log" || status=1
timeout "${T_BENCH1:-150}" python bench/bench_mla_attention.py --no-peers --impl gluon_seesaw --combine launch last \
  --batch 1 --prefix 1024 4096 32768 --tree 9 33 65 --layers 8 --out "$OUT/mla_attention_last.jsonl" 2>&1 \
  | tee -a "$OUT/bench_mla_last.log" || status=1
timeout "${T_WIDE:-90}" python bench/bench_mla_attention.py --no-peers --impl gluon_seesaw --combine launch last \
  --batch 16 --prefix 1024 4096 --tree 9 65 --table-len 131072 --out "$OUT/mla_attention_last.jsonl" 2>&1 \
  | tee -a "$OUT/bench_mla_last.log" || status=1
echo "exit $status" | tee -a "$OUT/last_gpu.txt"
exit $status
