"""Drafter + verifier as real processes on loopback: exactness through every transport, continuous
batching, admission by KV capacity, cancellation and deadlines, multi-turn sessions, bad input.

One drafter process serves two verifiers at once (colocated and grpc transports; the grpc one sends projected context
rows, `--context-projection`, the colocated one taps), which also checks that streams from different verifiers do not
disturb each other.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from drafter_service.checkpoint import write_random_drafter
from protos.ddtree.v1 import verifier_pb2
from tests.integration.harness import (
    Service,
    channel,
    drafter_argv,
    drafter_info,
    generate,
    request,
    verifier_argv,
    verifier_info,
    verifier_stub,
    wait_until,
)
from verifier_service import presets

pytestmark = pytest.mark.integration
PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7], [42], list(range(60, 72))]
TREE = 17  # nodes of a budget-16 top-4 tree at depth 7


@pytest.fixture(scope="module")
def services(pair):
    procs = []
    try:
        d = Service("drafter", drafter_argv(pair, "127.0.0.1:0"))
        procs.append(d)
        da = d.wait_for("serving")
        co = Service("verifier-colocated", verifier_argv(pair, "127.0.0.1:0", da))  # default: colocated
        # the gRPC verifier holds the drafter's context projection (as the split manifests deploy it): its rows
        # cross projected; the co-located one sends taps
        gr = Service("verifier-grpc", verifier_argv(pair, "127.0.0.1:0", da, "--transport", "grpc",
                                                    "--kv-pages", "96", "--context-projection", str(pair[1])))
        procs += [co, gr]
        yield {"drafter": da, "colocated": co.wait_for("serving"), "grpc": gr.wait_for("serving")}
    finally:
        for p in procs:
            p.stop()


def idle(services, name) -> bool:
    info = verifier_info(services[name])
    return info.kv_pages_free == info.kv_pages_total and info.open_sessions == 0


def run_concurrently(address, reqs, timeout=120.0):
    with channel(address) as ch, concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
        stub = verifier_stub(ch)
        return list(pool.map(lambda r: generate(stub, r, timeout), reqs))


@pytest.mark.parametrize("transport", ["colocated", "grpc"])
@pytest.mark.parametrize("budget", [0, 16])
def test_greedy_output_equals_inprocess_engine(services, reference, transport, budget):
    new = 24
    ref = reference(PROMPTS, new)
    results = run_concurrently(services[transport], [request(f"{transport}-{budget}-{i}", p, new, budget)
                                                     for i, p in enumerate(PROMPTS)])
    for (tokens, msgs), expected in zip(results, ref):
        assert tokens == expected
        assert msgs[0].stats.prefill_tokens > 0 and msgs[-1].finish_reason == verifier_pb2.FINISH_REASON_LENGTH
        steps = msgs[1:]
        assert {m.stats.tree_size for m in steps} == ({1} if budget == 0 else {TREE})  # drafted over the wire
        assert msgs[-1].usage.completion_tokens == new and msgs[-1].usage.steps == len(steps)
    info = verifier_info(services[transport])
    assert info.transport == transport and info.drafter_connected
    wait_until(lambda: idle(services, transport), what="KV freed")
    wait_until(lambda: drafter_info(services["drafter"]).active_sessions == 0, what="drafter contexts freed")


def test_32_concurrent_sessions_mixed_budgets(services, reference):
    new = 16
    prompts = [[(7 * i + j) % 250 for j in range(1 + i % 9)] for i in range(32)]
    budgets = [0, 4, 16, 64]
    reqs = [request(f"c32-{i}", p, new, budgets[i % 4], topk=1 + i % 5) for i, p in enumerate(prompts)]
    results = run_concurrently(services["colocated"], reqs)
    assert [t for t, _ in results] == reference(prompts, new)
    wait_until(lambda: idle(services, "colocated"), what="KV freed")


def test_admission_is_bounded_by_kv_capacity(services, reference):
    """The grpc verifier has 96 pages of 16 tokens: a turn that cannot fit next to a running one
    is refused with RESOURCE_EXHAUSTED; the running one is unaffected; after it leaves, it fits."""
    addr = services["grpc"]
    with channel(addr) as ch:
        stub = verifier_stub(ch)
        big = stub.Generate(request("cap-big", [1, 2, 3], 1400, 0), timeout=60)  # reserves 89 pages
        first = next(big)
        assert first.tokens
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request("cap-small", PROMPTS[0], 200, 16), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV cache full" in e.value.details() and "pages" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request("cap-huge", PROMPTS[0], 9000, 0), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "allows" in e.value.details()
        assert next(big).tokens  # the running turn goes on
        big.cancel()
        wait_until(lambda: idle(services, "grpc"), what="KV freed after cancel")
        tokens, _ = generate(stub, request("cap-small", PROMPTS[0], 200, 16))
        assert tokens == reference([PROMPTS[0]], 200)[0]


def test_cancel_and_deadline_free_kv_on_both_services(services):
    addr = services["colocated"]
    with channel(addr) as ch:
        stub = verifier_stub(ch)
        call = stub.Generate(request("cancel-me", PROMPTS[1], 2000, 16), timeout=60)
        for _ in range(3):
            next(call)
        assert verifier_info(addr).running_sessions == 1
        assert drafter_info(services["drafter"]).active_sessions >= 1
        call.cancel()
        wait_until(lambda: idle(services, "colocated"), what="verifier KV freed after cancel")
        wait_until(lambda: drafter_info(services["drafter"]).active_sessions == 0, what="drafter context freed")

        with pytest.raises(grpc.RpcError) as e:
            for _ in stub.Generate(request("deadline", PROMPTS[1], 2000, 16), timeout=1.0):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: idle(services, "colocated"), what="verifier KV freed after the deadline")
        wait_until(lambda: drafter_info(services["drafter"]).active_sessions == 0, what="drafter context freed")


def test_multi_turn_session(services, reference):
    addr = services["colocated"]
    p1, t2 = PROMPTS[3], [7, 8, 9]
    o1 = reference([p1], 10)[0]
    o2 = reference([p1 + o1 + t2], 12)[0]
    with channel(addr) as ch:
        stub = verifier_stub(ch)
        tokens, msgs = generate(stub, request("mt", p1, 10, 16, persistent=True))
        assert tokens == o1
        info = verifier_info(addr)
        assert info.open_sessions == 1 and info.running_sessions == 0 and info.kv_pages_free < info.kv_pages_total
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, request("mt", p1, 10, 16))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        tokens, msgs = generate(stub, request("mt", t2, 12, 16, continue_session=True))
        assert tokens == o2
        assert msgs[0].stats.prefill_tokens == 1 + len(t2)
        assert msgs[-1].usage.session_length == len(p1 + o1 + t2 + o2)
        # a turn still running cannot be continued
        call = stub.Generate(request("mt", [1], 500, 0, continue_session=True), timeout=30)
        next(call)
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, request("mt", [2], 5, 0, continue_session=True))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        resp = stub.Release(verifier_pb2.ReleaseRequest(session_id="mt"), timeout=10)
        assert resp.cancelled_running_turn
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED and "released" in e.value.details()
        wait_until(lambda: idle(services, "colocated"), what="KV freed after release")
        for rpc in (lambda: generate(stub, request("mt", t2, 5, 0, continue_session=True)),
                    lambda: stub.Release(verifier_pb2.ReleaseRequest(session_id="mt"), timeout=10)):
            with pytest.raises(grpc.RpcError) as e:
                rpc()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("req, words", [
    (request("bad id!", [1], 4, 0), "session_id"),
    (request("empty", [], 4, 0), "prompt is empty"),
    (request("vocab", [1, 100000], 4, 0), "outside the vocabulary"),
    (request("budget", [1], 4, 65), "budget"),
    (request("topk", [1], 4, 16, topk=0), "topk"),
    (verifier_pb2.GenerateRequest(session_id="temp", tokens=[1], params=verifier_pb2.DecodeParams(temperature=-1)),
     "temperature"),
    (verifier_pb2.GenerateRequest(session_id="newtok", tokens=[1], params=verifier_pb2.DecodeParams(
        max_new_tokens=0)), "max_new_tokens"),
])
def test_bad_requests_are_invalid_argument(services, req, words):
    with channel(services["grpc"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            generate(verifier_stub(ch), req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details()
    assert idle(services, "grpc")


def test_health_and_reflection(services):
    for name, service in (("colocated", "ddtree.v1.Verifier"), ("drafter", "ddtree.v1.Drafter")):
        with channel(services[name]) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for svc in ("", service):
                resp = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=5)
            names = {s.name for a in answers for s in a.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


def test_streams_of_two_verifiers_run_side_by_side(services, reference):
    """Both verifiers draft from the one drafter at the same time, with the same session ids."""
    new = 20
    out: dict[str, list] = {}

    def run(name):
        out[name] = run_concurrently(services[name], [request(f"same-{i}", p, new, 16) for i, p in enumerate(PROMPTS)])

    threads = [threading.Thread(target=run, args=(n,)) for n in ("colocated", "grpc")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ref = reference(PROMPTS, new)
    for name in ("colocated", "grpc"):
        assert [t for t, _ in out[name]] == ref
    assert drafter_info(services["drafter"]).streams == 2


def test_inprocess_transport_server(pair, reference):
    """`--transport inprocess`: the drafter runs inside the verifier process."""
    v = Service("verifier-inprocess", verifier_argv(pair, "127.0.0.1:0", None, "--transport", "inprocess",
                                                    "--drafter", str(pair[1])))
    try:
        addr = v.wait_for("serving")
        results = run_concurrently(addr, [request(f"ip-{i}", p, 16, 16) for i, p in enumerate(PROMPTS[:2])])
        assert [t for t, _ in results] == reference(PROMPTS[:2], 16)
        assert {m.stats.tree_size for _, msgs in results for m in msgs[1:]} == {TREE}
        info = verifier_info(addr)
        assert info.transport == "inprocess" and info.drafter_connected and info.block_size == 8
        assert info.mla_kernel == "reference"  # CPU: the torch reference, whatever --mla-kernel says
    finally:
        v.stop()


def test_gluon_mla_kernel_refused_at_start_where_it_cannot_run(pair):
    """`--mla-kernel gluon` on a machine without an sm_90 GPU (here: CPU) stops the server before it
    serves, saying why, instead of failing requests later."""
    v = Service("verifier-gluon", verifier_argv(pair, "127.0.0.1:0", None, "--transport", "inprocess",
                                                "--drafter", str(pair[1]), "--mla-kernel", "gluon"))
    try:
        with pytest.raises(RuntimeError, match="sm_90"):
            v.wait_for("serving")
    finally:
        v.stop()


def test_a_verifier_holding_another_drafters_projection_stops_at_start(services, pair, tmp_path):
    """`--context-projection` pointed at another drafter checkpoint than the served one: the verifier stops before it
    serves, naming the flag, instead of serving with a drafter that refuses its rows."""
    other = tmp_path / "other-drafter"
    hidden = json.loads((pair[0] / "config.json").read_text())["text_config"]["hidden_size"]
    write_random_drafter(other, presets.drafter_config("tiny"), hidden, seed=7)
    v = Service("verifier-other-projection", verifier_argv(pair, "127.0.0.1:0", services["drafter"], "--transport",
                                                           "grpc", "--context-projection", str(other)))
    try:
        with pytest.raises(RuntimeError, match="has another context projection"):
            v.wait_for("serving")
    finally:
        v.stop()


def test_unix_socket_drafter_defaults_to_colocated(pair, reference, tmp_path):
    sock = f"unix:{tmp_path}/drafter.sock"
    d = Service("drafter-unix", drafter_argv(pair, sock))
    v = None
    try:
        assert d.wait_for("serving") == sock
        v = Service("verifier-unix", verifier_argv(pair, "127.0.0.1:0", sock))
        addr = v.wait_for("serving")
        assert verifier_info(addr).transport == "colocated"
        with channel(addr) as ch:
            tokens, msgs = generate(verifier_stub(ch), request("unix", PROMPTS[0], 16, 16))
        assert tokens == reference([PROMPTS[0]], 16)[0] and msgs[1].stats.tree_size == TREE
    finally:
        for p in (v, d):
            if p is not None:
                p.stop()
