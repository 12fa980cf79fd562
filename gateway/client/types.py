"""Typed results of the gateway client SDK and their conversion from/to the wire (protobuf stays here).

Nothing in `gateway.client` imports torch or the server side: grpcio and the generated stubs only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import grpc

from protos.ddtree.v1 import gateway_pb2

DEFAULT_UNARY_TIMEOUT_S = 30.0  # deadline of the unary calls (sessions, info, models) of both clients
_REASON = {gateway_pb2.STOP_REASON_STOP: "stop", gateway_pb2.STOP_REASON_LENGTH: "length"}


class GatewayError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the server's message (names the field for
    INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.attempts = attempts  # > 1 when an idempotent call was retried

    @classmethod
    def from_rpc(cls, e: grpc.RpcError, attempts: int = 1) -> GatewayError:
        code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
        details = e.details() if callable(getattr(e, "details", None)) else str(e)
        return cls(code, details or "", attempts)


@dataclass(frozen=True)
class Sampling:
    """Sampling and stopping; None = the server's default (greedy, its max_tokens and draft settings)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    draft_budget: int | None = None
    draft_topk: int | None = None

    def to_pb(self) -> gateway_pb2.SamplingOptions:
        msg = gateway_pb2.SamplingOptions(stop_token_ids=list(self.stop_token_ids), stop=list(self.stop),
                                          ignore_eos=self.ignore_eos)
        for f in ("max_tokens", "temperature", "top_p", "top_k", "seed", "draft_budget", "draft_topk"):
            v = getattr(self, f)
            if v is not None:
                setattr(msg, f, v)
        return msg


SAMPLING_FIELDS = frozenset(f.name for f in fields(Sampling))


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of prompt_tokens, already in the verifier's KV cache (a continued session)
    steps: int
    mean_accepted_length: float
    seed: int | None  # the seed used when sampling (reuse it to reproduce the output)
    finish_reason: str  # "stop" | "length"
    matched_stop: str | None
    matched_stop_token_id: int | None
    session_tokens: int


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    text: str
    accepted_length: int  # tokens the step committed (0 for the prefill chunk)
    tree_size: int  # nodes verified incl. the root (1 = autoregressive, 0 = prefill)
    prefill_tokens: int
    session_id: str
    usage: Usage | None  # on the last chunk


@dataclass
class Result:
    text: str
    token_ids: list[int]
    usage: Usage
    session_id: str = ""
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        return self.usage.finish_reason


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    verifier: str
    model: str
    idle_timeout_s: int


@dataclass(frozen=True)
class ModelCard:
    id: str
    owned_by: str
    created: int
    max_context: int


@dataclass(frozen=True)
class ServerInfo:
    """GatewayInfo: the served model, limits, admission and session state, the verifier."""

    model: str
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer: str
    has_chat_template: bool
    running: int
    queued: int
    max_concurrency: int
    max_queue: int
    sessions: int
    max_sessions: int
    verifier_address: str
    verifier_ready: bool
    max_budget: int
    max_session_len: int
    default_max_tokens: int
    default_draft_budget: int
    default_draft_topk: int


def server_info_from_pb(m: gateway_pb2.GatewayInfo) -> ServerInfo:
    kw = {f.name: getattr(m, f.name) for f in fields(ServerInfo)}
    kw["eos_token_ids"] = list(m.eos_token_ids)
    return ServerInfo(**kw)


def usage_from_pb(u: gateway_pb2.GenerationUsage) -> Usage:
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.steps, u.mean_accepted_length,
                 u.seed if u.HasField("seed") else None, _REASON.get(u.stop_reason, "unspecified"),
                 u.matched_stop if u.HasField("matched_stop") else None,
                 u.matched_stop_token_id if u.HasField("matched_stop_token_id") else None, u.session_tokens)


def chunk_from_pb(m: gateway_pb2.GenerationChunk) -> Chunk:
    return Chunk(list(m.token_ids), m.text, m.step.accepted_length, m.step.tree_size, m.step.prefill_tokens,
                 m.session_id, usage_from_pb(m.usage) if m.HasField("usage") else None)


def request_to_pb(text: str | None, token_ids: Sequence[int] | None, messages: Sequence[Message | dict] | None,
                  sampling: Sampling, session_id: str | None, model: str | None) -> gateway_pb2.GenerationRequest:
    given = [n for n, v in (("text", text), ("token_ids", token_ids), ("messages", messages)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of text, token_ids or messages (got {given or 'none'})")
    msg = gateway_pb2.GenerationRequest(sampling=sampling.to_pb(), session_id=session_id or "", model=model or "")
    if text is not None:
        msg.text = text
    elif token_ids is not None:
        msg.token_ids.SetInParent()  # set the oneof even for an empty list (the server then says why)
        msg.token_ids.ids.extend(token_ids)
    else:
        msg.chat.SetInParent()
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, dict) else (m.role, m.content)
            msg.chat.messages.add(role=role, content=content)
    return msg


def sampling_of(sampling: Sampling | None, kw: dict) -> Sampling:
    unknown = set(kw) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling options {sorted(unknown)} (known: {sorted(SAMPLING_FIELDS)})")
    if sampling is not None and kw:
        raise TypeError("pass either sampling=Sampling(...) or sampling keyword arguments, not both")
    return sampling if sampling is not None else Sampling(**kw)


class Collector:
    """Folds chunks into a Result."""

    def __init__(self):
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.steps: list[int] = []
        self.usage: Usage | None = None
        self.session_id = ""

    def add(self, c: Chunk) -> None:
        self.text.append(c.text)
        self.tokens += c.token_ids
        if c.tree_size:
            self.steps.append(c.accepted_length)
        self.session_id = c.session_id
        if c.usage is not None:
            self.usage = c.usage

    def result(self) -> Result:
        if self.usage is None:
            raise GatewayError(grpc.StatusCode.UNKNOWN, "the stream ended without a final chunk")
        return Result("".join(self.text), self.tokens, self.usage, self.session_id, self.steps)
