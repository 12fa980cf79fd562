#!/usr/bin/env bash
# Twelfth session, one device call: the Gluon MoE GPU tests, the layer benchmark of its schedules (register path vs
# the cp.async ring, 1- and 4-warp programs) and the whole verify step per MoE schedule. Output under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${T_TESTS:-200}" python -m pytest tests/kernels/test_int4_moe_gluon.py -q -rs -x -m gpu 2>&1 \
    | tee "$OUT/gpu_tests.log"
fi
timeout "${T_MOE:-220}" python bench/bench_int4_moe.py --no-peers --tokens ${TOKENS:-1 9 33 129} --gluon $VARIANTS \
  --out "$OUT/int4_moe_gluon.jsonl" 2>&1 | tee "$OUT/bench_int4_moe.log"
# STEPS: ';'-separated verify-step configs, each "LAYOUT [STAGES W13 W2 PAIRS]"
IFS=';' read -ra cfgs <<< "${STEPS:-}"
for cfg in "${cfgs[@]}"; do
  read -r layout stages w13 w2 pairs <<< "$cfg"
  extra=()
  [ "$layout" = gluon ] && extra=(--moe-stages "$stages" --moe-warps "$w13" "$w2" --moe-block-pairs "$pairs")
  timeout "${T_STEP:-150}" python bench/bench_verify_step.py --prefix 4096 --batch ${STEP_BATCH:-1 16} \
    --trees ${STEP_TREES:-1 9 33} --invariant on --moe-layout "$layout" "${extra[@]}" \
    --out "$OUT/verify_step_moe.jsonl" 2>&1 | tee -a "$OUT/bench_verify_step.log"
done
