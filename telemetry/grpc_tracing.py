"""W3C trace-context propagation for grpc.aio: client interceptors that inject it into metadata, and a
server interceptor that extracts it and runs each RPC inside a SERVER span.

    channel = grpc.aio.insecure_channel(addr, interceptors=client_interceptors())
    server = grpc.aio.server(interceptors=[TracingServerInterceptor()])

Client side: injection only (no client span); the caller's current span (e.g. the verifier's
`ddtree.transport.draft` span) becomes the remote parent. grpc.aio starts each intercepted call in
a task created at call time, which copies the caller's contextvars, so the current span is visible.
Server side: span name "package.Service/Method", attributes rpc.system/rpc.service/rpc.method and
rpc.grpc.status_code; error status for the codes the RPC conventions call server errors. Health
checks and reflection are not traced (probes would flood the backend).
"""

from __future__ import annotations

import asyncio
import inspect
from contextlib import aclosing, contextmanager

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from telemetry.tracing import extract_metadata, get_tracer, inject_metadata

DEFAULT_EXCLUDE = ("/grpc.health.v1.", "/grpc.reflection.")
# https://opentelemetry.io/docs/specs/semconv/rpc/grpc/ : these codes mark a server span as an error
_SERVER_ERRORS = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
                            grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
_BY_INT = {c.value[0]: c for c in grpc.StatusCode}


# --- client ---------------------------------------------------------------------------------------
def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    md = grpc.aio.Metadata(*inject_metadata(tuple(details.metadata or ())))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace_context(client_call_details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace_context(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """One injector per call kind (grpc.aio files an interceptor under a single kind only)."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]


# --- server ---------------------------------------------------------------------------------------
def _status_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    try:
        code = context.code()
    except Exception:  # a context that cannot say: judge by the exception alone
        code = None
    if isinstance(code, int):
        code = _BY_INT.get(code)
    if code is None:
        return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN
    return code


@contextmanager
def _server_span(tracer: trace.Tracer, method: str, parent, context: grpc.aio.ServicerContext):
    name = method.lstrip("/")
    service, _, rpc = name.rpartition("/")
    attrs = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}
    with tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs,
                                      record_exception=False, set_status_on_exception=False) as span:
        exc: BaseException | None = None
        try:
            yield span
        except BaseException as e:
            exc = e
            raise
        finally:
            code = _status_of(context, exc)
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if exc is not None and not isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError)):
                span.record_exception(exc)
            if code in _SERVER_ERRORS:
                details = None
                try:
                    details = context.details()
                except Exception:
                    pass
                span.set_status(Status(StatusCode.ERROR, details or code.name))


def _wrap(behavior, response_streaming: bool, tracer_of, method: str, parent):
    if response_streaming and inspect.isasyncgenfunction(behavior):
        async def gen(request, context):
            with _server_span(tracer_of(), method, parent, context):
                # aclosing: when the call is cancelled while this wrapper waits at `yield`, the handler's
                # own `finally` (e.g. releasing a session) runs now, not whenever the GC finalizes it
                async with aclosing(behavior(request, context)) as items:
                    async for item in items:
                        yield item
        return gen

    async def unary(request, context):
        with _server_span(tracer_of(), method, parent, context):
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
    return unary


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Extracts the W3C context from invocation metadata; runs the RPC inside a SERVER span."""

    def __init__(self, tracer_provider=None, exclude_prefixes: tuple[str, ...] = DEFAULT_EXCLUDE):
        self._provider = tracer_provider  # None: the global provider at call time (configure later is fine)
        self._exclude = tuple(exclude_prefixes)

    def _tracer(self) -> trace.Tracer:
        return get_tracer(self._provider)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._exclude):
            return handler
        parent = extract_metadata(handler_call_details.invocation_metadata)
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap(handler.unary_unary, False, self._tracer, method, parent), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap(handler.unary_stream, True, self._tracer, method, parent), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap(handler.stream_unary, False, self._tracer, method, parent), **kw)
        return grpc.stream_stream_rpc_method_handler(
            _wrap(handler.stream_stream, True, self._tracer, method, parent), **kw)
