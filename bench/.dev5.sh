export PYTHONPATH=$PWD
for t in off on; do
timeout 200 python bench/bench_verify_step.py --layers 8 --prefix 4096 32768 --batch 16 --trees 1 33 --invariant on --max-session-len 33024 --no-lm-head --mla-tma $t --out $OUT/verify_step_mla_tma_session24.jsonl 2>&1 | tail -7 | tee -a $OUT/bench_verify_step_mla_tma_session24.log
done
