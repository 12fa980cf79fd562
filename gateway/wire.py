"""Gateway protobuf messages <-> the gateway's dataclasses (protobuf stays at the edge).

Unset `optional` fields become None (the server's default applies), so "unset" and 0 differ:
temperature 0 is greedy on purpose, top_k 0 is "off", budget 0 is autoregressive.
"""

from __future__ import annotations

from gateway.chat import Message
from gateway.core import Chunk, TurnRequest, TurnUsage
from gateway.params import GenerationParams
from gateway.turns import TurnInput
from protos.ddtree.v1 import gateway_pb2

_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "draft_budget", "draft_topk")
STOP_REASON = {"stop": gateway_pb2.STOP_REASON_STOP, "length": gateway_pb2.STOP_REASON_LENGTH}


def params_from_pb(msg: gateway_pb2.SamplingOptions) -> GenerationParams:
    kw = {f: getattr(msg, f) for f in _OPTIONAL if msg.HasField(f)}
    for f in ("temperature", "top_p"):  # float32 on the wire: 0.8 arrives as 0.800000011920929
        if f in kw:
            kw[f] = round(float(kw[f]), 7)
    return GenerationParams(**kw, stop_token_ids=tuple(msg.stop_token_ids), stop=tuple(msg.stop),
                            ignore_eos=msg.ignore_eos)


def request_from_pb(msg: gateway_pb2.GenerationRequest) -> TurnRequest:
    which = msg.WhichOneof("input")
    if which == "text":
        inp = TurnInput(text=msg.text)
    elif which == "token_ids":
        inp = TurnInput(token_ids=tuple(msg.token_ids.ids))
    elif which == "chat":
        inp = TurnInput(messages=tuple(Message(m.role, m.content) for m in msg.chat.messages))
    else:
        inp = TurnInput()  # refused by the core: "input: exactly one of ..."
    return TurnRequest(inp, params_from_pb(msg.sampling), msg.session_id or None, msg.model or None,
                       "chat" if which == "chat" else "text_completion")


def usage_to_pb(u: TurnUsage) -> gateway_pb2.GenerationUsage:
    msg = gateway_pb2.GenerationUsage(
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
        steps=u.steps, mean_accepted_length=u.mean_accepted_length, stop_reason=STOP_REASON[u.stop_reason],
        session_tokens=u.session_tokens)
    if u.seed is not None:
        msg.seed = u.seed
    if u.matched_stop is not None:
        msg.matched_stop = u.matched_stop
    if u.matched_stop_token_id is not None:
        msg.matched_stop_token_id = u.matched_stop_token_id
    return msg


def chunk_to_pb(c: Chunk) -> gateway_pb2.GenerationChunk:
    msg = gateway_pb2.GenerationChunk(token_ids=c.token_ids, text=c.text, session_id=c.session_id,
                                      step=gateway_pb2.StepInfo(accepted_length=c.accepted_length,
                                                                tree_size=c.tree_size,
                                                                prefill_tokens=c.prefill_tokens))
    if c.usage is not None:
        msg.usage.CopyFrom(usage_to_pb(c.usage))
    return msg
