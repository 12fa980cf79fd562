"""A remote draft step's hand-offs from a host timeline (`telemetry.host_timeline`): the median time between
consecutive marks over the steps, both processes together.

    DDTREE_HOST_TIMELINE=/tmp/tl.log python bench/bench_transport.py ... --transports grpc --concurrency 1
    python bench/host_timeline.py /tmp/tl.log [--skip 5] [--json]

A step starts at each `step_sent`; every other mark counts the first time it appears before the next `step_sent` (run
one remote engine at a time, so that the marks are one stream's). The marks that at least half the steps have are the
path's (a co-located stream's first message travels over gRPC, its steps over the control socket); steps missing one
of them are dropped, as are the first --skip (warm-up). Prints one line per hand-off (median, p10, p90 in us; with
`cpu`, the median CPU time of the thread that made both marks, where one thread made them in most steps: well below
the wall time, the thread waited for the GIL or a core), the engine's side marks' time after `step_sent` and its lead
marks' time before the next one, and the
two host stretches a remote step adds to the drafter's own work: step_sent -> draft_begin and answer_ready -> the
verifier's end (answer_landed when the trees land on a GPU, else answer_taken).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from telemetry.host_timeline import LEAD_MARKS, MARKS, SIDE_MARKS  # noqa: E402

CPU = "@cpu"  # a step's {tag: (thread id, thread CPU ns)} for records that carry them


def steps_of(lines: list[str]) -> list[dict]:
    """The records (`<pid> <tag> <ns>[ <tid> <cpu ns>]`) -> one {tag: ns} per step, in time order; records with the
    thread's id and CPU time also go into the step's CPU entry ({tag: (tid, cpu ns)})."""
    events = sorted((int(f[2]), f[1], (int(f[3]), int(f[4])) if len(f) >= 5 else None)
                    for f in (line.split() for line in lines if line.strip()))
    steps: list[dict] = []
    for ns, tag, cpu in events:
        if tag == "step_sent":
            steps.append({tag: ns, CPU: {}})
        elif not steps or (tag in steps[-1] and tag not in LEAD_MARKS):  # lead marks: the last one counts
            continue
        else:
            steps[-1][tag] = ns
        if cpu is not None:
            steps[-1][CPU][tag] = cpu
    return steps


def _spread(d: list[float]) -> tuple[float, float, float]:
    d = sorted(d)
    return statistics.median(d), d[len(d) // 10], d[9 * len(d) // 10]


def hand_offs(steps: list[dict], skip: int = 0) -> dict:
    """-> {"marks": the marks of most steps, in MARKS order, "steps": how many, "segments": [(from, to, median,
    p10, p90) us], "cpu": {(from, to): the median CPU us of the thread that made both marks, for segments with both
    marks on one thread in most steps}, "side": {mark: (median, p10, p90) us after step_sent}, "lead": {mark: (median,
    p10, p90) us before the next step_sent}, "added_us": the median of (draft_begin - step_sent) + (end -
    answer_ready)}."""
    seen = [m for m in MARKS if 2 * sum(m in s for s in steps) >= len(steps)]  # marks of most steps (the path's)
    kept = [s for s in steps if all(m in s for m in seen)][skip:]
    if not kept:
        return {"marks": seen, "steps": 0, "segments": [], "cpu": {}, "side": {}, "lead": {}, "added_us": None}
    segments, cpu = [], {}
    for a, b in zip(seen, seen[1:]):
        segments.append((a, b, *_spread([(s[b] - s[a]) / 1e3 for s in kept])))
        one = [s[CPU] for s in kept if a in s.get(CPU, {}) and b in s[CPU] and s[CPU][a][0] == s[CPU][b][0]]
        if 2 * len(one) >= len(kept):
            cpu[(a, b)] = statistics.median((c[b][1] - c[a][1]) / 1e3 for c in one)
    side, lead = {}, {}
    for m in SIDE_MARKS:
        d = [(s[m] - s["step_sent"]) / 1e3 for s in kept if m in s]
        if 2 * len(d) >= len(kept):
            side[m] = _spread(d)
    for m in LEAD_MARKS:  # over consecutive steps (the first --skip left out)
        d = [(b["step_sent"] - a[m]) / 1e3 for a, b in zip(steps[skip:], steps[skip + 1:]) if m in a]
        if d and 2 * len(d) >= len(kept) - 1:
            lead[m] = _spread(d)
    end = "answer_landed" if "answer_landed" in seen else "answer_taken"
    added = None
    if {"step_sent", "draft_begin", "answer_ready", end} <= set(seen):
        added = statistics.median(((s["draft_begin"] - s["step_sent"]) + (s[end] - s["answer_ready"])) / 1e3
                                  for s in kept)
    return {"marks": seen, "steps": len(kept), "segments": segments, "cpu": cpu, "side": side, "lead": lead,
            "added_us": added, "end": end}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = hand_offs(steps_of(Path(args.file).read_text().splitlines()), args.skip)
    if args.json:
        print(json.dumps({**out, "cpu": {f"{a}->{b}": v for (a, b), v in out["cpu"].items()}}))
        return out
    print(f"{out['steps']} steps (cpu: the CPU time of the thread that made both marks)")
    for a, b, med, p10, p90 in out["segments"]:
        c = out["cpu"].get((a, b))
        print(f"{a:>14s} -> {b:<14s} median {med:8.1f} us   p10 {p10:8.1f}   p90 {p90:8.1f}"
              + (f"   cpu {c:8.1f}" if c is not None else ""))
    for m, (med, p10, p90) in out["side"].items():
        print(f"{m:>14s} after step_sent: median {med:8.1f} us   p10 {p10:8.1f}   p90 {p90:8.1f}")
    for m, (med, p10, p90) in out["lead"].items():
        print(f"{m:>14s} before the next step_sent: median {med:8.1f} us   p10 {p10:8.1f}   p90 {p90:8.1f}")
    if out["added_us"] is not None:
        print(f"step_sent -> draft_begin + answer_ready -> {out['end']}: median {out['added_us']:.1f} us")
    return out


if __name__ == "__main__":
    main()
