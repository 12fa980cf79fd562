#!/usr/bin/env bash
# One device call: Nsight Compute's source-level stall sampling of the one-token MoE layer's two GEMM kernels
# (`_moe_w13_wgmma_kernel`, `_moe_w2_wgmma_kernel` of `kernels.int4_moe_wgmma` at auto_schedule, T tokens, PDL off so
# each kernel is measured alone), the question the twenty-third session left open: which instructions the warps wait
# at while the schedulers find no eligible warp. For each kernel, under $OUT: `ncu_details_moe_<k>_T<T>.txt`
# (SpeedOfLight, Occupancy, SchedulerStats, WarpStateStats, SourceCounters) and `ncu_sass_moe_<k>_T<T>.csv.gz` (the
# SASS with its stall samples per instruction; `bench/sass_stalls.py` ranks them). Then `bench/tile_read.py`: the
# kernels' read order against the same bytes read in address order, no arithmetic (`tile_read.jsonl`, `tile_read.log`;
# TILE_READ=0 skips it). About 80 s. T=1 unless set;
# OPTIONS: JSON laid over the schedule (default '{"pdl": false}'). Run from the repo root.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-bench/results/run}
T=${T:-1}
OPTIONS=${OPTIONS:-'{"pdl": false}'}
mkdir -p "$OUT"
status=0
for k in w13 w2; do
  rep=/tmp/ncu_moe_${k}_T$T
  timeout "${T_NCU:-120}" ncu --clock-control none --kernel-name "regex:_moe_${k}_wgmma" --launch-skip 2 \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section SourceCounters --import-source no -f -o "$rep" \
    python bench/ncu_workload.py moe_wgmma "$T" "$OPTIONS" 2>&1 | tail -3 || status=1
  ncu --import "$rep.ncu-rep" --page details > "$OUT/ncu_details_moe_${k}_T$T.txt" 2>&1 || status=1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip > \
    "$OUT/ncu_sass_moe_${k}_T$T.csv.gz" || status=1
  python bench/sass_stalls.py "$OUT/ncu_sass_moe_${k}_T$T.csv.gz" --top 25 2>&1 | tee "$OUT/stalls_moe_${k}_T$T.txt"
done
if [ "${TILE_READ:-1}" != 0 ]; then
  timeout "${T_READ:-150}" python bench/tile_read.py --out "$OUT/tile_read.jsonl" 2>&1 | tee "$OUT/tile_read.log" || status=1
fi
exit $status
