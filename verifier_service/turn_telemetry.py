"""Metrics and trace spans of the verifier's turns, recorded for the scheduler (DESIGN 6).

The scheduler calls these hooks on its engine thread (`arrived` from the servicer's thread).
Metrics: queue depth (turns waiting for the scheduler to admit them), running sessions and KV usage
(each loop iteration), verify step time, and per step one `Metrics.record_steps` for acceptance
length, tree size and per-depth acceptance. Spans exist only for turns whose request span records
(`Turn.trace` set by the servicer): `ddtree.queue` (arrival -> admission) and `ddtree.prefill` are
recorded once their times are known; around each step every traced session gets a live
`ddtree.verify_step` span and, when it drafts, a `ddtree.transport.draft` child whose traceparent
rides in the session's draft request, so the drafter's `ddtree.draft` span hangs under it. A step
whose draft the step before queued ahead (`verifier_service.draft_ahead`) starts both spans when
that draft was asked for, and its traceparent reaches the drafter with the ahead step's counts
(`AheadCommitted`). A step serves many requests, so each session's spans live in that session's own
trace with the step's times. Untraced turns cost nothing here beyond the metrics.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from telemetry import tracing
from telemetry.metrics import Metrics

if TYPE_CHECKING:
    from verifier_service.engine import Engine
    from verifier_service.scheduler import Turn
    from verifier_service.session import Session

log = logging.getLogger(__name__)

# sid -> (session, its verify_step span, its transport span or None) for the step in flight
StepSpans = dict[str, tuple["Session", trace.Span, "trace.Span | None"]]


class TurnTelemetry:
    def __init__(self, metrics: Metrics | None = None, tracer: trace.Tracer | None = None,
                 transport: str | None = None):
        self.metrics = metrics if metrics is not None else Metrics()
        self.tracer = tracer if tracer is not None else tracing.get_tracer()
        self.transport = transport  # the ddtree.transport attribute of transport spans
        # admitted turns with a recording request span and their engine session, by session id
        self._traced: dict[str, tuple[Turn, Session]] = {}
        self._step_t0 = 0.0

    # --- admission (any thread, then the engine thread) ------------------------------------------
    def arrived(self, turn: Turn) -> None:
        self.metrics.queue_depth.inc()
        if turn.trace is not None:
            turn.arrival_ns = time.time_ns()

    def admitting(self, turn: Turn) -> int:
        """The scheduler took the turn's command: it leaves the queue. -> time.time_ns() (0 if untraced)."""
        self.metrics.queue_depth.dec()
        if turn.trace is None:
            return 0
        now = time.time_ns()
        tracing.record_span(self.tracer, tracing.SPAN_QUEUE, turn.trace, turn.arrival_ns, now)
        return now

    def prefilled(self, turn: Turn, s: Session, start_ns: int) -> None:
        """The turn was admitted and its prompt (turn.prefill_tokens) ran; it takes part in steps from now."""
        if turn.trace is None:
            return
        tracing.record_span(self.tracer, tracing.SPAN_PREFILL, turn.trace, start_ns, time.time_ns(),
                            {tracing.GEN_AI_USAGE_INPUT_TOKENS: turn.prefill_tokens})
        self._traced[turn.sid] = (turn, s)

    def refresh(self, running: int, used_pages: int, total_pages: int) -> None:
        self.metrics.running_sessions.set(running)
        self.metrics.set_kv_usage(used_pages, total_pages)

    # --- one verify step (engine thread) ---------------------------------------------------------
    def step_begin(self, engine: Engine) -> StepSpans:
        """Open the traced sessions' step spans; drafting ones get the transport span's traceparent."""
        self._step_t0 = time.perf_counter()
        if not self._traced:
            return {}
        t0 = time.time_ns()
        # a step whose draft the last one queued ahead (EngineConfig.draft_ahead) began there: its spans start then
        ahead = getattr(engine, "ahead", None)
        early = set(ahead.sids) if ahead is not None else set()
        spans: StepSpans = {}
        for sid, (turn, s) in list(self._traced.items()):
            # finished, cancelled or released since the last step (the id may even name a new session now)
            if engine.sessions.get(sid) is not s or not turn.running or s.done:
                del self._traced[sid]
                continue
            start = ahead.sent_ns if sid in early else t0
            step = self.tracer.start_span(tracing.SPAN_VERIFY_STEP, context=turn.trace, start_time=start)
            transport = None
            if engine.drafter is not None and s.params.budget > 0:
                transport = self.tracer.start_span(
                    tracing.SPAN_TRANSPORT, context=trace.set_span_in_context(step), kind=SpanKind.CLIENT,
                    start_time=start, attributes={tracing.DDTREE_TRANSPORT: self.transport} if self.transport else None)
                s.traceparent = tracing.traceparent(trace.set_span_in_context(transport))
            spans[sid] = (s, step, transport)
        return spans

    def step_end(self, engine: Engine, spans: StepSpans, out: dict[str, list[int]]) -> None:
        """After a successful step, before its events go out: metrics for every session, spans closed."""
        m = self.metrics
        m.step_seconds.observe(time.perf_counter() - self._step_t0)
        shares = []
        for sid in out:
            s = engine.sessions.get(sid)
            if s is not None and s.accepted_per_step:
                shares.append((s.tree_sizes[-1], s.tree_depth, s.accepted_per_step[-1] - 1))
        try:
            m.record_steps(shares)
        except ValueError:  # a metrics bug must not fail the turns
            log.exception("could not record the step's metrics")
        if not spans:
            return
        t1 = time.time_ns()
        draft_end = engine.draft_ns[1] if engine.draft_ns is not None else t1
        for sid, (s, step, transport) in spans.items():
            s.traceparent = ""  # the next turn of this session may be untraced
            if transport is not None:
                transport.end(end_time=draft_end)
            if sid in out and s.accepted_per_step:
                step.set_attributes(tracing.step_attributes(
                    tree_size=s.tree_sizes[-1], budget=s.params.budget if engine.drafter is not None else 0,
                    accepted_length=s.accepted_per_step[-1], tree_depth=s.tree_depth,
                    step=len(s.accepted_per_step), batch_sessions=len(out)))
            step.end(end_time=t1)

    def step_failed(self, spans: StepSpans, error: BaseException) -> None:
        t1 = time.time_ns()
        for s, step, transport in spans.values():
            s.traceparent = ""
            for span in (transport, step):
                if span is not None:
                    span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, f"verify step failed: {error!r}"))
                    span.end(end_time=t1)
