"""Per-step cost of each verifier <-> drafter transport against the in-process drafter.

    python bench/bench_transport.py [--pair models/kimi-mini] [--device cpu] [--concurrency 1 32]

For each transport the same engine (target in this process) runs C sessions at one budget; the
drafter is the in-process `Drafter` (inprocess) or a `ddtree drafter serve` process on loopback
reached through the stream client with shared regions (colocated: /dev/shm on CPU, CUDA IPC on
GPU) or inline bytes (grpc). Reported: median and p90 verify-step time, median time inside
`draft()`, and the step-time overhead against in-process at the same C. Output: a table on stdout
and JSON lines appended to bench/results/transport.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import commit  # noqa: E402


def timed_draft(client):
    """Wrap client.draft to record its wall time per call."""
    times = []
    inner = client.draft

    def draft(requests):
        t0 = time.perf_counter()
        out = inner(requests)
        times.append(time.perf_counter() - t0)
        return out

    client.draft = draft
    return times


def run_engine(engine, conc, budget, steps, warmup, vocab):
    from verifier_service.session import DecodeParams

    g = torch.Generator().manual_seed(0)
    for i in range(conc):
        prompt = torch.randint(0, vocab - 64, (64,), generator=g).tolist()
        engine.add(prompt, DecodeParams(max_new_tokens=10**6, budget=budget, topk=8, ignore_eos=True), sid=f"b{i}")
    times = []
    for k in range(warmup + steps):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    for i in range(conc):
        engine.release(f"b{i}")
    return times


def start_drafter(pair, device, dtype):
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "drafter", "serve", "--listen", "127.0.0.1:0",
                             "--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--device", device,
                             "--dtype", dtype, "--log-level", "WARNING"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        ev = json.loads(line)
        if ev.get("event") == "serving":
            return proc, ev["address"]
    raise RuntimeError("the drafter did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=str(REPO / "models" / "kimi-mini"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "transport.jsonl"))
    args = p.parse_args()

    from verifier_service.checkpoint import load_target
    from verifier_service.engine import Engine, EngineConfig
    from verifier_service.local import DTYPES, build_local_engine
    from verifier_service.transport_stream import DraftStreamClient, StreamClientConfig

    pair = Path(args.pair)
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = DTYPES[dtype_name]
    ecfg = EngineConfig(page_size=16, num_pages=8192, max_sessions=max(args.concurrency) + 1)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    rows = []
    inproc = build_local_engine(pair / "target", pair / "drafter", dtype, args.device, ecfg)
    vocab = inproc.target.cfg.vocab_size
    base = {}
    proc, addr = start_drafter(pair, args.device, dtype_name)
    try:
        target = load_target(pair / "target", dtype, args.device)
        for conc in args.concurrency:
            for transport in ("inprocess", "colocated", "grpc"):
                client = None
                if transport == "inprocess":
                    engine = inproc
                    draft_times = timed_draft(engine.drafter)
                else:
                    client = DraftStreamClient(StreamClientConfig(addr, colocated=transport == "colocated",
                                                                  region_device=args.device, draft_timeout_s=30))
                    client.start()
                    model = client.wait_ready(timeout=60)
                    engine = Engine(target, client, model.target_layer_ids, ecfg)
                    draft_times = timed_draft(client)
                times = run_engine(engine, conc, args.budget, args.steps, args.warmup, vocab)
                if client is not None:
                    assert client.stats["fallback_steps"] == 0, client.stats
                    client.close()
                else:
                    del engine.drafter.draft  # unwrap
                step = statistics.median(times) * 1e3
                base.setdefault(conc, step)
                row = {"name": "transport/step", "params": {"transport": transport, "concurrency": conc,
                                                             "budget": args.budget, "topk": 8, "pair": pair.name},
                       "device": device_name, "dtype": dtype_name, "torch": torch.__version__, "commit": commit(),
                       "metrics": {"step_ms_median": round(step, 3),
                                   "step_ms_p90": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 3),
                                   "draft_ms_median": round(statistics.median(draft_times[-len(times):]) * 1e3, 3),
                                   "overhead_vs_inprocess_pct": round(100 * (step / base[conc] - 1), 1)},
                       "time": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "note": "drafter in a separate process on loopback; on CPU the two processes share cores"}
                rows.append(row)
                m = row["metrics"]
                print(f"{transport:10s} C={conc:3d}  step {m['step_ms_median']:8.2f} ms (p90 {m['step_ms_p90']:8.2f})"
                      f"  draft {m['draft_ms_median']:8.2f} ms  overhead {m['overhead_vs_inprocess_pct']:+6.1f}%",
                      flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
