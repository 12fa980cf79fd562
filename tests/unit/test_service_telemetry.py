"""Verifier and drafter observability without processes: the `--metrics-listen` serve flag, the step
loop's metrics and spans (Scheduler + TurnTelemetry), the drafter stream's draft spans and counters,
drafter fallbacks by reason, the traceparent on the wire, and GrpcServer's metrics endpoint."""

from __future__ import annotations

import asyncio
import random
import urllib.error
import urllib.request

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from drafter_service.api import DraftRequest
from drafter_service.drafter import Drafter
from drafter_service.server import DrafterServerConfig, DrafterService
from telemetry import tracing as tr
from telemetry.metrics import Metrics, observe_many
from tests.helpers import OracleDrafter
from tests.unit.stream_harness import ServerThread, SlowOrBadDrafter, client_for, feats, steps
from tests.unit.test_scheduler import Collector, ar, settled
from verifier_service.engine import Engine, EngineConfig
from verifier_service.scheduler import Scheduler
from verifier_service.server import VerifierServerConfig
from verifier_service.session import DecodeParams
from verifier_service.turn_telemetry import TurnTelemetry


@pytest.fixture
def mem():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def val(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def fresh() -> Metrics:
    return Metrics(CollectorRegistry())


def hexid(span_id: int) -> str:
    return f"{span_id:016x}"


# --- flags ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("component", ["verifier", "drafter"])
def test_metrics_listen_reaches_the_server_config(component, monkeypatch):
    import importlib

    from gateway.cli import build_parser

    cmd = importlib.import_module(f"gateway.commands.{component}")
    seen = []
    monkeypatch.setattr(cmd, "run_server", lambda serve, cfg, level, name, *more: seen.append((cfg, name)) or 0)
    base = [component, "serve", "--listen", "127.0.0.1:0", "--target", "t"]
    base += ["--drafter-address", "127.0.0.1:1"] if component == "verifier" else ["--drafter", "d"]
    for extra, want in (([], None), (["--metrics-listen", "0.0.0.0:9400"], "0.0.0.0:9400")):
        args = build_parser().parse_args([*base, *extra])
        assert args.func(args) == 0
        cfg, name = seen.pop()
        assert cfg.metrics_listen == want and name == f"ddtree-{component}"  # the default OTEL service name


def test_bad_metrics_listen_is_refused():
    with pytest.raises(ValueError, match="HOST:PORT"):
        VerifierServerConfig("127.0.0.1:0", "t", "grpc", drafter_address="127.0.0.1:1", metrics_listen="9400")
    with pytest.raises(ValueError, match="HOST:PORT"):
        DrafterServerConfig("127.0.0.1:0", "t", "d", metrics_listen="host:port")


# --- cheap recording paths ----------------------------------------------------------------------------
def test_record_steps_equals_one_record_step_per_session():
    rng = random.Random(0)
    shares = []
    for _ in range(200):
        size = rng.randint(1, 40)
        depth = rng.randint(0, min(size - 1, 9))
        shares.append((size, depth, rng.randint(0, depth)))
    one, batched = Metrics(CollectorRegistry(), max_depth=6), Metrics(CollectorRegistry(), max_depth=6)
    for s in shares:
        one.record_step(*s)
    for k in range(0, len(shares), 7):  # steps of 7 sessions
        batched.record_steps(shares[k : k + 7])
    def samples(m):
        return {(s.name, tuple(s.labels.items())): s.value for f in m.registry.collect() for s in f.samples
                if not s.name.endswith("_created")}

    got, want = samples(batched), samples(one)
    assert got == want and any(k[0] == "ddtree_accepted_depth_total" for k in got)
    with pytest.raises(ValueError, match="inconsistent step"):
        batched.record_steps([(4, 2, 1), (3, 3, 0)])


@pytest.mark.parametrize("value", [0.0, 0.001, 0.0042, 0.01, 0.3, 7.0])
def test_observe_many_equals_repeated_observe(value):
    def hist():
        return Histogram("h", "h", buckets=(0.001, 0.005, 0.01, 0.5), registry=CollectorRegistry())

    def samples(h):
        return [(s.name, s.labels, pytest.approx(s.value)) for f in h.collect() for s in f.samples
                if not s.name.endswith("_created")]

    fast, public, ref = hist(), hist(), hist()
    for _ in range(5):
        ref.observe(value)
    observe_many(fast, value, 5)

    class PublicOnly:  # a prometheus_client without the internals relied on: the public API is used
        observe = public.observe

    observe_many(PublicOnly(), value, 5)
    assert samples(fast) == samples(ref) == samples(public)


# --- verifier: scheduler + TurnTelemetry ------------------------------------------------------------------
def test_scheduler_records_step_metrics_and_per_session_spans(tiny_target64, mem):
    tracer, exporter = mem
    prompts = {"traced": [5, 17, 99, 3], "plain": [42, 7]}
    refs = dict(zip(prompts, ar(tiny_target64, list(prompts.values()), 20)))
    oracle = OracleDrafter({k: p + refs[k] for k, p in prompts.items()}, tiny_target64.cfg.vocab_size, 8, seed=1)
    m = fresh()
    eng = Engine(tiny_target64, oracle, (), EngineConfig(page_size=8, num_pages=64, max_sessions=4))
    s = Scheduler(eng, None, TurnTelemetry(m, tracer, transport="inprocess"))
    s.start()
    try:
        with tracer.start_as_current_span("request") as req:
            ctx = trace.set_span_in_context(req)
        sinks = {k: Collector() for k in prompts}
        for k, p in prompts.items():
            s.open(k, p, DecodeParams(max_new_tokens=20, budget=16, topk=4), False, sinks[k],
                   trace=ctx if k == "traced" else None)
        events = {k: c.finish()[1] for k, c in sinks.items()}
        assert settled(s, 64)
    finally:
        s.close()
    step_events = [e for evs in events.values() for e in evs[1:]]
    accepted = [e.accepted_length for e in step_events]
    assert val(m, "ddtree_acceptance_length_count") == len(step_events)
    assert val(m, "ddtree_acceptance_length_sum") == sum(accepted) and max(accepted) > 2
    assert val(m, "ddtree_tree_size_nodes_sum") == sum(e.tree_size for e in step_events)
    for d in range(1, 5):
        assert val(m, "ddtree_accepted_depth_total", depth=str(d)) == sum(a > d for a in accepted)
    assert val(m, "ddtree_draft_depth_total", depth="1") == len(step_events)
    n_steps = val(m, "ddtree_verify_step_seconds_count")
    assert max(len(evs) - 1 for evs in events.values()) <= n_steps <= len(step_events)
    assert val(m, "ddtree_queue_depth") == 0 and val(m, "ddtree_running_sessions") == 0
    assert val(m, "ddtree_kv_cache_usage_ratio") == 0

    spans = exporter.get_finished_spans()
    tid, rid = req.get_span_context().trace_id, req.get_span_context().span_id
    assert {sp.context.trace_id for sp in spans} == {tid}  # the untraced turn made no spans
    by = {n: [sp for sp in spans if sp.name == n] for n in (tr.SPAN_QUEUE, tr.SPAN_PREFILL, tr.SPAN_VERIFY_STEP,
                                                           tr.SPAN_TRANSPORT, "request")}
    assert len(by[tr.SPAN_QUEUE]) == len(by[tr.SPAN_PREFILL]) == 1
    assert all(sp.parent.span_id == rid for n in (tr.SPAN_QUEUE, tr.SPAN_PREFILL, tr.SPAN_VERIFY_STEP) for sp in by[n])
    assert by[tr.SPAN_PREFILL][0].attributes[tr.GEN_AI_USAGE_INPUT_TOKENS] == 4
    traced_steps = events["traced"][1:]
    step_spans = sorted(by[tr.SPAN_VERIFY_STEP], key=lambda sp: sp.attributes[tr.DDTREE_STEP])
    assert [(sp.attributes[tr.DDTREE_TREE_SIZE], sp.attributes[tr.DDTREE_ACCEPTED_LENGTH]) for sp in step_spans] == [
        (e.tree_size, e.accepted_length) for e in traced_steps]
    assert all(sp.attributes[tr.DDTREE_BUDGET] == 16 and sp.start_time < sp.end_time for sp in step_spans)
    transports = by[tr.SPAN_TRANSPORT]
    assert sorted(sp.parent.span_id for sp in transports) == sorted(sp.context.span_id for sp in step_spans)
    assert all(sp.attributes[tr.DDTREE_TRANSPORT] == "inprocess" for sp in transports)
    # each traced draft request carried its step's transport span as parent; untraced ones carry nothing
    sent = {r.traceparent.split("-")[2] for r in oracle.requests if r.session_id == "traced"}
    assert sent == {hexid(sp.context.span_id) for sp in transports}
    assert all(r.traceparent == "" for r in oracle.requests if r.session_id == "plain")
    assert all(sess.traceparent == "" for sess in eng.sessions.values())


# --- drafter stream and the stream client ---------------------------------------------------------
def test_draft_stream_spans_counters_and_client_fallbacks(parts, mem):
    tracer, exporter = mem
    dm, cm = fresh(), fresh()
    model, embed, head = parts
    service = DrafterService(max_sessions=8, window=64, metrics=dm, tracer=tracer)
    service.attach(SlowOrBadDrafter(model, embed, head, max_sessions=8, window=64), "tiny", embed.shape[1])
    srv = ServerThread(service)
    client = client_for(srv.port, colocated=False, draft_timeout_s=0.3)
    client.metrics = cm
    try:
        with tracer.start_as_current_span("request") as req:
            tp = tr.traceparent()
        reqs = steps(("a", "bad", "c"))[0]
        reqs[0].traceparent = tp
        got = client.draft(reqs)
        (span,) = [sp for sp in exporter.get_finished_spans() if sp.name == tr.SPAN_DRAFT]  # only "a" is traced
        assert span.parent.span_id == req.get_span_context().span_id
        assert span.context.trace_id == req.get_span_context().trace_id
        assert dict(span.attributes) == {tr.DDTREE_TREE_SIZE: got.n_nodes[0], tr.DDTREE_BUDGET: 16,
                                         tr.DDTREE_BATCH_SESSIONS: 3, tr.GEN_AI_CONVERSATION_ID: "a"}
        assert val(dm, "ddtree_draft_requests_total", status="ok") == 3 and val(dm, "ddtree_draft_seconds_count") == 1
        assert val(dm, "ddtree_draft_sessions") == 3 == service.active_sessions()
        # "bad" came back corrupt: counted when the step's verdicts are read (as the scheduler does after a step)
        assert val(cm, "ddtree_drafter_fallbacks_total", reason="invalid_tree") == 0
        assert list(client.take_errors()) == ["bad"]
        assert val(cm, "ddtree_drafter_fallbacks_total", reason="invalid_tree") == 1

        refused = [DraftRequest("x", 0, feats(5, 1, F=7), 18, 5, 16, 4)]  # wrong feature width
        assert client.draft(refused).n_nodes == [1]
        assert val(dm, "ddtree_draft_requests_total", status="invalid_argument") == 1
        assert val(cm, "ddtree_drafter_fallbacks_total", reason="not_ready") == 1

        service.drafter.delay = 0.8
        client.draft(steps(("t1", "t2"))[0])
        assert val(cm, "ddtree_drafter_fallbacks_total", reason="timeout") == 2
        service.drafter.delay = 0.0
    finally:
        client.close()
        srv.stop()


@pytest.mark.parametrize("graphs", [True, False])
def test_draft_graph_runs_are_exported_at_scrape_time(parts, graphs):
    """`ddtree_draft_graph_runs_total{kind}` is the drafter's graph runner's own count of how its steps ran (on the
    CPU: padded-eager runs, the GPU's replays), read at each scrape; nothing without a runner."""
    dm = fresh()
    model, embed, head = parts
    drafter = Drafter(model, embed, head, max_sessions=8, window=64, cuda_graphs=graphs)
    service = DrafterService(max_sessions=8, window=64, metrics=dm)
    service.attach(drafter, "tiny", embed.shape[1])
    for reqs in steps(("a", "b"))[:2]:
        drafter.draft(reqs)
    if not graphs:
        assert drafter.graphs is None and "kind=" not in generate_latest(dm.registry).decode()
        return
    stats = dict(drafter.graphs.stats)
    assert stats["padded_eager"] == 2 and stats["context_padded_eager"] >= 2, stats
    assert all(val(dm, "ddtree_draft_graph_runs_total", kind=k) == n for k, n in stats.items())
    drafter.draft(steps(("a", "b"))[2])
    assert val(dm, "ddtree_draft_graph_runs_total", kind="padded_eager") == 3  # read again, not a copy


def test_traceparent_travels_in_the_draft_request():
    from protos.codec import draft_request_from_pb, draft_request_to_pb

    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    r = DraftRequest("s", 3, torch.zeros(2, 4), 7, 5, 16, 4, tp)
    msg = draft_request_to_pb(r)
    assert msg.traceparent == tp and draft_request_from_pb(msg).traceparent == tp
    assert draft_request_from_pb(draft_request_to_pb(DraftRequest("s", 3, torch.zeros(2, 4), 7, 5, 16, 4))
                                 ).traceparent == ""


# --- the metrics endpoint of a server ------------------------------------------------------------------
def test_grpc_server_serves_metrics_until_drained(capsys):
    from protos.serving import GrpcServer

    async def scenario():
        server = GrpcServer("127.0.0.1:0", [], 1 << 20, 0.0, metrics_listen="127.0.0.1:0")
        await server.start()
        url = f"http://127.0.0.1:{server.metrics_server.port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        await server.drain()
        return url, body

    url, body = asyncio.run(scenario())
    assert "ddtree_requests_total" in body or "# TYPE ddtree_requests counter" in body
    assert '"event": "metrics_listening"' in capsys.readouterr().out
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)
