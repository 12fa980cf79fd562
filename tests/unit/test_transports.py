"""Transports between the verifier and the drafter.

The stream client (grpc bytes and co-located shared memory) against a real grpc.aio drafter
service on loopback in this process must produce exactly the trees of the in-process `Drafter`;
faults (the drafter stops, a step times out, a malformed tree, a session the drafter refuses)
degrade to root-only trees without raising, and context rows that were never acknowledged are
sent again after a reconnect. The harness: stream_harness.py; the same client on a GPU: test_transports_gpu.py;
transport selection: test_transport_resolution.py; the shared regions and IPC events themselves:
test_shared_region.py.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time

import grpc
import pytest
import torch

from drafter_service.api import DraftRequest
from drafter_service.drafter import Drafter
from kernels.tree_build import TreeBatch
from protos.codec import tensor_to_pb
from protos.control_socket import ControlListener
from protos.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from protos.shared_region import shm_dir
from tests.unit.stream_harness import (
    ServerThread,
    SlowOrBadDrafter,
    as_older_drafter,
    assert_same_trees,
    client_for,
    feats,
    make_service,
    root_only,
    steps,
)
from verifier_service import draft_call, transport_stream


@pytest.fixture
def served(parts):
    service = make_service(parts, SlowOrBadDrafter)
    srv = ServerThread(service)
    yield service, srv
    srv.stop()


@pytest.mark.parametrize("step_features", [True, False])
@pytest.mark.parametrize("colocated", [False, True])
def test_stream_client_equals_inprocess_drafter(parts, served, colocated, step_features, monkeypatch):
    """step_features False: a drafter that does not announce DrafterInfo.step_features gets every session's
    rows in its own message (the form older drafters read); True: one tensor of rows per step."""
    service, srv = served
    if not step_features:
        as_older_drafter(service, monkeypatch, step_features=False)
    sent = []
    send = draft_call.DraftCall.send
    monkeypatch.setattr(draft_call.DraftCall, "send", lambda self, msg: (sent.append(msg), send(self, msg))[1])
    local = Drafter(*parts, max_sessions=8, window=64)
    client = client_for(srv.port, colocated)
    try:
        assert client._stream.step_features == step_features
        # the drafter mapped the regions, so their files are gone already: a killed process leaves nothing
        assert list(shm_dir().glob(f"ddtree-{os.getpid()}-*")) == []
        assert client.depth == local.depth and client.model.target_layer_ids == tuple(local.cfg.target_layer_ids)
        for reqs in steps():
            assert_same_trees(client.draft(reqs), local.draft(reqs))
        assert service.info().active_sessions == 2 and client.take_errors() == {}
        # the co-located stream really used its regions (context rows out, trees back), the grpc one none
        assert client.region_devices == ({1: "cpu", 2: "cpu"} if colocated else {})
        assert client.control_socket == colocated  # co-located messages leave gRPC for a unix socket
        assert not client.ipc_events and client.stats["event_steps"] == 0  # CPU regions: no CUDA IPC events
        assert (client.stats["region_tensors"] > 0) == colocated
        assert client.stats["region_trees"] == (client.stats["steps"] if colocated else 0)
        step_msgs = [m.step for m in sent if m.WhichOneof("kind") == "step"]
        assert len(step_msgs) == 3 and all(len(m.sessions) == 2 for m in step_msgs)
        for m, reqs in zip(step_msgs, steps()):  # the rows travelled in the announced form
            assert m.HasField("ctx_features") == step_features
            assert [q.ctx_rows for q in m.sessions] == ([r.ctx_features.shape[0] for r in reqs] if step_features
                                                        else [0, 0])
            assert all(q.HasField("ctx_features") != step_features for q in m.sessions)
            where = m.ctx_features if step_features else m.sessions[0].ctx_features
            assert where.WhichOneof("storage") == ("region" if colocated else "data")
        # the drafter reported its compute time, so the client can tell it from the transport's cost
        t = client.last_step_ms
        assert 0 < t["drafter"] <= t["round_trip"] and t["transport"] == pytest.approx(t["round_trip"] - t["drafter"])
        assert t["decode"] >= 0 and t["check"] > 0
        assert client.metrics.draft_transport_seconds._sum.get() > 0
        client.release("a")
        deadline = time.monotonic() + 5
        while service.info().active_sessions != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert service.info().active_sessions == 1
    finally:
        client.close()
    deadline = time.monotonic() + 5
    while service.info().streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.info().active_sessions == 0 and service.info().streams == 0  # the stream end freed everything


def test_grpc_steps_run_on_the_event_loop_unless_the_model_is_busy(parts, served, monkeypatch):
    """A step of a bytes stream runs its model part on the server's event loop (no hand-off to the model thread
    and back); one that finds the model lock taken (another stream's step) waits on the model thread instead.
    Both give the in-process drafter's trees."""
    from drafter_service.draft_stream import DraftStream

    service, srv = served
    threads = []
    stage = DraftStream.stage  # every step's model part starts there
    monkeypatch.setattr(DraftStream, "stage", lambda self, step: (threads.append(threading.current_thread().name),
                                                                  stage(self, step))[1])
    local = Drafter(*parts, max_sessions=8, window=64)
    client = client_for(srv.port, colocated=False)
    try:
        first, second, third = steps()
        assert_same_trees(client.draft(first), local.draft(first))
        assert threads == [srv.thread.name]
        with service._model_lock:  # the model is busy: the step must wait for it, off the event loop
            out: queue.Queue = queue.Queue()
            worker = threading.Thread(target=lambda: out.put(client.draft(second)))
            worker.start()
            time.sleep(0.3)
            assert len(threads) == 1  # the step waits for the lock, and the loop still answers other calls
            assert service.info().streams == 1
        worker.join(20)
        assert_same_trees(out.get(timeout=1), local.draft(second))
        assert threads[1].startswith("drafter-model")
        assert_same_trees(client.draft(third), local.draft(third))
        assert threads[2] == srv.thread.name and client.stats["fallback_steps"] == 0
    finally:
        client.close()


def test_waiting_for_the_trees_host_copy_learns_its_length():
    """`_copied` polls at every loop turn once the expected wait is nearly over, and sleeps before that: a copy
    found done right after a sleep halves the expectation (the sleep may have overshot), a polled one sets it."""
    from drafter_service.server import _copied

    class Work:
        def __init__(self, after_s):
            self.t = time.perf_counter() + after_s

        def ready(self):
            return time.perf_counter() >= self.t

    assert asyncio.run(_copied(Work(0.0), 1.0)) < 0.001  # done at once: nothing to wait for next time either
    polled = asyncio.run(_copied(Work(0.004), 0.0))  # nothing expected: polled from the start
    assert 0 < polled < 0.5  # about the 4 ms left when it started
    assert asyncio.run(_copied(Work(0.004), 10.0)) == 5.0  # found after a sleep: the expectation halves


@pytest.mark.parametrize("colocated", [False, True])
def test_long_contexts_go_ahead_in_context_messages(parts, served, colocated):
    """With a 4 KiB message limit a step carries 2 KiB of context (two fp64 rows of 128): longer
    prompts are sent ahead in `context` messages, and the trees are still exactly the in-process ones."""
    _, srv = served
    local = Drafter(*parts, max_sessions=8, window=64)
    client = client_for(srv.port, colocated, max_message_bytes=4096)
    try:
        long_prompt = [DraftRequest("long", 0, feats(11, 5), 30, 11, 16, 4), DraftRequest("short", 0, feats(1, 6),
                                                                                          31, 1, 16, 4)]
        nxt = [DraftRequest("long", 11, feats(3, 7), 32, 14, 16, 4), DraftRequest("short", 1, feats(2, 8), 33, 3, 16,
                                                                                  4)]
        for reqs in (long_prompt, nxt):
            assert_same_trees(client.draft(reqs), local.draft(reqs))
        assert client.stats["fallback_steps"] == 0 and client.take_errors() == {}
    finally:
        client.close()


def test_refused_context_message_is_reported_at_the_step(served):
    """A context row of the wrong width, sent ahead, fails the session at its next step (no tree, no
    error for the caller), and the client sends the context again as a new session afterwards."""
    service, srv = served
    client = client_for(srv.port, colocated=False, max_message_bytes=4096)
    try:
        bad = [DraftRequest("w", 0, feats(9, 1, F=64), 40, 9, 16, 4)]  # 64 columns: refused by the drafter
        got = client.draft(bad)
        assert root_only(got, 0, 40) and client.take_errors() == {} and client.connected
        assert service.info().active_sessions == 0
    finally:
        client.close()


def test_invalid_tree_fails_only_its_session(parts, served):
    _, srv = served
    local = Drafter(*parts, max_sessions=8, window=64)
    client = client_for(srv.port, colocated=True)
    try:
        for reqs in steps(("a", "bad", "c")):
            got = client.draft(reqs)
            ref = local.draft(reqs)
            assert_same_trees(got, ref, rows=[0, 2])
            assert root_only(got, 1, reqs[1].root_token)
            errs = client.take_errors()
            assert list(errs) == ["bad"] and "outside the vocabulary" in errs["bad"]
        assert client.take_errors() == {} and client.connected
    finally:
        client.close()


def test_session_refused_by_the_drafter_drafts_autoregressively(served):
    _, srv = served
    client = client_for(srv.port, colocated=False)
    try:
        reqs = steps()[0]
        reqs[1] = DraftRequest("b", 0, feats(5, 1, F=7), 18, 5, 16, 4)  # wrong feature width
        got = client.draft(reqs)
        assert got.n_nodes[0] > 1 and root_only(got, 1, 18)
        assert client.take_errors() == {}  # not the session's fault: no error, just no tree
        assert client.connected
    finally:
        client.close()


def test_timeout_falls_back_then_reconnects(parts, served):
    service, srv = served
    client = client_for(srv.port, colocated=True, draft_timeout_s=0.3)
    try:
        reqs = steps()[0]
        service.drafter.delay = 1.0
        t0 = time.monotonic()
        got = client.draft(reqs)
        assert time.monotonic() - t0 < 0.9
        assert all(root_only(got, r, q.root_token) for r, q in enumerate(reqs))
        service.drafter.delay = 0.0
        time.sleep(1.0)  # the drafter's one model thread is still inside the slow step
        deadline = time.monotonic() + 10
        while not client.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.connected and client.stats["reconnects"] >= 1
        # the timed-out step's rows were never acknowledged: the new stream gets them again
        local = Drafter(*parts, max_sessions=8, window=64)
        local.draft(reqs)
        nxt = steps()[1]
        assert_same_trees(client.draft(nxt), local.draft(nxt))
    finally:
        client.close()


def test_answer_waiting_for_an_event_the_stream_lacks_is_refused(served, monkeypatch):
    """A drafter that says its trees are ready only after an IPC event, on a stream that negotiated none (CPU
    regions), cannot be read safely: the step goes on autoregressively and the stream is dropped."""
    import drafter_service.draft_stream as ds

    encode = ds.trees_to_pb

    def claims_event(*args, **kw):
        msg = encode(*args, **kw)
        msg.after_event = True
        return msg

    monkeypatch.setattr(ds, "trees_to_pb", claims_event)
    _, srv = served
    client = client_for(srv.port, colocated=True)
    try:
        reqs = steps()[0]
        got = client.draft(reqs)
        assert all(root_only(got, r, q.root_token) for r, q in enumerate(reqs))
        assert client.stats["fallback_steps"] == 1 and client.stats["event_steps"] == 0
        assert "event this stream does not have" in client.last_error
    finally:
        client.close()


def test_a_stream_that_cannot_open_leaves_no_region_behind(served):
    """The client is closed while its connector opens a stream (its channel closed after the regions were made): the
    open fails and the regions' files go with it (a CPU region is a file in /dev/shm, which outlives the process)."""
    _, srv = served
    client = client_for(srv.port, colocated=True)
    client.close()
    before = set(shm_dir().glob(f"ddtree-{os.getpid()}-*"))
    with pytest.raises(ValueError, match="Channel closed"):
        client._open()
    assert set(shm_dir().glob(f"ddtree-{os.getpid()}-*")) == before


@pytest.mark.parametrize("colocated", [False, True])
def test_drafter_down_then_back_resends_unacknowledged_context(parts, colocated):
    service = make_service(parts)
    srv = ServerThread(service)
    client = client_for(srv.port, colocated=colocated)
    s0, s1, s2 = steps()
    try:
        client.draft(s0)
        port = srv.port
        srv.stop()
        deadline = time.monotonic() + 5
        while client.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        got = client.draft(s1)  # the drafter is gone: autoregressive, nothing raised
        assert all(root_only(got, r, q.root_token) for r, q in enumerate(s1))
        assert client.stats["fallback_steps"] >= 1
        srv = ServerThread(make_service(parts), port)
        deadline = time.monotonic() + 10
        while not client.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.connected
        # a fresh drafter that saw the step-1 rows (kept unacknowledged) and then the step-2 rows
        local = Drafter(*parts, max_sessions=8, window=64)
        for r in s1:
            local.add_context(r.session_id, r.ctx_start, r.ctx_features)
        assert_same_trees(client.draft(s2), local.draft(s2))
    finally:
        client.close()
        srv.stop()


def test_control_socket_unreachable_falls_back_to_grpc_messages(parts, served, monkeypatch):
    """A drafter that cannot connect to the socket (another /dev/shm) fails the open with FAILED_PRECONDITION
    naming it; the client opens again with its messages on the gRPC stream (regions still shared)."""
    service, srv = served

    class Elsewhere(ControlListener):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.real, self.path = self.path, "/nonexistent-dir/ddtree.sock"

        def close(self):
            self.path = self.real
            super().close()

    monkeypatch.setattr(transport_stream, "ControlListener", Elsewhere)
    local = Drafter(*parts, max_sessions=8, window=64)
    client = client_for(srv.port, colocated=True)
    try:
        assert "FAILED_PRECONDITION" in client.last_error and "control socket" in client.last_error
        assert not client.control_socket and client.region_devices == {1: "cpu", 2: "cpu"}
        for reqs in steps():
            assert_same_trees(client.draft(reqs), local.draft(reqs))
        assert client.stats["fallback_steps"] == 0 and client.stats["region_trees"] == 3
    finally:
        client.close()
    assert not list(shm_dir().glob(f"ddtree-{os.getpid()}-*.sock"))


@pytest.mark.parametrize("bad, code, words", [
    ("garbage", grpc.StatusCode.INVALID_ARGUMENT, "does not parse"),
    ("grpc_message", grpc.StatusCode.FAILED_PRECONDITION, "must travel over that socket"),
    ("unknown_region", grpc.StatusCode.INVALID_ARGUMENT, "unknown response region 7"),
    ("open_again", grpc.StatusCode.FAILED_PRECONDITION, "unexpected `open`"),
    ("rows_mismatch", grpc.StatusCode.INVALID_ARGUMENT, "the sessions' ctx_rows, 2 in all"),
    ("rows_without_step_features", grpc.StatusCode.INVALID_ARGUMENT, "no ctx_features"),
    ("rows_twice", grpc.StatusCode.INVALID_ARGUMENT, "no session carries its own"),
    ("doorbell_without_one", grpc.StatusCode.INVALID_ARGUMENT, "doorbell_value without a doorbell on this stream"),
    ("in_place_without_region", grpc.StatusCode.INVALID_ARGUMENT, "trees_in_place 8 without a response region"),
    ("close", None, None),
])
def test_control_socket_protocol(served, bad, code, words):
    """A raw verifier: what arrives on the control socket is checked like what arrives on gRPC, a protocol
    error ends the gRPC stream with a status naming it, and closing the socket ends the stream cleanly."""
    service, srv = served
    listener = ControlListener(1 << 20)
    requests: queue.Queue = queue.Queue()
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        call = drafter_pb2_grpc.DrafterStub(ch).Draft(iter(requests.get, None), timeout=30)
        requests.put(drafter_pb2.DraftStreamRequest(open=drafter_pb2.OpenStream(client_id="raw",
                                                                                control_socket=listener.path)))
        opened = next(call)
        assert opened.WhichOneof("kind") == "opened" and opened.opened.trees_in_place
        sock = listener.accept(5)
        listener.close()
        # a good step first: answered on the socket, nothing on the gRPC stream
        sock.send(drafter_pb2.DraftStreamRequest(step=drafter_pb2.DraftStep(step_id=1)))
        assert sock.recv(drafter_pb2.DraftStreamResponse, timeout=10).trees.step_id == 1
        if bad == "garbage":
            sock.sock.sendall(b"\x03\x00\x00\x00\xff\xff\xff")
        elif bad == "grpc_message":
            requests.put(drafter_pb2.DraftStreamRequest(step=drafter_pb2.DraftStep(step_id=2)))
        elif bad == "unknown_region":
            sock.send(drafter_pb2.DraftStreamRequest(step=drafter_pb2.DraftStep(step_id=2, response_region_id=7)))
        elif bad.startswith("rows"):  # DraftStep.ctx_features and the sessions' ctx_rows must add up
            step = drafter_pb2.DraftStep(step_id=2, sessions=[
                drafter_pb2.SessionDraftRequest(session_id="x", ctx_start=0, root_token=1, root_pos=2, budget=4,
                                                topk=2, ctx_rows=2)])
            if bad != "rows_without_step_features":
                tensor_to_pb(torch.zeros(3 if bad == "rows_mismatch" else 2, 128), step.ctx_features)
            if bad == "rows_twice":
                tensor_to_pb(torch.zeros(2, 128), step.sessions[0].ctx_features)
            sock.send(drafter_pb2.DraftStreamRequest(step=step))
        elif bad == "doorbell_without_one":  # a value to ring on a stream that negotiated no doorbell
            sock.send(drafter_pb2.DraftStreamRequest(step=drafter_pb2.DraftStep(step_id=2, doorbell_value=5)))
        elif bad == "in_place_without_region":
            sock.send(drafter_pb2.DraftStreamRequest(step=drafter_pb2.DraftStep(step_id=2, trees_in_place=8)))
        elif bad == "open_again":
            sock.send(drafter_pb2.DraftStreamRequest(open=drafter_pb2.OpenStream(client_id="again")))
        else:
            sock.close()
        if code is None:
            assert list(call) == []  # the stream ended without an error
        else:
            with pytest.raises(grpc.RpcError) as e:
                next(call)
            assert e.value.code() == code and words in e.value.details()
        requests.put(None)
        sock.close()
    deadline = time.monotonic() + 5
    while service.info().streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.info().streams == 0


def test_trees_in_place_through_a_cpu_region(parts, served):
    """A raw verifier asks for the trees in place (DraftStep.trees_in_place) in a CPU region: the answer names no
    tensors, the block at the region's start holds the valid session's tree (as the in-process drafter builds it)
    in its row and an all -1 row for the refused one (a budget of 0), whose refusal the answer reports; a width
    outside 1..max_budget + 1 ends the stream with INVALID_ARGUMENT."""
    from protos.shared_region import SharedRegion

    _, srv = served
    local = Drafter(*parts, max_sessions=8, window=64)
    region = SharedRegion.create(2, 1 << 16, "cpu")
    listener = ControlListener(1 << 20)
    rows = feats(3, seed=4)
    width = 20
    try:
        requests: queue.Queue = queue.Queue()
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            call = drafter_pb2_grpc.DrafterStub(ch).Draft(iter(requests.get, None), timeout=30)
            requests.put(drafter_pb2.DraftStreamRequest(open=drafter_pb2.OpenStream(
                client_id="raw", regions=[region.to_pb()], control_socket=listener.path)))
            assert next(call).opened.trees_in_place
            sock = listener.accept(5)
            region.buf.fill_(0x55)
            step = drafter_pb2.DraftStep(step_id=1, response_region_id=2, trees_in_place=width, sessions=[
                drafter_pb2.SessionDraftRequest(session_id="no", ctx_start=0, root_token=5, root_pos=3, budget=0,
                                                topk=2, ctx_features=tensor_to_pb(rows)),
                drafter_pb2.SessionDraftRequest(session_id="yes", ctx_start=0, root_token=7, root_pos=3, budget=16,
                                                topk=4, ctx_features=tensor_to_pb(rows))])
            sock.send(drafter_pb2.DraftStreamRequest(step=step))
            answer = sock.recv(drafter_pb2.DraftStreamResponse, timeout=10).trees
            assert answer.in_place and list(answer.session_ids) == ["yes"] and not answer.tokens.ByteSize()
            assert [e.session_id for e in answer.errors] == ["no"] and "budget 0" in answer.errors[0].message
            want = local.draft([DraftRequest("yes", 0, rows, 7, 3, 16, 4)])
            assert list(answer.n_nodes) == want.n_nodes and want.n_nodes[0] <= width
            block = region.view(0, 6 * 2 * width * 4).view(torch.int32).view(6, 2, width)
            assert (block[:5, 0] == -1).all() and (block[5, 0] == torch.tensor(float("-inf")).view(torch.int32)).all()
            got = TreeBatch.from_packed(block[:, 1:].contiguous(), answer.n_nodes)
            assert_same_trees(got, want)
            sock.send(drafter_pb2.DraftStreamRequest(step=drafter_pb2.DraftStep(
                step_id=2, response_region_id=2, trees_in_place=4096)))
            with pytest.raises(grpc.RpcError) as e:
                next(call)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "trees_in_place 4096 is outside" in \
                e.value.details()
            requests.put(None)
            sock.close()
    finally:
        listener.close()
        region.close()


def test_doorbell_offers_without_a_gpu(served, tmp_path):
    """The doorbell is only for CUDA regions with IPC events: offered with CPU regions it is declined (the
    stream opens, `trees_doorbell` false); an id naming no region of the stream fails the open."""
    from protos.shared_region import SharedRegion

    _, srv = served
    region = SharedRegion.create(3, 64, "cpu")
    try:
        for rid, code in ((3, None), (9, grpc.StatusCode.FAILED_PRECONDITION)):
            requests: queue.Queue = queue.Queue()
            with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
                call = drafter_pb2_grpc.DrafterStub(ch).Draft(iter(requests.get, None), timeout=30)
                requests.put(drafter_pb2.DraftStreamRequest(open=drafter_pb2.OpenStream(
                    client_id="raw", regions=[region.to_pb()], doorbell_region_id=rid)))
                if code is None:
                    opened = next(call)
                    assert opened.WhichOneof("kind") == "opened" and not opened.opened.trees_doorbell
                else:
                    with pytest.raises(grpc.RpcError) as e:
                        next(call)
                    assert e.value.code() == code and "doorbell region 9" in e.value.details()
                requests.put(None)
    finally:
        region.close()




@pytest.mark.parametrize("mode", ["on", "auto"])
def test_when_a_step_asks_for_its_trees_in_place(mode):
    """`InPlacePlan.width`: on = every step of a stream that can (one answered step behind, a block that fits the
    response region); auto = only once QUORUM of the last VOTES answers found the drafter's ring rung already, with
    one answered step in every PROBE_EVERY + 1 to look again."""
    from verifier_service.in_place import PROBE_EVERY, QUORUM, InPlacePlan

    plan = InPlacePlan(mode)
    room = 6 * 4 * 17 * 4  # a response region with room for [6, 4, 17] int32
    caps = [17, 9, 17, 1]
    assert plan.width(caps, room) == 0  # the stream's first step answers
    plan.ready = True
    assert plan.width(caps + [17], room) == 0  # [6, 5, 17] does not fit the region
    if mode == "on":
        assert [plan.width(caps, room) for _ in range(40)] == [17] * 40
        return
    for seen in [True] * (QUORUM - 1) + [False]:
        plan.observe(seen)
        assert plan.width(caps, room) == 0  # not enough answers came after their ring
    plan.observe(True)
    widths = [plan.width(caps, room) for _ in range(2 * PROBE_EVERY + 2)]
    probes = [i for i, w in enumerate(widths) if w == 0]
    assert probes == [PROBE_EVERY, 2 * PROBE_EVERY + 1] and set(widths) == {0, 17}
    for seen in (False, False):  # the answers now beat the ring: back to answered steps
        plan.observe(seen)
    assert [plan.width(caps, room) for _ in range(3)] == [0, 0, 0]


def test_auto_looks_at_the_ring_on_the_first_answers_then_on_one_in_observe_every_and_at_probes():
    """Looking is a host wait for the GPU: the first VOTES answered steps, then one in OBSERVE_EVERY, and every probe
    that an in-place run answers (whatever the count)."""
    from verifier_service.in_place import OBSERVE_EVERY, VOTES, InPlacePlan

    plan = InPlacePlan("auto")
    looked = [plan.looks() for _ in range(4 * OBSERVE_EVERY)]
    assert looked[:VOTES] == [True] * VOTES
    assert [i + 1 for i, seen in enumerate(looked) if seen][VOTES:] == \
        [k for k in range(VOTES + 1, 4 * OBSERVE_EVERY + 1) if k % OBSERVE_EVERY == 0]
    plan.ready = True
    for _ in range(VOTES):
        plan.observe(True)
    room, caps = 6 * 4 * 17 * 4, [17, 9, 17, 1]
    while plan.width(caps, room):  # in place until the probe
        pass
    assert (plan.answered + 1) % OBSERVE_EVERY and (plan.answered + 2) % OBSERVE_EVERY  # off the count: 33, 34
    assert plan.looks()  # the probe looks
    assert not plan.looks()  # the answered step after it does not


def test_an_in_place_answer_is_settled_after_its_step():
    """`_settle_in_place` (the answer of a step verified before it was read): the drafter's refusals and trees of the
    wrong size excuse their rows' device verdicts, a wrong size is told once as an invalid tree, refused sessions
    leave the stream's synced set (their rows go again); an answer that is not the in-place block voids every row
    and fails the step; a step the watch released fails as a timeout without reading anything."""
    import types

    from verifier_service.in_place import InPlaceStep
    from verifier_service.transport import StreamClientConfig
    from verifier_service.transport_stream import DraftStreamClient

    client = DraftStreamClient(StreamClientConfig("127.0.0.1:1", colocated=True))
    answers: queue.Queue = queue.Queue()
    s = types.SimpleNamespace(released=threading.Event(), step_id=5, doorbell=True, bell_value=9, synced={"b"},
                              broken=False, recv=lambda timeout: answers.get(timeout=timeout))

    def settle(trees: drafter_pb2.DraftTrees | None) -> set[str]:
        excused: set[str] = set()
        client._in_flight = InPlaceStep(s, ["a", "b", "c"], [17, 17, 9], excused, 0.0, time.monotonic() + 5, 0.25, 5)
        if trees is not None:
            answers.put(drafter_pb2.DraftStreamResponse(trees=trees))
        client._settle()
        return excused

    try:
        good = drafter_pb2.DraftTrees(step_id=5, session_ids=["a", "c"], n_nodes=[17, 5], in_place=True,
                                      doorbell_value=9, compute_us=800, errors=[drafter_pb2.SessionError(
                                          session_id="b", code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                          message="no room")])
        assert settle(good) == {"b", "c"}
        errors = client.take_errors()
        assert set(errors) == {"c"} and "expected a full tree of 9 nodes" in errors["c"]
        assert s.synced == {"a", "c"} and client.stats["fallback_steps"] == 0
        assert client.last_step_ms == {"drafter": 0.8, "check": 0.25}  # no round trip: read after the step
        not_in_place = drafter_pb2.DraftTrees(step_id=5, session_ids=["a", "b", "c"], n_nodes=[17, 17, 9],
                                              doorbell_value=9)
        assert settle(not_in_place) == {"a", "b", "c"} and client.stats["fallback_steps"] == 1
        assert client.take_errors() == {}  # a wrong answer is the transport's fault: no session fails for it
        s.released.set()
        assert settle(None) == set() and client.stats["fallback_steps"] == 2
    finally:
        client._channel.close()
