"""Trace context across a real grpc.aio server and client on loopback (in-memory span exporter).

A tiny generic service covers all four call kinds plus an abort and a crash; the standard health
service runs beside it and must stay untraced.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from telemetry.grpc_tracing import TracingServerInterceptor, client_interceptors

SERVICE = "ddtree.test.Echo"


def _handlers(tracer):
    def work():  # a span made inside the handler must be a child of the server span
        with tracer.start_as_current_span("handler-work"):
            pass

    async def unary(req, ctx):
        work()
        return req

    async def server_stream(req, ctx):
        work()
        for i in range(3):
            yield req + bytes([i])

    async def bidi(it, ctx):
        async for req in it:
            work()
            yield req

    async def client_stream(it, ctx):
        work()
        return b"".join([r async for r in it])

    async def abort(req, ctx):
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad tree")

    async def crash(req, ctx):
        raise RuntimeError("boom")

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        "Abort": grpc.unary_unary_rpc_method_handler(abort),
        "Crash": grpc.unary_unary_rpc_method_handler(crash),
    })


async def _exercise(provider: TracerProvider) -> dict:
    tracer = provider.get_tracer("test")
    server = grpc.aio.server(interceptors=[TracingServerInterceptor(provider)])
    server.add_generic_rpc_handlers([_handlers(tracer)])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_interceptors()) as ch:
            with tracer.start_as_current_span("client-root") as root:
                out["root"] = root.get_span_context()
                out["unary"] = await ch.unary_unary(f"/{SERVICE}/Unary")(b"a", timeout=10)
                out["stream"] = [m async for m in ch.unary_stream(f"/{SERVICE}/ServerStream")(b"s", timeout=10)]

                async def reqs():
                    for x in (b"1", b"2"):
                        yield x
                out["bidi"] = [m async for m in ch.stream_stream(f"/{SERVICE}/Bidi")(reqs(), timeout=10)]
                out["client_stream"] = await ch.stream_unary(f"/{SERVICE}/ClientStream")(reqs(), timeout=10)
                for name in ("Abort", "Crash"):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await ch.unary_unary(f"/{SERVICE}/{name}")(b"x", timeout=10)
                    out[name] = e.value.code()
                hc = health_pb2_grpc.HealthStub(ch)
                out["health"] = (await hc.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)).status
            # outside any span: the server span is a root of its own trace
            await ch.unary_unary(f"/{SERVICE}/Unary")(b"z", timeout=10)
    finally:
        await server.stop(None)
    return out


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    out = asyncio.run(_exercise(provider))
    return out, exporter.get_finished_spans()


def _server_spans(spans, method):
    return [s for s in spans if s.kind == SpanKind.SERVER and s.name == f"{SERVICE}/{method}"]


def test_rpc_results_pass_through(traced):
    out, _ = traced
    assert out["unary"] == b"a"
    assert out["stream"] == [b"s\x00", b"s\x01", b"s\x02"]
    assert out["bidi"] == [b"1", b"2"] and out["client_stream"] == b"12"
    assert out["Abort"] == grpc.StatusCode.INVALID_ARGUMENT and out["Crash"] == grpc.StatusCode.UNKNOWN
    assert out["health"] == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("method", ["Unary", "ServerStream", "Bidi", "ClientStream", "Abort", "Crash"])
def test_server_span_is_child_of_the_client_span(traced, method):
    out, spans = traced
    root = out["root"]
    mine = [s for s in _server_spans(spans, method) if s.context.trace_id == root.trace_id]
    assert len(mine) == 1, [s.name for s in spans]
    (s,) = mine
    assert s.parent is not None and s.parent.is_remote and s.parent.span_id == root.span_id
    assert s.attributes["rpc.system"] == "grpc"
    assert (s.attributes["rpc.service"], s.attributes["rpc.method"]) == (SERVICE, method)
    work = [w for w in spans if w.name == "handler-work" and w.parent and w.parent.span_id == s.context.span_id]
    assert len(work) == {"Unary": 1, "ServerStream": 1, "Bidi": 2, "ClientStream": 1}.get(method, 0)


def test_status_codes_and_error_status(traced):
    _, spans = traced
    codes = {m: _server_spans(spans, m)[0] for m in ("Unary", "Abort", "Crash")}
    assert codes["Unary"].attributes["rpc.grpc.status_code"] == 0
    assert codes["Unary"].status.status_code == StatusCode.UNSET
    # INVALID_ARGUMENT is the caller's fault: recorded, but not a server error (RPC conventions)
    assert codes["Abort"].attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert codes["Abort"].status.status_code == StatusCode.UNSET
    assert codes["Crash"].attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNKNOWN.value[0]
    assert codes["Crash"].status.status_code == StatusCode.ERROR
    assert any(e.name == "exception" and "boom" in e.attributes["exception.message"] for e in codes["Crash"].events)


def test_health_checks_are_not_traced_and_untraced_calls_start_a_new_trace(traced):
    out, spans = traced
    assert not [s for s in spans if "Health" in s.name]
    unary = _server_spans(spans, "Unary")
    assert len(unary) == 2
    (lone,) = [s for s in unary if s.context.trace_id != out["root"].trace_id]
    assert lone.parent is None
    assert trace.format_trace_id(lone.context.trace_id) != trace.format_trace_id(out["root"].trace_id)
