"""KeepWarm messages on the Draft stream: when the verifier's gRPC request thread sends one.

On loopback a gRPC message that follows ~5 ms or more of silence on the stream takes ~0.4 ms longer through the
two processes' gRPC threads than one on a busy stream (`bench/grpc_echo.py --gap-ms`; docs/performance.md,
fourteenth session), and a Draft stream is silent for a whole draft between a request and its answer and for a
whole verify step between an answer and the next request. One message shortly before the expected next one
removes most of that (on a 2-core host, one empty message 0.7 ms before the request: its way 0.64 -> 0.26 ms). One
every 3 ms did as well, but its wake-ups slowed torch's CPU compute on that host by ~20%: the plan sends one per
silence.

The plan alternates two turns: the drafter's (a step was sent, its answer is awaited) and the verifier's (the
answer came, the next step is awaited). Each turn expects to last as long as the same turn did the time before;
the ping goes out LEAD_S before that, but never sooner than `period_s` into the turn (a short turn needs none), and
while the turn overruns, again every `period_s` (so also through a turn of unknown length: the first ones, and the
first after an idle engine). No pings once no step was sent for ACTIVE_S.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

from telemetry import host_timeline

ACTIVE_S = 0.25  # pings only this long after the last step sent
LEAD_S = 0.001  # how long before the expected message the ping goes out


class KeepWarmPlan:
    """The stream's last step and answer times and the turns before them. `sent` runs on the engine thread,
    `answered` on the reader thread, `deadline` / `pinged` on gRPC's request thread: each time is written by one
    thread, and a stale read only moves one ping."""

    def __init__(self, period_s: float, on_ping: Callable[[], None] = lambda: None):
        self.period_s = period_s
        self.on_ping = on_ping
        self.sent_at = self.answered_at = self.pinged_at = -float("inf")
        self.drafter_turn = self.verifier_turn = 0.0  # the last turns' lengths (0: not known yet)

    def sent(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.answered_at > self.sent_at:  # a turn longer than ACTIVE_S was an idle engine: not a turn to expect
            turn = now - self.answered_at
            self.verifier_turn = turn if turn < ACTIVE_S else 0.0
        self.sent_at = now

    def answered(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.sent_at > self.answered_at:
            self.drafter_turn = now - self.sent_at
        self.answered_at = now

    def pinged(self, now: float | None = None) -> None:
        self.pinged_at = time.monotonic() if now is None else now
        self.on_ping()

    def deadline(self, now: float | None = None) -> float | None:
        """When the next ping is due (monotonic), if no message goes out before; None: no ping planned."""
        now = time.monotonic() if now is None else now
        if self.period_s <= 0 or now - self.sent_at >= ACTIVE_S:
            return None
        if self.answered_at >= self.sent_at:
            start, expect = self.answered_at, self.verifier_turn
        else:
            start, expect = self.sent_at, self.drafter_turn
        if self.pinged_at >= start:  # pinged this turn already: the turn overruns its expectation
            return self.pinged_at + self.period_s
        return start + max(expect - LEAD_S, self.period_s)


def paced(requests: queue.Queue, ping, plan: KeepWarmPlan | None) -> Iterator:
    """A gRPC request iterator: the messages put in `requests`, in order, until None; and `ping` whenever the
    plan's deadline passes with no message (the deadline is read again when it passes: the plan may have moved)."""
    while True:
        due = plan.deadline() if plan is not None else None
        try:
            msg = requests.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
            host_timeline.mark("step_out")  # (any message taken: the first after a step's `step_sent` is the step)
        except queue.Empty:
            due = plan.deadline()
            if due is None or due > time.monotonic():
                continue  # an answer came meanwhile, or the engine went idle: the plan moved
            plan.pinged()
            yield ping
            continue
        if msg is None:
            return
        yield msg
