#!/usr/bin/env bash
# One device call for the transports on the GPU: the GPU tests of the transports (test_transports_gpu.py,
# test_device_copy.py, test_shared_region.py, test_tree_verdicts.py, test_doorbell.py, test_tree_inputs.py,
# test_tree_accept_kernel.py, test_commit_moves.py,
# test_gpu_transport.py), then
# bench_transport.py at C=1 and C=32 on cuda: kimi-mini (about 3 minutes), or with K26=1 a random-weight Kimi K2.6 pair
# (K26_LAYERS target layers, 5 by default, ~43 GB written to K26_DIR, /tmp/k26_<layers> by default, ~2 min; about 5
# minutes in all). Logs and JSONL go to $OUT (bench/results/run when unset); run from the repo root. Section time
# limits: T_TESTS / T_BENCH (seconds); extra bench flags: BENCH_ARGS; TESTS=0 skips the tests, BENCH=0 the bench; then
# bench/grpc_echo.py with and without a 9 ms silence and keep-warm messages (ECHO=0 skips it, T_ECHO its limit). MPS=1
# runs everything under an MPS control daemon of its own (pipe and log directories under /tmp/ddtree-mps; quit at the
# end), so the processes share one GPU context. TRACE=1 adds a short gRPC run at C = 1 (TRACE_ARGS to change it) under
# torch.profiler in both processes (--torch-trace) and `bench/trace_steps.py`'s step-by-step GPU timeline of both into
# $OUT/trace_steps_<label>.txt for each engine label of TRACE_LABELS (default grpc; e.g. "colocated inprocess"), and the
# traces themselves as $OUT/traces.tgz (TRACE_TGZ=0: not; the device returns few files). TIMELINE=1 adds, for each
# engine of TIMELINE_TRANSPORTS (default grpc colocated) and each C of TIMELINE_C (default 1 32), a short run under
# DDTREE_HOST_TIMELINE and `bench/host_timeline.py`'s hand-offs into $OUT/timeline_<engine>_c<C>.txt (TIMELINE_ARGS:
# more bench flags for those runs). The device image
# lacks grpcio-health-checking, grpcio-reflection and opentelemetry-sdk: carry `.whl/` (the wheels, git-ignored) and
# they are installed into /tmp/site here. K26=1 with 5 layers needs ~78 GB on the GPU (the verifier 66 GB, the drafter
# process 11 GB): an H200; each MoE layer fewer saves ~9.5 GB, so an 80 GB H100 takes K26_LAYERS=4 (a shorter in-process
# step: the overheads' ratios come out higher than with 5 layers; params.target_layers).
set -o pipefail
# shellcheck source=bench/_wheels.sh
. bench/_wheels.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-bench/results/run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
python -c "import torch, triton, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, 'grpcio', grpc.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${MPS:-0}" != 0 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/ddtree-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ddtree-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS control daemon started" | tee -a "$OUT/gpu.txt"
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
tests=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${T_TESTS:-200}" python -m pytest -q -rs -m gpu --durations=8 tests/unit/test_transports_gpu.py \
    tests/unit/test_device_copy.py tests/unit/test_shared_region.py tests/unit/test_tree_verdicts.py \
    tests/unit/test_doorbell.py tests/unit/test_tree_inputs.py tests/unit/test_tree_accept_kernel.py \
    tests/unit/test_commit_moves.py tests/unit/test_draft_ahead.py \
    tests/integration/test_gpu_transport.py 2>&1 \
    | tee "$OUT/transport_tests.log"
  tests=$?
fi
pair=${K26_DIR:-/tmp/k26_${K26_LAYERS:-5}}
if [ "${K26:-0}" != 0 ]; then
  need=$(python -c "print(round(78 - 9.5 * (5 - ${K26_LAYERS:-5})))")  # GB, and 10% to spare below
  python -c "import torch, sys; sys.exit(torch.cuda.get_device_properties(0).total_memory < $need * 1.1e9)" \
    || { echo "K26=1: the K2.6 pair with ${K26_LAYERS:-5} target layers needs ~$need GB of GPU memory, more than this" \
              "GPU has (an H200, or K26_LAYERS=4 on an 80 GB GPU)" >&2; exit 2; }
  [ -d "$pair/target" ] || { time python -m gateway.cli init-random --preset kimi-k2.6 --layers "${K26_LAYERS:-5}" \
    --out "$pair" ; } 2>&1 | tail -3
fi
bench=0
if [ "${BENCH:-1}" = 0 ]; then
  :
elif [ "${K26:-0}" != 0 ]; then
  timeout "${T_BENCH:-300}" python bench/bench_transport.py --pair "$pair" --concurrency 1 32 --steps 60 --warmup 6 \
    --out "$OUT/transport_k26.jsonl" $BENCH_ARGS 2>&1 | tee "$OUT/bench_transport_k26.log"
  bench=$?
else
  timeout "${T_BENCH:-240}" python bench/bench_transport.py --device cuda --concurrency 1 32 --steps 30 --warmup 5 \
    --time-budget-s 100 --out "$OUT/transport.jsonl" $BENCH_ARGS 2>&1 | tee "$OUT/bench_transport.log"
  bench=$?
fi
if [ "${TRACE:-0}" != 0 ]; then
  if [ "${K26:-0}" != 0 ]; then src=(--pair "$pair"); else src=(--device cuda); fi
  rm -rf /tmp/ddtree-traces
  # shellcheck disable=SC2086
  timeout "${T_TRACE:-150}" python bench/bench_transport.py "${src[@]}" ${TRACE_ARGS:---transports grpc \
    --concurrency 1 --steps 14 --warmup 6} --torch-trace /tmp/ddtree-traces:12:6 --out /tmp/ddtree-traces.jsonl \
    2>&1 | tail -4 | tee "$OUT/trace_run.log"
  for label in ${TRACE_LABELS:-grpc}; do
    python bench/trace_steps.py /tmp/ddtree-traces --step-label "$label" > "$OUT/trace_steps_$label.txt" 2>&1
  done
  [ "${TRACE_TGZ:-1}" = 0 ] || tar czf "$OUT/traces.tgz" -C /tmp ddtree-traces
fi
if [ "${TIMELINE:-0}" != 0 ]; then  # host timelines (telemetry/host_timeline.py): one remote engine at a time
  if [ "${K26:-0}" != 0 ]; then src=(--pair "$pair"); else src=(--device cuda); fi
  for t in ${TIMELINE_TRANSPORTS:-grpc colocated}; do
    for c in ${TIMELINE_C:-1 32}; do
      log="$OUT/timeline_${t}_c$c.log"
      rm -f "$log"
      DDTREE_HOST_TIMELINE="$log" timeout "${T_TIMELINE:-90}" python bench/bench_transport.py "${src[@]}" \
        --transports "$t" --concurrency "$c" --steps 30 --warmup 6 --out "$OUT/timeline_runs.jsonl" $TIMELINE_ARGS \
        2>&1 | tail -2
      python bench/host_timeline.py "$log" | tee "$OUT/timeline_${t}_c$c.txt"
    done
  done
fi
if [ "${ECHO:-1}" != 0 ]; then  # the bare gRPC round trip on this host, busy and after a verify step's silence
  timeout "${T_ECHO:-150}" python bench/grpc_echo.py --sizes 20000 300000 --n 300 --gap-ms 0 9 --keepwarm-ms 0 3 \
    --out "$OUT/grpc_echo.jsonl" 2>&1 | grep -v fork_posix | tee "$OUT/grpc_echo.log"
fi
echo "tests exit $tests, bench exit $bench" | tee -a "$OUT/gpu.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
