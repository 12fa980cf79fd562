"""Tracing setup from OTEL_* variables, W3C propagation helpers and span helpers (in-memory exporter)."""

from __future__ import annotations

import io
import json
import sys
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from telemetry import tracing as tr

OTLP_GRPC_MODULE = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"


@pytest.fixture
def mem():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


# --- configure_tracing ----------------------------------------------------------------------------
@pytest.mark.parametrize("env", [
    {},  # nothing configured: nothing exported
    {"OTEL_SERVICE_NAME": "x"},
    {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
    {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"},
])
def test_nothing_exported_when_not_configured(env):
    assert tr.configure_tracing(env, "ddtree-test", set_global=False) is None


def test_console_exporter_writes_one_json_span_per_line():
    out = io.StringIO()
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "ddtree-verifier",
           "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=verifier-0,deployment.environment=prod%2Ceu"}
    provider = tr.configure_tracing(env, "fallback-name", console_out=out, set_global=False)
    tracer = tr.get_tracer(provider)
    with tracer.start_as_current_span("outer"):
        with tracer.start_as_current_span("inner"):
            pass
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    spans = [json.loads(x) for x in lines]
    assert [s["name"] for s in spans] == ["inner", "outer"]
    res = spans[0]["resource"]["attributes"]
    assert res["service.name"] == "ddtree-verifier"
    assert res["k8s.pod.name"] == "verifier-0" and res["deployment.environment"] == "prod,eu"
    assert spans[0]["parent_id"] == spans[1]["context"]["span_id"]


def test_default_service_name_and_sampler_from_env():
    out = io.StringIO()
    provider = tr.configure_tracing({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "traceidratio",
                                     "OTEL_TRACES_SAMPLER_ARG": "0"}, "ddtree-gateway", console_out=out,
                                    set_global=False)
    assert provider.resource.attributes["service.name"] == "ddtree-gateway"
    with tr.get_tracer(provider).start_as_current_span("dropped") as span:
        assert not span.is_recording()
    assert out.getvalue() == ""


def test_missing_otlp_package_is_not_fatal(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, OTLP_GRPC_MODULE, None)  # import of it raises ImportError
    with caplog.at_level("WARNING"):
        provider = tr.configure_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, "svc",
                                        set_global=False)
    assert provider is None
    assert "exporter package is missing" in caplog.text
    # with console also asked for, tracing still works through the exporter that is there
    out = io.StringIO()
    provider = tr.configure_tracing({"OTEL_TRACES_EXPORTER": "otlp,console"}, "svc", console_out=out,
                                    set_global=False)
    with tr.get_tracer(provider).start_as_current_span("still-works"):
        pass
    assert '"still-works"' in out.getvalue()


def test_unknown_exporter_is_ignored_with_a_warning(caplog):
    with caplog.at_level("WARNING"):
        assert tr.configure_tracing({"OTEL_TRACES_EXPORTER": "zipkin_json"}, "svc", set_global=False) is None
    assert "zipkin_json" in caplog.text


def test_otlp_export_reaches_a_collector(monkeypatch):
    """OTEL_EXPORTER_OTLP_ENDPOINT alone turns on OTLP/gRPC export; a fake collector receives the span."""
    pytest.importorskip(OTLP_GRPC_MODULE)
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_SERVICE_NAME": "ddtree-drafter"}
        for k, v in env.items():  # the exporter reads its connection settings from the process env
            monkeypatch.setenv(k, v)
        provider = tr.configure_tracing(env, "unused", set_global=False)
        with tr.get_tracer(provider).start_as_current_span(tr.SPAN_DRAFT, attributes={tr.DDTREE_BUDGET: 16}):
            pass
        assert provider.force_flush(timeout_millis=10_000)
        provider.shutdown()
    finally:
        server.stop(None)
    spans = [(rs.resource, s) for req in received for rs in req.resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    assert len(spans) == 1
    resource, span = spans[0]
    assert span.name == tr.SPAN_DRAFT
    assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "ddtree-drafter"
    assert {a.key: a.value.int_value for a in span.attributes}[tr.DDTREE_BUDGET] == 16


# --- propagation ----------------------------------------------------------------------------------
def test_metadata_round_trip_keeps_other_keys_and_replaces_stale_traceparent(mem):
    provider, _ = mem
    with provider.get_tracer("t").start_as_current_span("parent") as span:
        md = tr.inject_metadata([("authorization", "Bearer x"), ("traceparent", "00-stale")])
    keys = [k for k, _ in md]
    assert keys.count("traceparent") == 1 and "authorization" in keys
    ctx = tr.extract_metadata(md + [("bin-bin", b"\x00")])
    remote = trace.get_current_span(ctx).get_span_context()
    assert remote.trace_id == span.get_span_context().trace_id
    assert remote.span_id == span.get_span_context().span_id and remote.is_remote


def test_http_headers_any_case(mem):
    provider, exporter = mem
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    for headers in ({"Traceparent": tp, "Content-Type": "json"}, [("TRACEPARENT", tp)]):
        ctx = tr.extract_http(headers)
        with provider.get_tracer("t").start_as_current_span("http", context=ctx):
            pass
    for s in exporter.get_finished_spans():
        assert f"{s.context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert f"{s.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert "traceparent" in tr.inject_http({}, context=ctx)


def test_traceparent_string_round_trip(mem):
    provider, _ = mem
    assert tr.traceparent() == ""  # no current span
    with provider.get_tracer("t").start_as_current_span("p") as span:
        tp = tr.traceparent()
    sc = span.get_span_context()
    assert tp == f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}" and sc.trace_flags.sampled
    back = trace.get_current_span(tr.context_from_traceparent(tp)).get_span_context()
    assert (back.trace_id, back.span_id) == (sc.trace_id, sc.span_id)
    for bad in ("", None, "garbage", "00-0000-00-01"):
        assert not trace.get_current_span(tr.context_from_traceparent(bad)).get_span_context().is_valid


# --- span helpers ---------------------------------------------------------------------------------
def test_request_span_uses_genai_names(mem):
    provider, exporter = mem
    with tr.request_span(provider.get_tracer("t"), "chat", "kimi-k2.6", conversation_id="sess-1",
                         input_tokens=12, attributes={tr.GEN_AI_REQUEST_TEMPERATURE: 0.0,
                                                      tr.GEN_AI_REQUEST_SEED: None}) as span:
        tr.set_usage(span, output_tokens=34, finish_reason="stop")
    (s,) = exporter.get_finished_spans()
    assert s.name == "chat kimi-k2.6"
    assert dict(s.attributes) == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "kimi-k2.6", "gen_ai.conversation.id": "sess-1",
        "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 34, "gen_ai.request.temperature": 0.0,
        "gen_ai.response.finish_reasons": ("stop",),
    }


def test_record_span_for_batched_steps(mem):
    """One step, two sessions in two traces: each gets a span with the step's times under its own parent."""
    provider, exporter = mem
    tracer = provider.get_tracer("t")
    parents = []
    for name in ("req-a", "req-b"):
        with tracer.start_as_current_span(name) as p:
            parents.append(trace.set_span_in_context(p))
    t0 = time.time_ns()
    t1 = t0 + 1_500_000
    for ctx, acc in zip(parents, (3, 1)):
        tr.record_span(tracer, tr.SPAN_VERIFY_STEP, ctx, t0, t1,
                       tr.step_attributes(tree_size=9, budget=8, accepted_length=acc, batch_sessions=2, step=None))
    req_a, req_b, step_a, step_b = exporter.get_finished_spans()
    for req, step, acc in ((req_a, step_a, 3), (req_b, step_b, 1)):
        assert step.context.trace_id == req.context.trace_id and step.parent.span_id == req.context.span_id
        assert (step.start_time, step.end_time) == (t0, t1)
        assert dict(step.attributes) == {"ddtree.tree.size": 9, "ddtree.budget": 8, "ddtree.accepted_length": acc,
                                         "ddtree.batch.sessions": 2}
    assert step_a.context.trace_id != step_b.context.trace_id
