"""What a hand-off between two processes' GPU contexts costs, beside the same hand-off between two streams of one
process (issue 4: the co-located chain drafting ahead, docs/performance.md, forty-second session).

    python bench/context_switch.py [--work-us 3500] [--kernels 150] [--reps 40] [--out FILE.jsonl]

Roles as in a co-located step drafting ahead. V (the verifier) runs a short kernel (its acceptance), stamps the GPU's
clock and records an IPC event, then tells D by a pipe; D (the drafter) polls that event from its host
(`IpcEvent.wait_host`'s loop) and replays a CUDA graph: a stamp, `--kernels` spin kernels of `--work-us` in all, a
stamp; then rings a doorbell (cuStreamWriteValue32). V's stream waits for the ring (cuStreamWaitValue32, `Doorbell`)
and stamps. A stamp is a one-thread kernel that stores %globaltimer, one clock for every context on the GPU (its
resolution is ~1 us here). Per rep: `switch_in` = D's first stamp - V's last stamp before its event (the host poll,
the launch and, across processes, the switch to D's context), `work` = D's graph between its stamps, `resume` = V's
stamp after the wait - D's last stamp (the ring and the switch back). Cases:
  one_process   both roles in one process and one thread, on two streams (the in-process engine's chain);
  blocked       two processes; V queues its wait and the stamp behind it right after its event (what the co-located
                engine does: its next step waits on the GPU for the drafter's ring);
  idle          two processes; V queues its wait only once D's host has seen its graph end (nothing of V's pending
                while D works; `resume` is then a host round trip and not comparable);
  queued        two processes; D queues its graph ahead, behind a GPU wait on a request doorbell of V's (allocated by V,
                mapped by D), which V rings on its stream after its acceptance instead of recording an event; V's wait
                as in `blocked` (a co-located drafter that queues its ahead step before the verifier's acceptance:
                `switch_in` is then the switch alone, no host poll and no launch on the chain);
  queued_late   as `queued`, but V's host queues its wait only `--late-us` after its ring (V's context idle, not
                blocked in a wait, when it rings: does the switch into D's context wait on V's blocked stream?);
  queued_tail   as `queued`, but D queues `--tail-us` of spin kernels after its ring (D's context busy, not idle,
                when V's wait ends: does the switch back wait for D to go idle, or preempt it?);
  polled        two processes; V's host reads the counter (`Doorbell.read`: a 4-byte copy on V's context and a
                synchronize) in a loop until D has rung, as the benchmark's `wait_ahead` did before the forty-second
                session (`resume`: V's stamp after its loop, a host path).
`polled` against `idle` says what GPU work of V's during D's costs D. `blocked` against `idle` says whether a
stream of V's waiting during D's work slows D's work or its start (the GPUs' time-slicing between contexts);
`blocked` against `one_process` is what the two contexts cost a hand-off.
Medians and p90 in microseconds, one JSON line per case with `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protos.doorbell import Doorbell  # noqa: E402
from protos.shared_region import IpcEvent  # noqa: E402

STAMPS = 4  # V before its event, D first, D last, V after the wait
CASES = ("one_process", "blocked", "idle", "polled", "queued", "queued_late", "queued_tail")


@triton.jit
def _stamp_kernel(buf, i):
    t = tl.inline_asm_elementwise(asm="mov.u64 $0, %globaltimer;", constraints="=l", args=[], dtype=tl.int64,
                                  is_pure=False, pack=1)
    tl.store(buf + i, t)


def stamp(buf: torch.Tensor, i: int) -> None:
    _stamp_kernel[(1,)](buf, i)


def cycles_per_us() -> float:
    """The spin kernel's cycles per microsecond, timed once."""
    torch.cuda._sleep(1000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(2_000_000)
    b.record()
    b.synchronize()
    return 2_000_000 / (a.elapsed_time(b) * 1e3)


def work_graph(buf: torch.Tensor, kernels: int, cycles: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """D's step: a stamp, the spin kernels, a stamp (warmed up, then captured)."""
    def body():
        stamp(buf, 1)
        for _ in range(kernels):
            torch.cuda._sleep(cycles)
        stamp(buf, 2)

    with torch.cuda.stream(stream):
        body()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        body()
    return g


def poll(event: IpcEvent) -> None:
    if not event.wait_host(10.0):
        raise RuntimeError("the event did not complete within 10 s")


def v_prologue(buf: torch.Tensor, stream: torch.cuda.Stream, event: IpcEvent, accept_cycles: int) -> None:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(accept_cycles)
        stamp(buf, 0)
        event.record()


def one_process(args, cyc: float) -> list[list[int]]:
    dev = torch.device("cuda")
    sv, sd = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    buf = torch.zeros(STAMPS, dtype=torch.int64, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    bell, event = Doorbell(counter), IpcEvent.create(dev)
    bell.prepare_release()
    g = work_graph(buf, args.kernels, int(args.work_us / args.kernels * cyc), sd)
    with torch.cuda.stream(sv):
        stamp(buf, 3)
    out = []
    for r in range(1, args.reps + args.warmup + 1):
        torch.cuda.synchronize()
        v_prologue(buf, sv, event, int(args.accept_us * cyc))
        bell.wait(r, sv)
        with torch.cuda.stream(sv):
            stamp(buf, 3)
        poll(event)
        with torch.cuda.stream(sd):
            g.replay()
        bell.ring(r, sd)
        torch.cuda.synchronize()
        if r > args.warmup:
            out.append(buf.tolist())
    return out


def drafter_proc(conn, kernels: int, cycles: int, tail_cycles: int) -> None:
    dev = torch.device("cuda")
    counter, request, handle = conn.recv()
    bell, asked, event = Doorbell(counter), Doorbell(request), IpcEvent.open(handle, dev)
    asked.prepare_release()
    sd = torch.cuda.Stream(dev)
    buf = torch.zeros(STAMPS, dtype=torch.int64, device=dev)
    g = work_graph(buf, kernels, cycles, sd)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        r, queued, tail = msg
        if queued:  # the graph queued behind V's request ring; V goes on once told so
            asked.wait(r, sd)
        else:
            poll(event)
        with torch.cuda.stream(sd):
            g.replay()
        bell.ring(r, sd)
        if tail:  # work of D's after its ring (its context busy when V's wait ends)
            with torch.cuda.stream(sd):
                torch.cuda._sleep(tail_cycles)
        if queued:
            conn.send("queued")
        sd.synchronize()
        conn.send(buf.tolist())


def two_processes(args, cyc: float, case: str) -> list[list[int]]:
    dev = torch.device("cuda")
    sv = torch.cuda.Stream(dev)
    buf = torch.zeros(STAMPS, dtype=torch.int64, device=dev)
    counter, request = (torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(2))
    bell, asked, event = Doorbell(counter), Doorbell(request), IpcEvent.create(dev)
    bell.prepare_release()
    with torch.cuda.stream(sv):
        stamp(buf, 3)
        torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=drafter_proc, args=(there, args.kernels, int(args.work_us / args.kernels * cyc),
                                               int(args.tail_us * cyc)))
    p.start()
    here.send((counter, request, event.handle))
    if here.recv() != "ready":
        raise RuntimeError("the drafter process did not start")
    out = []
    queued = case.startswith("queued")  # D's graph queued ahead behind V's request ring
    try:
        for r in range(1, args.reps + args.warmup + 1):
            torch.cuda.synchronize()
            if queued:
                here.send((r, True, case == "queued_tail"))
                if here.recv() != "queued":
                    raise RuntimeError("the drafter process did not queue its graph")
                with torch.cuda.stream(sv):
                    torch.cuda._sleep(int(args.accept_us * cyc))
                    stamp(buf, 0)
                asked.ring(r, sv)
                if case == "queued_late":
                    time.sleep(args.late_us / 1e6)
            else:
                v_prologue(buf, sv, event, int(args.accept_us * cyc))
            if case == "blocked" or queued:
                bell.wait(r, sv)
                with torch.cuda.stream(sv):
                    stamp(buf, 3)
            if not queued:
                here.send((r, False, False))
            if case == "polled":
                while bell.read() < r:
                    time.sleep(0)
            d = here.recv()
            if case != "blocked" and not queued:
                bell.wait(r, sv)
                with torch.cuda.stream(sv):
                    stamp(buf, 3)
            torch.cuda.synchronize()
            if r > args.warmup:
                v = buf.tolist()
                out.append([v[0], d[1], d[2], v[3]])
    finally:
        here.send(None)
        p.join(30)
    return out


def summary(name: str, rows: list[list[int]], args) -> dict:
    def stat(xs):
        xs = sorted(xs)
        return {"median": round(statistics.median(xs) / 1e3, 1), "p90": round(xs[int(0.9 * (len(xs) - 1))] / 1e3, 1)}

    res = {"switch_in_us": stat([r[1] - r[0] for r in rows]), "work_us": stat([r[2] - r[1] for r in rows]),
           "resume_us": stat([r[3] - r[2] for r in rows])}
    return {"name": "context_switch", "case": name, "gpu": torch.cuda.get_device_name(),
            "params": {"work_us": args.work_us, "kernels": args.kernels, "accept_us": args.accept_us,
                       "reps": args.reps, **({"late_us": args.late_us} if name == "queued_late" else {}),
                       **({"tail_us": args.tail_us} if name == "queued_tail" else {})}, **res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-us", type=float, default=3500.0, help="D's graph: its spin kernels' time in all")
    p.add_argument("--kernels", type=int, default=150, help="D's graph: how many spin kernels")
    p.add_argument("--accept-us", type=float, default=50.0, help="V's kernel before its event")
    p.add_argument("--late-us", type=float, default=1000.0, help="queued_late: V's host sleep between ring and wait")
    p.add_argument("--tail-us", type=float, default=300.0, help="queued_tail: D's spin after its ring")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("context_switch.py needs a CUDA GPU")
    torch.cuda.init()
    cyc = cycles_per_us()
    print(f"{torch.cuda.get_device_name()}: {cyc:.0f} spin cycles per us")
    for case in args.cases:
        t0 = time.perf_counter()
        rows = one_process(args, cyc) if case == "one_process" else two_processes(args, cyc, case)
        s = summary(case, rows, args)
        print(f"{case:12s} switch_in {s['switch_in_us']}  work {s['work_us']}  resume {s['resume_us']}  "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(s) + "\n")


if __name__ == "__main__":
    main()
