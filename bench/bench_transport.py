"""Per-step cost of each verifier <-> drafter transport against the in-process drafter.

    python bench/bench_transport.py [--pair models/kimi-mini] [--device cpu|cuda] [--concurrency 1 32]
                                    [--steps 30] [--warmup 5] [--time-budget-s S] [--no-gc-freeze]
                                    [--no-check-graphs] [--control-spin-ms MS] [--keepwarm-ms MS]
                                    [--transports T ...] [--drafter-sessions N]
                                    [--torch-trace DIR[:FIRST[:COUNT]]] [--rows projected|taps]
                                    [--tree-inputs auto|torch] [--local-draft eager|lazy] [--variant SPEC ...]
                                    [--block-steps K] [--draft-ahead on|off]

For each transport the same engine (target in this process) runs C sessions at one budget; the drafter
is the in-process `Drafter` (inprocess) or a `ddtree drafter serve` process on loopback (same device)
reached through the stream client with shared regions (colocated: /dev/shm on CPU, CUDA IPC on GPU,
the trees handed over by the verifier's doorbell its stream waits on, the requests by a CUDA IPC event; GPU only:
colocated_in_place and colocated_answer, the same with the trees always written where the verifier laid them out and
the verify step queued behind the doorbell right after the request leaves, or always once the answer is read
(`StreamClientConfig.trees_in_place` on / off; colocated is its default, auto), colocated_events, the same as
colocated with the drafter's IPC event polled on the verifier's host instead of the doorbell, and colocated_sync,
without events, each side waiting for its GPU before a message) or
inline bytes (grpc; on a GPU its verify step queued before the trees arrive, behind a host doorbell that the
thread reading the answer rings, `verifier_service.tree_landing`; GPU only: grpc_sync, the trees waited for on
the host before the step is queued). The gRPC streams send the drafter KeepWarm messages shortly before each
expected request and answer (`verifier_service.keepwarm`, period --keepwarm-ms); grpc_cold is grpc without them.
Context rows: `--rows projected` has every engine project the taps with the drafter's context projection before sending
(`drafter_service.context_projection`: in-process with its drafter's modules, the remote engines as `ddtree verifier
serve --context-projection` does); `--rows taps` sends the taps and lets the drafters project them (every engine alike,
so the trees still match): the wire format before the projection moved to the verifier. `--rows auto` (the default, as
the manifests deploy it): the gRPC engines project, in-process projects (as it always does), the co-located engines send
taps (their rows cross no wire, and the drafter's host launches its step while its GPU projects, instead of waiting
for the verifier's projection to finish before it touches the region). The drafter projects a step's rows in one GEMM
over the same rows in the same order as the verifier would, so the trees still match in every mode.
All engines share one target (batch-invariant on CUDA, as `build_local_engine` builds it) and step in
interleaved rounds, so that load from other processes falls on all of them alike. Checked: every session's
tokens equal the in-process engine's (greedy: a transport must not change a token), and every round's tokens
too (the drafter runs the same
model on the same device, so the trees must be the same, which is also what makes the timings
comparable). On CUDA each timed step is bracketed by torch.cuda.synchronize(). Reported: median and p90
verify-step time, median time from asking the drafter to having the trees (`Engine.draft_ns`; for a
remote drafter the engine prepares the batch layout in between), the ratio and overhead against
in-process at the same C, and for the remote transports the medians of the stream client's per-step
phases (`breakdown_ms`: round trip, the drafter's own compute as it reports it, transport = the
difference, decode, check), and how the drafter process ran its steps at that C (`drafter_graph_runs`: CUDA-graph
replays, captures, eager runs, from its `ddtree_draft_graph_runs_total`; all remote engines together). Output: a
table on stdout and JSON lines appended to bench/results/transport.jsonl. Exit status 1 (after writing the
records, flagged with `problems`) when a check fails, a step fell back to autoregressive, or the co-located stream
did not use its shared regions on the requested device.

glibc's allocator: this process (the verifier side of every engine) applies the served processes' malloc settings
(`gateway.commands.host_memory`, as `ddtree verifier serve` and the drafter process it starts do: one arena, fixed
mmap and trim thresholds), else its dynamic mmap threshold decides, by the process's allocation history, whether a
step's megabyte messages and temporaries are reused or mapped and page-faulted afresh every step (a C = 32 step's
0.9 MB gRPC request at K2.6 widths: 1.8 ms of message building on the 2-core CPU host instead of 0.2). Records
say whether it took (`malloc_tuned`) and whether MALLOC_* variables pinned it as well (`malloc_pinned`).
`--gil-switch-us` sets the GIL switch interval in both processes (`gateway.commands.gil_switch`; records:
`gil_switch_us`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
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
from bench.transport_lineup import (  # noqa: E402
    DOORBELLED,
    Variant,
    drafter_trace_spec,
    graph_runs,
    keepwarm_ms,
    kind,
    open_engines,
    remote_transports,
    start_drafter,
    wait_serving,
)
from drafter_service.device_copy import pinned_min_bytes  # noqa: E402

TRANSPORTS = ("inprocess", "colocated", "grpc")


def admit(engine, conc, budget, vocab) -> None:
    from verifier_service.session import DecodeParams

    g = torch.Generator().manual_seed(0)
    for i in range(conc):
        prompt = torch.randint(0, vocab - 64, (64,), generator=g).tolist()
        engine.add(prompt, DecodeParams(max_new_tokens=10**6, budget=budget, topk=8, ignore_eos=True), sid=f"b{i}")


def timed_step(engine, block: int = 1) -> tuple[float, dict[str, list[int]]]:
    """`block` steps of one engine back to back -> (the time per step, each session's tokens of the block). On CUDA
    the block is bracketed by torch.cuda.synchronize() and, for a drafter process asked for the next step's draft
    ahead, a wait for that draft (`Engine.wait_ahead`): GPU work the block queued belongs to it, not to the next
    engine's in the round."""
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
    t0 = time.perf_counter()
    out: dict[str, list[int]] = {}
    for _ in range(block):
        for sid, toks in engine.step().items():
            out.setdefault(sid, []).extend(toks)
    if cuda:
        torch.cuda.synchronize(engine.device)
        engine.wait_ahead()
    return (time.perf_counter() - t0) / block, out


def report_syncs() -> None:
    """--sync-debug: print each new call stack that made the host wait for the GPU (torch's sync debug warnings)."""
    import traceback
    import warnings

    seen: set[tuple] = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        stack = traceback.extract_stack()[:-1]
        key = tuple((f.filename, f.lineno) for f in stack[-6:])
        if key not in seen:
            seen.add(key)
            print(f"sync: {message}\n" + "".join(traceback.format_list(stack[-8:])), flush=True)

    warnings.simplefilter("always")
    warnings.showwarning = show


def mps_running() -> bool:
    """Whether an MPS control daemon serves this environment's CUDA clients (its pipe exists): every process of
    the bench, in-process engine included, then shares one GPU context through it."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def versions() -> dict:
    import grpc

    v = {"torch": torch.__version__, "grpcio": grpc.__version__, "python": platform.python_version(),
         "cuda": torch.version.cuda}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        pass
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=str(REPO / "models" / "kimi-mini"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--steps", type=int, default=30, help="measured rounds per concurrency (all transports)")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured rounds first (Triton compiles, caches warm)")
    p.add_argument("--block-steps", type=int, default=1,
                   help="steps of one engine back to back per round, timed together (the step's time: their mean): "
                        "1 brackets every step with a synchronize, so nothing a step queued for the next one overlaps "
                        "that next step's host work; a block > 1 measures the steady state of an engine whose steps "
                        "overlap (draft_ahead: the next draft runs while the host prepares the next step)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop measuring a concurrency early (after at least 5 rounds) once its share of this "
                        "many seconds is spent; the records say how many rounds were measured")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default=None,
                   help="verify forwards and draft steps through CUDA graphs in every engine and the drafter "
                        "process (default: on for cuda, as served)")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="freeze the heap after the warm-up rounds, as `ddtree ... serve` does once warmed up "
                        "(the drafter process always does)")
    p.add_argument("--check-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="the stream clients replay the tree check from CUDA graphs (StreamClientConfig.check_graphs)")
    p.add_argument("--control-spin-ms", type=float, default=0.0,
                   help="co-located streams: both ends poll their control socket this long before sleeping")
    p.add_argument("--keepwarm-ms", type=float, default=3.0,
                   help="gRPC streams (not grpc_cold): the KeepWarm period (StreamClientConfig.keepwarm_ms)")
    p.add_argument("--transports", nargs="+", default=None,
                   help="the remote engines to run beside in-process (default: all: colocated, grpc, and on a GPU "
                        "colocated_events, colocated_sync and grpc_sync; grpc_cold everywhere)")
    p.add_argument("--drafter-sessions", type=int, default=None,
                   help="the drafter process's --max-sessions (default: every remote engine's sessions at the "
                        "largest C, + 8): the size of its context cache and of its CUDA-graph buckets")
    p.add_argument("--rows", choices=("auto", "projected", "taps"), default="auto",
                   help="context rows the engines send: projected by the verifier, taps, or auto (default): projected "
                        "over gRPC and in-process, taps co-located")
    p.add_argument("--torch-trace", default=None, metavar="DIR[:FIRST[:COUNT]]",
                   help="diagnosis: torch.profiler over rounds FIRST.. FIRST+COUNT-1 in this process (the markers "
                        "name each engine's step, or block) and over the drafter process's steps of the same rounds "
                        "(it counts the steps it is sent: the remote engines' blocks), Chrome traces into DIR; "
                        "`bench/trace_steps.py DIR --step-label grpc` lines them up. Timings taken meanwhile are not "
                        "representative")
    p.add_argument("--malloc-tune", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the served processes' glibc malloc settings in this process (the verifier side), as "
                        "`ddtree verifier serve` does; --no-malloc-tune: glibc's defaults (the records before the "
                        "thirty-seventh session)")
    p.add_argument("--gil-switch-us", type=float, default=0.0,
                   help="the GIL switch interval of this process (the verifier side) and the drafter process, us "
                        "(0: the interpreter's default, 5000; gateway.commands.gil_switch)")
    p.add_argument("--tree-inputs", choices=("torch", "auto"), default="auto",
                   help="every engine's forward tree inputs: one Triton launch on CUDA (auto, the default) or the "
                        "torch code (EngineConfig.tree_inputs)")
    p.add_argument("--draft-ahead", choices=("on", "off"), default="on",
                   help="whether the engines draft each next step before their host read (EngineConfig.draft_ahead, "
                        "on by default; gRPC engines send the next requests right after the read instead; a --variant "
                        "draft_ahead=false copy steps beside the others)")
    p.add_argument("--local-draft", choices=("eager", "lazy"), default="eager",
                   help="when the in-process engine queues its drafter's work: before the step's layout (eager, the "
                        "default) or after it (EngineConfig.local_draft)")
    p.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE[,...][@ENGINE[/ENGINE]]",
                   help="also step a copy of every engine (or of those named after @) with these EngineConfig "
                        "fields changed (and rows=projected|taps: the context rows a copy of a remote engine "
                        "sends), named ENGINE+FIELD=VALUE,..., in the same interleaved rounds: an A/B that the "
                        "machine's drift between runs does not touch. Each copy has a drafter state and a stream of "
                        "its own on the shared target and drafter process. Repeatable")
    p.add_argument("--sync-debug", action="store_true",
                   help="diagnosis: warn at every CUDA call that makes this process's host wait for its GPU in the "
                        "measured rounds (torch.cuda.set_sync_debug_mode; each place once, with its stack)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "transport.jsonl"))
    return p


@dataclasses.dataclass
class Run:
    """What every engine's records share: the arguments and what the setup decided."""

    args: argparse.Namespace
    cuda: bool
    gpu: str | None
    device_name: str
    dtype_name: str
    graphs: bool
    drafter_sessions: int
    malloc_tuned: bool
    gil_switch_us: float


@dataclasses.dataclass
class Rounds:
    """One concurrency's measured rounds, per engine."""

    times: dict[str, list[float]]  # s per step (a block's mean)
    draft_times: dict[str, list[float]]  # engine.draft_ns: asked -> trees
    phases: dict[str, list[dict[str, float]]]  # the stream clients' last_step_ms
    emitted: dict[str, dict[str, list[int]]]  # each session's tokens, warm-up included
    diverged: int = 0  # engine-rounds that emitted other tokens than in-process that round (other trees)


def run_rounds(run: Run, engines: dict, clients: dict, conc: int, share: float | None, step_trace) -> Rounds:
    """The warm-up and measured rounds at one concurrency: each round steps every engine once (a block of
    --block-steps), in the same order; stops early once `share` seconds are spent (after at least 5 rounds)."""
    from protos.serving import freeze_startup_heap

    args = run.args
    r = Rounds({t: [] for t in engines}, {t: [] for t in engines}, {t: [] for t in clients},
               {t: {} for t in engines})
    t_conc = time.monotonic()
    for k in range(args.warmup + args.steps):
        outs = {}
        if k == args.warmup and args.gc_freeze:
            freeze_startup_heap()  # as the servers do once warmed up (GrpcServer.set_serving)
        if k == args.warmup and args.sync_debug and run.cuda:
            report_syncs()
            torch.cuda.set_sync_debug_mode("warn")
        for t, e in engines.items():
            if step_trace is not None:
                step_trace.tick(t)
            dt, outs[t] = timed_step(e, args.block_steps)
            if k >= args.warmup:
                r.times[t].append(dt)
                if e.draft_ns is not None:
                    r.draft_times[t].append((e.draft_ns[1] - e.draft_ns[0]) * 1e-9)
                if t in clients and clients[t].last_step_ms:
                    r.phases[t].append(clients[t].last_step_ms)
        for t, out in outs.items():
            for sid, toks in out.items():
                r.emitted[t].setdefault(sid, []).extend(toks)
            if out != outs["inprocess"]:
                r.diverged += 1
                if r.diverged <= 3:
                    print(f"note: C={conc} round {k}: {t} emitted {out}, in-process {outs['inprocess']}", flush=True)
        if share is not None and k >= args.warmup + 4 and time.monotonic() - t_conc > share:
            print(f"C={conc}: time budget spent after {k + 1 - args.warmup} measured rounds", flush=True)
            break
    return r


def stream_problems(run: Run, clients: dict, before: dict, conc: int) -> tuple[list[str], dict[str, dict[str, int]]]:
    """-> (what the streams' counters over one concurrency's rounds say went wrong, each stream's hand-over counts:
    steps whose trees went where the verifier laid them out, answers that found the drafter's ring rung, ...)."""
    problems, in_place = [], {}
    for t, c in clients.items():
        d = {key: c.stats[key] - before[t][key] for key in c.stats}
        if d["fallback_steps"] or d["invalid_trees"]:
            problems.append(f"C={conc} {t}: {d['fallback_steps']} autoregressive fallback steps, "
                            f"{d['invalid_trees']} invalid trees ({c.last_error})")
        if not kind(t).startswith("grpc") and (d["region_tensors"] == 0 or d["region_trees"] != d["steps"]):
            problems.append(f"C={conc} {t}: shared regions not used for every step ({d})")
        handed = {"colocated": "doorbell_steps", "colocated_in_place": "doorbell_steps",
                  "colocated_answer": "doorbell_steps", "colocated_polled": "doorbell_steps",
                  "colocated_events": "event_steps",
                  "grpc": "landed_steps", "grpc_cold": "landed_steps"}.get(kind(t)) if run.cuda else None
        if handed and d[handed] != d["steps"]:
            problems.append(f"C={conc} {t}: {handed} is not every step ({d})")
        # a stream's first step is answered
        if kind(t) == "colocated_in_place" and d["in_place_steps"] < d["steps"] - 1:
            problems.append(f"C={conc} {t}: in_place_steps is not every step after the first ({d})")
        # every ahead step of a stream with the request doorbell rings it (the drafter may wait on it; rings count
        # the steps sent, ahead_steps those taken: the last one sent is never taken)
        polled = kind(t) == "colocated_polled"
        if run.cuda and kind(t) in DOORBELLED and (d["request_rings"] if polled else
                                                    d["request_rings"] < d["ahead_steps"]):
            problems.append(f"C={conc} {t}: request_rings is not every ahead step ({d})")
        in_place[t] = {"in_place_steps": d["in_place_steps"], "ring_first": d["ring_first"],
                       "ahead_steps": d["ahead_steps"], "request_rings": d["request_rings"]}
    return problems, in_place


def record(run: Run, t: str, e, conc: int, r: Rounds, base: float, inproc, client, runs: dict, hand_over: dict,
           lossless: bool) -> dict:
    """One engine's JSON record at one concurrency (`base`: the in-process engine's median step, ms)."""
    args = run.args
    times = r.times[t]
    step, n = statistics.median(times) * 1e3, len(times)
    phases = r.phases.get(t, ())
    return {"name": "transport/step",
            "params": {"transport": t, "concurrency": conc, "device": args.device, "budget": args.budget,
                       "topk": 8, "pair": Path(args.pair).name, "steps": n, "warmup": args.warmup,
                       "block_steps": args.block_steps,
                       "cuda_graphs": run.graphs, "control_spin_ms": args.control_spin_ms,
                       "keepwarm_ms": keepwarm_ms(kind(t), args), "drafter_sessions": run.drafter_sessions,
                       "gc_freeze": args.gc_freeze, "check_graphs": args.check_graphs,
                       "mps": run.cuda and mps_running(), "torch_trace": args.torch_trace,
                       "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                       "rows": args.rows, "target_layers": inproc.target.cfg.num_hidden_layers,
                       "tree_inputs": e.cfg.tree_inputs, "local_draft": e.cfg.local_draft,
                       "draft_ahead": e.cfg.draft_ahead,
                       "projected_rows": e.projection is not None, "variant": t[len(kind(t)) + 1:] or None},
            "device": run.device_name, "gpu": run.gpu, "dtype": run.dtype_name, "commit": commit(),
            "torch": torch.__version__, "versions": versions(),
            "ms": round(step, 4), "ratio": round(step / base, 4),
            "metrics": {"step_ms_median": round(step, 3),
                        "step_ms_p90": round(sorted(times)[int(0.9 * (n - 1))] * 1e3, 3),
                        "draft_ms_median": round(statistics.median(r.draft_times[t]) * 1e3, 3),
                        "overhead_vs_inprocess_pct": round(100 * (step / base - 1), 1),
                        # per phase over the steps that timed it (an in-place step has no round trip)
                        "breakdown_ms": {key: round(statistics.median(p[key] for p in phases if key in p), 3)
                                         for key in dict.fromkeys(k for p in phases for k in p)}},
            "outputs_identical": lossless, "steps_identical": not r.diverged,
            "regions": client.region_devices if client is not None else {},
            "drafter_graph_runs": runs if client is not None else {},
            "ipc_events": client is not None and client.ipc_events,
            "doorbell": client is not None and client.doorbell,
            **hand_over.get(t, {"in_place_steps": 0, "ring_first": 0, "ahead_steps": 0, "request_rings": 0}),
            "malloc_pinned": "MALLOC_MMAP_THRESHOLD_" in os.environ, "malloc_tuned": run.malloc_tuned,
            "gil_switch_us": run.gil_switch_us,
            "pinned_min_bytes": pinned_min_bytes(os.environ.get("DDTREE_PINNED_MIN_BYTES")),
            "time": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "note": "drafter in a separate process on loopback, same device; engines share one target "
                    "and step in interleaved rounds"
                    + (("; each step bracketed by torch.cuda.synchronize()" if args.block_steps == 1 else
                        f"; blocks of {args.block_steps} steps, each block bracketed by "
                        "torch.cuda.synchronize()") if run.cuda else
                       "; on CPU the processes share the machine's cores with other work")}


def measure(run: Run, inproc, engines: dict, clients: dict, conc: int, share: float | None, step_trace,
            metrics_addr: str | None) -> tuple[list[dict], list[str]]:
    """One concurrency: admit C sessions to every engine, run the rounds, check them, release the sessions ->
    (a record per engine, the problems found)."""
    args = run.args
    before = {t: dict(c.stats) for t, c in clients.items()}
    runs_before = graph_runs(metrics_addr)
    vocab = inproc.target.cfg.vocab_size
    for e in engines.values():
        admit(e, conc, args.budget, vocab)
    r = run_rounds(run, engines, clients, conc, share, step_trace)
    problems = []
    # lossless: every session's tokens so far are a prefix of the in-process engine's, or extend them
    wrong = [(t, sid) for t in engines if t != "inprocess" for sid, ref in r.emitted["inprocess"].items()
             if (got := r.emitted[t].get(sid, []))[: len(ref)] != ref[: len(got)]]
    if wrong:
        problems.append(f"C={conc}: outputs differ from in-process: {wrong[:4]}")
    if r.diverged:  # same tokens, but other trees: expected bit-identical on one device; timings not paired
        problems.append(f"C={conc}: {r.diverged} engine-rounds emitted other tokens than in-process that round "
                        "(other trees)")
    found, hand_over = stream_problems(run, clients, before, conc)
    problems += found
    runs_after = graph_runs(metrics_addr)  # the drafter process's, all remote engines of this C together
    runs = {k: v - runs_before.get(k, 0) for k, v in runs_after.items() if v != runs_before.get(k, 0)}
    print(f"drafter graph runs at C={conc} (warm-up included, all remote engines): {runs}", flush=True)
    rung = sum(v["request_rings"] for v in hand_over.values())
    if run.cuda and rung and not runs.get("ahead_queued"):  # the drafter took none behind a GPU wait
        problems.append(f"C={conc}: {rung} ahead steps rang the request doorbell, the drafter queued none behind it "
                        f"({runs})")
    rows = []
    base = statistics.median(r.times["inprocess"]) * 1e3
    for t, e in engines.items():
        for i in range(conc):
            e.release(f"b{i}")
        row = record(run, t, e, conc, r, base, inproc, clients.get(t), runs, hand_over, not wrong)
        rows.append(row)
        m = row["metrics"]
        print(f"{t:10s} C={conc:3d}  step {m['step_ms_median']:8.2f} ms (p90 {m['step_ms_p90']:8.2f})"
              f"  draft {m['draft_ms_median']:8.2f} ms  ratio {row['ratio']:6.3f}"
              f"  overhead {m['overhead_vs_inprocess_pct']:+6.1f}%  ({len(r.times[t])} steps)"
              + "".join(f"  {key} {v:.2f}" for key, v in m["breakdown_ms"].items()), flush=True)
    return rows, problems


def print_table(rows: list[dict], run: Run) -> None:
    print(f"\n| transport | C | step ms (median) | p90 ms | draft ms | ratio vs in-process |  ({run.device_name}, "
          f"{run.dtype_name})\n|---|---|---|---|---|---|")
    for r in rows:
        m = r["metrics"]
        print(f"| {r['params']['transport']} | {r['params']['concurrency']} | {m['step_ms_median']:.3f} | "
              f"{m['step_ms_p90']:.3f} | {m['draft_ms_median']:.3f} | {r['ratio']:.3f} |")


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.block_steps < 1:
        p.error(f"--block-steps must be >= 1, got {args.block_steps}")

    from gateway.commands.gil_switch import set_gil_switch
    from gateway.commands.host_memory import tune_glibc_malloc
    from telemetry.torch_trace import StepTrace, parse_spec
    from verifier_service.engine import EngineConfig
    from verifier_service.local import DTYPES, build_local_engine

    malloc_tuned = args.malloc_tune and tune_glibc_malloc()  # before this process's threads exist, as servers do
    gil_switch_us = set_gil_switch(args.gil_switch_us)
    t_start = time.monotonic()
    pair = Path(args.pair)
    cuda = args.device.startswith("cuda")
    dtype_name = args.dtype or ("bfloat16" if cuda else "float32")
    # one engine config for all engines (the verifier server turns CUDA graphs on for a GPU)
    graphs = cuda if args.cuda_graphs is None else args.cuda_graphs == "on"
    ecfg = EngineConfig(page_size=16, num_pages=8192, max_sessions=max(args.concurrency) + 1, cuda_graphs=graphs,
                        tree_inputs=args.tree_inputs, local_draft=args.local_draft,
                        draft_ahead=args.draft_ahead == "on")
    try:
        variants = {v.suffix: v for v in (Variant.parse(spec, ecfg) for spec in args.variant)}
    except ValueError as e:
        p.error(str(e))
    remote = remote_transports(args, cuda, p)
    n_streams = sum(1 + sum(v.takes(t) for v in variants.values()) for t in remote)  # all sessions on each stream
    drafter_sessions = args.drafter_sessions or n_streams * max(args.concurrency) + 8
    if drafter_sessions < n_streams * max(args.concurrency):
        p.error(f"--drafter-sessions {drafter_sessions}: the remote engines hold "
                f"{n_streams * max(args.concurrency)} sessions at C={max(args.concurrency)}")
    try:
        trace_window = None if args.torch_trace is None else parse_spec(args.torch_trace)
    except ValueError as e:
        p.error(str(e))
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if cuda else None
    run = Run(args, cuda, gpu, gpu or platform.processor() or "cpu", dtype_name, graphs, drafter_sessions,
              malloc_tuned, gil_switch_us)
    rows, problems = [], []
    step_trace = None
    proc = start_drafter(pair, args.device, dtype_name, drafter_sessions, graphs, args.control_spin_ms,
                         None if args.torch_trace is None else
                         drafter_trace_spec(args.torch_trace, n_streams * args.block_steps),
                         args.gil_switch_us)  # loads now
    clients: dict = {}
    try:
        inproc = build_local_engine(pair / "target", pair / "drafter", DTYPES[dtype_name], args.device, ecfg)
        projector = inproc.projection
        if args.rows == "taps":
            inproc.projection = None  # its drafter projects them, as the remote drafters do
        addr, metrics_addr = wait_serving(proc)
        engines = open_engines(args, inproc, projector, ecfg, variants, remote, addr, clients)
        if trace_window is not None:  # FIRST / COUNT in rounds: every engine ticks once a round (`drafter_trace_spec`
            out_dir, first, count = trace_window  # scaled the drafter's to the steps it is sent)
            step_trace = StepTrace(out_dir, "verifier", first * len(engines), count * len(engines))
        regions = clients["colocated"].region_devices if "colocated" in clients else None
        print(f"device {run.device_name}; drafter process at {addr}; co-located regions {regions}; "
              f"setup {time.monotonic() - t_start:.1f} s", flush=True)
        want = torch.device(args.device).type
        if regions is not None and (not regions or any(torch.device(d).type != want for d in regions.values())):
            problems.append(f"co-located regions {regions} are not on {args.device}")
        share = None if args.time_budget_s is None else args.time_budget_s / len(args.concurrency)
        for conc in args.concurrency:
            got, found = measure(run, inproc, engines, clients, conc, share, step_trace, metrics_addr)
            rows += got
            problems += found
    finally:
        if step_trace is not None:
            step_trace.close()
        for c in clients.values():
            c.close()
        proc.terminate()  # the drafter writes its trace as it drains
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if problems:
        for row in rows:
            row["problems"] = problems
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print_table(rows, run)
    print(f"total {time.monotonic() - t_start:.1f} s; {len(rows)} records appended to {args.out}", flush=True)
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
