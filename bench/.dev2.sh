export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/gpu.txt
timeout 200 python -m pytest -q -m gpu tests/kernels/test_mla_attention.py -k "tma or (gluon and not gluon_ws)" -x 2>&1 | tail -4 | tee $OUT/gpu_mla_tma16_tests_session24.log
timeout 150 python bench/bench_mla_attention.py --no-peers --impl gluon --tma off on --page 16 --batch 1 16 --prefix 4096 32768 --tree 9 65 --out $OUT/mla_attention_tma_page16_session24.jsonl 2>&1 | tee $OUT/bench_mla_attention_tma_page16_session24.log
cd $OUT && timeout 200 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:gluon --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters --export ncu_tma -f python $OLDPWD/bench/ncu_workload.py mla 16 32768 65 gluon > ncu_run.txt 2>&1; tail -3 ncu_run.txt
/usr/local/cuda/bin/ncu --import ncu_tma.ncu-rep --page details > ncu_details_mla_gluon_tma_b16_32k_65_session24.txt 2>&1
/usr/local/cuda/bin/ncu --import ncu_tma.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > ncu_sass_mla_gluon_tma_b16_32k_65_session24.csv.gz
rm -f ncu_tma.ncu-rep ncu_run.txt; ls -la
