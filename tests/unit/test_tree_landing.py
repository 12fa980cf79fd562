"""Landing gRPC trees into a verify step queued before they arrive (`verifier_service.tree_landing`).

On the CPU: what the stream's reader thread writes into the landing's rows for each kind of answer (trees for
some sessions and errors for others, a tree of the wrong size, an answer for the wrong sessions, none at all),
that the bell rings exactly once whatever happens first, and how `DraftCall` routes a step's answer to its landing
whether it arrives before or after the landing is set, or the stream breaks instead. On the GPU (in
test_transports_gpu.py and the split-services GPU test): the landing path end to end.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
import torch

from kernels.tree_build import TreeBatch, build_tree
from protos.codec import trees_to_pb
from protos.ddtree.v1 import drafter_pb2
from verifier_service import draft_call
from verifier_service.tree_landing import Landing, root_only

NEG_INF_BITS = int(np.float32(-np.inf).view(np.int32))


class _Bell:
    def __init__(self):
        self.rings = []

    def ring(self, value):
        self.rings.append(value)


def _trees(R, budget, seed=0, V=50, depth=4):
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(torch.randn(R, depth, V, generator=g), -1)
    return build_tree(logq, torch.arange(R, dtype=torch.int64) + 3, [budget] * R, [4] * R)


def _landing(ids, caps, roots=None):
    roots = roots or [3 + i for i in range(len(ids))]
    host = np.zeros((6, len(ids), max(caps)), dtype=np.int32)
    root_only(host, roots)
    z = torch.zeros(len(ids), max(caps), dtype=torch.int32)
    return Landing(7, list(ids), roots, list(caps), host, TreeBatch(z, z, z, z, z, z.float(), list(caps)), _Bell(), 41)


def _is_root_only(host, r, root):
    return host[0, r, 0] == root and (host[0, r, 1:] == -1).all() and (host[1, r] == -1).all() \
        and host[2, r, 0] == 0 and (host[2, r, 1:] == -1).all() and host[5, r, 0] == 0 \
        and (host[5, r, 1:] == NEG_INF_BITS).all()


def test_answer_fills_the_answered_rows_and_rings_once():
    trees = _trees(2, 8)  # two full trees of 9 nodes
    caps = [trees.n_nodes[0], trees.n_nodes[1], trees.n_nodes[0]]
    land = _landing(["a", "b", "c"], caps)
    msg = trees_to_pb(trees, ["c", "a"], 7)  # in another order than asked
    msg.errors.add(session_id="b", code=8, message="no room")
    land.deliver(msg)
    packed = trees.pack().numpy()
    assert (land.host[:, 2, : caps[2]] == packed[:, 0, : caps[2]]).all()  # c got the first tree
    assert (land.host[:, 0, : caps[0]] == packed[:, 1, : caps[0]]).all()
    assert _is_root_only(land.host, 1, 4)  # b: refused by the drafter, verified root-only
    assert land.answered == ["c", "a"] and land.errors == {"b": "RESOURCE_EXHAUSTED: no room"}
    assert land.excused == {"b"} and land.refused == {} and land.problem is None and land.compute_us == 0
    assert land.bell.rings == [41] and land.settled()
    land.release("too late")  # a later release or answer changes nothing
    land.deliver(msg)
    assert land.bell.rings == [41] and land.problem is None


def test_the_usual_answer_lands_as_the_row_by_row_copy_would():
    """Every row answered in order with full trees of one size (the usual answer) is taken in one copy: the same
    rows as when the same trees come in another order (row by row), and the bell rings."""
    trees = _trees(4, 8)
    assert len(set(trees.n_nodes)) == 1  # full trees of 9 nodes: M = 9 for every row
    caps, ids = list(trees.n_nodes), ["a", "b", "c", "d"]
    usual = _landing(ids, caps)
    usual.deliver(trees_to_pb(trees, ids, 7))
    order = [2, 0, 3, 1]
    shuffled = TreeBatch.from_packed(trees.pack()[:, order].contiguous(), [trees.n_nodes[j] for j in order])
    by_row = _landing(ids, caps)
    by_row.deliver(trees_to_pb(shuffled, [ids[j] for j in order], 7))
    assert (usual.host == trees.pack().numpy()).all() and (usual.host == by_row.host).all()
    assert usual.answered == ids and usual.excused == set() == usual.refused.keys() and usual.bell.rings == [41]


def test_a_tree_of_another_size_keeps_the_root_only_row():
    trees = _trees(2, 8)
    n = trees.n_nodes[0]
    land = _landing(["a", "b"], [n, n + 4])  # b was laid out for a bigger tree than it got
    land.deliver(trees_to_pb(trees, ["a", "b"], 7))
    assert (land.host[:, 0, :n] == trees.pack().numpy()[:, 0, :n]).all()
    assert (land.host[:5, 0, n:] == -1).all() and (land.host[5, 0, n:] == NEG_INF_BITS).all()  # padding after it
    assert _is_root_only(land.host, 1, 4)
    assert set(land.refused) == {"b"} and "expected a full tree of" in land.refused["b"]
    assert land.excused == {"b"} and land.answered == ["a", "b"] and land.bell.rings == [41]


@pytest.mark.parametrize("answer", ["other_sessions", "duplicate", "truncated", "released"])
def test_a_wrong_answer_or_none_leaves_every_row_root_only(answer):
    trees = _trees(2, 8)
    caps = list(trees.n_nodes)
    land = _landing(["a", "b"], caps)
    if answer == "released":  # the stream broke: the reader or close() releases the landing
        land.release("stream failed: UNAVAILABLE")
        land.deliver(trees_to_pb(trees, ["a", "b"], 7))  # too late: not taken
        assert land.problem == "stream failed: UNAVAILABLE"
    else:
        msg = trees_to_pb(trees, ["a", "x"] if answer == "other_sessions" else ["a", "b"], 7)
        if answer == "duplicate":
            msg.errors.add(session_id="a", code=3, message="bad")
        if answer == "truncated":  # the numpy decoder declines it; the general one names what is wrong
            msg.logw.data = msg.logw.data[:-4]
        land.deliver(msg)
        assert ("bytes for shape" if answer == "truncated" else "answered sessions") in land.problem
    assert all(_is_root_only(land.host, r, 3 + r) for r in range(2))
    assert land.excused == {"a", "b"} and land.bell.rings == [41]


def test_a_landing_the_watch_released_takes_no_answer():
    trees = _trees(1, 8)
    land = _landing(["a"], list(trees.n_nodes))
    land.released.set()  # the watch rings the bell itself, then sets nothing else
    land.deliver(trees_to_pb(trees, ["a"], 7))
    assert _is_root_only(land.host, 0, 3) and land.bell.rings == [] and not land.settled()


class _Call:
    """A Draft call whose answers the test pushes (None ends it, an exception breaks it)."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def __iter__(self):
        while (item := self.q.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    def cancel(self):
        self.q.put(None)


class _Stub:
    def __init__(self):
        self.call = _Call()

    def Draft(self, requests):
        return self.call


def _answer(step_id, trees, ids):
    return drafter_pb2.DraftStreamResponse(trees=trees_to_pb(trees, ids, step_id))


def _until(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("early", [False, True])
def test_the_stream_routes_a_steps_answer_to_its_landing(early):
    """The reader thread delivers the landing's answer itself; one that came before the landing was set is
    delivered by `land`; other answers stay for `recv`."""
    trees = _trees(1, 8)
    stub = _Stub()
    broken = []
    s = draft_call.DraftCall(stub, {}, lambda st, why: broken.append(why))
    try:
        land = _landing(["a"], list(trees.n_nodes))
        other = _answer(6, trees, ["a"])
        stub.call.q.put(other)
        if early:
            stub.call.q.put(_answer(7, trees, ["a"]))
            _until(lambda: s._responses.qsize() == 2)
        s.land(land)
        if not early:
            stub.call.q.put(_answer(7, trees, ["a"]))
        _until(land.settled)
        assert land.answered == ["a"] and land.bell.rings == [41] and land.problem is None
        assert s.recv(1.0) == other and s._responses.empty()  # the other answer is still there
        assert s.landing is None
    finally:
        s.close()
    assert broken == []


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_broken_stream_releases_its_landing(when):
    stub = _Stub()
    broken = []
    s = draft_call.DraftCall(stub, {}, lambda st, why: broken.append(why))
    land = _landing(["a"], [9])
    if when == "before":
        stub.call.q.put(RuntimeError("boom"))
        _until(lambda: s.broken)
    s.land(land)
    if when == "after":
        stub.call.q.put(RuntimeError("boom"))
    _until(land.settled)
    assert "boom" in land.problem and land.excused == {"a"} and land.bell.rings == [41]
    _until(lambda: broken)
    s.close()


def test_closing_the_stream_releases_its_landing():
    s = draft_call.DraftCall(_Stub(), {}, lambda st, why: None)
    land = _landing(["a"], [9])
    s.land(land)
    threading.Thread(target=s.close).start()
    _until(land.settled)
    assert land.problem == "stream closed" and land.bell.rings == [41]
