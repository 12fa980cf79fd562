"""The gateway's request pipeline, independent of the surface (gRPC servicer, OpenAI HTTP).

`GatewayCore.generate(request)` is an async iterator of `Chunk`s, one per verify step:
  1. check the model name and the parameters (INVALID_ARGUMENT naming the field), take the session;
  2. turn the input into tokens (`gateway.turns`), size max_tokens against the room left;
  3. wait for an admission slot (bounded queue: RESOURCE_EXHAUSTED when full);
  4. open or continue the verifier session with the deadline's remaining time and stream its steps
     through `TurnText` (UTF-8-safe text, stop token ids, stop strings across tokens);
  5. the last chunk carries the usage. A turn that ends on the gateway's side (stop string, client
     cancel, deadline, error) cancels the verifier call, which frees its KV on the verifier and the
     drafter; a session then reopens with its whole history on its next turn (`gateway.sessions`).
Consumers close the iterator when they stop early (`contextlib.aclosing`); cancellation of the
consuming task does the same.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace

from gateway.chat import Message
from gateway.detokenizer import TurnText
from gateway.errors import GatewayError
from gateway.params import GenerationParams, Limits, ResolvedParams, fit_max_tokens, resolve
from gateway.sessions import Session
from gateway.state import GatewayState
from gateway.turns import TurnInput, TurnPlan, TurnPlanner, require_input
from gateway.verifier_client import VerifierTurn
from telemetry import tracing
from telemetry.metrics import STATUSES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnRequest:
    input: TurnInput
    params: GenerationParams = GenerationParams()
    session_id: str | None = None
    model: str | None = None  # None / "" = the served model
    operation: str = "text_completion"  # GenAI operation name: "chat" | "text_completion"


@dataclass
class TurnUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    steps: int
    mean_accepted_length: float
    seed: int | None
    stop_reason: str  # "stop" | "length"
    matched_stop: str | None = None
    matched_stop_token_id: int | None = None
    session_tokens: int = 0


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    accepted_length: int = 0
    tree_size: int = 0
    prefill_tokens: int = 0
    session_id: str = ""
    usage: TurnUsage | None = None


@dataclass
class _Progress:
    """What a turn has streamed so far."""

    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # accepted length per verify step
    verifier_done: bool = False  # the verifier finished the turn itself (a persistent session keeps its KV)
    verifier_finished: bool = False  # the verifier's call ended with the turn's last step
    stop: bool = False  # ended by EOS, a stop token id or a stop string (else by max_tokens)


class GatewayCore:
    def __init__(self, state: GatewayState, tracer_provider=None):
        self.state = state
        self.tracer_provider = tracer_provider  # None: the global one, as configured at request time

    @property
    def tok(self):
        return self.state.tokenizer

    # --- entry point ------------------------------------------------------------------------------
    async def generate(self, req: TurnRequest, timeout: float | None = None,
                       trace_context=None) -> AsyncIterator[Chunk]:
        st = self.state
        start = time.perf_counter()
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        tracer = tracing.get_tracer(self.tracer_provider)
        attrs = {tracing.GEN_AI_OPERATION_NAME: req.operation, tracing.GEN_AI_REQUEST_MODEL: st.model_name}
        span = tracer.start_span(f"{req.operation} {st.model_name}", context=trace_context, kind=trace.SpanKind.SERVER,
                                 attributes=attrs)
        status = "unknown"
        session: Session | None = None
        try:
            limits, defaults = st.ready_limits(), st.defaults
            st.check_model(req.model)
            require_input(req.input)
            params = resolve(req.params, limits, defaults)
            _trace_request(span, params, req.session_id)
            if req.session_id:
                session = st.sessions.begin_turn(req.session_id)
            plan = self._plan(req.input, session)
            stop_ids = self._stop_ids(params, req.input.is_chat, limits)
            max_new = fit_max_tokens(params, len(plan.context), limits, defaults)
            span.set_attribute(tracing.GEN_AI_USAGE_INPUT_TOKENS, len(plan.context))
            queue_span = tracer.start_span(tracing.SPAN_QUEUE, context=trace.set_span_in_context(span))
            try:
                async with st.admission.slot():
                    queue_span.end()
                    st.metrics.prompt_tokens.inc(len(plan.context))
                    timer = st.metrics.token_timer(start)
                    async for chunk in self._run(req, session, plan, params, max_new, stop_ids, deadline, span):
                        timer.tokens(len(chunk.token_ids))
                        if chunk.usage is not None:
                            status = "ok"
                        yield chunk
            finally:
                if queue_span.is_recording():  # refused by admission, or cancelled while queued
                    queue_span.end()
        except GatewayError as e:
            status = e.code.lower()
            span.set_status(trace.Status(trace.StatusCode.ERROR, e.message))
            raise
        except asyncio.CancelledError:
            if status != "ok":
                status = "cancelled"
            if session is not None and session.closed and asyncio.current_task().uncancel() == 0:
                raise GatewayError("CANCELLED", "session_id: the session was closed while this turn was "
                                                "running", "session_id") from None
            raise
        except GeneratorExit:
            if status != "ok":
                status = "cancelled"
            raise
        finally:
            if session is not None:
                st.sessions.end_turn(session)
            st.metrics.record_request(status if status in STATUSES else "unknown")
            span.end()

    # --- planning ---------------------------------------------------------------------------------
    def _plan(self, inp: TurnInput, session: Session | None) -> TurnPlan:
        planner = TurnPlanner(self.tok, self.state.template, self.state.ready_limits().vocab_size)
        return planner.session_turn(session, inp) if session is not None else planner.one_shot(inp)

    def _stop_ids(self, params: ResolvedParams, chat: bool, limits: Limits) -> tuple[int, ...]:
        ids: list[int] = []
        if not params.ignore_eos:
            ids += [*limits.eos_token_ids, *self.tok.eos_token_ids()]
            if chat:
                ids += self.state.chat_stop_ids
        ids += params.stop_token_ids
        return tuple(dict.fromkeys(i for i in ids if 0 <= i < limits.vocab_size))

    # --- one turn on the verifier -----------------------------------------------------------------
    async def _run(self, req: TurnRequest, session: Session | None, plan: TurnPlan, params: ResolvedParams,
                   max_new: int, stop_ids: tuple[int, ...], deadline: float | None, span) -> AsyncIterator[Chunk]:
        if session is not None and not plan.continue_session and session.verifier_sid is not None:
            await self._release_quietly(session.verifier_sid)  # the plan replaces what it holds
            session.verifier_sid = None
        if session is None:
            vsid = f"g-{secrets.token_hex(12)}"
        elif plan.continue_session:
            vsid = session.verifier_sid
        else:
            vsid = session.next_verifier_sid()
        text = TurnText(self.tok.token_bytes, stop_ids, params.stop)
        p = _Progress()
        if session is not None:
            session.running_vsid = vsid
        vt = self._start(vsid, plan, params, max_new, stop_ids, session is not None, deadline, span)
        outcome = "cancelled"  # until proven otherwise: "done" | "refused" | "reopen" | "cancelled"
        try:
            async for ev in vt.events():
                delta, n = text.push(ev.tokens)
                if ev.tree_size > 0:
                    p.steps.append(ev.accepted_length)
                chunk = Chunk(ev.tokens[:n], delta, ev.accepted_length, ev.tree_size, ev.prefill_tokens,
                              session.id if session is not None else "")
                last = text.hit is not None or ev.finish_reason is not None
                if last and text.hit is None:
                    chunk.text += text.finish()
                p.tokens += chunk.token_ids
                p.text.append(chunk.text)
                if last:
                    p.verifier_finished = ev.finish_reason is not None
                    p.verifier_done = p.verifier_finished and n == len(ev.tokens)
                    p.stop = text.hit is not None or ev.finish_reason == "stop"
                    chunk.usage = self._usage(plan, params, p, text, session)
                    tracing.set_usage(span, input_tokens=chunk.usage.prompt_tokens,
                                      output_tokens=chunk.usage.completion_tokens,
                                      finish_reason=chunk.usage.stop_reason)
                    outcome = "done"
                    yield chunk
                    return
                yield chunk
            raise GatewayError("INTERNAL", "verifier: the stream ended before the turn finished")
        except GatewayError as e:
            if p.tokens:
                raise
            outcome = "refused"  # the verifier refused the turn before generating: it changed nothing
            if not (e.code == "NOT_FOUND" and session is not None and plan.continue_session):
                raise
            outcome = "reopen"
        finally:
            if not p.verifier_finished:
                vt.cancel()  # frees the turn's KV on the verifier and the drafter
            elif not p.verifier_done and session is not None:  # it kept tokens past the stop: drop them
                self.state.spawn(self._release_quietly(vsid))
            if session is not None and outcome != "reopen":
                self._record(session, plan, p, text, vsid, outcome)
        # the verifier lost the session (restarted): prefill the whole history into a new one
        log.info("session %s: the verifier no longer holds it; reopening with its history", session.id)
        session.verifier_sid = None
        again = TurnPlan(plan.context, False, plan.context, 0, plan.messages_after)
        async for chunk in self._run(req, session, again, params, max_new, stop_ids, deadline, span):
            yield chunk

    def _start(self, vsid: str, plan: TurnPlan, params: ResolvedParams, max_new: int, stop_ids: tuple[int, ...],
               persistent: bool, deadline: float | None, span) -> VerifierTurn:
        timeout = None
        if deadline is not None:
            timeout = deadline - asyncio.get_running_loop().time()
            if timeout <= 0:
                raise GatewayError("DEADLINE_EXCEEDED", "the deadline passed while the request was queued")
        with trace.use_span(span, end_on_exit=False):  # the call's metadata carries this span's context
            return self.state.verifier.turn(vsid, plan.send, params, max_new, stop_ids,
                                            continue_session=plan.continue_session, persistent=persistent,
                                            timeout=timeout)

    def _usage(self, plan: TurnPlan, params: ResolvedParams, p: _Progress, text: TurnText,
               session: Session | None) -> TurnUsage:
        hit = text.hit
        steps = len(p.steps)
        return TurnUsage(
            prompt_tokens=len(plan.context), completion_tokens=len(p.tokens), cached_tokens=plan.cached,
            steps=steps, mean_accepted_length=sum(p.steps) / steps if steps else 0.0,
            seed=params.sampling.seed if not params.sampling.greedy else None,
            stop_reason="stop" if p.stop else "length", matched_stop=hit.string if hit is not None else None,
            matched_stop_token_id=hit.token_id if hit is not None else None,
            session_tokens=len(plan.context) + len(p.tokens) if session is not None else 0)

    def _record(self, s: Session, plan: TurnPlan, p: _Progress, text: TurnText, vsid: str, outcome: str) -> None:
        """Record the turn in the session: what it sent and what it generated (all of it, or what was
        streamed before it ended early), and whether the verifier still holds it."""
        if s.closed:  # closed while running: make sure the verifier lets go of it
            if p.verifier_done:
                self.state.spawn(self._release_quietly(vsid))
            return
        if outcome == "refused":  # nothing changed on the verifier
            if not plan.continue_session:
                s.verifier_sid = None
            return
        if not p.tokens and outcome != "done":  # cancelled before any token: the turn leaves no trace
            if plan.continue_session:  # the verifier dropped the session, or will once it is released
                self.state.spawn(self._release_quietly(vsid))
            s.verifier_sid = None
            return
        s.tokens = plan.context + p.tokens
        s.verifier_sid = vsid if p.verifier_done else None
        s.last_stop_token = text.hit.token_id if text.hit is not None and text.hit.kind == "token" else None
        if plan.messages_after is not None:
            s.messages = [*plan.messages_after, Message("assistant", "".join(p.text))]
        else:
            s.messages = None  # raw tokens were added: a chat no longer describes the session

    async def _release_quietly(self, vsid: str) -> None:
        try:
            await self.state.verifier.release(vsid)
        except GatewayError as e:
            log.warning("could not release verifier session %s: %s", vsid, e)


def _trace_request(span, params: ResolvedParams, session_id: str | None) -> None:
    s = params.sampling
    attrs = {tracing.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens, tracing.GEN_AI_REQUEST_TEMPERATURE: s.temperature,
             tracing.GEN_AI_REQUEST_TOP_P: s.top_p, tracing.GEN_AI_REQUEST_TOP_K: s.top_k,
             tracing.GEN_AI_REQUEST_SEED: s.seed, tracing.GEN_AI_CONVERSATION_ID: session_id or None,
             tracing.DDTREE_BUDGET: params.draft_budget}
    span.set_attributes({k: v for k, v in attrs.items() if v is not None})

