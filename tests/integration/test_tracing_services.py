"""One traced request through the real drafter and verifier processes on loopback, and their metrics.

Both services export spans with OTEL_TRACES_EXPORTER=console into their own file
(DDTREE_TRACES_CONSOLE_FILE) and serve Prometheus on `--metrics-listen 127.0.0.1:0`. The test client
opens a span, calls Generate with its traceparent in the metadata and then checks that every span of
the request shares the client's trace id with the right parents:

    client span -> Verifier/Generate (SERVER) -> ddtree.queue, ddtree.prefill, ddtree.verify_step x steps
    ddtree.verify_step -> ddtree.transport.draft (CLIENT) -> ddtree.draft (drafter process)

and that both endpoints' counters moved exactly as the stream says (tokens, steps, acceptance).
"""

from __future__ import annotations

import json
import urllib.request
from datetime import datetime

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client.parser import text_string_to_metric_families

from telemetry import tracing as tr
from tests.integration.harness import Service, channel, drafter_argv, request, verifier_argv, verifier_stub, wait_until

pytestmark = pytest.mark.integration
PROMPT, NEW, BUDGET = [5, 17, 99, 3], 12, 16


@pytest.fixture(scope="module")
def traced(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("spans")
    files = {"drafter": out / "drafter.jsonl", "verifier": out / "verifier.jsonl"}
    procs = []

    def env(name):
        return {"OTEL_TRACES_EXPORTER": "console", tr.CONSOLE_FILE_ENV: str(files[name])}

    try:
        d = Service("drafter", drafter_argv(pair, "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"), env=env("drafter"))
        procs.append(d)
        da = d.wait_for("serving")
        v = Service("verifier", verifier_argv(pair, "127.0.0.1:0", da, "--transport", "grpc", "--metrics-listen",
                                              "127.0.0.1:0"), env=env("verifier"))
        procs.append(v)
        yield {"verifier": v.wait_for("serving"), "files": files,
               "metrics": {"drafter": d.wait_for("metrics_listening"), "verifier": v.wait_for("metrics_listening")}}
    finally:
        for p in procs:
            p.stop()


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def get(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def spans(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def when(span, key) -> datetime:
    return datetime.fromisoformat(span[key].replace("Z", "+00:00"))


def test_one_trace_across_verifier_and_drafter(traced):
    before = {k: scrape(a) for k, a in traced["metrics"].items()}
    provider = TracerProvider()
    with provider.get_tracer("test-client").start_as_current_span("client") as client:
        md = tr.inject_metadata()
        with channel(traced["verifier"]) as ch:
            msgs = list(verifier_stub(ch).Generate(request("traced-1", PROMPT, NEW, BUDGET), metadata=md,
                                                   timeout=120))
    trace_id = f"0x{client.get_span_context().trace_id:032x}"
    tokens = [t for m in msgs for t in m.tokens]
    steps = msgs[1:]
    assert len(tokens) == NEW and steps and all(m.stats.tree_size > 1 for m in steps)  # drafted over the wire

    def collected():
        v, d = spans(traced["files"]["verifier"]), spans(traced["files"]["drafter"])
        done = any(s["name"] == "ddtree.v1.Verifier/Generate" for s in v)
        return (v, d) if done and len([s for s in d if s["name"] == tr.SPAN_DRAFT]) >= len(steps) else None

    v_all, d_spans = wait_until(collected, timeout=30, what="the request's spans in both files")
    v_spans = [s for s in v_all if s["context"]["trace_id"] == trace_id]  # a later test may add other traces
    assert {s["context"]["trace_id"] for s in d_spans} == {trace_id}  # the drafter traced only this request
    ids = {s["context"]["span_id"] for s in v_spans + d_spans} | {f"0x{client.get_span_context().span_id:016x}"}
    assert all(s["parent_id"] in ids for s in v_spans + d_spans)  # connected: every parent is in the trace
    assert {s["resource"]["attributes"]["service.name"] for s in v_spans} == {"ddtree-verifier"}
    assert {s["resource"]["attributes"]["service.name"] for s in d_spans} == {"ddtree-drafter"}

    def named(name, among):
        return [s for s in among if s["name"] == name]

    (server,) = named("ddtree.v1.Verifier/Generate", v_spans)
    assert server["kind"] == "SpanKind.SERVER" and server["parent_id"] == f"0x{client.get_span_context().span_id:016x}"
    sid = server["context"]["span_id"]
    a = server["attributes"]
    assert a[tr.GEN_AI_OPERATION_NAME] == "text_completion" and a[tr.GEN_AI_REQUEST_MODEL] == "target"
    assert a[tr.GEN_AI_CONVERSATION_ID] == "traced-1" and a[tr.GEN_AI_USAGE_INPUT_TOKENS] == len(PROMPT)
    assert a[tr.GEN_AI_USAGE_OUTPUT_TOKENS] == NEW and a["rpc.grpc.status_code"] == 0
    (queue,), (prefill,) = named(tr.SPAN_QUEUE, v_spans), named(tr.SPAN_PREFILL, v_spans)
    assert queue["parent_id"] == sid and prefill["parent_id"] == sid
    assert when(queue, "end_time") <= when(prefill, "end_time")
    assert prefill["attributes"][tr.GEN_AI_USAGE_INPUT_TOKENS] == len(PROMPT)

    step_spans = sorted(named(tr.SPAN_VERIFY_STEP, v_spans), key=lambda s: s["attributes"][tr.DDTREE_STEP])
    assert len(step_spans) == len(steps) and all(s["parent_id"] == sid for s in step_spans)
    for k, (span, msg) in enumerate(zip(step_spans, steps), 1):
        sa = span["attributes"]
        assert sa[tr.DDTREE_STEP] == k and sa[tr.DDTREE_BUDGET] == BUDGET
        assert (sa[tr.DDTREE_TREE_SIZE], sa[tr.DDTREE_ACCEPTED_LENGTH]) == (msg.stats.tree_size,
                                                                              msg.stats.accepted_length)
    assert len(named(tr.SPAN_TRANSPORT, v_spans)) == len(steps)
    transports = {s["parent_id"]: s for s in named(tr.SPAN_TRANSPORT, v_spans)}
    assert set(transports) == {s["context"]["span_id"] for s in step_spans}
    assert all(s["attributes"][tr.DDTREE_TRANSPORT] == "grpc" and s["kind"] == "SpanKind.CLIENT"
               for s in transports.values())

    drafts = named(tr.SPAN_DRAFT, d_spans)
    by_transport = {s["context"]["span_id"]: s for s in transports.values()}
    assert len(drafts) == len(steps) and {s["parent_id"] for s in drafts} == set(by_transport)
    sizes = {s["context"]["span_id"]: s["attributes"][tr.DDTREE_TREE_SIZE] for s in step_spans}
    for dspan in drafts:
        t = by_transport[dspan["parent_id"]]
        assert when(t, "start_time") <= when(dspan, "start_time") <= when(dspan, "end_time") <= when(t, "end_time")
        assert dspan["attributes"][tr.DDTREE_TREE_SIZE] == sizes[t["parent_id"]]
        assert dspan["attributes"][tr.GEN_AI_CONVERSATION_ID] == "traced-1"
        assert dspan["attributes"][tr.DDTREE_BUDGET] == BUDGET

    # --- metrics: what moved during this one request ---------------------------------------------------
    def settled():
        now = {k: scrape(a) for k, a in traced["metrics"].items()}
        idle = get(now["verifier"], "ddtree_running_sessions") == 0 == get(now["drafter"], "ddtree_draft_sessions")
        return now if idle else None

    after = wait_until(settled, what="both services idle")
    vb, va = before["verifier"], after["verifier"]
    db, dd = before["drafter"], after["drafter"]

    def delta(name, samples=(vb, va), **labels):
        return get(samples[1], name, **labels) - get(samples[0], name, **labels)

    accepted = [m.stats.accepted_length for m in steps]
    assert delta("ddtree_requests_total", status="ok") == 1
    assert delta("ddtree_generated_tokens_total") == NEW and delta("ddtree_prompt_tokens_total") == len(PROMPT)
    assert delta("ddtree_time_to_first_token_seconds_count") == 1
    assert delta("ddtree_inter_token_latency_seconds_count") == NEW - 1
    assert delta("ddtree_verify_step_seconds_count") == len(steps)
    assert delta("ddtree_acceptance_length_count") == len(steps) and delta("ddtree_acceptance_length_sum") == sum(
        accepted)
    assert sum(accepted) >= NEW - 1  # every emitted token after the first was committed by a step
    assert delta("ddtree_tree_size_nodes_sum") == sum(m.stats.tree_size for m in steps)
    for d in (1, 2, 3):
        assert delta("ddtree_accepted_depth_total", depth=str(d)) == sum(a > d for a in accepted)
    assert delta("ddtree_draft_depth_total", depth="1") == len(steps)
    assert not any(k[0] == "ddtree_drafter_fallbacks_total" for k in va)
    assert get(va, "ddtree_queue_depth") == 0 and get(va, "ddtree_kv_cache_usage_ratio") == 0
    assert delta("ddtree_draft_requests_total", (db, dd), status="ok") == len(steps)
    assert delta("ddtree_draft_seconds_count", (db, dd)) == len(steps)


def test_refused_request_is_counted_by_status(traced):
    address = traced["metrics"]["verifier"]
    before = get(scrape(address), "ddtree_requests_total", status="invalid_argument")
    with channel(traced["verifier"]) as ch, pytest.raises(grpc.RpcError) as e:
        list(verifier_stub(ch).Generate(request("bad id!", [1], 4, 0), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert get(scrape(address), "ddtree_requests_total", status="invalid_argument") == before + 1


def test_cancelled_request_is_counted_and_frees_the_session(traced):
    address = traced["metrics"]["verifier"]
    before = get(scrape(address), "ddtree_requests_total", status="cancelled")
    with channel(traced["verifier"]) as ch:
        call = verifier_stub(ch).Generate(request("cancel-me", PROMPT, 2000, BUDGET), timeout=60)
        next(call), next(call)
        call.cancel()
    wait_until(lambda: get(scrape(address), "ddtree_requests_total", status="cancelled") == before + 1,
               what="the cancelled request counted")
    wait_until(lambda: get(scrape(address), "ddtree_running_sessions") == 0, what="the session freed")
