export PYTHONPATH=$PWD
timeout 150 python -m pytest -q -m gpu tests/kernels/test_mla_attention.py -k "test_mla_gluon_tma or (gluon and not gluon_ws)" -x 2>&1 | tail -3 | tee $OUT/gpu_mla_qtma_tests_session24.log
timeout 150 python -m pytest -q -m gpu tests/unit/test_gpu_exact.py -x 2>&1 | tail -3 | tee -a $OUT/gpu_mla_qtma_tests_session24.log
timeout 150 python bench/bench_mla_attention.py --no-peers --impl gluon --out $OUT/mla_attention_qtma_session24.jsonl 2>&1 | tee $OUT/bench_mla_attention_qtma_session24.log
timeout 60 python bench/bench_mla_attention.py --no-peers --impl gluon --page 16 --batch 1 16 --prefix 32768 --tree 65 --out $OUT/mla_attention_qtma_page16_session24.jsonl 2>&1 | tee -a $OUT/bench_mla_attention_qtma_session24.log
