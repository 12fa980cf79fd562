"""Continuous batching of verifier sessions on one engine thread (DESIGN 5).

The engine is synchronous and single-threaded; the gRPC servicer is asyncio. The scheduler owns the
engine on a dedicated thread: servicers submit commands (open, continue, cancel, release) that run
between steps on that thread, and receive `TurnEvent`s / `TurnError`s through a `sink` callable
(the servicer hands in a thread-safe one that feeds an asyncio queue). Every step verifies all
running sessions at once; sessions join and leave between steps.

Admission is bounded by the KV cache: a turn reserves the pages it can ever touch
(prompt + max_new_tokens + one tree) against the free pages minus what running turns may still
grow into, so a running session never runs out of cache mid-turn; a turn that does not fit is
refused with RESOURCE_EXHAUSTED and nothing changes. A turn that finishes frees its KV on both
services unless the session is persistent; cancel and release always free it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.context import Context

from telemetry.torch_trace import StepTrace
from verifier_service.engine import Engine
from verifier_service.kv_cache import KVCapacityError
from verifier_service.session import DecodeParams, Session
from verifier_service.turn_telemetry import TurnTelemetry

log = logging.getLogger(__name__)


@dataclass
class TurnUsage:
    prompt_tokens: int
    completion_tokens: int
    steps: int
    mean_accepted_length: float
    session_length: int


@dataclass
class TurnEvent:
    """One step's worth of a turn: emitted tokens and what the step did."""

    tokens: list[int]
    accepted_length: int = 0  # committed by this verify step (root + accepted drafts); 0 = prefill
    tree_size: int = 0  # nodes verified incl. the root; 0 = prefill
    prefill_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" on the turn's last event
    usage: TurnUsage | None = None


@dataclass
class TurnError(Exception):
    """Ends a turn; `code` is a grpc.StatusCode name."""

    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


Sink = Callable[[TurnEvent | TurnError], None]


@dataclass(eq=False)
class Turn:
    sid: str
    sink: Sink
    persistent: bool
    prefill_tokens: int = 0
    reserve_len: int = 0  # cache rows this turn may touch
    running: bool = True
    trace: Context | None = None  # context of the request's recording span; None = untraced
    arrival_ns: int = 0  # time.time_ns() when submitted (traced turns only)


@dataclass(frozen=True)
class Snapshot:
    """KV usage and session counts as of the end of the last loop iteration (read by Info)."""

    kv_pages_total: int = 0
    kv_pages_free: int = 0
    open_sessions: int = 0
    running_sessions: int = 0


class Scheduler:
    def __init__(self, engine: Engine, drafter_errors: Callable[[], dict[str, str]] | None = None,
                 telemetry: TurnTelemetry | None = None, step_trace: StepTrace | None = None):
        self.engine = engine
        self.step_trace = step_trace  # a torch.profiler window over verify steps (diagnosis; None: off)
        self._drafter_errors = drafter_errors or (lambda: {})
        self.telemetry = telemetry if telemetry is not None else TurnTelemetry()
        self._commands: queue.Queue = queue.Queue()
        self._turns: dict[str, Turn] = {}  # sessions holding KV: running turns and idle persistent ones
        self._stop = threading.Event()
        self.snapshot = Snapshot()
        self._thread = threading.Thread(target=self._run, name="verifier-engine", daemon=True)

    def start(self) -> None:
        self._refresh()
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop; every session still held is released (KV on both services)."""
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)

    # --- called from any thread --------------------------------------------------------------------
    def open(self, sid: str, prompt: list[int], params: DecodeParams, persistent: bool, sink: Sink,
             trace: Context | None = None) -> Turn:
        turn = Turn(sid, sink, persistent, trace=trace)
        self.telemetry.arrived(turn)
        self._commands.put(lambda: self._open(turn, prompt, params))
        return turn

    def continue_turn(self, sid: str, tokens: list[int], params: DecodeParams, sink: Sink,
                      trace: Context | None = None) -> Turn:
        turn = Turn(sid, sink, persistent=True, trace=trace)
        self.telemetry.arrived(turn)
        self._commands.put(lambda: self._continue(turn, tokens, params))
        return turn

    def cancel(self, turn: Turn) -> None:
        """The caller went away (cancel, deadline, closed stream): free the session if still running."""
        self._commands.put(lambda: self._cancel(turn))

    def release(self, sid: str) -> concurrent.futures.Future:
        """-> Future[bool]: True if a running turn was cancelled; TurnError NOT_FOUND if unknown."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(lambda: self._release(sid, fut))
        return fut

    # --- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            running = any(t.running for t in self._turns.values())
            try:
                cmd = self._commands.get(block=not running)
            except queue.Empty:
                cmd = False
            while cmd is not False:
                if cmd is None:
                    break
                try:
                    cmd()
                except Exception:  # noqa: BLE001 - a command bug must not stop the loop
                    log.exception("scheduler command failed")
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = False
            if not self._stop.is_set() and any(t.running for t in self._turns.values()):
                self._step()
            self._refresh()
        for sid in list(self._turns):
            self._drop(sid)
        self._refresh()
        if self.step_trace is not None:
            self.step_trace.close()  # on the thread that stepped (the profiler is thread-affine)

    def _refresh(self) -> None:
        kv = self.engine.kv
        self.snapshot = Snapshot(kv.num_pages, kv.num_pages - kv.used_pages, len(self._turns),
                                 sum(t.running for t in self._turns.values()))
        self.telemetry.refresh(self.snapshot.running_sessions, kv.used_pages, kv.num_pages)

    def _pages(self, rows: int) -> int:
        return -(-rows // self.engine.kv.page_size)

    def _admit(self, turn: Turn, reserve_len: int, current_rows: int) -> None:
        """Raise TurnError unless the turn's worst case fits next to the running turns' reservations."""
        kv = self.engine.kv
        if reserve_len > kv.max_session_len:
            raise TurnError("INVALID_ARGUMENT", f"the session would need {reserve_len} cache rows (tokens so far + "
                                                f"max_new_tokens + one draft tree); this verifier allows "
                                                f"{kv.max_session_len} per session")
        promised = sum(max(0, self._pages(t.reserve_len) - self._pages(kv.capacity(self.engine.sessions[s].row)))
                       for s, t in self._turns.items() if t.running)
        free = kv.num_pages - kv.used_pages - promised
        need = self._pages(reserve_len) - self._pages(current_rows)
        if need > free:
            raise TurnError("RESOURCE_EXHAUSTED", f"KV cache full: this turn needs {need} pages of "
                                                  f"{kv.page_size} tokens, {free} of {kv.num_pages} are available "
                                                  f"({promised} promised to running sessions); retry later or "
                                                  "ask for fewer max_new_tokens")
        turn.reserve_len = reserve_len

    def _open(self, turn: Turn, prompt: list[int], params: DecodeParams) -> None:
        sid = turn.sid
        t0 = self.telemetry.admitting(turn)
        try:
            if sid in self._turns or sid in self.engine.sessions:
                raise TurnError("ALREADY_EXISTS", f"session {sid!r} already exists on this verifier")
            self.engine.validate(prompt, params)
            self._admit(turn, len(prompt) + params.max_new_tokens + self.engine.tree_nodes(params), 0)
            s = self.engine.add(prompt, params, sid=sid, persistent=turn.persistent)
        except (TurnError, KVCapacityError, ValueError) as e:
            turn.running = False
            _send(turn, _as_turn_error(e))
            return
        turn.prefill_tokens = len(prompt)
        self._turns[sid] = turn
        self.telemetry.prefilled(turn, s, t0)
        self._emit_prefill(turn, s)

    def _continue(self, turn: Turn, tokens: list[int], params: DecodeParams) -> None:
        sid = turn.sid
        t0 = self.telemetry.admitting(turn)
        prev = self._turns.get(sid)
        try:
            if prev is None:
                raise TurnError("NOT_FOUND", f"no session {sid!r} on this verifier (released, finished without "
                                             "persistent, or never opened)")
            if prev.running:
                raise TurnError("FAILED_PRECONDITION", f"session {sid!r} is still generating its previous turn")
            s = self.engine.sessions[sid]
            start = s.committed + 1 + len(tokens)  # [previous last token] + new tokens are prefilled
            self._admit(turn, start + params.max_new_tokens + self.engine.tree_nodes(params),
                        self.engine.kv.capacity(s.row))
            s = self.engine.extend(sid, tokens, params)
        except (TurnError, KVCapacityError, ValueError) as e:
            turn.running = False
            _send(turn, _as_turn_error(e))
            return
        turn.prefill_tokens = 1 + len(tokens)
        self._turns[sid] = turn
        self.telemetry.prefilled(turn, s, t0)
        self._emit_prefill(turn, s)

    def _emit_prefill(self, turn: Turn, s: Session) -> None:
        ev = TurnEvent(tokens=list(s.output), prefill_tokens=turn.prefill_tokens)
        self._deliver(turn, s, ev)

    def _deliver(self, turn: Turn, s: Session, ev: TurnEvent) -> None:
        if s.done:
            ev.finish_reason = s.finish_reason
            steps = len(s.accepted_per_step)
            ev.usage = TurnUsage(turn.prefill_tokens, len(s.output), steps,
                                 sum(s.accepted_per_step) / steps if steps else 0.0, s.committed + 1)
        _send(turn, ev)
        if s.done:
            turn.running = False
            if not turn.persistent:
                self._drop(turn.sid)

    def _step(self) -> None:
        if self.step_trace is not None:
            self.step_trace.tick()
        spans = self.telemetry.step_begin(self.engine)
        try:
            out = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine failed: fail the running turns, keep serving
            log.exception("verify step failed")
            self.telemetry.step_failed(spans, e)
            for sid, t in list(self._turns.items()):
                if t.running:
                    _send(t, TurnError("INTERNAL", f"verify step failed: {e!r}"))
                    self._drop(sid)
            return
        self.telemetry.step_end(self.engine, spans, out)
        errors = self._drafter_errors()
        for sid, tokens in out.items():
            turn = self._turns.get(sid)
            s = self.engine.sessions.get(sid)
            if turn is None or s is None:
                continue
            ev = TurnEvent(tokens=tokens, accepted_length=s.accepted_per_step[-1], tree_size=s.tree_sizes[-1])
            if sid in errors:
                _send(turn, ev)
                _send(turn, TurnError("INVALID_ARGUMENT", errors[sid]))
                self._drop(sid)
                continue
            self._deliver(turn, s, ev)

    def _drop(self, sid: str) -> None:
        """Forget the session and free its KV on both services."""
        self._turns.pop(sid, None)
        self.engine.release(sid)

    def _cancel(self, turn: Turn) -> None:
        if self._turns.get(turn.sid) is turn and turn.running:
            log.info("session %s cancelled by its caller", turn.sid)
            self._drop(turn.sid)

    def _release(self, sid: str, fut: concurrent.futures.Future) -> None:
        turn = self._turns.get(sid)
        if turn is None:
            fut.set_exception(TurnError("NOT_FOUND", f"no session {sid!r} on this verifier"))
            return
        was_running = turn.running
        if was_running:
            _send(turn, TurnError("CANCELLED", f"session {sid!r} was released"))
        self._drop(sid)
        fut.set_result(was_running)


def _as_turn_error(e: Exception) -> TurnError:
    if isinstance(e, TurnError):
        return e
    if isinstance(e, KVCapacityError):
        return TurnError("RESOURCE_EXHAUSTED", str(e))
    return TurnError("INVALID_ARGUMENT", str(e))


def _send(turn: Turn, item: TurnEvent | TurnError) -> None:
    """Deliver to the turn's caller; a caller that went away must not stop the engine thread."""
    try:
        turn.sink(item)
    except Exception:  # noqa: BLE001
        log.exception("could not deliver an event of session %s", turn.sid)
