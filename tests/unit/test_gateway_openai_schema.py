"""OpenAI request bodies -> TurnRequest (gateway.openai_schema): defaults as OpenAI documents them, vLLM-style
extensions, 400s naming the field, and the response / chunk objects."""

from __future__ import annotations

import pytest

from gateway.core import TurnUsage
from gateway.errors import GatewayError
from gateway.openai_schema import ResponseBuilder, chat_request, completion_request, stream_flags


def test_completion_defaults_follow_openai():
    r = completion_request({"model": "m", "prompt": "hi"})
    assert r.input.text == "hi" and r.input.add_special_tokens and r.model == "m" and r.operation == "text_completion"
    assert (r.params.max_tokens, r.params.temperature) == (16, 1.0)  # OpenAI's defaults
    r = completion_request({"prompt": [[1, 2]], "max_tokens": 5, "temperature": 0, "top_k": -1, "stop": "x",
                            "stop_token_ids": [3], "ignore_eos": True, "draft_budget": 0, "seed": 9})
    p = r.params
    assert r.input.token_ids == (1, 2) and r.input.ids_field == "prompt"
    assert (p.max_tokens, p.temperature, p.top_k, p.stop, p.stop_token_ids, p.ignore_eos, p.draft_budget, p.seed) == \
        (5, 0.0, 0, ("x",), (3,), True, 0, 9)


def test_chat_messages_and_text_parts():
    r = chat_request({"messages": [{"role": "system", "content": None},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
                      "max_completion_tokens": 7})
    assert [(m.role, m.content) for m in r.input.messages] == [("system", ""), ("user", "ab")]
    assert r.params.max_tokens == 7 and r.operation == "chat"
    assert chat_request({"messages": [{"role": "user", "content": "x"}]}).params.max_tokens is None


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"), ({"prompt": "x", "max_tokens": "9"}, "max_tokens"),
    ({"prompt": "x", "temperature": True}, "temperature"), ({"prompt": "x", "stop": ["a", 1]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [1.5]}, "stop_token_ids"), ({"prompt": "x", "seed": 1.0}, "seed"),
    ({"prompt": "x", "model": 3}, "model"), ({"prompt": "x", "suffix": "s"}, "suffix"),
])
def test_completion_errors_name_the_param(body, param):
    with pytest.raises(GatewayError) as e:
        completion_request(body)
    assert (e.value.code, e.value.param, e.value.http_status) == ("INVALID_ARGUMENT", param, 400)
    assert e.value.openai_body()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({}, "messages"), ({"messages": []}, "messages"), ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_chat_errors_name_the_param(body, param):
    with pytest.raises(GatewayError) as e:
        chat_request(body)
    assert e.value.param == param


def test_stream_flags():
    assert stream_flags({}) == (False, False)
    assert stream_flags({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    assert stream_flags({"stream_options": {"include_usage": True}}) == (False, False)
    with pytest.raises(GatewayError, match="stream_options.include_usage"):
        stream_flags({"stream": True, "stream_options": {"include_usage": "yes"}})


def test_response_objects():
    u = TurnUsage(4, 3, 1, 2, 1.5, 42, "stop", matched_stop="\n")
    chat = ResponseBuilder(True, "m")
    full = chat.full("hey", u)
    assert full["object"] == "chat.completion" and full["choices"][0]["message"] == {"role": "assistant",
                                                                                    "content": "hey"}
    assert full["usage"]["total_tokens"] == 7 and full["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    assert full["usage"]["ddtree"] == {"seed": 42, "steps": 2, "mean_accepted_length": 1.5, "matched_stop": "\n"}
    first = chat.delta("", None, True, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    assert chat.delta("", "stop", False)["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                           "finish_reason": "stop"}
    assert chat.usage_chunk(u)["choices"] == [] and chat.usage_chunk(u)["id"] == full["id"]
    comp = ResponseBuilder(False, "m")
    assert comp.delta("a", None, False)["object"] == "text_completion"
    assert comp.full("a", u)["choices"][0]["text"] == "a"


@pytest.mark.parametrize("code, status, kind", [
    ("INVALID_ARGUMENT", 400, "invalid_request_error"), ("UNAUTHENTICATED", 401, "authentication_error"),
    ("NOT_FOUND", 404, "not_found_error"), ("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
    ("UNAVAILABLE", 503, "server_error"), ("INTERNAL", 500, "server_error"),
])
def test_error_mapping(code, status, kind):
    e = GatewayError(code, "m", "p")
    assert e.http_status == status and e.openai_body() == {"error": {"message": "m", "type": kind, "param": "p",
                                                                     "code": code.lower()}}
