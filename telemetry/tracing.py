"""OpenTelemetry tracing: setup from the standard OTEL_* variables, W3C propagation, span helpers.

One trace per request: gateway -> verifier -> drafter (DESIGN 6). The pieces:
- `configure_tracing(env, default_service_name)`: builds a TracerProvider only when something is
  to be exported (OTEL_TRACES_EXPORTER, or an OTLP endpoint variable); otherwise installs nothing,
  so the API's no-op tracer stays in place (it still passes an incoming trace context through).
  Exporter packages are optional imports: a missing one is logged and skipped, never fatal.
- W3C `traceparent`/`tracestate` (+ baggage) propagation over gRPC metadata, HTTP headers, and as a
  plain string for contexts that travel inside messages (a long-lived multiplexed stream such as
  verifier->drafter carries many requests, so per-session context must ride in the message).
  The grpc.aio interceptors live in `telemetry.grpc_tracing`.
- Span names and attribute names (GenAI semantic conventions + `ddtree.*`), and
  `record_span(...)` for the batched step loop: one verify step serves many requests, so each
  session gets its own span in its own trace with the step's start and end times.

Env vars are passed in as a mapping (read in __main__/CLI only, DESIGN 1). The exporters' own
connection settings (OTEL_EXPORTER_OTLP_HEADERS, ..._INSECURE, ..._TIMEOUT, OTEL_BSP_*) are read by
the OpenTelemetry SDK as it documents.
"""

from __future__ import annotations

import logging
import sys
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import IO

from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACER_NAME = "ddtree"
# With OTEL_TRACES_EXPORTER=console: append the JSON span lines to this file instead of stdout (the services'
# stdout carries their lifecycle JSON lines). Meant for tests and local debugging, not for production export.
CONSOLE_FILE_ENV = "DDTREE_TRACES_CONSOLE_FILE"

# --- attribute names ------------------------------------------------------------------------------
# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/)
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" | "text_completion"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
# DDTree-specific
DDTREE_TREE_SIZE = "ddtree.tree.size"  # nodes verified, root included
DDTREE_TREE_DEPTH = "ddtree.tree.depth"
DDTREE_ACCEPTED_LENGTH = "ddtree.accepted_length"  # tokens committed this step (accepted drafts + bonus)
DDTREE_BUDGET = "ddtree.budget"  # draft nodes asked for (N; 0 = autoregressive)
DDTREE_STEP = "ddtree.step"  # index of the verify step within the session
DDTREE_BATCH_SESSIONS = "ddtree.batch.sessions"  # sessions sharing the step / draft call
DDTREE_BATCH_NODES = "ddtree.batch.nodes"  # flat node count of the step
DDTREE_TRANSPORT = "ddtree.transport"  # inprocess | colocated | grpc
DDTREE_FALLBACK = "ddtree.fallback"  # why a step ran without a tree (drafter failure)

# --- span names (the services and the tracing integration test agree on these) ----------------------
SPAN_QUEUE = "ddtree.queue"  # gateway: admitted -> handed to a verifier; verifier: arrival -> scheduler admission
SPAN_PREFILL = "ddtree.prefill"  # verifier: prompt forward
SPAN_VERIFY_STEP = "ddtree.verify_step"  # verifier: one step, one span per session
SPAN_TRANSPORT = "ddtree.transport.draft"  # verifier: the draft round trip through the transport
SPAN_DRAFT = "ddtree.draft"  # drafter: one tree build for one session

_PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
             "parentbased_traceidratio")


# --- setup ----------------------------------------------------------------------------------------
def _compact_json(span) -> str:
    return span.to_json(indent=None) + "\n"


def _otlp_exporter(env: Mapping[str, str]):
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%r is not supported (grpc, http/protobuf); no OTLP export",
                        protocol)
            return None
    except ImportError as e:
        log.warning("OTLP trace export requested but the exporter package is missing (%s); install "
                    "ddtree-serve[otlp]. Continuing without OTLP export.", e)
        return None
    return OTLPSpanExporter()  # endpoint, headers, TLS, timeout: from OTEL_EXPORTER_OTLP_* per the SDK


def _sampler(env: Mapping[str, str]):
    from opentelemetry.sdk.trace import sampling

    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    if name not in _SAMPLERS:
        log.warning("unknown OTEL_TRACES_SAMPLER=%r; using parentbased_always_on", name)
        name = "parentbased_always_on"
    ratio = 1.0
    if name.endswith("traceidratio"):
        try:
            ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        except ValueError:
            log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a number; using 1.0", env.get("OTEL_TRACES_SAMPLER_ARG"))
        ratio = min(max(ratio, 0.0), 1.0)
    return {
        "always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
        "traceidratio": sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": sampling.ParentBasedTraceIdRatio(ratio),
    }[name]


def _resource(env: Mapping[str, str], default_service_name: str):
    from opentelemetry.sdk.resources import Resource

    attrs: dict[str, str] = {}
    for item in (env.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip():
            attrs[k.strip()] = urllib.parse.unquote(v.strip())
    attrs["service.name"] = env.get("OTEL_SERVICE_NAME") or attrs.get("service.name") or default_service_name
    return Resource.create(attrs)


def configure_tracing(env: Mapping[str, str], default_service_name: str, *, console_out: IO[str] | None = None,
                      set_global: bool = True):
    """Build (and by default install) a TracerProvider from OTEL_* settings in `env`.

    Returns the SDK TracerProvider, or None when nothing is exported: OTEL_SDK_DISABLED=true,
    OTEL_TRACES_EXPORTER=none, or neither OTEL_TRACES_EXPORTER nor an OTLP endpoint is set.
    Exporters: "otlp" (grpc or http/protobuf, by OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL) and
    "console" (one compact JSON span per line to `console_out`, else to the file named by
    DDTREE_TRACES_CONSOLE_FILE, else to stdout).
    """
    if (env.get("OTEL_SDK_DISABLED") or "").strip().lower() == "true":
        return None
    raw = env.get("OTEL_TRACES_EXPORTER")
    if raw is None or not raw.strip():
        has_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        names = ["otlp"] if has_endpoint else []
    else:
        names = [n.strip().lower() for n in raw.split(",") if n.strip() and n.strip().lower() != "none"]
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    processors = []
    for name in dict.fromkeys(names):
        if name == "otlp":
            exporter = _otlp_exporter(env)
            if exporter is not None:
                processors.append(BatchSpanProcessor(exporter))
        elif name == "console":
            out = console_out
            if out is None and env.get(CONSOLE_FILE_ENV):
                out = open(env[CONSOLE_FILE_ENV], "a", buffering=1)  # line-buffered; lives as long as the process
            processors.append(SimpleSpanProcessor(ConsoleSpanExporter(out=out or sys.stdout, formatter=_compact_json)))
        else:
            log.warning("OTEL_TRACES_EXPORTER=%r is not supported here (otlp, console, none); ignored", name)
    if not processors:
        return None
    provider = TracerProvider(sampler=_sampler(env), resource=_resource(env, default_service_name))
    for p in processors:
        provider.add_span_processor(p)
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def is_configured() -> bool:
    """True when an SDK TracerProvider is installed globally (configure_tracing found something to export).
    Services check it once at startup to skip span work entirely when tracing is off."""
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(trace.get_tracer_provider(), TracerProvider)


def get_tracer(provider=None) -> trace.Tracer:
    """The ddtree tracer of `provider`, or of the global provider (a no-op one when unconfigured)."""
    return (provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)


# --- propagation ----------------------------------------------------------------------------------
def inject_metadata(metadata: Iterable[tuple[str, str | bytes]] | None = None,
                    context: Context | None = None) -> list[tuple[str, str | bytes]]:
    """gRPC metadata with the W3C headers of `context` (default: current) added; old copies replaced."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    kept = [(k, v) for k, v in (metadata or ()) if k.lower() not in carrier]
    return kept + list(carrier.items())


def extract_metadata(metadata: Iterable | None, context: Context | None = None) -> Context:
    """Context from gRPC invocation metadata ((key, value) pairs; binary values ignored)."""
    carrier = {}
    for item in metadata or ():
        k, v = item[0], item[1]
        if isinstance(v, str):
            carrier[k.lower()] = v
    return _PROPAGATOR.extract(carrier, context=context)


def extract_http(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None,
                 context: Context | None = None) -> Context:
    """Context from incoming HTTP headers (any case; a Mapping or (name, value) pairs)."""
    items = headers.items() if isinstance(headers, Mapping) else (headers or ())
    carrier = {str(k).lower(): str(v) for k, v in items}
    return _PROPAGATOR.extract(carrier, context=context)


def inject_http(headers: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    """Outgoing HTTP headers with the W3C headers of `context` (default: current) added."""
    headers = dict(headers or {})
    _PROPAGATOR.inject(headers, context=context)
    return headers


def traceparent(context: Context | None = None) -> str:
    """The W3C traceparent of `context` (default: current), or "" when there is no valid span.
    For trace context that travels inside messages (per-session fields of a multiplexed stream)."""
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=context)
    return carrier.get("traceparent", "")


def context_from_traceparent(value: str | None, tracestate: str | None = None) -> Context:
    """Inverse of `traceparent`; an empty or malformed value gives a context with no parent."""
    carrier = {"traceparent": value} if value else {}
    if value and tracestate:
        carrier["tracestate"] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


# --- span helpers ---------------------------------------------------------------------------------
def _clean(attributes: Mapping[str, object] | None) -> dict:
    return {k: v for k, v in (attributes or {}).items() if v is not None}


@contextmanager
def request_span(tracer: trace.Tracer, operation: str, model: str, *, conversation_id: str | None = None,
                 input_tokens: int | None = None, context: Context | None = None,
                 kind: trace.SpanKind = trace.SpanKind.INTERNAL,
                 attributes: Mapping[str, object] | None = None) -> Iterator[trace.Span]:
    """The GenAI span of one request: named "{operation} {model}" as the conventions ask."""
    attrs = {GEN_AI_OPERATION_NAME: operation, GEN_AI_REQUEST_MODEL: model, GEN_AI_CONVERSATION_ID: conversation_id,
             GEN_AI_USAGE_INPUT_TOKENS: input_tokens, **(attributes or {})}
    with tracer.start_as_current_span(f"{operation} {model}", context=context, kind=kind,
                                      attributes=_clean(attrs)) as span:
        yield span


def set_usage(span: trace.Span, *, input_tokens: int | None = None, output_tokens: int | None = None,
              finish_reason: str | None = None) -> None:
    attrs = {GEN_AI_USAGE_INPUT_TOKENS: input_tokens, GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
             GEN_AI_RESPONSE_FINISH_REASONS: [finish_reason] if finish_reason else None}
    span.set_attributes(_clean(attrs))


def step_attributes(*, tree_size: int, budget: int, accepted_length: int | None = None,
                    tree_depth: int | None = None, step: int | None = None, batch_sessions: int | None = None,
                    batch_nodes: int | None = None) -> dict:
    """Attributes of a verify-step or draft span (None values dropped)."""
    return _clean({DDTREE_TREE_SIZE: tree_size, DDTREE_BUDGET: budget, DDTREE_ACCEPTED_LENGTH: accepted_length,
                   DDTREE_TREE_DEPTH: tree_depth, DDTREE_STEP: step, DDTREE_BATCH_SESSIONS: batch_sessions,
                   DDTREE_BATCH_NODES: batch_nodes})


def record_span(tracer: trace.Tracer, name: str, parent: Context | None, start_ns: int, end_ns: int,
                attributes: Mapping[str, object] | None = None, links: Iterable[trace.Link] = ()) -> trace.Span:
    """Emit an already-finished span under `parent` (e.g. one session's share of a batched step,
    timed with time.time_ns() around the step). Returns the ended span."""
    span = tracer.start_span(name, context=parent, attributes=_clean(attributes), links=list(links),
                             start_time=start_ns)
    span.end(end_time=end_ns)
    return span
