# one-off device experiment (not kept): co-located answered / in place / auto on the K2.6 pair
R=/tmp/res; mkdir -p $R; . bench/_wheels.sh; export PYTHONPATH=/tmp/site:.
L=$(python -c "import torch;print(5 if torch.cuda.get_device_properties(0).total_memory>100e9 else 4)"); echo layers $L > $R/sys.txt
nvidia-smi --query-gpu=name --format=csv >> $R/sys.txt
[ -d /tmp/k26_$L/target ] || python -m gateway.cli init-random --preset kimi-k2.6 --layers $L --out /tmp/k26_$L > $R/init.log 2>&1
timeout 230 python bench/bench_transport.py --pair /tmp/k26_$L --transports colocated colocated_in_place colocated_answer grpc --concurrency 1 32 --steps 40 --warmup 6 --out $R/modes.jsonl > $R/modes.log 2>&1
rm -f $R/tl_ip.log; DDTREE_HOST_TIMELINE=$R/tl_ip.log timeout 80 python bench/bench_transport.py --pair /tmp/k26_$L --transports colocated_in_place --concurrency 1 --steps 30 --warmup 6 --out $R/tl_runs.jsonl > $R/tl_run_ip.log 2>&1
python bench/host_timeline.py $R/tl_ip.log > $R/tl_ip.txt 2>&1
tar czf $OUT/res.tgz -C /tmp res
cat $R/sys.txt; grep -h "C= " $R/modes.log $R/tl_run_ip.log; cat $R/tl_ip.txt
