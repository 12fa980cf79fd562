"""Verifier session API codecs: DecodeParams and turn events <-> ddtree.v1 verifier messages.

Unset `optional` fields take the engine's defaults (DecodeParams / SamplingParams), so "unset"
and "0" stay different (budget 0 = autoregressive; temperature 0 = greedy). Range checks are the
dataclasses' own (`__post_init__`); their ValueError names the field and the servicer turns it into
INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protos.ddtree.v1 import verifier_pb2
from verifier_service.sampling_params import SamplingParams
from verifier_service.session import DecodeParams

if TYPE_CHECKING:
    from verifier_service.scheduler import TurnEvent

FINISH_TO_PB = {"stop": verifier_pb2.FINISH_REASON_STOP, "length": verifier_pb2.FINISH_REASON_LENGTH}
PB_TO_FINISH = {v: k for k, v in FINISH_TO_PB.items()}
_DECODE = ("max_new_tokens", "budget", "topk")
_SAMPLING = ("temperature", "top_p", "top_k", "seed")


def params_from_pb(msg: verifier_pb2.DecodeParams, default_eos: tuple[int, ...]) -> DecodeParams:
    """Raises ValueError naming the field when a value is out of range."""
    kw = {f: getattr(msg, f) for f in _DECODE if msg.HasField(f)}
    sampling = {f: getattr(msg, f) for f in _SAMPLING if msg.HasField(f)}
    if "temperature" in sampling:
        sampling["temperature"] = round(float(sampling["temperature"]), 7)  # float32 on the wire
    if "top_p" in sampling:
        sampling["top_p"] = round(float(sampling["top_p"]), 7)
    eos = tuple(msg.eos_token_ids) or tuple(default_eos)
    return DecodeParams(**kw, eos_ids=eos, ignore_eos=msg.ignore_eos, sampling=SamplingParams(**sampling))


def params_to_pb(p: DecodeParams) -> verifier_pb2.DecodeParams:
    msg = verifier_pb2.DecodeParams(max_new_tokens=p.max_new_tokens, budget=p.budget, topk=p.topk,
                                    eos_token_ids=list(p.eos_ids), ignore_eos=p.ignore_eos)
    s = p.sampling
    msg.temperature, msg.top_p, msg.top_k = s.temperature, s.top_p, s.top_k
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def event_to_pb(ev: TurnEvent) -> verifier_pb2.GenerateResponse:
    msg = verifier_pb2.GenerateResponse(tokens=ev.tokens, stats=verifier_pb2.StepStats(
        accepted_length=ev.accepted_length, tree_size=ev.tree_size, prefill_tokens=ev.prefill_tokens))
    if ev.finish_reason is not None:
        msg.finish_reason = FINISH_TO_PB.get(ev.finish_reason, verifier_pb2.FINISH_REASON_UNSPECIFIED)
    if ev.usage is not None:
        u = ev.usage
        msg.usage.CopyFrom(verifier_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                              steps=u.steps, mean_accepted_length=u.mean_accepted_length,
                                              session_length=u.session_length))
    return msg
