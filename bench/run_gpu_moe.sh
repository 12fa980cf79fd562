#!/usr/bin/env bash
# One device call for the wgmma INT4 MoE kernels' schedules: their GPU tests (test_int4_moe_wgmma.py,
# test_int4_moe_wgmma_steps.py and test_int4_moe_ws.py), the layer benchmark of the schedule variants at uniform and
# at crowded routing, then the whole verify step (8 K2.6 layers, prefix 4096) with the default schedule and with
# each schedule in SCHEDULES (JSON options laid over int4_moe_wgmma.auto_schedule, `;`-separated). About 8 minutes
# with the defaults (~250 s of them the tests). Logs and JSONL go to $OUT (bench/results/run when unset); run from
# the repo root. Overrides:
# VARIANTS (bench_int4_moe --gluon names), TOKENS, POOL_TOKENS, LAYERS (0: no back-to-back timing), STEP_ARGS,
# MOE_LAYOUTS (the verify step's, default wgmma_steps, each with the default schedule: "wgmma wgmma_steps" to compare
# the weight orders), TESTS_K (a pytest -k filter of the tests, e.g.
# "counted or decode_options or cuda_graph"); section time limits T_TESTS / T_LAYER / T_STEP (seconds); TESTS=0 / STEP=0 skip.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
# auto_schedule on the step-major weights (the default layout: at T = 1 the ws GEMMs in the timed graphs) beside the
# ring kernels there, the ws GEMMs with one w2 row tile (the default: 2), the combine in w2, and auto_schedule on
# the row-major "wgmma" ones (the fused decode, measured slower in the twenty-third session, is
# VARIANTS=wgmma_steps_fused); at T = 1 each is also timed as 8 layers back to back, LAYERS, and every T beside the read peer: bench_int4_moe.py's docstring
VARIANTS=${VARIANTS:-"wgmma_steps_auto wgmma_steps_ring wgmma_steps_ws_rt1 wgmma_steps_w2c wgmma_auto"}
SCHEDULES=${SCHEDULES:-'{"w2_combine": true};{"w2_combine": true, "row_tiles": 2}'}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${T_TESTS:-300}" python -m pytest -q -rs -m gpu --durations=5 tests/kernels/test_int4_moe_wgmma.py \
    tests/kernels/test_int4_moe_wgmma_steps.py tests/kernels/test_int4_moe_ws.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tee "$OUT/moe_tests.log" || status=1
fi
# shellcheck disable=SC2086  # word splitting of the lists is intended
timeout "${T_LAYER:-150}" python bench/bench_int4_moe.py --no-peers --tokens ${TOKENS:-1 9 33 129} --gluon $VARIANTS \
  --layers "${LAYERS:-8}" --out "$OUT/int4_moe_schedules.jsonl" 2>&1 | tee "$OUT/bench_int4_moe_schedules.log" || status=1
# shellcheck disable=SC2086
timeout "${T_LAYER:-150}" python bench/bench_int4_moe.py --no-peers --pool 64 --tokens ${POOL_TOKENS:-144 528} \
  --gluon $VARIANTS --out "$OUT/int4_moe_schedules.jsonl" 2>&1 | tee "$OUT/bench_int4_moe_schedules_pool.log" \
  || status=1
if [ "${STEP:-1}" != 0 ]; then
  step=(python bench/bench_verify_step.py --prefix 4096 --batch 1 16 --trees 1 9 33 --invariant on
        --out "$OUT/verify_step_schedules.jsonl")
  for layout in ${MOE_LAYOUTS:-wgmma_steps}; do
    # shellcheck disable=SC2086
    timeout "${T_STEP:-150}" "${step[@]}" --moe-layout "$layout" $STEP_ARGS 2>&1 \
      | tee -a "$OUT/bench_verify_step_schedules.log" || status=1
  done
  IFS=';' read -r -a scheds <<< "$SCHEDULES"
  for s in "${scheds[@]}"; do
    # shellcheck disable=SC2086
    timeout "${T_STEP:-150}" "${step[@]}" --moe-layout wgmma_steps --moe-wgmma-schedule "$s" $STEP_ARGS 2>&1 \
      | tee -a "$OUT/bench_verify_step_schedules.log" || status=1
  done
fi
echo "exit $status" | tee -a "$OUT/gpu.txt"
exit $status
