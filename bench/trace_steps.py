"""Each step's GPU activity, from the Chrome traces of several processes (`--torch-trace`, telemetry.torch_trace).

    python bench/trace_steps.py DIR [--step-label grpc] [--gap-us 20] [--merged OUT.json]

Reads every DIR/<role>-<pid>.json, puts their events on one clock (Kineto's `baseTimeNanoseconds` + `ts`: the same
host clock in every process), and for each marked step of the first role found (`verifier` before `drafter`; with
`--step-label`, only the markers that carry it, e.g. one engine of bench_transport) prints, relative to the step's
marker: every process's GPU work as runs of kernels (kernels less than --gap-us apart joined; count, first and last
name), each copy and memset alone, and the host-side waits (cudaStreamSynchronize, cudaEventSynchronize,
cudaMemcpy) that took over 50 us. `--merged` also writes all processes' events as one trace (open it in Perfetto
or chrome://tracing).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
MARK = re.compile(r"^ddtree:(\w+) step (\d+)(?: (.*))?$")


@dataclass
class Event:
    role: str
    cat: str
    name: str
    t0: float  # us on the common clock
    dur: float


def load(path: Path) -> tuple[str, list[Event], list[dict]]:
    """One trace -> (its role, its events on the common clock, its raw events with ts moved to that clock)."""
    d = json.loads(path.read_text())
    role = path.name.split("-")[0]
    base_us = d.get("baseTimeNanoseconds", 0) / 1e3
    events, raw = [], []
    for e in d.get("traceEvents", []):
        if e.get("ph") != "X" or "ts" not in e:
            continue
        t0 = float(e["ts"]) + base_us
        events.append(Event(role, e.get("cat", ""), e.get("name", ""), t0, float(e.get("dur", 0.0))))
        raw.append({**e, "ts": t0, "pid": f"{role} {e.get('pid', '')}"})
    return role, events, raw


def step_marks(events: list[Event], role: str, label: str | None) -> list[float]:
    """Start times of `role`'s step markers (those with `label` when given), in order."""
    out = []
    for e in events:
        m = MARK.match(e.name)
        if e.role == role and m and m.group(1) == role and (label is None or m.group(3) == label):
            out.append(e.t0)
    return sorted(out)


def gpu_runs(events: list[Event], gap_us: float) -> list[tuple[float, float, str]]:
    """A process's GPU events in a window -> (start, end, text): kernels joined into runs, copies alone."""
    out: list[tuple[float, float, str]] = []
    run: list[Event] = []
    end = 0.0  # where the run's kernels have ended

    def flush() -> None:
        if run:
            names = f"{run[0].name[:40]}" + (f" .. {run[-1].name[:40]}" if len(run) > 1 else "")
            out.append((run[0].t0, end, f"{len(run)} kernel(s): {names}"))
            run.clear()

    for e in sorted(events, key=lambda e: e.t0):
        if e.cat == "kernel":
            if run and e.t0 - end > gap_us:
                flush()
            end = max(end, e.t0 + e.dur) if run else e.t0 + e.dur
            run.append(e)
        else:
            flush()
            out.append((e.t0, e.t0 + e.dur, f"{e.cat} {e.name[:60]}"))
    flush()
    return out


def report(events: list[Event], marks: list[float], gap_us: float, out=sys.stdout) -> None:
    roles = sorted({e.role for e in events})
    for i, t in enumerate(marks):
        end = marks[i + 1] if i + 1 < len(marks) else max(e.t0 + e.dur for e in events)
        print(f"step {i}: {(end - t) / 1e3:.3f} ms to the next marker", file=out)
        lines = []
        for role in roles:
            inside = [e for e in events if e.role == role and t <= e.t0 < end]
            for a, b, text in gpu_runs([e for e in inside if e.cat in GPU_CATS], gap_us):
                lines.append((a, f"  {(a - t) / 1e3:+8.3f} ms  {role:9} GPU  {(b - a) / 1e3:7.3f} ms  {text}"))
            for e in inside:
                if e.cat == "cuda_runtime" and e.name.startswith(HOST_WAITS) and e.dur > 50:
                    lines.append((e.t0, f"  {(e.t0 - t) / 1e3:+8.3f} ms  {role:9} host {e.dur / 1e3:7.3f} ms  "
                                        f"{e.name}"))
                m = MARK.match(e.name)
                if m and e.t0 != t:
                    lines.append((e.t0, f"  {(e.t0 - t) / 1e3:+8.3f} ms  {role:9} mark {e.name}"))
        for _, line in sorted(lines):
            print(line, file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--step-label", default=None, help="only the step markers carrying this label")
    ap.add_argument("--gap-us", type=float, default=20.0, help="kernels closer than this form one run")
    ap.add_argument("--merged", type=Path, default=None, help="also write one merged Chrome trace here")
    args = ap.parse_args(argv)
    paths = sorted(p for p in args.dir.glob("*-*.json") if not p.name.endswith(".meta.json"))
    if not paths:
        ap.error(f"no <role>-<pid>.json traces in {args.dir}")
    events: list[Event] = []
    raw: list[dict] = []
    for p in paths:
        _, ev, r = load(p)
        events += ev
        raw += r
    roles = {e.role for e in events}
    role = "verifier" if "verifier" in roles else sorted(roles)[0]
    marks = step_marks(events, role, args.step_label)
    if not marks:
        ap.error(f"no `ddtree:{role} step` markers{' with label ' + args.step_label if args.step_label else ''}")
    print(f"{len(paths)} trace(s) ({', '.join(p.name for p in paths)}); steps of the {role}: {len(marks)}")
    report(events, marks, args.gap_us)
    if args.merged is not None:
        args.merged.write_text(json.dumps({"traceEvents": raw, "displayTimeUnit": "ms"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
