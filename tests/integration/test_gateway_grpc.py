"""The gateway's gRPC API and client SDK against real drafter, verifier and gateway processes on loopback.

Outputs must equal the in-process engine token for token (greedy, and seeded sampling with the same
seed); sessions reuse their KV; cancel, deadline and CloseSession free the KV on the verifier and
the drafter; bad parameters are INVALID_ARGUMENT naming the field; text never carries a broken
character and stop strings that span tokens are caught; API key and admission queue on a second
gateway (`guarded`: key "s3cret", one request at a time, one waiting).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.client import AsyncGatewayClient, GatewayClient, GatewayError
from gateway.text_tokenizer import decode, load_text_tokenizer
from tests.integration.gateway_stack import sampled_reference, start_gateway, start_stack
from tests.integration.harness import REPO, channel, drafter_info, verifier_info, wait_until

pytestmark = pytest.mark.integration
PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7], list(range(60, 72))]
KEY = "s3cret"


@pytest.fixture(scope="module")
def stack(pair):
    with start_stack(pair, {"main": ([], None),
                            "guarded": (["--max-concurrency", "1", "--max-queue", "1"], KEY)}) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with GatewayClient(stack.gateways["main"].grpc) as c:
        yield c


@pytest.fixture(scope="module")
def tok(pair):
    return load_text_tokenizer(pair[0])


@pytest.mark.parametrize("budget", [0, 16])
def test_greedy_equals_inprocess_engine(stack, client, reference, tok, budget):
    new = 24
    for prompt, expected in zip(PROMPTS, reference(PROMPTS, new)):
        r = client.generate(token_ids=prompt, max_tokens=new, ignore_eos=True, draft_budget=budget, timeout=60)
        assert r.token_ids == expected
        assert r.text == decode(tok, expected)
        u = r.usage
        assert (u.prompt_tokens, u.completion_tokens, u.finish_reason, u.seed) == (len(prompt), new, "length", None)
        assert u.steps == len(r.accepted_per_step) and u.mean_accepted_length >= 1.0
    stack.wait_idle()


def test_seeded_sampling_equals_inprocess_engine(stack, client, reference):
    prompt, new = PROMPTS[1], 20
    expected = sampled_reference(reference, prompt, new, 0.9, top_p=0.95, top_k=40, seed=1234)
    r = client.generate(token_ids=prompt, max_tokens=new, ignore_eos=True, temperature=0.9, top_p=0.95, top_k=40,
                        seed=1234, draft_budget=16, timeout=60)
    assert r.token_ids == expected and r.usage.seed == 1234
    drawn = client.generate(token_ids=prompt, max_tokens=new, ignore_eos=True, temperature=0.9, timeout=60)
    assert drawn.usage.seed is not None  # drawn by the gateway and reported: the output is reproducible
    again = client.generate(token_ids=prompt, max_tokens=new, ignore_eos=True, temperature=0.9,
                            seed=drawn.usage.seed, draft_budget=0, timeout=60)
    assert again.token_ids == drawn.token_ids == sampled_reference(reference, prompt, new, 0.9, seed=drawn.usage.seed)


def test_session_turns_reuse_the_verifier_kv(stack, client, reference):
    p1, t2 = PROMPTS[2], [7, 8, 9]
    o1 = reference([p1], 10)[0]
    o2 = reference([p1 + o1 + t2], 12)[0]
    s = client.create_session()
    r1 = client.generate(token_ids=p1, session_id=s.session_id, max_tokens=10, ignore_eos=True, timeout=60)
    assert r1.token_ids == o1 and r1.usage.session_tokens == len(p1 + o1)
    # idle, but its KV is kept (the turn counts as running until the end of the step that streamed its last
    # tokens, which may come just after the client has them)
    info = wait_until(lambda: (i := verifier_info(stack.verifier)).running_sessions == 0 and i, 5, "an idle turn")
    assert info.open_sessions == 1
    with client.stream(token_ids=t2, session_id=s.session_id, max_tokens=12, ignore_eos=True, timeout=60) as st:
        chunks = list(st)
    assert [t for c in chunks for t in c.token_ids] == o2
    assert chunks[0].prefill_tokens == 1 + len(t2)  # only the new tokens (+ the last reply token) were prefilled
    u = chunks[-1].usage
    assert (u.cached_tokens, u.prompt_tokens, u.session_tokens) == (len(p1 + o1) - 1, len(p1 + o1 + t2),
                                                                    len(p1 + o1 + t2 + o2))
    assert client.close_session(s.session_id) is False
    stack.wait_idle()
    with pytest.raises(GatewayError) as e:
        client.generate(token_ids=[1], session_id=s.session_id, timeout=10)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "session_id" in e.value.details


def test_chat_session_continues_the_conversation(stack, client, reference, tok):
    from gateway.chat import KIMI_TEMPLATE, ChatTemplate, Message

    t = ChatTemplate(KIMI_TEMPLATE)  # the tiny folder has no template: the gateway uses Kimi's shape
    u1, u2 = [Message("user", "Hi there")], [Message("user", "More, é")]
    ctx1 = tok.encode(t.render(u1, add_generation_prompt=True))
    o1 = reference([ctx1], 8)[0]
    reply = decode(tok, o1)
    closing, delta = t.continuation([*u1, Message("assistant", reply)], u2)
    ctx2 = ctx1 + o1 + tok.encode(closing + delta)
    o2 = reference([ctx2], 8)[0]
    s = client.create_session()
    as_dicts = [{"role": m.role, "content": m.content} for m in u1]
    r1 = client.generate(messages=as_dicts, session_id=s.session_id, max_tokens=8, ignore_eos=True, timeout=60)
    r2 = client.generate(messages=u2, session_id=s.session_id, max_tokens=8, ignore_eos=True, timeout=60)
    assert (r1.token_ids, r2.token_ids) == (o1, o2)
    assert r2.usage.cached_tokens == len(ctx1 + o1) - 1 and r2.usage.prompt_tokens == len(ctx2)
    client.close_session(s.session_id)
    stack.wait_idle()


def test_cancel_mid_stream_frees_kv_everywhere(stack, client):
    st = client.stream(token_ids=PROMPTS[1], max_tokens=2000, ignore_eos=True, timeout=60)
    it = iter(st)
    for _ in range(3):
        next(it)
    assert verifier_info(stack.verifier).running_sessions == 1
    assert drafter_info(stack.drafter).active_sessions >= 1
    st.cancel()
    stack.wait_idle("KV freed after the client cancelled")
    wait_until(lambda: client.info().running == 0, what="the gateway slot freed")


def test_deadline_is_propagated_and_frees_kv(stack, client):
    with pytest.raises(GatewayError) as e:
        client.generate(token_ids=PROMPTS[0], max_tokens=2000, ignore_eos=True, timeout=1.0)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_idle("KV freed after the deadline")


def test_close_session_cancels_its_running_turn(stack, client):
    s = client.create_session()
    st = client.stream(token_ids=PROMPTS[0], session_id=s.session_id, max_tokens=2000, ignore_eos=True, timeout=60)
    it = iter(st)
    next(it)
    next(it)
    assert client.close_session(s.session_id) is True
    with pytest.raises(GatewayError) as e:
        list(it)
    assert e.value.code == grpc.StatusCode.CANCELLED and "closed" in e.value.details
    stack.wait_idle("KV freed after CloseSession")


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 9000}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": 1e-7}, "temperature"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": 100000}, "top_k"), ({"seed": 2**63}, "seed"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"), ({"stop": [""]}, "stop"), ({"stop": ["x"] * 17}, "stop"),
    ({"draft_budget": 65}, "draft_budget"), ({"draft_topk": 0}, "draft_topk"),
    ({"token_ids": [1, 100000]}, "token_ids"), ({"token_ids": []}, "prompt"), ({"text": ""}, "prompt"),
])
def test_bad_parameters_are_invalid_argument_naming_the_field(stack, client, kw, field):
    source = {} if "token_ids" in kw or "text" in kw else {"token_ids": [1, 2]}
    with pytest.raises(GatewayError) as e:
        client.generate(**source, **kw, timeout=10)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details.startswith(f"{field}:"), e.value.details
    assert verifier_info(stack.verifier).open_sessions == 0


def test_unknown_model_and_session_are_not_found(client):
    for kw, field in (({"model": "other"}, "model"), ({"session_id": "s-nope"}, "session_id")):
        with pytest.raises(GatewayError) as e:
            client.generate(token_ids=[1], timeout=10, **kw)
        assert e.value.code == grpc.StatusCode.NOT_FOUND and field in e.value.details


def test_multibyte_characters_split_across_tokens_stream_whole(stack, client, reference, tok):
    """Byte-level tokens: a 3-byte character arrives over three steps (budget 0: one token per step)."""
    prompts = [[i] for i in range(40, 80)]
    outs = reference(prompts, 64)
    prompt, out = next((p, o) for p, o in zip(prompts, outs)
                       if any(len(c.encode()) >= 3 and c != "\ufffd" for c in decode(tok, o)))
    with client.stream(token_ids=prompt, max_tokens=64, ignore_eos=True, draft_budget=0, timeout=60) as st:
        chunks = list(st)
    assert [t for c in chunks for t in c.token_ids] == out
    assert "".join(c.text for c in chunks) == decode(tok, out)  # the same text as one decode of everything
    assert all(len(c.token_ids) == 1 for c in chunks)
    wide = next(i for i, c in enumerate(chunks) if any(len(ch.encode()) >= 3 and ch != "\ufffd" for ch in c.text))
    assert chunks[wide - 1].text == chunks[wide - 2].text == ""  # its first bytes were held back, not mangled
    # the prompt side: text with multi-byte characters encodes to their bytes
    r = client.generate("é日🙂", max_tokens=1, timeout=30)
    assert r.usage.prompt_tokens == len("é日🙂".encode())


@pytest.mark.parametrize("budget", [0, 16])
def test_stop_string_spanning_tokens(stack, client, reference, tok, budget):
    prompt, out, (stop, k, n) = _stop_case(reference, tok, 40, 3)
    assert len(stop.encode()) >= 3  # byte-level vocabulary: the stop string spans 3+ tokens
    r = client.generate(token_ids=prompt, max_tokens=40, ignore_eos=True, stop=[stop, "never-matches"],
                        draft_budget=budget, timeout=60)
    assert r.text == decode(tok, out)[:k] and r.token_ids == out[:n]
    assert (r.usage.finish_reason, r.usage.matched_stop, r.usage.completion_tokens) == ("stop", stop, n)
    stack.wait_idle("the verifier turn ended by the gateway was freed")


def _first_stop(tok, out: list[int], width: int) -> tuple[str, int, int]:
    """A stop string of `width` characters from this output: (stop, where in the text, tokens to complete it)."""
    text = decode(tok, out)
    k = next(i for i in range(2, len(text) - width + 1) if "\ufffd" not in text[i : i + width]
             and text.find(text[i : i + width]) == i)
    stop = text[k : k + width]
    return stop, k, next(m for m in range(1, len(out) + 1) if stop in decode(tok, out[:m]))


def _stop_case(reference, tok, new: int, width: int):
    """The first candidate prompt whose output has a usable stop string (random outputs are mostly bytes
    that are not valid UTF-8)."""
    for prompt in [*PROMPTS, *([i] for i in range(40, 80))]:
        out = reference([prompt], new)[0]
        try:
            return prompt, out, _first_stop(tok, out, width)
        except StopIteration:
            continue
    raise AssertionError("no candidate output holds a usable stop string")


def test_stop_in_a_session_keeps_history_consistent(stack, client, reference, tok):
    """Turns ended early (stop token: KV kept; stop string: KV dropped) continue from exactly what was returned."""
    p1, t2 = PROMPTS[1], [11, 12]
    out = reference([p1], 30)[0]
    s = client.create_session()
    r1 = client.generate(token_ids=p1, session_id=s.session_id, max_tokens=30, ignore_eos=True,
                         stop_token_ids=[out[6]], timeout=60)
    cut = out[: out.index(out[6]) + 1]
    assert r1.token_ids == cut and r1.usage.matched_stop_token_id == out[6]
    assert verifier_info(stack.verifier).open_sessions == 1  # a stop token ends the turn on the verifier: KV kept
    h2 = p1 + cut + t2
    o2 = reference([h2], 24)[0]
    stop, _, n = _first_stop(tok, o2, 2)
    r2 = client.generate(token_ids=t2, session_id=s.session_id, max_tokens=24, ignore_eos=True, stop=[stop],
                         timeout=60)
    assert r2.token_ids == o2[:n] and r2.usage.cached_tokens == len(p1 + cut) - 1
    wait_until(lambda: verifier_info(stack.verifier).open_sessions == 0, what="the cut verifier session dropped")
    h3 = h2 + o2[:n] + [4]
    r3 = client.generate(token_ids=[4], session_id=s.session_id, max_tokens=5, ignore_eos=True, timeout=60)
    assert r3.token_ids == reference([h3], 5)[0]  # reopened with exactly the history it returned
    assert r3.usage.cached_tokens == 0 and r3.usage.prompt_tokens == len(h3)
    client.close_session(s.session_id)
    stack.wait_idle()


def test_async_client_streams_and_cancels(stack, reference):
    async def main():
        async with AsyncGatewayClient(stack.gateways["main"].grpc) as c:
            r = await c.generate(token_ids=PROMPTS[0], max_tokens=10, ignore_eos=True, timeout=60)
            st = c.stream(token_ids=PROMPTS[1], max_tokens=2000, ignore_eos=True, timeout=60)
            seen = 0
            async for _ in st:
                seen += 1
                if seen == 3:
                    st.cancel()
                    break
            return r, (await c.list_models())[0]

    r, model = asyncio.run(main())
    assert r.token_ids == reference([PROMPTS[0]], 10)[0] and model.id == "target"
    stack.wait_idle()


def test_api_key_is_required_on_the_guarded_gateway(stack):
    addr = stack.gateways["guarded"].grpc
    for key in (None, "wrong", KEY[:-1], KEY + "x"):
        with GatewayClient(addr, api_key=key) as c, pytest.raises(GatewayError) as e:
            c.generate(token_ids=[1], max_tokens=1, timeout=10)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with GatewayClient(addr, api_key=KEY) as c:
        assert c.generate(token_ids=[1], max_tokens=2, timeout=30).usage.completion_tokens == 2
    with channel(addr) as ch:  # probes need no key
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="ddtree.v1.Gateway"), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_full_admission_queue_is_resource_exhausted(stack, reference):
    with GatewayClient(stack.gateways["guarded"].grpc, api_key=KEY) as c:
        running = c.stream(token_ids=PROMPTS[0], max_tokens=2000, ignore_eos=True, timeout=60)
        it = iter(running)
        next(it)
        waiting: dict = {}
        t = threading.Thread(target=lambda: waiting.update(r=c.generate(token_ids=PROMPTS[2], max_tokens=6,
                                                                        ignore_eos=True, timeout=60)))
        t.start()
        wait_until(lambda: c.info().queued == 1, what="the second request queued")
        with pytest.raises(GatewayError) as e:
            c.generate(token_ids=[1], max_tokens=1, timeout=10)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in e.value.details
        running.cancel()
        t.join(60)
        assert waiting["r"].token_ids == reference([PROMPTS[2]], 6)[0]  # it ran once the slot was free
    stack.wait_idle()


def test_health_and_reflection(stack):
    with channel(stack.gateways["main"].grpc) as ch:
        for svc in ("", "ddtree.v1.Gateway"):
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        answers = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        assert "ddtree.v1.Gateway" in {s.name for a in answers for s in a.list_services_response.service}


def test_generate_cli_goes_through_the_gateway(stack, reference):
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "generate", "--server", stack.gateways["main"].grpc,
                          "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "12", "--budget", "16",
                          "--ignore-eos", "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["mode"] == "server" and r["tokens"] == reference([PROMPTS[0]], 12)[0]
    assert r["finish_reason"] == "length" and r["steps"] == len(r["accepted_per_step"])


def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(stack, pair, reference):
    gw = start_gateway("gateway-drain", stack.verifier, pair[0])
    try:
        with GatewayClient(gw.grpc) as c:
            it = iter(c.stream(token_ids=PROMPTS[2], max_tokens=100, ignore_eos=True, draft_budget=0, timeout=60))
            first = next(it)
            gw.service.signal(signal.SIGTERM)
            wait_until(lambda: _health(gw.grpc) != health_pb2.HealthCheckResponse.SERVING, what="NOT_SERVING")
            with pytest.raises(GatewayError) as e:
                c.generate(token_ids=[1], max_tokens=1, timeout=10)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            tokens = first.token_ids + [t for chunk in it for t in chunk.token_ids]
        assert tokens == reference([PROMPTS[2]], 100)[0]  # the running stream finished within the grace period
        assert gw.service.wait_exit(30) == 0 and "stopped" in gw.service.seen
    finally:
        gw.service.stop()
    stack.wait_idle()


def _health(address: str) -> int:
    try:
        with channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="ddtree.v1.Gateway"),
                                                        timeout=2).status
    except grpc.RpcError:
        return -1
