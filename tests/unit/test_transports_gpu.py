"""The stream client on a GPU: CUDA regions with an in-process drafter, gRPC bytes from a GPU drafter with and
without the landing, and the faults of the GPU handovers (a slow drafter, a bad tree, a ring that never comes).
Skipped without CUDA; the CPU side of the same client: test_transports.py."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from drafter_service.api import DraftRequest
from kernels.tree_build import TreeBatch, build_tree
from tests.unit.stream_harness import (
    ServerThread,
    SlowOrBadDrafter,
    assert_same_trees,
    client_for,
    cuda_parts,
    cuda_steps,
    one_process_landing,
    root_only,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def assert_reconnects_once(client, timeout_s: float = 20.0) -> None:
    """The client's stream was dropped: it opens a new one in the background, once."""
    deadline = time.monotonic() + timeout_s
    while client.stats["reconnects"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats["reconnects"] == 1, client.stats


@pytest.mark.parametrize("mode", ["in_place", "answer", "events"])
def test_cuda_regions_with_an_in_process_drafter(parts, mode):
    """Drafter and verifier in one process on the GPU: the regions are CUDA allocations that the
    server side takes as they are (a process cannot open its own IPC handle); trees equal the
    in-process drafter's and travel through the regions, handed over by the trees doorbell (our stream
    waits for the drafter's ring) or, without it, by IPC events. With the doorbell, every step after the stream's
    first asks for its trees in place and queues their check before the answer is read (in_place), unless that is
    off (answer). (The one-process caveats of `one_process_landing`.)"""
    service, local = cuda_parts(parts)
    srv = ServerThread(service)
    doorbell = mode != "events"
    client = client_for(srv.port, colocated=True, region_device="cuda", doorbell=doorbell,
                        trees_in_place="on" if mode == "in_place" else "off")
    try:
        assert set(client.region_devices.values()) == {"cuda:0"}
        with one_process_landing(service):
            for reqs in cuda_steps():
                assert_same_trees(client.draft(reqs), local.draft(reqs))
                assert client.take_errors() == {}
        assert client.stats["fallback_steps"] == 0 and client.stats["region_tensors"] > 0
        handed = client.stats["doorbell_steps" if doorbell else "event_steps"]
        assert client.stats["region_trees"] == client.stats["steps"] == handed == 3, client.stats
        assert client.stats["event_steps" if doorbell else "doorbell_steps"] == 0, client.stats
        assert client.stats["in_place_steps"] == (2 if mode == "in_place" else 0), client.stats
        assert client.ipc_events and client.doorbell == doorbell  # one process: each side's event is the other's
        # the trees came back to one place in the region every step: their check replayed from one CUDA graph
        assert client._checker.graphs.stats == {"replays": 3, "captures": 1}
    finally:
        client.close()
        srv.stop()


def warm_refusal_paths(reqs):
    """One process only: a kernel's first launch loads its module, which waits for the whole context; launched for the
    first time while our stream waits for the drafter's ring (which this process's other thread would write next), it
    never returns. So the kernels of the paths a refused session and a bad tree take on both sides (the in-place
    block with a missing row, the corrupted token, the client's merge of good and root-only rows) run once here."""
    from protos.codec import trees_in_place
    from protos.shared_region import RegionArena, SharedRegion
    from verifier_service.tree_assembly import assemble_trees

    region = SharedRegion.create(9, 1 << 16, torch.device("cuda", torch.cuda.current_device()))
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        logq = torch.log_softmax(torch.randn(len(reqs), 3, 50, generator=g), -1).cuda()
        tb = build_tree(logq, torch.tensor([q.root_token for q in reqs]).cuda(), [16] * len(reqs), [4] * len(reqs))
        tb.tokens[0, 1] = 10**6
        ids = [q.session_id for q in reqs]
        trees_in_place(TreeBatch.from_packed(tb.pack()[:, 1:].contiguous(), tb.n_nodes[1:]), ids[1:], 1,
                       list(range(1, len(reqs))), len(reqs), tb.tokens.shape[1] + 1, RegionArena(region))
        assemble_trees(reqs, ids, tb, set(ids[1:]))
        torch.cuda.synchronize()
    finally:
        region.close()


def test_in_place_steps_with_a_refused_session_and_a_bad_tree(parts, monkeypatch):
    """An in-place step (queued before the answer) where the drafter refuses one session (its row all -1: an
    autoregressive step, told as not ready, not as an invalid tree; its rows are sent again) and sends a bad tree
    for another (that session alone fails); the other sessions' trees equal the in-process drafter's."""
    import grpc

    from drafter_service import draft_stream

    request = draft_stream.DraftStream._request
    refuse = {"refuse"}

    def refusing(self, m, seen, rows):
        if m.session_id in refuse:
            raise draft_stream.SessionFault(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room (test)")
        return request(self, m, seen, rows)

    monkeypatch.setattr(draft_stream.DraftStream, "_request", refusing)
    service, local = cuda_parts(parts, SlowOrBadDrafter)
    srv = ServerThread(service)
    client = client_for(srv.port, colocated=True, region_device="cuda", check_graphs=False, trees_in_place="on")
    try:
        with one_process_landing(service):
            first, second, third = cuda_steps()
            warm_refusal_paths(first)
            assert_same_trees(client.draft(first), local.draft(first))  # answered first: the stream's first step
            fresh = [DraftRequest(sid, 0, q.ctx_features, q.root_token, q.root_pos - q.ctx_start, 16, 4)
                     for sid, q in zip(("refuse", "bad"), first)]
            got = client.draft(second + fresh)
            assert client.stats["in_place_steps"] == 1, client.stats
            errors = client.take_errors()
            assert set(errors) == {"bad"} and "invalid tree" in errors["bad"], errors
            want = local.draft(second)
            assert_same_trees(got, want, rows=range(len(second)))
            assert all(root_only(got, len(second) + j, q.root_token) for j, q in enumerate(fresh))
            assert "refuse" not in client._stream.synced and "bad" in client._stream.synced
            refuse.clear()  # it is drafted once it fits: its rows were kept and go again
            got = client.draft(third + [dataclasses.replace(fresh[0], ctx_features=fresh[0].ctx_features[:0],
                                                            ctx_start=fresh[0].root_pos)])
            assert client.take_errors() == {}
            assert_same_trees(got, local.draft(third), rows=range(len(third)))
            assert got.n_nodes[-1] > 1 and not root_only(got, len(third), fresh[0].root_token)
            assert client.stats["in_place_steps"] == 2 and client.stats["fallback_steps"] == 0, client.stats
    finally:
        client.close()
        srv.stop()


@pytest.mark.parametrize("doorbell", [True, False])
def test_grpc_bytes_from_a_gpu_drafter(parts, monkeypatch, doorbell):
    """Trees as bytes from a GPU drafter: one pinned device-to-host copy per step, waited for on the event loop
    without blocking it; the trees equal the in-process drafter's and the wait is learned. The verifier lands
    them at a fixed place on its GPU and checks them from a graph: with the host doorbell in a step queued before
    they arrived (`verifier_service.tree_landing`), without it once they are here. (The one-process caveats of
    `one_process_landing`; the check's graph is tested without the landing.)"""
    from drafter_service import draft_stream

    service, local = cuda_parts(parts)
    works = []
    launch = draft_stream.DraftStream.launch  # every step's work comes from there
    monkeypatch.setattr(draft_stream.DraftStream, "launch", lambda self, staged: works.append(launch(self, staged))
                        or works[-1])
    srv = ServerThread(service)
    client = client_for(srv.port, colocated=False, region_device="cuda", doorbell=doorbell, check_graphs=not doorbell)
    try:
        with one_process_landing(service):
            for reqs in cuda_steps():
                assert_same_trees(client.draft(reqs), local.draft(reqs))
                assert client.take_errors() == {}
        assert client.stats["fallback_steps"] == 0 and client.stats["region_trees"] == 0
        assert client.stats["landed_steps"] == (3 if doorbell else 0), client.stats
        assert len(works) == 3 and all(w.copied is not None and w.trees.tokens.is_pinned() for w in works)
        (st,) = service._streams.values()
        assert st.copy_wait_s > 0
        if not doorbell:  # the trees landed at one place on our GPU every step: their check replayed from one graph
            assert client._checker.graphs.stats == {"replays": 3, "captures": 1}
    finally:
        client.close()
        srv.stop()


def test_landed_steps_survive_a_slow_drafter_and_a_bad_tree(parts, monkeypatch):
    """gRPC with the host doorbell: a step whose answer misses its deadline is released by the watch and verified
    root-only (no session fails, the stream reconnects, the unacknowledged rows are sent again); a bad tree that
    lands fails its session only."""
    from drafter_service import device_copy

    # the drafter's wire rows go pageable here, the variant this test has passed with on the H200 (the pinned path is
    # test_grpc_bytes_from_a_gpu_drafter's); its nineteenth-session failure was the read-back order below
    monkeypatch.setattr(device_copy, "PINNED_MIN_BYTES", 1 << 40)
    service, local = cuda_parts(parts, SlowOrBadDrafter)
    srv = ServerThread(service)
    client = client_for(srv.port, colocated=False, region_device="cuda", draft_timeout_s=0.3, check_graphs=False)
    try:
        with one_process_landing(service):
            first, second, third = cuda_steps()
            warm_refusal_paths(first)  # the bad tree's kernels: a first launch behind the landing's wait stalls it
            b = [q[1] for q in (first, second, third)]
            rows = torch.cat([q.ctx_features for q in b])
            # the bad step's drafter path too (a new session of 8 rows, corrupted), straight on the drafter: its first
            # kernels or compiles there would stall behind the landing's wait or outlast the 0.3 s deadline
            service.drafter.draft([DraftRequest("warm-bad", 0, rows, b[2].root_token, b[2].root_pos, 16, 4)])
            service.drafter.release("warm-bad")
            torch.cuda.synchronize()
            service.drafter.delay = 1.0
            t0 = time.monotonic()
            got = client.draft(first)  # returns at once: the trees are still on their way
            assert time.monotonic() - t0 < 0.25
            assert all(root_only(got, r, q.root_token) for r, q in enumerate(first))  # read after the release
            assert time.monotonic() - t0 >= 0.3
            assert client.take_errors() == {} and client.stats["doorbell_timeouts"] == 1
            assert client.stats["fallback_steps"] == 1
            service.drafter.delay = 0.0
            client.cfg = dataclasses.replace(client.cfg, draft_timeout_s=10.0)  # the steps below must not time out
            deadline = time.monotonic() + 10
            while not client.connected and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.connected
            local.draft(first)
            assert_same_trees(client.draft(second), local.draft(second))  # the first step's rows were sent again
            bad = DraftRequest("bad", 0, rows, b[2].root_token, b[2].root_pos, 16, 4)
            got = client.draft([bad])
            # read the step back first (take_errors' contract): the landing step returns before its trees have landed
            assert root_only(got, 0, bad.root_token)
            errors = client.take_errors()
            assert set(errors) == {"bad"} and "invalid tree" in errors["bad"]
            assert client.stats["landed_steps"] == 3
    finally:
        client.close()
        srv.stop()


def test_a_drafter_that_never_rings_costs_one_deadline_and_no_session(parts, monkeypatch):
    """The drafter answers with its doorbell value but its ring never comes (a drafter that died between
    its answer and its GPU work): the verifier's stream is released at the step's deadline by the watch,
    the stream is dropped and reconnects, and no session is failed for what the region held meanwhile."""
    from protos.shared_region import RegionArena

    monkeypatch.setattr(RegionArena, "ring", lambda self, bell, value: None)
    service, _ = cuda_parts(parts)
    srv = ServerThread(service)
    client = client_for(srv.port, colocated=True, region_device="cuda", draft_timeout_s=0.5)
    try:
        assert client.doorbell
        reqs = cuda_steps()[0]
        t0 = time.monotonic()
        trees = client.draft(reqs)
        torch.cuda.synchronize()  # blocked behind the wait until the watch releases it
        assert time.monotonic() - t0 >= 0.45
        assert trees.tokens.shape[0] == len(reqs)
        assert client.stats["doorbell_timeouts"] == 1 and "did not ring" in client.last_error
        assert client.take_errors() == {}
        assert_reconnects_once(client)
    finally:
        client.close()
        srv.stop()


def test_an_in_place_step_whose_ring_never_comes(parts, monkeypatch):
    """An in-place step is queued before the answer; when the drafter's ring never comes, the watch releases the
    wait at the step's deadline, the step's verdicts are dropped (no session fails), the stream is dropped and
    reconnects."""
    from protos.shared_region import RegionArena

    service, local = cuda_parts(parts)
    srv = ServerThread(service)
    client = client_for(srv.port, colocated=True, region_device="cuda", draft_timeout_s=0.5, check_graphs=False,
                        trees_in_place="on")
    try:
        with one_process_landing(service):
            first, second, _ = cuda_steps()
            assert_same_trees(client.draft(first), local.draft(first))
            assert client.take_errors() == {}
            monkeypatch.setattr(RegionArena, "ring", lambda self, bell, value: None)
            t0 = time.monotonic()
            trees = client.draft(second)  # queued behind the wait: back at once
            assert time.monotonic() - t0 < 0.4 and client.stats["in_place_steps"] == 1, client.stats
            torch.cuda.synchronize()  # blocked until the watch releases the wait
            assert time.monotonic() - t0 >= 0.45 and trees.tokens.shape[0] == len(second)
            assert client.take_errors() == {}
            assert client.stats["doorbell_timeouts"] == 1 and client.stats["fallback_steps"] == 1, client.stats
            assert_reconnects_once(client)
    finally:
        client.close()
        srv.stop()
