#!/usr/bin/env bash
# Where MPS's slowdown of the in-process step comes from (issue 4: under MPS the co-located step is within 2% of the
# in-process one, but the in-process step itself gets 5-10% slower: twelfth, forty-third and forty-fourth sessions;
# the forty-fourth's run of this script found the kernels' GPU time unchanged and the work queues beside the point,
# docs/performance.md). One device
# call on a K2.6 pair already written (PAIR, default /tmp/k26_4: run_gpu_transport.sh with K26=1 makes it), for each
# mode of MODES (default "plain mps mps_conn32 mps_conn2"):
#   - the INT4 MoE layer at T = 1 (the Triton launcher, the read peer and the sm_90 default, one layer and 8 back to
#     back: GPU time of CUDA-graph replays; is a kernel slower under MPS, or only what lies between kernels?);
#   - the in-process and co-located engines at C = 1, blocks of 6 (`bench_transport.py`, ROUNDS rounds).
# Modes: plain (no MPS), mps (a control daemon of our own, pipes under /tmp/ddtree-mps), mps_connN (the same with
# CUDA_DEVICE_MAX_CONNECTIONS=N in both processes: MPS clients share one pool of hardware work queues, so a client may
# get fewer than the 8 it gets alone, and streams that share a queue serialize). Logs and JSONL under $OUT (records
# carry params.mps; the mode is in the log names). Carry `.whl`; set DDTREE_COMMIT.
set -o pipefail
# shellcheck source=bench/_wheels.sh
. bench/_wheels.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-bench/results/run}
PAIR=${PAIR:-/tmp/k26_4}
mkdir -p "$OUT"
[ -d "$PAIR/target" ] || { echo "no K2.6 pair at $PAIR (run_gpu_transport.sh with K26=1 writes one)" >&2; exit 2; }
status=0
for mode in ${MODES:-plain mps mps_conn32 mps_conn2}; do
  (
    if [ "$mode" != plain ]; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/ddtree-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ddtree-mps/log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d || exit 1
      trap 'echo quit | nvidia-cuda-mps-control; sleep 1' EXIT
      case "$mode" in mps_conn*) export CUDA_DEVICE_MAX_CONNECTIONS=${mode#mps_conn} ;; esac
    fi
    echo "== $mode (CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset})"
    timeout "${T_MOE:-60}" python bench/bench_int4_moe.py --no-peers --tokens 1 --gluon wgmma_steps_auto --layers 8 \
      --out "$OUT/mps_int4_moe.jsonl" 2>&1 | tail -6 | tee "$OUT/mps_int4_moe_$mode.log"
    timeout "${T_BENCH:-150}" python bench/bench_transport.py --pair "$PAIR" --transports colocated --concurrency 1 \
      --steps "${ROUNDS:-12}" --warmup 2 --block-steps 6 --out "$OUT/mps_transport.jsonl" 2>&1 \
      | tee "$OUT/mps_transport_$mode.log" | tail -6
  ) || status=1
done
exit $status
