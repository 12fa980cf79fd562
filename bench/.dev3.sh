export PYTHONPATH=$PWD
timeout 120 python -m pytest -q -m gpu tests/kernels/test_mla_attention.py -k "tma" -x 2>&1 | tail -3 | tee $OUT/gpu_mla_tma_tests2_session24.log
timeout 120 python bench/bench_mla_attention.py --no-peers --impl gluon --tma on --batch 1 16 --prefix 4096 32768 --tree 65 --out $OUT/mla_attention_tma_rows_session24.jsonl 2>&1 | tee $OUT/bench_mla_attention_tma_rows_session24.log
cd $OUT && timeout 240 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:gluon --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters --export ncu_tma -f python $PYTHONPATH/bench/ncu_workload.py mla 16 32768 65 gluon > ncu_run.txt 2>&1; tail -3 ncu_run.txt
/usr/local/cuda/bin/ncu --import ncu_tma.ncu-rep --page details > ncu_details_mla_gluon_tma_b16_32k_65_session24.txt 2>&1
/usr/local/cuda/bin/ncu --import ncu_tma.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > ncu_sass_mla_gluon_tma_b16_32k_65_session24.csv.gz
rm -f ncu_tma.ncu-rep ncu_run.txt; ls -la
