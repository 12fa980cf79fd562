"""Service lifecycle with real processes: health NOT_SERVING until ready, SIGTERM drains.

- a verifier whose drafter is not up yet listens but is NOT_SERVING (and refuses Generate with
  UNAVAILABLE); once the drafter serves, the verifier warms up and turns SERVING;
- SIGTERM on the verifier: health NOT_SERVING, new calls refused, the running turn finishes
  (token-exact) within the grace period, exit code 0;
- SIGTERM on the drafter: it ends its streams after the current step and exits 0 promptly; the
  verifier carries on autoregressively with the same tokens.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.harness import (
    Service,
    channel,
    drafter_argv,
    free_port,
    generate,
    request,
    verifier_argv,
    verifier_info,
    verifier_stub,
)

pytestmark = pytest.mark.integration
PROMPT = [5, 17, 99, 3]


def health(address: str, service: str = "") -> int:
    with channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_not_serving_until_the_drafter_is_up_then_serving(pair):
    port = free_port()
    v = Service("verifier", verifier_argv(pair, "127.0.0.1:0", f"127.0.0.1:{port}"))
    d = None
    try:
        addr = v.wait_for("listening")
        time.sleep(1.0)  # time enough to load the tiny target; it must still wait for the drafter
        for svc in ("", "ddtree.v1.Verifier"):
            assert health(addr, svc) == health_pb2.HealthCheckResponse.NOT_SERVING
        with channel(addr) as ch:
            with pytest.raises(grpc.RpcError) as e:
                generate(verifier_stub(ch), request("early", PROMPT, 4, 0))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "serving" not in v.seen
        d = Service("drafter", drafter_argv(pair, f"127.0.0.1:{port}"))
        d.wait_for("serving")
        assert v.wait_for("serving") == addr
        for svc in ("", "ddtree.v1.Verifier"):
            assert health(addr, svc) == health_pb2.HealthCheckResponse.SERVING
        assert verifier_info(addr).drafter_connected
    finally:
        for p in (v, d):
            if p is not None:
                p.stop()


def test_sigterm_drains_the_verifier(pair, reference):
    new = 60
    d = Service("drafter", drafter_argv(pair, "127.0.0.1:0"))
    v = None
    try:
        v = Service("verifier", verifier_argv(pair, "127.0.0.1:0", d.wait_for("serving")))
        addr = v.wait_for("serving")
        with channel(addr) as ch:
            stub = verifier_stub(ch)
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            call = stub.Generate(request("drain", PROMPT, new, 16), timeout=60)
            head = [next(call), next(call)]
            v.signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # pushed to watchers
            watch.cancel()  # an open Watch would hold the drain for the whole grace period
            with pytest.raises(grpc.RpcError) as e:
                generate(stub, request("late", PROMPT, 4, 0), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(call)  # the running turn completes
        assert [t for m in head + rest for t in m.tokens] == reference([PROMPT], new)[0]
        assert v.wait_exit(15) == 0
        assert "stopped" in v.seen
    finally:
        for p in (v, d):
            if p is not None:
                p.stop()


def test_sigterm_on_the_drafter_ends_its_streams_and_the_verifier_carries_on(pair, reference):
    new = 60
    d = Service("drafter", drafter_argv(pair, "127.0.0.1:0"))
    v = None
    try:
        v = Service("verifier", verifier_argv(pair, "127.0.0.1:0", d.wait_for("serving")))
        addr = v.wait_for("serving")
        with channel(addr) as ch:
            call = verifier_stub(ch).Generate(request("carry-on", PROMPT, new, 16), timeout=60)
            head = [next(call), next(call)]
            t0 = time.monotonic()
            d.signal(signal.SIGTERM)
            assert d.wait_exit(10) == 0
            assert time.monotonic() - t0 < 5.0  # streams end after their step, not after the grace period
            rest = list(call)
        assert [t for m in head + rest for t in m.tokens] == reference([PROMPT], new)[0]
        assert rest[-1].stats.tree_size == 1
        assert not verifier_info(addr).drafter_connected
    finally:
        for p in (v, d):
            if p is not None:
                p.stop()
