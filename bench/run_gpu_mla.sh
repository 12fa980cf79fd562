#!/usr/bin/env bash
# Device calls for the MLA kernel options (read docs/performance.md, "Twenty-fifth session" to "Twenty-ninth session").
# Steps, each switched by its variable:
#   TESTS=1   the GPU tests of the persistent kernel (bitwise against the grid kernel), of bf16 partials, of the fold
#             (bitwise against the split launch), of batch invariance with both partial dtypes and of the default
#             kernel (the seesaw one since the twenty-eighth session; TESTS_K, default `(persistent or partials or
#             invariance or fold or default_kernel) and not seesaw`); the benches below run only if they pass (or with
#             TESTS=0);
#   BENCH=1   the kernel bench, gluon, persistent kernel off / on x partials fp32 / bf16 (page 64; MLA_ARGS adds
#             options, e.g. "--c-min 512 1024"; PAGE16=1: also the serving page 16 at 4k / 32k);
#   FOLD=1    the bench of the fold off / on, gluon and Triton, partials fp32 / bf16;
#   SEESAW=1  the seesaw kernel's GPU tests (`-k "seesaw and not persistent"`, under their own time limit; the
#             first run's compiles take most of two minutes), then, if they pass, the bench of gluon against
#             gluon_seesaw and the seesaw kernel at c_min 512 / 1024 (1k and 4k prefixes, 1-65 nodes);
#   SSP=1     the persistent seesaw kernel (twenty-ninth session; H100, thirty-first: right, near the grid): its
#             GPU tests (bitwise its grid form, `-k "persistent and gluon_seesaw"`), then, if they pass, the bench of
#             the seesaw kernel with the persistent form off / on (every case, page 64);
#   PROFILE=1 (default 0) the per-kernel split of the default kernel and of gluon (bench/profile_mla_attention.py);
#   STEP=1    (default 0) the whole verify step (8 K2.6 layers, 4k prefix, batch 1 / 16, 1-33 nodes) with the MLA
#             kernel auto (the seesaw one on sm_90) and gluon (STEP_ARGS adds options, e.g. "--prefix 32768").
# At the end the tables of every MLA record of the call (summary.md). Logs and JSONL under $OUT (bench/results/run
# when unset). All of it does not fit one device call (600 s): e.g. call 1 `TESTS=0 BENCH=0 FOLD=0 SEESAW=0` (the
# persistent seesaw), call 2 `BENCH=0 FOLD=0 SEESAW=0 SSP=0 PROFILE=1 STEP=1`, call 3 `TESTS=0 BENCH=0 FOLD=0 SSP=0`.
# Run from the repo root; set DDTREE_COMMIT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
ok=1
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${T_TESTS:-240}" python -m pytest tests/kernels/test_mla_attention_gpu.py -q -x -rs --durations=8 \
    -k "${TESTS_K:-(persistent or partials or invariance or fold or default_kernel) and not seesaw}" 2>&1 | tee "$OUT/tests_mla.log" || ok=0
fi
if [ "$ok" = 1 ] && [ "${BENCH:-1}" = 1 ]; then
  timeout "${T_MLA:-300}" python bench/bench_mla_attention.py --no-peers --impl gluon --persistent off on \
    --partials fp32 out --out "$OUT/mla_attention.jsonl" $MLA_ARGS 2>&1 | tee "$OUT/bench_mla_attention.log"
  if [ "${PAGE16:-0}" = 1 ]; then
    timeout "${T_MLA16:-120}" python bench/bench_mla_attention.py --no-peers --impl gluon --persistent off on \
      --partials fp32 out --page 16 --prefix 4096 32768 --out "$OUT/mla_attention_page16.jsonl" 2>&1 \
      | tee "$OUT/bench_mla_page16.log"
  fi
fi
if [ "$ok" = 1 ] && [ "${FOLD:-1}" = 1 ]; then
  timeout "${T_FOLD:-300}" python bench/bench_mla_attention.py --no-peers --impl gluon triton --fold off on \
    --partials fp32 out --out "$OUT/mla_attention_fold.jsonl" 2>&1 | tee "$OUT/bench_mla_fold.log"
fi
if [ "${SEESAW:-1}" = 1 ] && timeout "${T_SEESAW:-150}" python -m pytest tests/kernels/test_mla_attention_gpu.py -q -x \
    -rs -k "seesaw and not persistent" 2>&1 | tee "$OUT/tests_mla_seesaw.log"; then
  timeout "${T_MLA_SEESAW:-150}" python bench/bench_mla_attention.py --no-peers --impl gluon gluon_seesaw \
    --out "$OUT/mla_attention_seesaw.jsonl" 2>&1 | tee "$OUT/bench_mla_seesaw.log"
  timeout "${T_MLA_CMIN:-120}" python bench/bench_mla_attention.py --no-peers --impl gluon_seesaw --c-min 512 1024 \
    --tree 1 9 33 65 --prefix 1024 4096 --out "$OUT/mla_attention_seesaw_cmin.jsonl" 2>&1 \
    | tee "$OUT/bench_mla_seesaw_cmin.log"
fi
if [ "${SSP:-1}" = 1 ] && timeout "${T_SSP:-200}" python -m pytest tests/kernels/test_mla_attention_gpu.py -q -x \
    -rs -k "persistent and gluon_seesaw" 2>&1 | tee "$OUT/tests_mla_seesaw_persistent.log"; then
  timeout "${T_MLA_SSP:-150}" python bench/bench_mla_attention.py --no-peers --impl gluon_seesaw --persistent off on \
    --out "$OUT/mla_attention_seesaw_persistent.jsonl" 2>&1 | tee "$OUT/bench_mla_seesaw_persistent.log"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  timeout "${T_PROFILE:-90}" python bench/profile_mla_attention.py --impl auto gluon 2>&1 | tee "$OUT/profile_mla.log"
fi
if [ "${STEP:-0}" = 1 ]; then
  for impl in auto gluon; do
    timeout "${T_STEP:-120}" python bench/bench_verify_step.py --invariant on --mla-impl "$impl" \
      --out "$OUT/verify_step.jsonl" $STEP_ARGS 2>&1 | tee "$OUT/bench_verify_step_$impl.log"
  done
fi
if ls "$OUT"/mla_attention*.jsonl >/dev/null 2>&1; then
  python bench/summarize.py "$OUT"/mla_attention*.jsonl 2>&1 | tee "$OUT/summary.md"
fi
