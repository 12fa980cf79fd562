#!/usr/bin/env bash
# Twelfth session: ncu of the Gluon w13 (registers vs the ring) at T = 129, and both MoE paths at crowded routing.
export PYTHONPATH=. PYTHONUNBUFFERED=1
NCU=/usr/local/cuda/bin/ncu
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
run() { name=$1; shift; timeout 100 $NCU --clock-control none --kernel-name regex:$KREGEX --launch-skip 2 --launch-count ${COUNT:-1} $S $EXTRA "$@" > $OUT/ncu_$name.log 2>&1; echo "$name rc=$?"; }
KREGEX=_moe_w13_gluon EXTRA="--section SourceCounters -o $OUT/rep_reg" run w13_T129_reg python bench/ncu_workload.py moe_gluon 129 0 8 0
KREGEX=_moe_w13_gluon EXTRA="--section SourceCounters -o $OUT/rep_ring2" run w13_T129_ring2 python bench/ncu_workload.py moe_gluon 129 0 8 2
for r in rep_reg rep_ring2; do $NCU --import $OUT/$r.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $OUT/sass_$r.csv.gz; $NCU --import $OUT/$r.ncu-rep --page details > $OUT/details_$r.txt 2>&1; done
KREGEX=_moe_w COUNT=2 EXTRA="" run crowded_triton python bench/ncu_workload.py moe 528 202
KREGEX=_moe_w COUNT=2 EXTRA="" run crowded_gluon16 python bench/ncu_workload.py moe_gluon 528 202 16 0
KREGEX=_moe_w COUNT=2 EXTRA="" run crowded_gluon8 python bench/ncu_workload.py moe_gluon 528 202 8 0
ls -la $OUT
