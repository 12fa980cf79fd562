"""A small simulator of warp-specialized kernels' synchronisation, for checking a kernel's barrier protocol on the CPU.

Gluon has no interpreter, and a protocol mistake on the GPU is a hang or a silent race. Tests replay each partition of
a kernel as a Python generator that yields the operations it performs on shared memory and mbarriers, in program
order; `run` interleaves the partitions under a schedule and checks:

- **mbarriers as the hardware has them:** a barrier has an arrival count and a count of completed phases; `wait(bar,
  parity)` passes while the phase in progress has the other parity (`try_wait.parity`), so a waiter whose barrier ran
  two phases ahead blocks (a hang) and one whose barrier never completes blocks (a hang). No partition runnable and
  not all finished is reported as a deadlock, with every partition's blocking wait.
- **what a wait was meant for:** arrivals can carry a label (e.g. the tile a copy brought); a wait that names the label
  it expects fails if the phase it passed on carries another.
- **data races, by happens-before** (vector clocks: an arrival releases the arriving partition's clock into the
  barrier's phase, a wait that passes acquires every completed phase's): a write must come after every earlier read
  and write of the buffer by another partition, a read after the last write by another partition. So a race is
  reported whichever order this schedule happened to run them in.
- **asynchronous reads** (wgmma operands): `read_async` starts a read that lasts until `retire` of its token; a write
  into the buffer while it is in flight (by anyone) is a race.
- **contents:** every write stores a tag and a read can name the tag it expects (the tile, the pair), so a wait that
  passed on a stale phase shows up as the wrong data even where the clocks happen to order it.

Async copies (TMA, cp.async) are modelled as the issuing partition's write at issue followed by its arrival, which is
what their mbarrier completion orders for the reader.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field


class ProtocolError(AssertionError):
    pass


@dataclass(frozen=True)
class Op:
    kind: str  # wait | arrive | write | read | read_async | retire
    target: str = ""
    arg: object = None  # wait: parity; write / read*: tag; retire: token
    expect: object = None  # wait: the label expected; read_async: token
    note: str = ""


def wait(bar: str, parity: int, expect: object = None, note: str = "") -> Op:
    return Op("wait", bar, parity & 1, expect, note)


def arrive(bar: str, label: object = None, note: str = "") -> Op:
    return Op("arrive", bar, label, None, note)


def write(buf: str, tag: object, note: str = "") -> Op:
    return Op("write", buf, tag, None, note)


def read(buf: str, tag: object = None, note: str = "") -> Op:
    return Op("read", buf, tag, None, note)


def read_async(buf: str, tag: object, token: object, note: str = "") -> Op:
    return Op("read_async", buf, tag, token, note)


def retire(token: object, note: str = "") -> Op:
    return Op("retire", "", token, None, note)


Partition = Generator[Op, None, None]


@dataclass
class _Barrier:
    count: int
    pending: int
    done: int = 0  # completed phases
    labels: list = field(default_factory=list)  # per completed phase
    clock: list | None = None  # join of every completed phase's arrivals
    acc: list | None = None  # the phase in progress's arrivals
    label: object = None


@dataclass
class _Buffer:
    tag: object = None
    writer: tuple | None = None  # (partition, epoch)
    readers: dict = field(default_factory=dict)  # partition -> epoch of its last read
    inflight: dict = field(default_factory=dict)  # (partition, token) -> the access's note


def _join(a: list | None, b: list) -> list:
    return list(b) if a is None else [max(x, y) for x, y in zip(a, b)]


def run(partitions: Sequence[Callable[[], Partition]], barriers: dict[str, int], pick: Callable[[list[int]], int],
        names: Sequence[str] | None = None, max_steps: int = 200_000) -> int:
    """Interleave `partitions` (callables returning fresh generators), choosing the next runnable partition with
    `pick(list of runnable indices)`; `barriers` maps a name to its arrival count. Returns the number of operations
    run; raises ProtocolError on a deadlock, a race, a wrong label or a wrong tag."""
    n = len(partitions)
    names = list(names or [f"p{i}" for i in range(n)])
    gens = [p() for p in partitions]
    clocks = [[1 if i == k else 0 for i in range(n)] for k in range(n)]
    bars = {b: _Barrier(c, c) for b, c in barriers.items()}
    bufs: dict[str, _Buffer] = {}
    cur: list[Op | None] = [None] * n
    finished = [False] * n
    trail: list[str] = []

    def fail(msg: str) -> None:
        raise ProtocolError(msg + "\n  last operations:\n    " + "\n    ".join(trail[-12:]))

    def advance(k: int) -> None:
        try:
            cur[k] = next(gens[k])
        except StopIteration:
            cur[k], finished[k] = None, True

    def ordered(acc: tuple, k: int) -> bool:  # acc (partition, epoch) happens before partition k's present
        return acc[0] == k or acc[1] <= clocks[k][acc[0]]

    def runnable(k: int) -> bool:
        op = cur[k]
        if op is None:
            return False
        if op.kind == "wait":
            return (bars[op.target].done & 1) != op.arg
        return True

    for k in range(n):
        advance(k)
    steps = 0
    while not all(finished):
        ready = [k for k in range(n) if runnable(k)]
        if not ready:
            blocked = [f"{names[k]} waits {cur[k].target} parity {cur[k].arg} ({cur[k].note}; "
                       f"{bars[cur[k].target].done} phases done)" for k in range(n) if cur[k] is not None]
            fail("deadlock: " + "; ".join(blocked))
        k = pick(ready)
        op = cur[k]
        who = names[k]
        trail.append(f"{who}: {op.kind} {op.target} {op.arg!r} {op.note}")
        steps += 1
        if steps > max_steps:
            fail("no progress")
        if op.kind == "wait":
            b = bars[op.target]
            clocks[k] = _join(b.clock, clocks[k]) if b.clock is not None else clocks[k]
            # (parity 1 passes on a fresh barrier: the phase "before the first", as producers use it)
            got = b.labels[-1] if b.labels else "the phase before the first"
            if op.expect is not None and got != op.expect:
                fail(f"{who} waited {op.target} for {op.expect!r} ({op.note}) and passed on {got!r}")
        elif op.kind == "arrive":
            b = bars[op.target]
            if op.arg is not None:
                if b.pending < b.count and b.label != op.arg:
                    fail(f"{who} arrived on {op.target} for {op.arg!r} in a phase begun for {b.label!r}")
                b.label = op.arg
            b.acc = _join(b.acc, clocks[k])
            b.pending -= 1
            if b.pending == 0:
                b.done += 1
                b.labels.append(b.label)
                b.clock = _join(b.clock, b.acc)
                b.acc, b.label, b.pending = None, None, b.count
            clocks[k][k] += 1
        elif op.kind == "write":
            buf = bufs.setdefault(op.target, _Buffer())
            for (p, _), note in buf.inflight.items():
                fail(f"{who} wrote {op.target} ({op.note}) while {names[p]}'s MMA reads it ({note})")
            if buf.writer is not None and not ordered(buf.writer, k):
                fail(f"{who} wrote {op.target} ({op.note}) unordered with {names[buf.writer[0]]}'s write of "
                     f"{buf.tag!r}")
            for p, e in buf.readers.items():
                if not ordered((p, e), k):
                    fail(f"{who} wrote {op.target} ({op.note}) unordered with {names[p]}'s read of {buf.tag!r}")
            buf.tag, buf.writer, buf.readers = op.arg, (k, clocks[k][k]), {}
        elif op.kind in ("read", "read_async"):
            buf = bufs.setdefault(op.target, _Buffer())
            if buf.writer is not None and not ordered(buf.writer, k):
                fail(f"{who} read {op.target} ({op.note}) unordered with {names[buf.writer[0]]}'s write of "
                     f"{buf.tag!r}")
            if op.arg is not None and buf.tag != op.arg:
                fail(f"{who} read {op.target} ({op.note}) expecting {op.arg!r}, holding {buf.tag!r}")
            if op.kind == "read":
                buf.readers[k] = clocks[k][k]
            else:
                buf.inflight[(k, op.expect)] = op.note
        elif op.kind == "retire":
            for buf in bufs.values():
                if (k, op.arg) in buf.inflight:
                    del buf.inflight[(k, op.arg)]
                    buf.readers[k] = clocks[k][k]
        else:
            fail(f"unknown operation {op.kind}")
        advance(k)
    left = [f"{names[p]} on {b}" for b, buf in bufs.items() for (p, _) in buf.inflight]
    if left:
        fail("MMAs never retired: " + ", ".join(left))
    unfinished = [f"{name}: {b.pending} of {b.count}" for name, b in bars.items() if b.pending != b.count]
    if unfinished:
        fail("barriers left mid-phase: " + ", ".join(unfinished))
    return steps


def schedules(n: int, seeds: int) -> list[Callable[[list[int]], int]]:
    """Pickers to run a protocol under: each fixed priority order of the n partitions (one runs as far as it can
    before the next moves), then `seeds` uniformly random ones."""
    out: list[Callable[[list[int]], int]] = []
    for order in itertools.permutations(range(n)):
        rank = {p: i for i, p in enumerate(order)}
        out.append(lambda ready, rank=rank: min(ready, key=rank.__getitem__))
    for s in range(seeds):
        rng = random.Random(s)
        out.append(lambda ready, rng=rng: rng.choice(ready))
    return out
