#!/usr/bin/env bash
# One device call for the standings of the open speed targets, meant for an H200 (the kernels' ratios are against the
# H200's floors, and the 5-layer K2.6 transport pair needs ~78 GB of GPU memory; on an 80 GB H100 the pair gets 4 target
# layers, K26_LAYERS overrides): the ws GEMMs' GPU tests, the INT4 MoE layer at T = 1 and 9 with the default schedule
# beside the ring kernels, ws with one row tile in w2 (the default: 2) and the row-major weights (8 layers back to back
# too), then the transports at C = 1 and 32 on the K2.6 pair (`run_gpu_transport.sh` with K26=1). About 8-9 minutes;
# carry `.whl` (the transport bench imports the wheels the image lacks). Logs and JSONL under $OUT (bench/results/run
# when unset); run from the repo root and set DDTREE_COMMIT (the device's .git is stale). Overrides: VARIANTS
# (bench_int4_moe --gluon names), TRANSPORT_ARGS (bench_transport flags); section limits T_TESTS / T_LAYER (seconds);
# TESTS=0 / MOE=0 / TRANSPORT=0 / SWITCH=0 skip. SWITCH: bench/context_switch.py, the cost of a hand-off between two
# processes' GPU contexts (T_SWITCH its limit). An A/B of engine settings belongs in one run: TRANSPORT_ARGS="...
# --variant FIELD=VALUE" (bench_transport.py steps a copy of the engines with it in the same rounds). By default the
# in-process engine runs a second time asking the drafter after the host read (draft_ahead=false), and the co-located
# one also runs without the request doorbell (colocated_polled: the drafter polls our event before it launches a draft
# queued ahead; the doorbell is on by default since the forty-third session). Drafting ahead
# (verifier_service/draft_ahead.py and ahead_steps.py) is the default since the fortieth session; over gRPC, with
# draft_ahead, the next requests go right after the host read since the forty-first session (`draft_ahead.ask_early`).
# Steps run in blocks of 6 per engine and round (--block-steps: an engine drafting ahead overlaps its next draft with
# its host's next step, which a synchronize after every step would hide). The kernels' GPU tests join the tests.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# shellcheck source=bench/_wheels.sh
. bench/_wheels.sh  # the transport tests import grpc_health and the opentelemetry SDK
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
VARIANTS=${VARIANTS:-"wgmma_steps_auto wgmma_steps_ring wgmma_steps_ws_rt1 wgmma_auto"}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv 2>&1 | tee "$OUT/standings_gpu.txt"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${T_TESTS:-120}" python -m pytest -q -rs -m gpu tests/kernels/test_int4_moe_ws.py \
    tests/unit/test_tree_inputs.py tests/unit/test_tree_accept_kernel.py tests/unit/test_commit_moves.py \
    2>&1 | tee "$OUT/ws_tests.log" | tail -5 \
    || status=1
  # drafting ahead, in process and co-located (kimi-mini; the drafter service in its own process), the doorbells
  # (`Doorbell.wait_host`: the bench's wait for an ahead draft) and the request ring's fault path (every GPU test
  # function of test_gpu_transport.py has a case here: tests/unit/test_gpu_scripts.py)
  timeout "${T_AHEAD:-200}" python -m pytest -q -rs -m gpu tests/unit/test_draft_ahead.py tests/unit/test_doorbell.py \
    tests/integration/test_gpu_transport.py -k "ahead or doorbell or request_ring" 2>&1 \
    | tee "$OUT/ahead_tests.log" | tail -5 || status=1
fi
if [ "${SWITCH:-1}" != 0 ]; then  # a hand-off between two processes' GPU contexts (bench/context_switch.py)
  timeout "${T_SWITCH:-90}" python bench/context_switch.py --out "$OUT/context_switch.jsonl" 2>&1 \
    | tee "$OUT/context_switch.log" || status=1
fi
if [ "${MOE:-1}" != 0 ]; then
  # shellcheck disable=SC2086  # word splitting of the list is intended
  timeout "${T_LAYER:-120}" python bench/bench_int4_moe.py --no-peers --tokens 1 9 --gluon $VARIANTS --layers 8 \
    --out "$OUT/int4_moe_standing.jsonl" 2>&1 | tee "$OUT/bench_int4_moe_standing.log" || status=1
fi
if [ "${TRANSPORT:-1}" != 0 ]; then
  # the K2.6 pair's target layers: 5 where they fit (an H200), else 4 (an 80 GB H100; run_gpu_transport.sh says why)
  layers=${K26_LAYERS:-$(python -c "import torch
print(5 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 4)")}
  # each copy holds a KV pool (~0.75 GB), an in-process one a drafter cache (~1.6 GB at 33 sessions) and a remote one
  # 32 more sessions of the drafter process (~1.5 GB): on an 80 GB GPU with 4 layers (~69 GB for the pair) the drafter
  # process takes three remote engines (four ran out of memory in the forty-first session): the co-located, the gRPC
  # and the co-located without the request doorbell (colocated_polled), beside an in-process copy asking the usual way
  variants="--variant draft_ahead=false@inprocess"
  OUT="$OUT" K26_LAYERS=$layers K26=1 TESTS=0 ECHO=0 \
    BENCH_ARGS="${TRANSPORT_ARGS:---transports colocated colocated_polled grpc --steps 24 --warmup 2 --block-steps 6 \
$variants}" \
    bash bench/run_gpu_transport.sh \
    || status=1
fi
echo "exit $status" | tee -a "$OUT/standings_gpu.txt"
exit $status
