"""The client SDK (gateway.client) against an in-process fake Gateway server: retries on UNAVAILABLE for
idempotent calls only, deadlines, the API key in metadata, typed results; and that importing it (or
running the gateway's CLI paths) never imports torch."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gateway.auth import bearer_token, check_api_key
from gateway.client import GatewayClient, GatewayError, Sampling
from gateway.errors import GatewayError as ServerError
from protos.ddtree.v1 import gateway_pb2, gateway_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


class Flaky(gateway_pb2_grpc.GatewayServicer):
    """Fails the first `fail` calls of every RPC with UNAVAILABLE; records calls and metadata."""

    def __init__(self, fail: int):
        self.fail = fail
        self.calls: dict[str, int] = {}
        self.metadata: list[dict] = []
        self.requests: list = []

    def _count(self, name, context):
        self.calls[name] = self.calls.get(name, 0) + 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.calls[name] <= self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")

    def Info(self, request, context):
        self._count("Info", context)
        return gateway_pb2.GatewayInfo(model="m", eos_token_ids=[3], verifier_ready=True)

    def ListModels(self, request, context):
        self._count("ListModels", context)
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelCard(id="m", owned_by="o", max_context=9)])

    def CloseSession(self, request, context):
        self._count("CloseSession", context)
        context.abort(grpc.StatusCode.NOT_FOUND, "gone")  # the failed first attempt may have closed it

    def CreateSession(self, request, context):
        self._count("CreateSession", context)
        return gateway_pb2.SessionInfo(session_id="s-1")

    def Generate(self, request, context):
        self._count("Generate", context)
        self.requests.append(request)
        yield gateway_pb2.GenerationChunk(token_ids=[1, 2], text="ab", step=gateway_pb2.StepInfo(
            accepted_length=2, tree_size=5))
        yield gateway_pb2.GenerationChunk(token_ids=[3], text="c", step=gateway_pb2.StepInfo(
            accepted_length=1, tree_size=5), usage=gateway_pb2.GenerationUsage(
            prompt_tokens=2, completion_tokens=3, steps=2, mean_accepted_length=1.5, seed=7,
            stop_reason=gateway_pb2.STOP_REASON_STOP, matched_stop="d"))


@pytest.fixture
def server():
    def start(fail: int):
        svc = Flaky(fail)
        srv = grpc.server(futures.ThreadPoolExecutor(4))
        gateway_pb2_grpc.add_GatewayServicer_to_server(svc, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append(srv)
        return svc, f"127.0.0.1:{port}"
    servers: list = []
    yield start
    for s in servers:
        s.stop(0)


def test_idempotent_calls_are_retried_on_unavailable(server):
    svc, addr = server(fail=2)
    with GatewayClient(addr, api_key="k", backoff_s=0.01) as c:
        info = c.info()
        assert (info.model, info.eos_token_ids, info.verifier_ready) == ("m", [3], True)
        assert c.list_models()[0].max_context == 9
        assert c.close_session("s-1") is False  # NOT_FOUND after a retry: closed by the attempt that failed
    assert svc.calls == {"Info": 3, "ListModels": 3, "CloseSession": 3}
    assert all(m.get("authorization") == "Bearer k" for m in svc.metadata)


def test_non_idempotent_calls_are_not_retried(server):
    svc, addr = server(fail=1)
    with GatewayClient(addr, backoff_s=0.01) as c:
        for call in (lambda: c.generate("x"), lambda: c.create_session()):
            with pytest.raises(GatewayError) as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.attempts == 1
        assert c.generate("x").text == "abc"  # the second call goes through
    assert svc.calls == {"Generate": 2, "CreateSession": 1}
    assert "authorization" not in svc.metadata[0]


def test_retries_give_up_and_not_found_without_retry_is_an_error(server):
    _, addr = server(fail=10)
    with GatewayClient(addr, max_retries=2, backoff_s=0.01) as c, pytest.raises(GatewayError) as e:
        c.info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.attempts == 3
    _, addr = server(fail=0)
    with GatewayClient(addr) as c, pytest.raises(GatewayError) as e:
        c.close_session("s-1")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_typed_results_and_request_fields(server):
    svc, addr = server(fail=0)
    with GatewayClient(addr) as c:
        r = c.generate(messages=[{"role": "user", "content": "hi"}], temperature=0.0, top_k=0, stop=["d"],
                       session_id="s-1", draft_budget=0, timeout=5)
        with pytest.raises(TypeError, match="unknown sampling options"):
            c.stream("x", temprature=1)
        with pytest.raises(ValueError, match="exactly one of"):
            c.stream("x", token_ids=[1])
        c.generate(token_ids=[], sampling=Sampling(max_tokens=3))
    assert (r.text, r.token_ids, r.accepted_per_step, r.finish_reason) == ("abc", [1, 2, 3], [2, 1], "stop")
    assert (r.usage.seed, r.usage.matched_stop, r.usage.matched_stop_token_id) == (7, "d", None)
    req, empty = svc.requests
    assert req.WhichOneof("input") == "chat" and req.session_id == "s-1"
    s = req.sampling
    assert s.HasField("temperature") and s.HasField("top_k") and s.HasField("draft_budget")  # 0 is sent, not unset
    assert not s.HasField("max_tokens") and list(s.stop) == ["d"]
    assert empty.WhichOneof("input") == "token_ids" and empty.sampling.max_tokens == 3


def test_imports_stay_light():
    code = ("import sys, gateway.client, gateway.commands.generate, gateway.server\n"
            "from gateway.cli import build_parser\n"
            "build_parser('gateway'); build_parser('serve'); build_parser('generate')\n"
            "heavy = sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules)\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_api_key_check_is_exact():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token(None) is None
    check_api_key(None, None)  # no key configured: open
    check_api_key("k€y", "Bearer k€y")
    for header in (None, "Bearer k", "Bearer k€y2", "k€y"):
        with pytest.raises(ServerError) as e:
            check_api_key("k€y", header)
        assert e.value.code == "UNAUTHENTICATED" and e.value.http_status == 401
