#!/usr/bin/env bash
# One device call: kernel tests on the GPU + both benchmarks. Logs and JSONL go to $OUT
# (the device tool's output folder; bench/results/run when unset). Run from the repo root.
# Extra benchmark flags: MOE_ARGS / MLA_ARGS (e.g. --sweep); section time limits: T_TESTS/T_MOE/T_MLA.
# STEP=1 also runs the whole-verify-step benchmark (8 layers of K2.6, ~90 GB, ~2.5 min; STEP_ARGS, T_STEP).
# DRAFT=1 also runs the draft-step benchmark (kimi-mini drafter, eager vs CUDA graphs; DRAFT_ARGS, T_DRAFT).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${T_TESTS:-200}" python -m pytest tests/kernels -q -rs -x --durations=10 2>&1 | tee "$OUT/tests.log"
timeout "${T_MOE:-200}" python bench/bench_int4_moe.py --out "$OUT/int4_moe.jsonl" $MOE_ARGS 2>&1 \
  | tee "$OUT/bench_int4_moe.log"
timeout "${T_MLA:-240}" python bench/bench_mla_attention.py --out "$OUT/mla_attention.jsonl" $MLA_ARGS 2>&1 \
  | tee "$OUT/bench_mla_attention.log"
if [ "${STEP:-0}" = 1 ]; then
  timeout "${T_STEP:-240}" python bench/bench_verify_step.py --out "$OUT/verify_step.jsonl" $STEP_ARGS 2>&1 \
    | tee "$OUT/bench_verify_step.log"
fi
if [ "${DRAFT:-0}" = 1 ]; then
  timeout "${T_DRAFT:-240}" python bench/bench_draft_step.py --out "$OUT/draft_step.jsonl" $DRAFT_ARGS 2>&1 \
    | tee "$OUT/bench_draft_step.log"
fi
