#!/usr/bin/env bash
# One device call for the MLA kernel options written in the twenty-fifth to twenty-seventh sessions without a GPU
# (read docs/performance.md, "Twenty-fifth session" and "Twenty-seventh session"):
#   1. the GPU tests of the persistent kernel (bitwise against the grid kernel, whose PTX the sessions did not change),
#      of bf16 partials, of the fold (bitwise against the split launch) and batch invariance with both partial dtypes
#      (TESTS_K, default `(persistent or partials or invariance or fold) and not seesaw`), then the kernel bench with
#      the persistent kernel off / on and the partials in fp32 / bf16 (page 64; PAGE16=1: also the serving page 16 at
#      4k / 32k), and the Triton kernel with the fold off / on (B 16, 65 nodes, 4k / 32k);
#   2. the seesaw kernel's GPU tests (`-k seesaw`, its own time limit: a hang there costs only T_SEESAW), then, if
#      they pass, the bench of gluon against gluon_seesaw;
#   3. STEP=1: the whole verify step (8 K2.6 layers, 32k prefix, 33-node trees) with the persistent kernel off / on
#      (STEP_ARGS adds options, e.g. "--mla-partials out").
# MLA_ARGS adds options to step 1's bench (e.g. "--c-min 512 1024": the base chunk size's trade-off at 4k). At the end
# the tables of every MLA record of the call (summary.md). Logs and JSONL under $OUT (bench/results/run when unset).
# Worst case the time limits add up to more than one device call (600 s): split it, MAIN=0 skips step 1 and SEESAW=0
# step 2 (e.g. call 1 SEESAW=0, call 2 MAIN=0 STEP=1). Run from the repo root; set DDTREE_COMMIT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${MAIN:-1}" = 1 ] && timeout "${T_TESTS:-240}" python -m pytest tests/kernels/test_mla_attention.py -q -x -rs --durations=8 \
    -k "${TESTS_K:-(persistent or partials or invariance or fold) and not seesaw}" 2>&1 | tee "$OUT/tests_mla.log"; then
  timeout "${T_MLA:-300}" python bench/bench_mla_attention.py --no-peers --impl gluon --persistent off on \
    --partials fp32 out --out "$OUT/mla_attention.jsonl" $MLA_ARGS 2>&1 | tee "$OUT/bench_mla_attention.log"
  # the fold (Triton kernel only so far): what dropping the partials' round trip and the combine buys at B 16
  timeout "${T_FOLD:-120}" python bench/bench_mla_attention.py --no-peers --impl triton --fold off on --batch 16 \
    --prefix 4096 32768 --tree 65 --out "$OUT/mla_attention_fold.jsonl" 2>&1 | tee "$OUT/bench_mla_fold.log"
  if [ "${PAGE16:-0}" = 1 ]; then
    timeout "${T_MLA16:-120}" python bench/bench_mla_attention.py --no-peers --impl gluon --persistent off on \
      --partials fp32 out --page 16 --prefix 4096 32768 --out "$OUT/mla_attention_page16.jsonl" 2>&1 | tee "$OUT/bench_mla_page16.log"
  fi
fi
if [ "${SEESAW:-1}" = 1 ] && timeout "${T_SEESAW:-150}" python -m pytest tests/kernels/test_mla_attention.py -q -x \
    -rs -k seesaw 2>&1 | tee "$OUT/tests_mla_seesaw.log"; then
  timeout "${T_MLA_SEESAW:-150}" python bench/bench_mla_attention.py --no-peers --impl gluon gluon_seesaw \
    --out "$OUT/mla_attention_seesaw.jsonl" 2>&1 | tee "$OUT/bench_mla_seesaw.log"
fi
if [ "${STEP:-0}" = 1 ]; then
  for p in off on; do
    timeout "${T_STEP:-200}" python bench/bench_verify_step.py --invariant on --prefix 32768 --trees 33 \
      --mla-persistent "$p" --out "$OUT/verify_step.jsonl" $STEP_ARGS 2>&1 | tee "$OUT/bench_verify_step_$p.log"
  done
fi
if ls "$OUT"/mla_attention*.jsonl >/dev/null 2>&1; then
  python bench/summarize.py "$OUT"/mla_attention*.jsonl 2>&1 | tee "$OUT/summary.md"
fi
