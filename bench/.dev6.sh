export PYTHONPATH=$PWD
timeout 110 python -m pytest -q -m gpu tests/kernels/test_mla_attention.py -k "test_mla_gluon_tma or (gluon and not gluon_ws)" -x 2>&1 | tail -2 | tee $OUT/gpu_mla_prologue_tests_session24.log
timeout 60 python -m pytest -q -m gpu tests/unit/test_gpu_exact.py -x 2>&1 | tail -2 | tee -a $OUT/gpu_mla_prologue_tests_session24.log
timeout 90 python bench/bench_mla_attention.py --no-peers --impl gluon --tree 9 65 --out $OUT/mla_attention_prologue_session24.jsonl 2>&1 | tee $OUT/bench_mla_attention_prologue_session24.log
