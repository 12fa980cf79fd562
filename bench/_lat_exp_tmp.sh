# one-off device experiment (not kept): where the remote engines' step launch waits
R=/tmp/res; mkdir -p $R; . bench/_wheels.sh; export PYTHONPATH=/tmp/site:.
L=$(python -c "import torch;print(5 if torch.cuda.get_device_properties(0).total_memory>100e9 else 4)"); echo layers $L > $R/sys.txt
[ -d /tmp/k26_$L/target ] || python -m gateway.cli init-random --preset kimi-k2.6 --layers $L --out /tmp/k26_$L > $R/init.log 2>&1
timeout 100 python bench/bench_transport.py --pair /tmp/k26_$L --transports colocated grpc --concurrency 1 --steps 5 --warmup 4 --sync-debug --out $R/sync.jsonl > $R/sync.log 2>&1
for t in colocated grpc; do
  rm -f $R/tl_$t.log; DDTREE_HOST_TIMELINE=$R/tl_$t.log timeout 80 python bench/bench_transport.py --pair /tmp/k26_$L --transports $t --concurrency 1 --steps 30 --warmup 6 --out $R/tl_runs.jsonl > $R/tl_run_$t.log 2>&1
  python bench/host_timeline.py $R/tl_$t.log > $R/tl_$t.txt 2>&1
done
tar czf $OUT/res.tgz -C /tmp res
grep -c "^sync:" $R/sync.log; grep -A9 "^sync:" $R/sync.log | head -150; cat $R/tl_*.txt; grep -h "C= " $R/tl_run_*.log $R/sync.log
