"""KeepWarm on the Draft stream: the verifier's gRPC request thread sends one shortly before the next request or
answer is expected (`verifier_service.keepwarm`), the drafter drops it, and nothing else changes.

Real grpc.aio drafter service on loopback (tests/unit/stream_harness.py), the tiny preset on CPU.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from drafter_service.drafter import Drafter
from protos.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from tests.unit.stream_harness import as_older_drafter, assert_same_trees, client_for, steps
from verifier_service import draft_call
from verifier_service.keepwarm import ACTIVE_S, LEAD_S, KeepWarmPlan, paced
from verifier_service.server import VerifierServerConfig
from verifier_service.transport import StreamClientConfig


def test_plan_pings_once_before_each_expected_message_and_repeats_while_a_turn_overruns():
    plan = KeepWarmPlan(0.003)
    assert plan.deadline(0.0) is None  # no step yet
    plan.sent(10.0)  # the drafter's turn, its length not known yet: a ping after one period of silence
    assert plan.deadline(10.0) == pytest.approx(10.003)
    plan.answered(10.005)  # drafter turn 5 ms; the verifier's turn, not known yet
    assert plan.deadline(10.005) == pytest.approx(10.008)
    plan.pinged(10.008)  # the turn overruns: again every period
    assert plan.deadline(10.009) == pytest.approx(10.011)
    plan.sent(10.015)  # verifier turn 10 ms
    assert plan.drafter_turn == pytest.approx(0.005) and plan.verifier_turn == pytest.approx(0.010)
    assert plan.deadline(10.016) == pytest.approx(10.015 + 0.005 - LEAD_S)  # LEAD_S before the expected answer
    plan.answered(10.020)
    assert plan.deadline(10.021) == pytest.approx(10.020 + 0.010 - LEAD_S)  # ... and before the next request
    plan.sent(10.021)  # a short verifier turn (1 ms)
    plan.answered(10.022)  # a short drafter turn too: the next ones need no ping within a period
    assert plan.deadline(10.022) == pytest.approx(10.022 + 0.003)
    assert plan.deadline(10.0215 + ACTIVE_S) is None  # no step for ACTIVE_S: the engine is idle
    plan.sent(11.0)  # the first step after the idle time: that silence is no verifier turn to expect again
    assert plan.verifier_turn == 0.0
    plan.answered(11.001)
    assert plan.deadline(11.001) == pytest.approx(11.004)
    off = KeepWarmPlan(0.0)
    off.sent(1.0)
    assert off.deadline(1.0) is None


def test_paced_yields_the_queue_in_order_and_pings_when_the_plan_says():
    q: queue.Queue = queue.Queue()
    pings = []
    plan = KeepWarmPlan(0.2, lambda: pings.append(1))  # wide margins: timers on a loaded CI host run late
    it = paced(q, "ping", plan)
    for m in ("a", "b"):
        q.put(m)
    assert [next(it), next(it)] == ["a", "b"] and pings == []  # no step sent: no plan, no ping
    plan.sent()
    t0 = time.monotonic()
    assert next(it) == "ping" and time.monotonic() - t0 >= 0.19 and pings == [1]
    threading.Timer(0.02, q.put, ("c",)).start()
    assert next(it) == "c" and pings == [1]  # a message before the deadline: no ping
    # the plan moves while the request thread waits (the answer comes after 0.1 s): the old deadline (0.2 s) passes
    # without a ping, the new one is 0.2 s after the answer
    plan.sent()
    threading.Timer(0.1, plan.answered).start()
    threading.Timer(0.25, q.put, ("d",)).start()
    assert next(it) == "d" and pings == [1]
    plan.period_s = 0.0  # off: blocks for the next message however long it takes
    threading.Timer(0.2, q.put, ("e",)).start()
    assert next(it) == "e" and pings == [1]
    q.put(None)
    assert list(it) == []


def _raw_stream(port):
    requests: queue.Queue = queue.Queue()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = drafter_pb2_grpc.DrafterStub(ch).Draft(iter(requests.get, None), timeout=30)
    return ch, requests, call


def test_the_drafter_drops_keep_warm_anywhere_on_the_stream(served):
    """Before `open`, between steps, many in a row: no answer, no error, the steps' answers unchanged."""
    service, srv = served
    assert service.info().keep_warm
    ch, requests, call = _raw_stream(srv.port)
    with ch:
        requests.put(draft_call.KEEP_WARM)
        requests.put(drafter_pb2.DraftStreamRequest(open=drafter_pb2.OpenStream(client_id="raw")))
        opened = next(call)
        assert opened.WhichOneof("kind") == "opened" and opened.opened.keep_warm
        for step_id in (1, 2):
            for _ in range(5):
                requests.put(draft_call.KEEP_WARM)
            requests.put(drafter_pb2.DraftStreamRequest(step=drafter_pb2.DraftStep(step_id=step_id)))
            resp = next(call)
            assert resp.WhichOneof("kind") == "trees" and resp.trees.step_id == step_id
        requests.put(draft_call.KEEP_WARM)
        requests.put(None)
        assert list(call) == []  # the stream ends cleanly: nothing was answered to the keep-warm messages
    deadline = time.monotonic() + 5
    while service.info().streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.info().streams == 0


def test_grpc_stream_keeps_warm_between_steps_and_stops_when_idle(parts, served):
    service, srv = served
    local = Drafter(*parts, max_sessions=8, window=64)
    client = client_for(srv.port, False, keepwarm_ms=2)
    try:
        assert client._stream.keepwarm.period_s == pytest.approx(0.002)
        for reqs in steps():
            assert_same_trees(client.draft(reqs), local.draft(reqs))  # the pings change no tree
            time.sleep(0.03)  # a verify step's silence: a ping goes out before the next request
        assert client.stats["keepwarm_sent"] >= 2
        assert client.stats["reconnects"] == 0 and client.stats["fallback_steps"] == 0 and client.take_errors() == {}
        time.sleep(ACTIVE_S + 0.1)  # the engine stopped stepping
        idle = client.stats["keepwarm_sent"]
        time.sleep(0.2)
        assert client.stats["keepwarm_sent"] == idle  # no pings on an idle stream
        # they start again with the next step, through a silence of a length not known yet
        r = steps()[0]
        for q in r:
            client.release(q.session_id)
            local.release(q.session_id)
        assert_same_trees(client.draft(r), local.draft(r))
        time.sleep(0.03)
        assert client.stats["keepwarm_sent"] > idle
    finally:
        client.close()


@pytest.mark.parametrize("case", ["off", "colocated", "older_drafter"])
def test_no_keep_warm_when_off_over_a_control_socket_or_to_an_older_drafter(served, monkeypatch, case):
    service, srv = served
    if case == "older_drafter":  # a drafter that does not announce DrafterInfo.keep_warm would refuse them
        as_older_drafter(service, monkeypatch, keep_warm=False)
    client = client_for(srv.port, case == "colocated", keepwarm_ms=0 if case == "off" else 2)
    try:
        assert client._stream.keepwarm.period_s == 0
        for reqs in steps():
            client.draft(reqs)
            time.sleep(0.02)
        assert client.stats["keepwarm_sent"] == 0 and client.stats["reconnects"] == 0
    finally:
        client.close()


def test_keepwarm_period_is_checked():
    for bad in (-1.0, 1001.0):
        with pytest.raises(ValueError, match="keepwarm_ms"):
            StreamClientConfig("127.0.0.1:1", keepwarm_ms=bad)
        with pytest.raises(ValueError, match="keepwarm_ms"):
            VerifierServerConfig(listen="127.0.0.1:0", target_dir="t", transport="grpc",
                                 drafter_address="127.0.0.1:1", keepwarm_ms=bad)


@pytest.mark.parametrize("flag, expected", [([], 3.0), (["--keepwarm-ms", "0"], 0.0), (["--keepwarm-ms", "1.5"], 1.5)])
def test_verifier_serve_keepwarm_flag_reaches_the_server_config(monkeypatch, flag, expected):
    from gateway.cli import build_parser
    from gateway.commands import verifier

    seen = []
    monkeypatch.setattr(verifier, "run_server", lambda serve, cfg, *a: seen.append(cfg) or 0)
    argv = ["verifier", "serve", "--listen", "127.0.0.1:0", "--target", "t", "--drafter-address", "127.0.0.1:1"]
    args = build_parser("verifier").parse_args([*argv, *flag])
    assert args.func(args) == 0 and seen[0].keepwarm_ms == expected
