#!/usr/bin/env bash
# The whole kimi-mini recipe for one device lease: train target -> quantize/export -> train drafter -> evaluate.
# Inputs (built on the CPU beforehand, see models/kimi-mini/README.md): $DATA (train.npy, heldout.npy,
# meta.json) and $TOK (tiktoken.model, tokenizer_config.json). Everything worth keeping lands in $OUT:
# the two training logs, the exported pair as pair.tar split into <16 MB parts, GPU evaluation lines, env.
# Each phase is time-budgeted and checkpointed (rerunning resumes from runs/gpu/ckpt_*).
# CPU smoke test: OUT=runs/smoke T_TARGET=20 T_DRAFTER=10 EXTRA_T="--toy --seq 64 --batch 8" \
#   EXTRA_D="--toy --seq 64 --batch 4 --blocks 6" EVAL_DEVICE=cpu bash training/gpu_recipe.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}
DATA=${DATA:-runs/data}
TOK=${TOK:-runs/tok}
W=${WORK:-runs/gpu}
T_TARGET=${T_TARGET:-150}
T_DRAFTER=${T_DRAFTER:-300}
D_BATCH=${D_BATCH:-64}
EVAL_DEVICE=${EVAL_DEVICE:-cuda}
EVAL_TIMEOUT=${EVAL_TIMEOUT:-75}
COMMIT=${COMMIT:-unknown}
mkdir -p "$OUT" "$W"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
  nproc; } > "$OUT/env.txt" 2>&1
t0=$(date +%s)
python3 -m training.train_target --data "$DATA" --ckpt "$W/ckpt_target" --export "$W/pair/target" --tokenizer "$TOK" \
  --time-budget "$T_TARGET" --log "$OUT/train_target.jsonl" --resume ${EXTRA_T:-} || exit 1
echo "target done at $(( $(date +%s) - t0 ))s"
python3 -m training.train_drafter --target "$W/pair/target" --data "$DATA" --ckpt "$W/ckpt_drafter" \
  --export "$W/pair/drafter" --time-budget "$T_DRAFTER" --batch "$D_BATCH" --log "$OUT/train_drafter.jsonl" --resume ${EXTRA_D:-} || exit 1
echo "drafter done at $(( $(date +%s) - t0 ))s"
tar -cf "$W/pair.tar" -C "$W" pair && split -b 15M "$W/pair.tar" "$OUT/pair.tar.part-"
# evaluation on the device: perplexity (full held-out set), acceptance by budget, AR vs DDTree tokens/s
timeout "$EVAL_TIMEOUT" python3 -m training.evaluate --pair "$W/pair" --data "$DATA" --device "$EVAL_DEVICE" \
  --commit "$COMMIT" --out "$OUT/eval.jsonl" ${EXTRA_E:-} || echo "evaluation stopped (rc $?)"
echo "all done at $(( $(date +%s) - t0 ))s"
