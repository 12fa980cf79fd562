"""One trace per request through the real gateway, verifier and drafter processes on loopback.

The three services run as `ddtree ... serve` processes (the tiny random pair, co-located transport as
`ddtree serve` starts them), each exporting spans with OTEL_TRACES_EXPORTER=console into its own file
(DDTREE_TRACES_CONSOLE_FILE). A client sends a request with a W3C traceparent of its own (random ids,
sampled), in gRPC metadata (a two-turn session) or as an HTTP header (/v1/completions). All spans of
the request must share the client's trace id and hang together like this:

    client -> "text_completion target" (gateway, SERVER) -> ddtree.queue (gateway admission)
                                                         -> ddtree.v1.Verifier/Generate (SERVER)
    Verifier/Generate -> ddtree.queue, ddtree.prefill, ddtree.verify_step x steps
    ddtree.verify_step -> ddtree.transport.draft (CLIENT) -> ddtree.draft (drafter process)

with GenAI attributes whose token counts equal the response's usage. The gateway's `--metrics-listen`
endpoint (served by GrpcServer) must show the same process registry as its HTTP /metrics.
"""

from __future__ import annotations

import collections
import json
import random
import urllib.request
from dataclasses import dataclass
from datetime import datetime

import grpc
import pytest

from protos.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from telemetry import tracing as tr
from tests.integration.gateway_stack import gateway_argv
from tests.integration.harness import Service, drafter_argv, verifier_argv, wait_until

pytestmark = pytest.mark.integration
PROMPT, TURN2, NEW, BUDGET = [5, 17, 99, 3], [7, 8, 9], 12, 16
SERVICES = ("gateway", "verifier", "drafter")


@pytest.fixture(scope="module")
def stack(pair, tmp_path_factory):
    yield from services(pair, tmp_path_factory)


@pytest.fixture(scope="module")
def usual_stack(pair, tmp_path_factory):
    """The same services, the verifier asking the drafter after each host read (`--draft-ahead off`)."""
    yield from services(pair, tmp_path_factory, "--draft-ahead", "off")


def services(pair, tmp_path_factory, *verifier_flags: str):
    out = tmp_path_factory.mktemp("e2e-spans")
    files = {name: out / f"{name}.jsonl" for name in SERVICES}
    # hermetic: whatever OTEL_* the caller's shell has, each process writes every span to its own file
    base = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "", "OTEL_SERVICE_NAME": "",
            "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    env = {name: {**base, tr.CONSOLE_FILE_ENV: str(files[name])} for name in SERVICES}
    procs: list[Service] = []
    try:
        d = Service("drafter", drafter_argv(pair, "127.0.0.1:0"), env=env["drafter"])
        procs.append(d)
        v = Service("verifier", verifier_argv(pair, "127.0.0.1:0", d.wait_for("listening"), *verifier_flags),
                    env=env["verifier"])
        procs.append(v)
        g = Service("gateway", gateway_argv(v.wait_for("listening"), pair[0], "--metrics-listen", "127.0.0.1:0"),
                    env=env["gateway"])
        procs.append(g)
        d.wait_for("serving")
        v.wait_for("serving")
        yield {"grpc": g.wait_for("serving"), "http": g.seen["http_listening"]["address"],
               "metrics": g.seen["metrics_listening"]["address"], "files": files}
    finally:
        for p in reversed(procs):  # gateway first, so it drains before the verifier goes
            p.stop()


# --- spans ------------------------------------------------------------------------------------------------
def hexid(n: int, width: int = 16) -> str:
    return f"0x{n:0{width}x}"


def load(files) -> dict[str, list[dict]]:
    """service -> every span its file holds so far (one JSON object a line)."""
    return {name: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.exists() else [] for name, path in files.items()}


def when(span: dict, key: str) -> datetime:
    return datetime.fromisoformat(span[key].replace("Z", "+00:00"))


def named(spans: list[dict], name: str) -> list[dict]:
    return [s for s in spans if s["name"] == name]


@dataclass(frozen=True)
class Client:
    """The caller's span, as a W3C traceparent (no SDK on this side: the test ignores its OTEL_* env)."""

    trace_id: str  # "0x" + 32 hex digits, as the span files write it
    span_id: str  # "0x" + 16 hex digits

    @classmethod
    def new(cls) -> Client:
        return cls(hexid(random.getrandbits(128) or 1, 32), hexid(random.getrandbits(64) or 1))

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id[2:]}-{self.span_id[2:]}-01"  # version 00, flags 01 = sampled


@dataclass
class Expect:
    """What the response says about one request: the spans must say the same."""

    prompt_tokens: int  # gen_ai.usage.input_tokens of the gateway span (the whole context)
    completion_tokens: int
    sent_tokens: int  # tokens the gateway sent the verifier (a continued turn: the new ones only)
    n_steps: int
    steps: list[tuple[int, int]] | None = None  # (tree_size, accepted_length) per verify step, if streamed
    conversation_id: str | None = None  # the gateway session, for session turns
    prefilled: int | None = None  # tokens the verifier prefilled (StepInfo.prefill_tokens); None = sent_tokens


def check_trace(files, client: Client, want: Expect) -> dict[str, dict]:
    """Assert the whole trace of one request sent with `client.traceparent`; returns its two server spans."""
    trace_id, client_id = client.trace_id, client.span_id
    server_name, gw_name = "ddtree.v1.Verifier/Generate", "text_completion target"

    def collected():
        by = {k: [s for s in v if s["context"]["trace_id"] == trace_id] for k, v in load(files).items()}
        done = (named(by["gateway"], gw_name) and named(by["verifier"], server_name)
                and len(named(by["drafter"], tr.SPAN_DRAFT)) >= want.n_steps)
        return by if done else None

    by = wait_until(collected, timeout=30, what=f"the spans of trace {trace_id} in all three files")
    g, v, d = by["gateway"], by["verifier"], by["drafter"]
    for name, spans in by.items():
        assert {s["resource"]["attributes"]["service.name"] for s in spans} == {f"ddtree-{name}"}
    ids = {s["context"]["span_id"] for s in g + v + d} | {client_id}
    assert all(s["parent_id"] in ids for s in g + v + d)  # one connected trace under the client's span
    n = want.n_steps
    assert collections.Counter(s["name"] for s in g) == {gw_name: 1, tr.SPAN_QUEUE: 1}
    assert collections.Counter(s["name"] for s in v) == {server_name: 1, tr.SPAN_QUEUE: 1, tr.SPAN_PREFILL: 1,
                                                         tr.SPAN_VERIFY_STEP: n, tr.SPAN_TRANSPORT: n}
    assert collections.Counter(s["name"] for s in d) == {tr.SPAN_DRAFT: n}

    # gateway: its SERVER span under the client's, admission queueing under it
    (gw,), (gq,) = named(g, gw_name), named(g, tr.SPAN_QUEUE)
    gid = gw["context"]["span_id"]
    assert gw["kind"] == "SpanKind.SERVER" and gw["parent_id"] == client_id and gq["parent_id"] == gid
    assert when(gw, "start_time") <= when(gq, "start_time") <= when(gq, "end_time") <= when(gw, "end_time")
    a = gw["attributes"]
    assert a[tr.GEN_AI_OPERATION_NAME] == "text_completion" and a[tr.GEN_AI_REQUEST_MODEL] == "target"
    assert (a[tr.GEN_AI_USAGE_INPUT_TOKENS], a[tr.GEN_AI_USAGE_OUTPUT_TOKENS]) == (want.prompt_tokens,
                                                                                  want.completion_tokens)
    assert a.get(tr.GEN_AI_CONVERSATION_ID) == want.conversation_id
    assert a[tr.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"] and a[tr.GEN_AI_REQUEST_MAX_TOKENS] == NEW
    assert a[tr.DDTREE_BUDGET] == BUDGET and gw["status"]["status_code"] == "UNSET"

    # verifier: its SERVER span under the gateway's (metadata of the gateway's call), the turn's spans under it
    (server,) = named(v, server_name)
    sid = server["context"]["span_id"]
    assert server["kind"] == "SpanKind.SERVER" and server["parent_id"] == gid
    assert when(gq, "end_time") <= when(server, "start_time")  # the gateway called after admission
    sa = server["attributes"]
    assert sa[tr.GEN_AI_OPERATION_NAME] == "text_completion" and sa[tr.GEN_AI_REQUEST_MODEL] == "target"
    assert (sa[tr.GEN_AI_USAGE_INPUT_TOKENS], sa[tr.GEN_AI_USAGE_OUTPUT_TOKENS]) == (want.sent_tokens,
                                                                                    want.completion_tokens)
    assert sa["rpc.grpc.status_code"] == 0 and sa[tr.GEN_AI_CONVERSATION_ID]  # the verifier session's id
    (vq,), (prefill,) = named(v, tr.SPAN_QUEUE), named(v, tr.SPAN_PREFILL)
    assert vq["parent_id"] == sid == prefill["parent_id"] and when(vq, "end_time") <= when(prefill, "end_time")
    prefilled = want.sent_tokens if want.prefilled is None else want.prefilled
    assert prefill["attributes"][tr.GEN_AI_USAGE_INPUT_TOKENS] == prefilled
    steps = sorted(named(v, tr.SPAN_VERIFY_STEP), key=lambda s: s["attributes"][tr.DDTREE_STEP])
    assert all(s["parent_id"] == sid for s in steps)
    numbers = [s["attributes"][tr.DDTREE_STEP] for s in steps]  # a session counts its steps across turns
    assert numbers == list(range(numbers[0], numbers[0] + n))
    got = [(s["attributes"][tr.DDTREE_TREE_SIZE], s["attributes"][tr.DDTREE_ACCEPTED_LENGTH]) for s in steps]
    assert all(size > 1 for size, _ in got) and all(s["attributes"][tr.DDTREE_BUDGET] == BUDGET for s in steps)
    if want.steps is not None:
        assert got == want.steps
    accepted = [acc for _, acc in got]  # the prefill gives the first token, each step commits up to its length
    assert sum(accepted[:-1]) < want.completion_tokens - 1 <= sum(accepted)

    # transport under each step, and the drafter's draft under each transport span (inside its time)
    transports = {s["parent_id"]: s for s in named(v, tr.SPAN_TRANSPORT)}
    assert set(transports) == {s["context"]["span_id"] for s in steps}
    assert all(t["kind"] == "SpanKind.CLIENT" and t["attributes"][tr.DDTREE_TRANSPORT] == "colocated"
               for t in transports.values())
    by_transport = {t["context"]["span_id"]: t for t in transports.values()}
    size_of = {s["context"]["span_id"]: s["attributes"][tr.DDTREE_TREE_SIZE] for s in steps}
    drafts = named(d, tr.SPAN_DRAFT)
    assert sorted(s["parent_id"] for s in drafts) == sorted(by_transport)
    for ds in drafts:
        t = by_transport[ds["parent_id"]]
        assert when(t, "start_time") <= when(ds, "start_time") <= when(ds, "end_time") <= when(t, "end_time")
        assert ds["attributes"][tr.DDTREE_TREE_SIZE] == size_of[t["parent_id"]]
        assert ds["attributes"][tr.GEN_AI_CONVERSATION_ID] == sa[tr.GEN_AI_CONVERSATION_ID]
    return {"gateway": gw, "verifier": server}


# --- requests -----------------------------------------------------------------------------------------------
def sampling() -> gateway_pb2.SamplingOptions:
    return gateway_pb2.SamplingOptions(max_tokens=NEW, temperature=0, ignore_eos=True, draft_budget=BUDGET)


def http_json(url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw, ctype = r.read(), r.headers.get("Content-Type", "")
        return r.status, json.loads(raw) if "json" in ctype else raw.decode()


@pytest.mark.parametrize("stack_name", ["stack", "usual_stack"])
def test_grpc_session_turns_are_one_trace_each(request, stack_name):
    """The spans of each turn of a session, drafting ahead (the default: a step's spans start when its draft was asked
    for, the drafter's under them; the draft queued after a turn's last step leaves no span) and not."""
    stack = request.getfixturevalue(stack_name)
    with grpc.insecure_channel(stack["grpc"]) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        create = Client.new()
        session = stub.CreateSession(gateway_pb2.CreateSessionRequest(), timeout=30,
                                     metadata=[("traceparent", create.traceparent)])
        turns = []
        for tokens in (PROMPT, TURN2):
            client = Client.new()
            req = gateway_pb2.GenerationRequest(token_ids=gateway_pb2.TokenIds(ids=tokens), sampling=sampling(),
                                                session_id=session.session_id)
            turns.append((client, list(stub.Generate(req, metadata=[("traceparent", client.traceparent)],
                                                     timeout=120))))
        stub.CloseSession(gateway_pb2.CloseSessionRequest(session_id=session.session_id), timeout=30)

    servers = []
    for client, chunks in turns:
        u = chunks[-1].usage
        steps = [(c.step.tree_size, c.step.accepted_length) for c in chunks if c.step.tree_size > 0]
        assert u.completion_tokens == NEW == sum(len(c.token_ids) for c in chunks) and u.steps == len(steps)
        servers.append(check_trace(stack["files"], client, Expect(
            u.prompt_tokens, u.completion_tokens, u.prompt_tokens - u.cached_tokens - (1 if u.cached_tokens else 0),
            len(steps), steps,
            session.session_id, sum(c.step.prefill_tokens for c in chunks))))
    first, second = (t[-1].usage for _, t in turns)
    assert (first.prompt_tokens, first.cached_tokens) == (len(PROMPT), 0)
    assert second.prompt_tokens == len(PROMPT) + NEW + len(TURN2)
    assert second.cached_tokens == len(PROMPT) + NEW - 1  # KV reused; the last reply token is prefilled again
    conv = [s["verifier"]["attributes"][tr.GEN_AI_CONVERSATION_ID] for s in servers]
    assert conv[0] == conv[1]  # the second turn continued the same verifier session

    # the other gateway RPCs get the interceptor's SERVER span; Generate only the GenAI one
    spans = load(stack["files"])
    (cs,) = [s for s in spans["gateway"] if s["context"]["trace_id"] == create.trace_id]
    assert cs["name"] == "ddtree.v1.Gateway/CreateSession" and cs["kind"] == "SpanKind.SERVER"
    assert cs["parent_id"] == create.span_id and cs["attributes"]["rpc.grpc.status_code"] == 0
    assert not [s for s in spans["verifier"] + spans["drafter"] if s["context"]["trace_id"] == create.trace_id]
    assert not named(spans["gateway"], "ddtree.v1.Gateway/Generate")


@pytest.mark.parametrize("stack_name", ["stack", "usual_stack"])
def test_http_completion_is_one_trace(request, stack_name):
    stack = request.getfixturevalue(stack_name)
    body = {"model": "target", "prompt": "tracing, end to end", "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "draft_budget": BUDGET}
    client = Client.new()
    status, resp = http_json(f"http://{stack['http']}/v1/completions", body, {"traceparent": client.traceparent})
    assert status == 200 and resp["choices"][0]["finish_reason"] == "length"
    u = resp["usage"]
    assert u["completion_tokens"] == NEW and u["prompt_tokens_details"]["cached_tokens"] == 0
    check_trace(stack["files"], client, Expect(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens"],
                                               u["ddtree"]["steps"]))


def scrape(url: str) -> dict[str, float]:
    _, text = http_json(url)
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("ddtree_"))}


def test_metrics_listen_serves_the_gateway_registry(stack):
    separate, on_http = f"http://{stack['metrics']}/metrics", f"http://{stack['http']}/metrics"
    ok, generated = 'ddtree_requests_total{status="ok"}', "ddtree_generated_tokens_total"
    before = scrape(separate)
    with grpc.insecure_channel(stack["grpc"]) as ch:
        req = gateway_pb2.GenerationRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT), sampling=sampling())
        chunks = list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120))  # untraced: no traceparent
    assert sum(len(c.token_ids) for c in chunks) == NEW

    def counted():
        now = scrape(separate)
        return now if now.get(ok, 0) == before.get(ok, 0) + 1 else None

    after = wait_until(counted, what="the request counted on --metrics-listen")
    assert after[generated] - before.get(generated, 0) == NEW
    both = scrape(on_http)
    assert (both[ok], both[generated]) == (after[ok], after[generated])  # one registry behind both endpoints
