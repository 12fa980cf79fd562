export PYTHONPATH=. DDTREE_COMMIT=$(cat /tmp/commit 2>/dev/null)
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee $OUT/gpu.txt
timeout 240 python -m pytest -q -m gpu tests/kernels/test_mla_attention.py -k "tma or (gluon and not gluon_ws)" -x --durations=5 2>&1 | tail -15 | tee $OUT/gpu_mla_tma_tests.log
timeout 300 python bench/bench_mla_attention.py --no-peers --impl gluon --tma off on --batch 1 16 --prefix 1024 4096 32768 --tree 9 65 --out $OUT/mla_attention_tma_session24.jsonl 2>&1 | tee $OUT/bench_mla_attention_tma_session24.log
