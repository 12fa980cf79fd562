"""Per-step cost of each verifier <-> drafter transport against the in-process drafter.

    python bench/bench_transport.py [--pair models/kimi-mini] [--device cpu] [--concurrency 1 32]

For each transport the same engine (target in this process) runs C sessions at one budget; the
drafter is the in-process `Drafter` (inprocess) or a `ddtree drafter serve` process on loopback
reached through the stream client with shared regions (colocated: /dev/shm on CPU, CUDA IPC on
GPU) or inline bytes (grpc). The three engines step in interleaved rounds, so that load from
other processes falls on all of them alike. Reported: median and p90 verify-step time, median time inside
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


def admit(engine, conc, budget, vocab) -> None:
    from verifier_service.session import DecodeParams

    g = torch.Generator().manual_seed(0)
    for i in range(conc):
        prompt = torch.randint(0, vocab - 64, (64,), generator=g).tolist()
        engine.add(prompt, DecodeParams(max_new_tokens=10**6, budget=budget, topk=8, ignore_eos=True), sid=f"b{i}")


def timed_step(engine) -> float:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


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
    from verifier_service.transport import StreamClientConfig
    from verifier_service.transport_stream import DraftStreamClient

    pair = Path(args.pair)
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = DTYPES[dtype_name]
    ecfg = EngineConfig(page_size=16, num_pages=8192, max_sessions=max(args.concurrency) + 1)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    rows = []
    base = {}
    proc, addr = start_drafter(pair, args.device, dtype_name)
    clients = []
    try:
        inproc = build_local_engine(pair / "target", pair / "drafter", dtype, args.device, ecfg)
        vocab = inproc.target.cfg.vocab_size
        target = load_target(pair / "target", dtype, args.device)
        engines = {"inprocess": inproc}
        for transport in ("colocated", "grpc"):
            client = DraftStreamClient(StreamClientConfig(addr, colocated=transport == "colocated",
                                                          region_device=args.device, draft_timeout_s=30))
            client.start()
            model = client.wait_ready(timeout=60)
            clients.append(client)
            engines[transport] = Engine(target, client, model.target_layer_ids, ecfg)
        draft_times = {t: timed_draft(e.drafter) for t, e in engines.items()}
        for conc in args.concurrency:
            times: dict[str, list[float]] = {t: [] for t in engines}
            for t, e in engines.items():
                admit(e, conc, args.budget, vocab)
                draft_times[t].clear()
            for k in range(args.warmup + args.steps):
                for t, e in engines.items():
                    dt = timed_step(e)
                    if k >= args.warmup:
                        times[t].append(dt)
            for t, e in engines.items():
                for i in range(conc):
                    e.release(f"b{i}")
                step = statistics.median(times[t]) * 1e3
                base.setdefault(conc, step)
                row = {"name": "transport/step", "params": {"transport": t, "concurrency": conc,
                                                             "budget": args.budget, "topk": 8, "pair": pair.name,
                                                             "steps": args.steps},
                       "device": device_name, "dtype": dtype_name, "torch": torch.__version__, "commit": commit(),
                       "metrics": {"step_ms_median": round(step, 3),
                                   "step_ms_p90": round(sorted(times[t])[int(0.9 * (len(times[t]) - 1))] * 1e3, 3),
                                   "draft_ms_median": round(statistics.median(draft_times[t][args.warmup:]) * 1e3, 3),
                                   "overhead_vs_inprocess_pct": round(100 * (step / base[conc] - 1), 1)},
                       "time": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "note": "drafter in a separate process on loopback; engines stepped in interleaved rounds; "
                               "on CPU the processes share the machine's cores with other work"}
                rows.append(row)
                m = row["metrics"]
                print(f"{t:10s} C={conc:3d}  step {m['step_ms_median']:8.2f} ms (p90 {m['step_ms_p90']:8.2f})"
                      f"  draft {m['draft_ms_median']:8.2f} ms  overhead {m['overhead_vs_inprocess_pct']:+6.1f}%",
                      flush=True)
        for c in clients:
            assert c.stats["fallback_steps"] == 0, c.stats
    finally:
        for c in clients:
            c.close()
        proc.terminate()
        proc.wait(30)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
