"""The gateway's OpenAI-compatible HTTP API, driven by the official `openai` client, against real drafter,
verifier and gateway processes on loopback.

Greedy and seeded outputs equal the in-process engine; SSE streaming with `stream_options.include_usage`
ends with a usage chunk and [DONE]; a client that disconnects mid-stream frees the KV; errors are
OpenAI-shaped with 400 / 401 / 404 / 429 / 503; /health, /metrics and /v1/models answer.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest

from gateway.chat import KIMI_TEMPLATE, ChatTemplate, Message
from gateway.text_tokenizer import decode, load_text_tokenizer
from tests.integration.gateway_stack import Gateway, gateway_argv, sampled_reference, start_stack
from tests.integration.harness import Service, free_port, wait_until

pytestmark = pytest.mark.integration
PROMPT = [200, 1, 2, 3, 4, 5, 6, 7]
KEY = "http-s3cret"


@pytest.fixture(scope="module")
def stack(pair):
    with start_stack(pair, {"main": (["--metrics-listen", "127.0.0.1:0"], None),
                            "guarded": (["--max-concurrency", "1", "--max-queue", "1"], KEY)}) as s:
        yield s


def oai(gw: Gateway, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{gw.http}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(stack):
    return oai(stack.gateways["main"])


@pytest.fixture(scope="module")
def tok(pair):
    return load_text_tokenizer(pair[0])


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, raw, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
    return status, json.loads(raw) if "json" in ctype else raw.decode()


def test_completions_greedy_equal_the_inprocess_engine(stack, client, reference, tok):
    expected = reference([PROMPT], 20)[0]
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == decode(tok, expected) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (8, 20, 28)
    assert r.object == "text_completion" and r.model == "target"


def test_chat_stream_with_usage_equals_the_non_streamed_answer(stack, client, reference, tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "naïve café 日本"}]
    ctx = tok.encode(ChatTemplate(KIMI_TEMPLATE).render([Message(**m) for m in messages], add_generation_prompt=True))
    expected = decode(tok, reference([ctx], 16)[0])
    kw = {"model": "target", "messages": messages, "max_tokens": 16, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == len(ctx)
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(**kw, stream=True))  # no include_usage: no usage chunk
    assert all(c.choices for c in plain) and "".join(c.choices[0].delta.content or "" for c in plain) == expected


def test_seeded_sampling_equals_the_inprocess_engine(stack, client, reference, tok):
    expected = sampled_reference(reference, PROMPT, 12, 0.7, top_p=0.9, seed=5)
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=0.7, top_p=0.9, seed=5,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == decode(tok, expected)
    assert r.usage.model_extra["ddtree"]["seed"] == 5


def test_stop_string_across_tokens_in_a_stream(stack, client, reference, tok):
    out = reference([PROMPT], 40)[0]
    text = decode(tok, out)
    k = next(i for i in range(2, len(text) - 1) if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i)
    stream = client.completions.create(model="target", prompt=PROMPT, max_tokens=40, temperature=0,
                                       stop=[text[k : k + 2]], stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == text[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"
    stack.wait_idle()


def test_client_disconnect_frees_the_kv(stack, client):
    stream = client.completions.create(model="target", prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    stack.wait_idle("KV freed after the HTTP client went away")


@pytest.mark.parametrize("kw, param", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 2.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2}, "n"), ({"logprobs": 3}, "logprobs"), ({"stop": 5}, "stop"), ({"seed": "x"}, "seed"),
    ({"prompt": {"a": 1}}, "prompt"), ({"prompt": [1, 100000]}, "prompt"), ({"extra_body": {"top_k": -5}}, "top_k"),
])
def test_bad_requests_are_400_naming_the_param(stack, client, kw, param):
    kw = {"model": "target", "prompt": PROMPT, "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw)
    err = e.value.body
    assert (err["param"], err["type"], err["code"]) == (param, "invalid_request_error", "invalid_argument")
    assert param in err["message"]


def test_bad_json_unknown_model_and_route(stack, client):
    base = f"http://{stack.gateways['main'].http}"
    status, body = http("POST", f"{base}/v1/completions", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and "JSON" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "model"
    status, body = http("GET", f"{base}/v1/nothing")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_api_key_401_and_queue_full_429(stack, reference, tok):
    gw = stack.gateways["guarded"]
    for key in ("wrong", KEY + "!"):
        with pytest.raises(openai.AuthenticationError) as e:
            oai(gw, key).models.list()
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    status, body = http("POST", f"http://{gw.http}/v1/completions", b"{}", {"Content-Type": "application/json"})
    assert status == 401 and "missing API key" in body["error"]["message"]
    assert http("GET", f"http://{gw.http}/health")[0] == 200  # probes need no key
    c = oai(gw, KEY)
    running = c.completions.create(model="target", prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    next(iter(running))
    done: dict = {}
    waiter = threading.Thread(target=lambda: done.update(r=c.completions.create(
        model="target", prompt=[5, 6], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})))
    waiter.start()
    wait_until(lambda: "ddtree_queue_depth 1.0" in http("GET", f"http://{gw.http}/metrics")[1], what="one queued")
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="target", prompt=[1], max_tokens=1)
    assert e.value.status_code == 429 and e.value.body["type"] == "rate_limit_error"
    running.close()
    waiter.join(60)
    assert done["r"].choices[0].text == decode(tok, reference([[5, 6]], 4)[0])
    stack.wait_idle()


def test_503_while_the_verifier_is_not_serving(pair):
    port = free_port()  # nothing listens there
    svc = Service("gateway-orphan", gateway_argv(f"127.0.0.1:{port}", pair[0]))
    try:
        svc.wait_for("http_listening")
        base = f"http://{svc.seen['http_listening']['address']}"
        status, body = http("GET", f"{base}/health")
        assert status == 503 and "not serving" in body["reason"]
        with pytest.raises(openai.APIStatusError) as e:
            openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0).completions.create(
                model="target", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "unavailable"
    finally:
        svc.stop()


def test_health_metrics_and_models(stack, client):
    base = f"http://{stack.gateways['main'].http}"
    assert http("GET", f"{base}/health") == (200, {"status": "ok", "model": "target"})
    models = client.models.list()
    assert [m.id for m in models.data] == ["target"] and models.data[0].owned_by == "ddtree"
    client.completions.create(model="target", prompt=PROMPT, max_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="target", prompt=PROMPT, max_tokens=2, top_p=0)
    _, text = http("GET", f"{base}/metrics")
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("ddtree_"))
    assert float(samples['ddtree_requests_total{status="ok"}']) >= 1
    assert float(samples['ddtree_requests_total{status="invalid_argument"}']) >= 1
    assert float(samples["ddtree_time_to_first_token_seconds_count"]) >= 1
    assert float(samples["ddtree_generated_tokens_total"]) > 0
    separate = stack.gateways["main"].service.seen["metrics_listening"]["address"]  # --metrics-listen
    assert 'ddtree_requests_total{status="ok"}' in http("GET", f"http://{separate}/metrics")[1]
