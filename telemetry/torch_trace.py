"""A window of steps under torch.profiler, exported as a Chrome trace: where a step's GPU work ran, per process.

`--torch-trace DIR[:FIRST[:COUNT]]` on `ddtree drafter serve`, `ddtree verifier serve` and `bench_transport.py`
builds a `StepTrace`: the process's `tick()` at the start of each step (the drafter's `DraftStream.begin`, the
verifier's scheduler step, the bench's timed step) counts steps; at tick FIRST (default 20: past warm-up and
graph captures) the profiler starts (CPU ops, and CUDA kernels / copies / syncs where a GPU is present), at tick
FIRST + COUNT (default 10) it stops and writes DIR/<role>-<pid>.json. Every tick inside the window is marked by a
zero-length `ddtree:<role> step N` op, so traces of two processes (a verifier and its drafter) line up by step:
their timestamps are the same host clock (Kineto's `baseTimeNanoseconds` plus each event's `ts`).
`bench/trace_steps.py` merges such traces and prints each step's GPU activity of every process.

The profiler is thread-affine (PyTorch records CPU ops of the thread that started it, and stopping it from another
thread crashed the process here): a StepTrace belongs to the thread of its first tick, ticks from other threads are
ignored (counted in `foreign_ticks`), and `close()` from another thread leaves an open window unwritten (logged).
So the window should end inside the run: the drafter's gRPC byte streams step on its event loop, co-located ones
on the model or control-socket thread; the verifier scheduler steps on its engine thread and closes there.

For diagnosis only: profiling slows the host part of each step it covers. Off unless asked for.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
DEFAULT_FIRST = 20
DEFAULT_COUNT = 10


def parse_spec(spec: str) -> tuple[Path, int, int]:
    """'DIR[:FIRST[:COUNT]]' (DIR without colons) -> (DIR, FIRST, COUNT); ValueError naming the form."""
    out, *nums = spec.split(":")
    if not out or len(nums) > 2 or not all(n.isdigit() for n in nums) or (len(nums) == 2 and int(nums[1]) == 0):
        raise ValueError(f"--torch-trace expects DIR[:FIRST[:COUNT]] (DIR without colons, COUNT > 0), got {spec!r}")
    first = int(nums[0]) if nums else DEFAULT_FIRST
    count = int(nums[1]) if len(nums) == 2 else DEFAULT_COUNT
    return Path(out), first, count


class StepTrace:
    """Profile steps [first, first + count) of this process (see the module docstring)."""

    def __init__(self, out_dir: Path | str, role: str, first: int = DEFAULT_FIRST, count: int = DEFAULT_COUNT):
        if first < 0 or count <= 0:
            raise ValueError(f"StepTrace: first must be >= 0 and count > 0, got {first}, {count}")
        self.out_dir, self.role, self.first, self.count = Path(out_dir), role, first, count
        self.steps = 0  # ticks seen
        self.foreign_ticks = 0  # ticks from another thread than the first one's (ignored)
        self._thread: int | None = None
        self.path: Path | None = None  # the trace written, once it is
        self._prof = None
        self._t0 = (0, 0)  # (time_ns, perf_counter_ns) when the window opened, for the sidecar
        self._lock = threading.Lock()  # ticks may come from the event loop and from the model thread

    @classmethod
    def from_spec(cls, spec: str | None, role: str) -> StepTrace | None:
        if spec is None:
            return None
        out, first, count = parse_spec(spec)
        return cls(out, role, first, count)

    def tick(self, label: str = "") -> None:
        """The start of a step (`label`: appended to its marker, e.g. which engine steps)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.get_ident()
            elif threading.get_ident() != self._thread:
                self.foreign_ticks += 1
                return
            n = self.steps
            self.steps += 1
            if n == self.first:
                self._start()
            elif n == self.first + self.count:
                self._stop()
            if self._prof is not None:
                with torch.profiler.record_function(f"ddtree:{self.role} step {n}{' ' + label if label else ''}"):
                    pass

    def close(self) -> None:
        """Stop and write the trace if the window is still open (the process ends inside it); from another thread
        than the stepping one the window is left unwritten (see the module docstring)."""
        with self._lock:
            if self._prof is not None and threading.get_ident() != self._thread:
                log.warning("torch trace of %s: the window (steps %d-%d) was open at close on another thread than "
                            "the one that steps; not written (choose a smaller COUNT)", self.role, self.first,
                            self.first + self.count - 1)
                return
            self._stop()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        self._t0 = (time.time_ns(), time.perf_counter_ns())

    def _stop(self) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{self.role}-{os.getpid()}.json"
        prof.export_chrome_trace(str(path))
        meta = {"role": self.role, "pid": os.getpid(), "first": self.first, "count": self.count,
                "started_time_ns": self._t0[0], "started_perf_counter_ns": self._t0[1]}
        path.with_suffix(".meta.json").write_text(json.dumps(meta) + "\n")
        self.path = path
        log.info("torch trace of %s steps %d-%d written to %s", self.role, self.first, self.first + self.count - 1,
                 path)
