"""OpenAI-compatible request bodies -> `TurnRequest`, and the response / stream-chunk objects back.

Follows the OpenAI API (https://platform.openai.com/docs/api-reference) for /v1/completions and
/v1/chat/completions: `max_tokens` (`max_completion_tokens` for chat), `temperature` (default 1, as
OpenAI), `top_p`, `seed`, `stop` (a string or a list), `stream`, `stream_options.include_usage`,
`n` = 1 only. Extensions, as in vLLM: `top_k`, `stop_token_ids`, `ignore_eos`, plus `draft_budget` and
`draft_topk`. A field of the wrong type, or a feature this server does not implement (n > 1,
logprobs, echo, penalties, tools), is a 400 naming the field. Usage carries OpenAI's
`prompt_tokens_details.cached_tokens` and a `ddtree` object (seed, steps, mean acceptance length).
"""

from __future__ import annotations

import secrets
import time

from gateway.chat import Message
from gateway.core import TurnRequest, TurnUsage
from gateway.errors import invalid
from gateway.params import GenerationParams
from gateway.turns import TurnInput

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API default
OPENAI_DEFAULT_TEMPERATURE = 1.0


def _opt(body: dict, name: str, kinds: tuple, what: str):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise invalid(name, f"must be {what}, got {v!r:.80}")
    return v


def _unsupported(body: dict, name: str, allowed) -> None:
    v = body.get(name)
    if v is not None and v not in allowed:
        raise invalid(name, f"{v!r:.80} is not supported by this server (allowed: {allowed})")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise invalid("stop", f"must be a string or a list of strings, got {v!r:.80}")


def _int_list(body: dict, name: str) -> tuple[int, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise invalid(name, f"must be a list of integers, got {v!r:.80}")
    return tuple(v)


def _params(body: dict, max_tokens_field: str, default_max_tokens: int | None) -> GenerationParams:
    for name, allowed in (("n", (1,)), ("best_of", (1,)), ("echo", (False,)), ("logprobs", (False, 0)),
                          ("top_logprobs", (0,)), ("suffix", ("",)), ("presence_penalty", (0, 0.0)),
                          ("frequency_penalty", (0, 0.0)), ("logit_bias", ({},)), ("tools", ([],))):
        _unsupported(body, name, allowed)
    max_tokens = _opt(body, max_tokens_field, (int,), "an integer")
    if max_tokens is None and max_tokens_field == "max_completion_tokens":
        max_tokens = _opt(body, "max_tokens", (int,), "an integer")
    temperature = _opt(body, "temperature", (int, float), "a number")
    top_k = _opt(body, "top_k", (int,), "an integer")
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    return GenerationParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=float(temperature) if temperature is not None else OPENAI_DEFAULT_TEMPERATURE,
        top_p=_opt(body, "top_p", (int, float), "a number"), top_k=top_k,
        seed=_opt(body, "seed", (int,), "an integer"), stop_token_ids=_int_list(body, "stop_token_ids"),
        stop=_stop(body), ignore_eos=bool(_opt(body, "ignore_eos", (bool,), "a boolean")),
        draft_budget=_opt(body, "draft_budget", (int,), "an integer"),
        draft_topk=_opt(body, "draft_topk", (int,), "an integer"))


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = bool(_opt(body, "stream", (bool,), "a boolean"))
    opts = _opt(body, "stream_options", (dict,), "an object") or {}
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise invalid("stream_options.include_usage", f"must be a boolean, got {include!r:.80}")
    return stream, stream and include


def model_of(body: dict) -> str | None:
    return _opt(body, "model", (str,), "a string")


def completion_request(body: dict) -> TurnRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        inp = TurnInput(text=prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        inp = TurnInput(token_ids=tuple(prompt), ids_field="prompt")
    elif prompt is None:
        raise invalid("prompt", "is required")
    else:
        raise invalid("prompt", "must be a string or a list of token ids (one prompt per request)")
    return TurnRequest(inp, _params(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS), None, model_of(body),
                       "text_completion")


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, p in enumerate(c):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise invalid(f"messages[{i}].content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                                                             "are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise invalid(f"messages[{i}].content", "must be a string or a list of text parts")


def chat_request(body: dict) -> TurnRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise invalid(f"messages[{i}]", "must be an object with a string role")
        out.append(Message(m["role"], _content(m, i)))
    return TurnRequest(TurnInput(messages=tuple(out)), _params(body, "max_completion_tokens", None), None,
                       model_of(body), "chat")


# --- responses -----------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage_json(u: TurnUsage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "ddtree": {"seed": u.seed, "steps": u.steps, "mean_accepted_length": u.mean_accepted_length,
                       "matched_stop": u.matched_stop if u.matched_stop is not None else u.matched_stop_token_id}}


class ResponseBuilder:
    """The objects of one response, streamed or not."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, u: TurnUsage) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": u.stop_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": u.stop_reason}
        return {**self._base(False), "choices": [choice], "usage": usage_json(u)}

    def delta(self, text: str | None, finish_reason: str | None, include_usage: bool, first: bool = False) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        out = {**self._base(True), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, u: TurnUsage) -> dict:
        return {**self._base(True), "choices": [], "usage": usage_json(u)}
