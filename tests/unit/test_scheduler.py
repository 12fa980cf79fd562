"""The verifier scheduler on its engine thread, without gRPC: continuous batching is token-exact,
admission is bounded by KV reservations, cancel/release free the KV, a session whose tree failed
validation fails alone, and an engine failure fails the running turns without stopping the loop."""

from __future__ import annotations

import queue
import time

import pytest

from tests.helpers import OracleDrafter
from verifier_service.engine import Engine, EngineConfig
from verifier_service.scheduler import Scheduler, TurnError, TurnEvent
from verifier_service.session import DecodeParams

PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7], [42]]


class Collector:
    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def __call__(self, ev):
        self.q.put(ev)

    def next(self, timeout=30.0):
        return self.q.get(timeout=timeout)

    def finish(self, timeout=60.0) -> tuple[list[int], list]:
        """Events until the turn ends -> (tokens, events); raises the TurnError if it failed."""
        events = []
        while True:
            ev = self.next(timeout)
            events.append(ev)
            if isinstance(ev, TurnError):
                raise ev
            if ev.finish_reason is not None:
                return [t for e in events for t in e.tokens], events


def settled(s: Scheduler, pages: int, open_sessions: int = 0) -> bool:
    """The snapshot is refreshed at the end of a loop iteration, just after the events went out."""
    for _ in range(200):
        snap = s.snapshot
        if snap.kv_pages_free == pages and snap.open_sessions == open_sessions:
            return True
        time.sleep(0.01)
    return False


def ar(target, prompts, new):
    eng = Engine(target, None, (), EngineConfig(page_size=8, num_pages=256, max_sessions=8))
    return [s.output for s in eng.generate(prompts, DecodeParams(max_new_tokens=new, budget=0))]


@pytest.fixture
def sched(tiny_target64):
    made = []

    def make(drafter=None, pages=64, errors=None):
        s = Scheduler(Engine(tiny_target64, drafter, (), EngineConfig(page_size=8, num_pages=pages, max_sessions=4)),
                      errors)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_batched_turns_equal_ar(tiny_target64, sched):
    ref = ar(tiny_target64, PROMPTS, 20)
    oracle = OracleDrafter({f"s{i}": p + r for i, (p, r) in enumerate(zip(PROMPTS, ref))},
                           tiny_target64.cfg.vocab_size, 8, seed=1)
    s = sched(oracle)
    sinks = [Collector() for _ in PROMPTS]
    for i, (p, c) in enumerate(zip(PROMPTS, sinks)):
        s.open(f"s{i}", p, DecodeParams(max_new_tokens=20, budget=16, topk=4), False, c)
    outs = [c.finish() for c in sinks]
    assert [t for t, _ in outs] == ref
    events = [e for _, evs in outs for e in evs[1:]]
    assert all(e.tree_size > 1 for e in events) and max(e.accepted_length for e in events) > 2
    assert outs[0][1][-1].usage.completion_tokens == 20
    assert settled(s, 64)


def test_admission_by_reservation_and_cancel(sched):
    s = sched(pages=16)  # 16 pages of 8 rows
    big = Collector()
    turn = s.open("big", [1, 2, 3], DecodeParams(max_new_tokens=100, budget=0), False, big)  # 13 pages
    assert isinstance(big.next(), TurnEvent)
    small = Collector()
    s.open("small", [4, 5], DecodeParams(max_new_tokens=30, budget=0), False, small)  # 5 pages: refused
    err = small.next()
    assert isinstance(err, TurnError) and err.code == "RESOURCE_EXHAUSTED" and "KV cache full" in err.message
    s.cancel(turn)
    again = Collector()
    s.open("small", [4, 5], DecodeParams(max_new_tokens=30, budget=0), False, again)
    assert len(again.finish()[0]) == 30
    assert settled(s, 16)


def test_persistent_release_and_errors(sched):
    s = sched()
    c = Collector()
    s.open("p", [1, 2], DecodeParams(max_new_tokens=3, budget=0), True, c)
    c.finish()
    assert settled(s, 64 - 1, open_sessions=1) and s.snapshot.running_sessions == 0
    dup = Collector()
    s.open("p", [1], DecodeParams(max_new_tokens=3, budget=0), False, dup)
    assert dup.next().code == "ALREADY_EXISTS"
    assert s.release("p").result(10) is False
    with pytest.raises(TurnError, match="no session"):
        s.release("p").result(10)
    gone = Collector()
    s.continue_turn("p", [3], DecodeParams(max_new_tokens=3, budget=0), gone)
    assert gone.next().code == "NOT_FOUND"
    bad = Collector()
    s.open("v", [10**6], DecodeParams(max_new_tokens=3, budget=0), False, bad)
    err = bad.next()
    assert err.code == "INVALID_ARGUMENT" and "vocabulary" in err.message
    assert settled(s, 64)


def test_invalid_tree_fails_only_that_session(tiny_target64, sched):
    ref = ar(tiny_target64, PROMPTS[:2], 10)
    oracle = OracleDrafter({"ok": PROMPTS[0] + ref[0], "bad": PROMPTS[1] + ref[1]}, tiny_target64.cfg.vocab_size, 8)
    failed = {"bad": "the drafter sent an invalid tree: node 3 ..."}
    s = sched(oracle, errors=lambda: failed.copy())
    ok, bad = Collector(), Collector()
    s.open("ok", PROMPTS[0], DecodeParams(max_new_tokens=10, budget=8, topk=2), False, ok)
    s.open("bad", PROMPTS[1], DecodeParams(max_new_tokens=10, budget=8, topk=2), False, bad)
    with pytest.raises(TurnError, match="invalid tree") as e:
        bad.finish()
    assert e.value.code == "INVALID_ARGUMENT"
    failed.clear()
    assert ok.finish()[0] == ref[0]
    assert "bad" in oracle.released


def test_engine_failure_fails_running_turns_and_the_loop_goes_on(sched):
    s = sched()
    real_step = s.engine.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    s.engine.step = flaky
    c = Collector()
    s.open("x", [1, 2], DecodeParams(max_new_tokens=10, budget=0), False, c)
    with pytest.raises(TurnError, match="boom") as e:
        c.finish()
    assert e.value.code == "INTERNAL"
    d = Collector()
    s.open("y", [1, 2], DecodeParams(max_new_tokens=4, budget=0), False, d)
    assert len(d.finish()[0]) == 4
    assert settled(s, 64)
