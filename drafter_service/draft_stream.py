"""One verifier's Draft stream inside the drafter: its sessions' contexts and the checks on
everything the verifier sends (context rows come as taps, or as projected rows on a stream whose verifier
holds the drafter's context projection: `drafter_service.context_projection`). Model work runs under the
server's one model lock (on its model thread, or a bytes stream's step on the event loop: `begin` under the
lock, `finish` without it).

Context caches live in the shared `Drafter` under "<stream number>/<session id>", so streams never
collide and closing a stream frees exactly its own sessions. Every request is checked against the
model (feature width, vocabulary, budget, positions) and against the stream's history (context rows
must continue where the session's previous rows ended); a bad request fails only its session,
reported in `DraftTrees.errors`, and that session's context is dropped so the verifier resends it.
Each step records the draft call's time and every session's outcome (`ddtree_draft_seconds`,
`ddtree_draft_requests{status}`); a session whose request carries a traceparent gets a `ddtree.draft`
span in its request's trace, timed by the batched draft call it shared.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch
from opentelemetry import trace

from drafter_service.api import DraftRequest
from drafter_service.drafter import AheadStage, Drafter
from kernels.tree_build import TreeBatch
from protos.codec import WireError, draft_request_from_pb, tensor_from_pb, trees_in_place, trees_to_pb
from protos.ddtree.v1 import drafter_pb2
from protos.doorbell import Doorbell
from protos.doorbell_watch import DoorbellWatch
from protos.shared_region import IpcEvent, RegionArena, SharedRegion
from telemetry import host_timeline, tracing
from telemetry.metrics import Metrics
from telemetry.torch_trace import StepTrace
from verifier_service.session import MAX_BUDGET

log = logging.getLogger(__name__)
MAX_POSITION = 1 << 31
MAX_SESSION_ID = 256
EVENT_TIMEOUT_S = 10.0  # the verifier's writes into the request region (a copy) take microseconds
BAD = grpc.StatusCode.INVALID_ARGUMENT


class SessionFault(Exception):
    """Fails one session's request (reported in DraftTrees.errors)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class ProtocolError(Exception):
    """Breaks the stream, not one session: the call ends with INVALID_ARGUMENT."""


@dataclass
class StepWork:
    """A step whose draft is queued (`DraftStream.begin`): what `DraftStream.finish` turns into its answer."""
    step_id: int
    ids: list[str]  # the sessions with a tree, in the trees' row order
    trees: TreeBatch  # on the drafter's device, or (bytes answers from a GPU) the pinned host copy in flight
    errors: list[drafter_pb2.SessionError]
    t_start: float  # perf_counter at the step's start (the answer's compute_us)
    region: SharedRegion | None  # the response region, None: the trees travel as bytes
    bell: tuple[Doorbell, int] | None
    copied: torch.cuda.Event | None = None  # recorded after the trees' device-to-host copy (None: no copy)
    # DraftStep.trees_in_place: (the block's width, the step's session count, each tree's row in the step)
    in_place: tuple[int, int, list[int]] | None = None

    def ready(self) -> bool:
        """Whether `finish` can encode without waiting for the GPU."""
        return self.copied is None or self.copied.query()


def _host_copy(trees: TreeBatch) -> tuple[TreeBatch, torch.cuda.Event]:
    """GPU trees -> (the same trees in pinned host memory, filled by one copy queued now; the event after it).
    One [6, R, M] copy instead of one blocking copy per field when the answer is encoded."""
    packed = trees.pack()
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(packed.device))  # the copy's stream, whatever this thread's device
    return TreeBatch.from_packed(host, trees.n_nodes), done


@dataclass
class AheadStep:
    """An ahead step staged (`DraftStream.stage`): the sessions with a tree and their places in the step, the
    refusals, the drafted sessions' context starts, the step's rows [S, P, F] and values [3, S] (views of the request
    region, not read yet), and the drafter's stage (None: no session drafts)."""

    step: drafter_pb2.DraftStep
    ids: list[str]
    at: list[int]
    errors: list[drafter_pb2.SessionError]
    starts: list[int]
    feats: torch.Tensor
    values: torch.Tensor
    stage: AheadStage | None = None


@dataclass
class StagedStep:
    """A step whose host part is done (`DraftStream.stage`), for `DraftStream.launch`: how long that part took, the
    response region, doorbell and in-place width it asked for, and its ahead part (None: a usual step, which does
    all its work in `launch`)."""

    step: drafter_pb2.DraftStep
    stage_s: float
    region: SharedRegion | None
    bell: tuple[Doorbell, int] | None
    width: int
    ahead: AheadStep | None


@dataclass
class AheadPending:
    """An ahead step drafted, until its AheadCommitted: its sessions in the step's order (those refused too, whose
    counts are ignored), where their rows start, the rows each, and for the span of each drafted session its tree's
    node count, with the step's budget, draft time (time_ns) and size."""

    step_id: int
    sids: list[str]
    starts: list[int]
    rows: int
    nodes: dict[str, int]
    budget: int
    t0: int
    t1: int


@dataclass
class DraftStream:
    number: int
    client_id: str
    regions: dict[int, SharedRegion]
    drafter: Drafter
    feature_dim: int  # the context rows' width: num_taps * target hidden size, or with `projected` the drafter's
    sessions: dict[str, int] = field(default_factory=dict)  # sid -> next expected context position
    faults: dict[str, SessionFault] = field(default_factory=dict)  # from `context` messages, told at the next step
    metrics: Metrics = field(default_factory=Metrics)
    tracer: trace.Tracer | None = None  # None: tracing is off in this process (no draft spans)
    step_trace: StepTrace | None = None  # a torch.profiler window over steps (diagnosis; None: off)
    # CUDA regions with IPC events (OpenStream.request_event): the verifier's, polled before touching the
    # regions, and ours, recorded after writing the trees (both None: wait for the GPU before answering)
    request_event: IpcEvent | None = None
    trees_event: IpcEvent | None = None
    # OpenStream.doorbell_region_id taken: rung after each step's writes instead of recording trees_event
    doorbell: Doorbell | None = None
    # OpenStream.request_doorbell_region_id taken: the watch of our waits on the verifier's request doorbell
    # (`queue_request_wait`), which ends a wait the verifier has not rung by its deadline and sets `fault`
    request_watch: DoorbellWatch | None = None
    request_released: threading.Event = field(default_factory=threading.Event)  # set by that watch on a release
    fault: str | None = None  # why the stream must end (told at its next message)
    views: dict = field(default_factory=dict)  # tensor_from_pb's cache of region views (dropped with the regions)
    copy_wait_s: float = 0.0  # bytes answers on a GPU: how long the server expects a step's trees to reach the host
    projected: bool = False  # OpenStream.context_projection taken: context rows arrive projected, not as taps
    draft_ahead: bool = False  # announced DrafterInfo.draft_ahead: takes DraftStep.ahead_values
    ahead: AheadPending | None = None  # the last ahead step, until its AheadCommitted
    closed: bool = False  # `close` ran: its regions are gone (a step that was waiting must not launch)

    def key(self, sid: str) -> str:
        return f"{self.number}/{sid}"

    # --- lifecycle -----------------------------------------------------------------------------------
    def forget(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self.drafter.release(self.key(sid))

    def release(self, sids: list[str]) -> None:
        for sid in sids:
            self.forget(sid)

    def close(self) -> None:
        self.closed = True
        for sid in list(self.sessions):
            self.forget(sid)
        if self.request_watch is not None:
            self.request_watch.close()  # a wait of ours still queued is ended first (nothing stays blocked)
            self.request_watch = None
        if self.doorbell is not None:
            self.doorbell.close()  # after our last ring has landed, before the page is unmapped
        self.views.clear()
        for r in self.regions.values():
            r.close()
        for e in (self.request_event, self.trees_event):
            if e is not None:
                e.close()
        self.request_event = self.trees_event = self.doorbell = None

    def _reserve(self, sid: str) -> str:
        key = self.key(sid)
        if key not in self.drafter.cache:
            try:
                self.drafter.cache.row(key)
            except RuntimeError as e:
                raise SessionFault(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        return key

    # --- checks --------------------------------------------------------------------------------------
    def _check_rows(self, sid: str, start: int, feats: torch.Tensor) -> None:
        """n >= 1 context rows: the model's feature width, in range, continuing the stream's rows."""
        n, F = feats.shape
        if F != self.feature_dim or not feats.dtype.is_floating_point:
            what = ("projected context rows (this stream's OpenStream.context_projection)" if self.projected else
                    f"taps of layers {list(self.drafter.cfg.target_layer_ids)}")
            raise SessionFault(BAD, f"ctx_features must be floating [n, {self.feature_dim}] ({what}), got "
                                    f"{feats.dtype} {list(feats.shape)}")
        if start < 0 or start + n > MAX_POSITION:
            raise SessionFault(BAD, f"context rows [{start}, {start + n}) are out of range")
        expected = self.sessions.get(sid)
        if expected is not None and start != expected:
            raise SessionFault(grpc.StatusCode.FAILED_PRECONDITION,
                               f"context gap: this stream holds rows up to {expected}, got rows from {start}; "
                               "send the session's context again as a new session")

    @staticmethod
    def _check_id(sid: str) -> None:
        if not 0 < len(sid) <= MAX_SESSION_ID:
            raise SessionFault(BAD, f"session id must have 1..{MAX_SESSION_ID} characters")

    def _request(self, m: drafter_pb2.SessionDraftRequest, seen: set[str], rows: torch.Tensor | None
                 ) -> DraftRequest:
        """One session's step request -> DraftRequest keyed for this stream, or SessionFault. rows: the
        session's part of DraftStep.ctx_features when the step carries them (None: in its message)."""
        sid = m.session_id
        self._check_session(m, seen)
        V = self.drafter.cfg.vocab_size
        if not 0 <= m.root_token < V:
            raise SessionFault(BAD, f"root token {m.root_token} is outside the vocabulary [0, {V})")
        if not 0 <= m.root_pos < MAX_POSITION:
            raise SessionFault(BAD, f"root position {m.root_pos} is outside [0, 2**31)")
        if rows is None:
            try:
                rows = draft_request_from_pb(m, self.regions, copy=False).ctx_features
            except WireError as e:
                raise SessionFault(BAD, str(e)) from None
        n, start = rows.shape[0], m.ctx_start
        expected = self.sessions.get(sid)
        if n:
            self._check_rows(sid, start, rows)
            if start + n != m.root_pos:
                raise SessionFault(BAD, f"context rows [{start}, {start + n}) must end right before "
                                        f"the root position {m.root_pos}")
        elif expected is not None and m.root_pos != expected:
            raise SessionFault(grpc.StatusCode.FAILED_PRECONDITION,
                               f"root position {m.root_pos} moved past the context ({expected}) without new rows")
        return DraftRequest(self._reserve(sid), start, rows, m.root_token, m.root_pos, m.budget, m.topk,
                            m.traceparent, self.projected)

    def _check_session(self, m: drafter_pb2.SessionDraftRequest, seen: set[str]) -> None:
        """What every step checks of a session's request: its id (once per step), no refusal pending from its context
        messages, budget and top-k in range."""
        sid = m.session_id
        self._check_id(sid)
        if sid in seen:
            raise SessionFault(BAD, "the session appears twice in one step")
        seen.add(sid)
        if sid in self.faults:  # its context rows, sent ahead, were refused
            raise self.faults.pop(sid)
        if not 1 <= m.budget <= MAX_BUDGET:
            raise SessionFault(BAD, f"budget {m.budget} is outside 1..{MAX_BUDGET}")
        if m.topk < 1:
            raise SessionFault(BAD, "topk must be >= 1")

    # --- messages ------------------------------------------------------------------------------------
    def context(self, m: drafter_pb2.SessionContext) -> None:
        """Rows sent ahead of a step; a problem is kept and told at the session's next step."""
        self._no_ahead_pending("a context message")
        sid = m.session_id
        try:
            self._check_id(sid)
            try:
                feats = tensor_from_pb(m.ctx_features, f"session {sid!r}: ctx_features", self.regions, copy=False)
            except WireError as e:
                raise SessionFault(BAD, str(e)) from None
            if feats.dim() != 2 or feats.shape[0] == 0:
                raise SessionFault(BAD, "a context message needs rows [n >= 1, features]")
            self._check_rows(sid, m.ctx_start, feats)
            self.drafter.add_context(self._reserve(sid), m.ctx_start, feats, projected=self.projected)
            self.sessions[sid] = m.ctx_start + feats.shape[0]
        except SessionFault as f:
            self.forget(sid)
            self.faults[sid] = f

    def ahead_committed(self, m: drafter_pb2.AheadCommitted) -> None:
        """The committed row counts of the last ahead step's sessions: their contexts end there now; and the draft
        spans of its traced sessions, under the steps that verify their trees."""
        a = self.ahead
        if a is None or m.step_id != a.step_id:
            raise ProtocolError(f"AheadCommitted for step {m.step_id}, but the last step taken ahead is "
                                f"{'none' if a is None else a.step_id}")
        n_sessions = len(a.sids)
        if len(m.rows) != n_sessions or not all(1 <= n <= a.rows for n in m.rows) or (
                m.traceparents and len(m.traceparents) != n_sessions):
            raise ProtocolError(f"AheadCommitted for step {a.step_id}: {n_sessions} counts in 1..{a.rows} (and as many "
                                f"traceparents, or none) expected, got {list(m.rows)[:8]}, "
                                f"{len(m.traceparents)} traceparents")
        self.ahead = None
        kept = [(sid, start, n) for sid, start, n in zip(a.sids, a.starts, m.rows)
                if sid in self.sessions and sid in a.nodes]
        self.drafter.advance([self.key(sid) for sid, _, _ in kept], [n for _, _, n in kept])
        for sid, start, n in kept:
            self.sessions[sid] = start + n
        if self.tracer is not None:
            for sid, tp in zip(a.sids, m.traceparents):
                if tp and sid in a.nodes:
                    self._span(sid, tp, a.nodes[sid], a.budget, len(a.nodes), a.t0, a.t1)

    def _no_ahead_pending(self, what: str) -> None:
        if self.ahead is not None:
            raise ProtocolError(f"{what} before the AheadCommitted of step {self.ahead.step_id} (taken ahead)")

    def request_expired(self, owner: object) -> None:
        """The request watch's callback (its thread): the verifier did not ring by the deadline; our wait is ended,
        the step drafted from whatever the region held (its trees are checked like any), the stream must go."""
        self.fault = (f"the verifier did not ring its request doorbell within {EVENT_TIMEOUT_S:.0f} s of an ahead "
                      "step (has it died?)")
        log.warning("stream %d: %s; ending the stream", self.number, self.fault)

    def queue_request_wait(self, s: StagedStep) -> bool:
        """A staged ahead step that carries DraftStep.request_doorbell_value: queue on our stream a wait for the
        verifier's ring, watched until the deadline, so that the draft can launch behind it now -> True; False where
        it must wait on the host instead (the request event): its draft would capture a graph, run an eager body or
        read refusals back (a kernel loaded for the first time behind a wait stalls, see `protos.doorbell`), or its
        answer would wait for our GPU (no response region or no trees doorbell value: the host would block behind the
        wait, holding the model).
        ProtocolError for a value on a stream without a request doorbell or on a usual step."""
        step = s.step
        if not step.HasField("request_doorbell_value"):
            return False
        if self.request_watch is None or s.ahead is None:
            raise ProtocolError(f"step {step.step_id}: request_doorbell_value " + (
                "on a stream without a request doorbell" if self.request_watch is None else "on a step not ahead"))
        a = s.ahead
        # the answer must go into the response region behind the trees doorbell: any other hand-over waits for our GPU
        if a.stage is None or len(a.ids) < len(step.sessions) or not a.stage.replays or s.region is None \
                or s.bell is None:
            return False
        self.request_watch.bell.wait(step.request_doorbell_value)
        self.request_watch.arm(self, step.request_doorbell_value, time.monotonic() + EVENT_TIMEOUT_S,
                               self.request_released)
        self.drafter.graphs.stats["ahead_queued"] += 1
        return True

    def await_request(self, step: drafter_pb2.DraftStep) -> None:
        """With IPC events: poll until the verifier's writes into the request region are done (outside the
        model lock: a dead verifier's event must not stall the other streams); ProtocolError if it never is."""
        if self.request_event is not None and not self.request_event.wait_host(EVENT_TIMEOUT_S):
            raise ProtocolError(f"step {step.step_id}: the verifier's request event did not complete within "
                                f"{EVENT_TIMEOUT_S:.0f} s (has the verifier died?)")

    def _step_rows(self, step: drafter_pb2.DraftStep) -> tuple[torch.Tensor, ...] | None:
        """DraftStep.ctx_features split into the sessions' rows (views, one op), None when the sessions carry
        their own; ProtocolError when the step's rows and the sessions' counts do not add up."""
        if not step.HasField("ctx_features"):
            if any(m.ctx_rows for m in step.sessions):
                raise ProtocolError(f"step {step.step_id}: sessions give ctx_rows but the step has no ctx_features")
            return None
        try:
            feats = tensor_from_pb(step.ctx_features, f"step {step.step_id}: ctx_features", self.regions, copy=False,
                                   views=self.views)
        except WireError as e:
            raise ProtocolError(str(e)) from None
        counts = [m.ctx_rows for m in step.sessions]
        if feats.dim() != 2 or feats.shape[0] != sum(counts):
            raise ProtocolError(f"step {step.step_id}: ctx_features {list(feats.shape)} must be [rows, features] "
                                f"with rows = the sessions' ctx_rows, {sum(counts)} in all")
        if any(m.HasField("ctx_features") for m in step.sessions):
            raise ProtocolError(f"step {step.step_id}: with step ctx_features no session carries its own")
        return (feats,) if len(counts) == 1 else feats.split(counts)  # one session (C = 1): no op at all

    @torch.no_grad()
    def begin(self, step: drafter_pb2.DraftStep) -> StepWork:
        """The model part of `step`: checks, the batched draft and the stream's bookkeeping, queued on the GPU.
        Trees that will travel as bytes start their one device-to-host copy here (pinned, not waited for), so
        the caller may wait for it elsewhere (`StepWork.ready`) and run `finish` without the model.
        `stage`, then `launch`."""
        return self.launch(self.stage(step))

    def stage(self, step: drafter_pb2.DraftStep) -> StagedStep:
        """The host part of `step` that reads nothing the verifier writes for it into the request region: the
        step's own checks, and for an ahead step everything up to the device work on its rows and values (each
        session's checks and the drafter's plan, no GPU work), so a server may run it before the verifier's
        request event has completed. The rest: `launch`."""
        if self.step_trace is not None:
            self.step_trace.tick()
        t_start = time.perf_counter()
        region = None  # where the trees go (its arena is made after the draft launches: off the critical path)
        if step.HasField("response_region_id"):
            region = self.regions.get(step.response_region_id)
            if region is None:
                raise ProtocolError(f"step {step.step_id}: unknown response region {step.response_region_id}")
        bell = self._bell(step, region)
        width = self._in_place_width(step, region)
        self._no_ahead_pending(f"step {step.step_id}")
        ahead = self._stage_ahead(step) if step.HasField("ahead_values") else None
        return StagedStep(step, time.perf_counter() - t_start, region, bell, width, ahead)

    @torch.no_grad()
    def launch(self, s: StagedStep) -> StepWork:
        """A staged step's draft, queued on the GPU (the verifier's writes into the request region have landed)."""
        if self.closed:
            raise ProtocolError(f"step {s.step.step_id}: the stream closed while the step waited for the verifier")
        t_start = time.perf_counter() - s.stage_s  # the answer's compute_us: the stage and what follows, not the wait
        ids, at, errors, trees = self._launch_ahead(s.ahead) if s.ahead is not None else self._draft(s.step)
        return self._work(s.step, ids, at, errors, trees, t_start, s.region, s.bell, s.width)

    def _draft(self, step: drafter_pb2.DraftStep) -> tuple[list[str], list[int], list, TreeBatch | None]:
        """A usual step's checks and draft -> (the sessions with a tree, their places in the step, the refusals, the
        trees)."""
        reqs, ids, errors, seen, at = [], [], [], set(), []
        rows = self._step_rows(step)
        for i, m in enumerate(step.sessions):
            try:
                reqs.append(self._request(m, seen, None if rows is None else rows[i]))
                ids.append(m.session_id)
                at.append(i)
            except SessionFault as f:
                errors.append(self._refused(m.session_id, f, ids))
        host_timeline.mark("draft_rows")
        if not reqs:
            return ids, at, errors, None
        t0, p0 = time.time_ns(), time.perf_counter()
        try:
            trees = self.drafter.draft(reqs)
        except Exception as e:  # noqa: BLE001 - a model failure fails this step's sessions, not the server
            return [], [], errors + self._draft_failed(step.step_id, ids, e), None
        for sid, r in zip(ids, reqs):
            self.sessions[sid] = r.root_pos  # the root's tap arrives next
        self.metrics.draft_seconds.observe(time.perf_counter() - p0)
        if self.tracer is not None:
            self._spans(ids, reqs, trees, t0, time.time_ns())
        return ids, at, errors, trees

    def _refused(self, sid: str, f: SessionFault, ids: list[str]) -> drafter_pb2.SessionError:
        """A session's request refused -> its error; its context is dropped (unless the session also has a tree in
        this step: the step named it twice)."""
        if sid not in ids:
            self.forget(sid)
        return drafter_pb2.SessionError(session_id=sid, code=f.code.value[0], message=f.message)

    def _work(self, step: drafter_pb2.DraftStep, ids: list[str], at: list[int], errors: list, trees: TreeBatch | None,
              t_start: float, region: SharedRegion | None, bell: tuple[Doorbell, int] | None, width: int) -> StepWork:
        """A begun step's StepWork (its trees' host copy started when they travel as bytes)."""
        self._count(len(ids), errors)
        if trees is None:
            z = torch.empty(0, 1, dtype=torch.int32)
            trees = TreeBatch(z, z, z, z, z, torch.empty(0, 1), [])
        copied = None
        if region is None and trees.tokens.device.type == "cuda":
            trees, copied = _host_copy(trees)
        in_place = (width, len(step.sessions), at) if width else None
        return StepWork(step.step_id, ids, trees, errors, t_start, region, bell, copied, in_place)

    def _stage_ahead(self, step: drafter_pb2.DraftStep) -> AheadStep:
        """An ahead step's checks and the drafter's stage (`Drafter.stage_ahead`; the counts, roots and positions
        stay on the GPU, clamped to their ranges there so that no value from the peer can fault a kernel)."""
        if not self.draft_ahead:
            raise ProtocolError(f"step {step.step_id}: ahead_values on a stream that does not take them")
        S = len(step.sessions)
        P = step.sessions[0].ctx_rows if S else 0
        if not S or not 1 <= P <= self.drafter.cache.window or any(m.ctx_rows != P for m in step.sessions):
            raise ProtocolError(f"step {step.step_id}: an ahead step needs sessions with one ctx_rows each, in "
                                f"1..{self.drafter.cache.window}")
        if len({(m.budget, m.topk) for m in step.sessions}) != 1:
            raise ProtocolError(f"step {step.step_id}: the sessions of an ahead step share one budget and topk")
        rows = self._step_rows(step)
        if rows is None:
            raise ProtocolError(f"step {step.step_id}: an ahead step's rows travel in its ctx_features")
        try:
            values = tensor_from_pb(step.ahead_values, f"step {step.step_id}: ahead_values", self.regions, copy=False,
                                    views=self.views)
        except WireError as e:
            raise ProtocolError(str(e)) from None
        if values.dtype != torch.int64 or tuple(values.shape) != (3, S):
            raise ProtocolError(f"step {step.step_id}: ahead_values must be int64 [3, {S}], got {values.dtype} "
                                f"{list(values.shape)}")
        ids, at, errors, starts, seen = [], [], [], [], set()
        for i, m in enumerate(step.sessions):
            try:
                sid = m.session_id
                self._check_session(m, seen)
                if self.sessions.get(sid) != m.ctx_start:
                    raise SessionFault(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"an ahead step's rows must continue the session's context (at "
                                       f"{self.sessions.get(sid)}), got rows from {m.ctx_start}")
                self._check_rows(sid, m.ctx_start, rows[i])
            except SessionFault as f:
                errors.append(self._refused(m.session_id, f, ids))
                continue
            ids.append(sid)
            at.append(i)
            starts.append(m.ctx_start)
        host_timeline.mark("draft_rows")
        # the step's one tensor of rows, as sent (`_step_rows` checked it; a cached view, no copy)
        feats = tensor_from_pb(step.ctx_features, "", self.regions, copy=False, views=self.views).view(S, P, -1)
        a = AheadStep(step, ids, at, errors, starts, feats, values)
        if ids:
            m0 = step.sessions[at[0]]
            try:
                a.stage = self.drafter.stage_ahead([self.key(sid) for sid in ids], starts, P, m0.budget, m0.topk)
            except Exception as e:  # noqa: BLE001 - a model failure fails this step's sessions, not the server
                a.ids, a.at, a.errors = [], [], errors + self._draft_failed(step.step_id, ids, e)
        return a

    def _launch_ahead(self, a: AheadStep) -> tuple[list[str], list[int], list, TreeBatch | None]:
        """A staged ahead step's draft -> (the sessions with a tree, their places in the step, the refusals, the
        trees)."""
        step, ids, at = a.step, a.ids, a.at
        if a.stage is None:  # no session drafts
            return ids, at, a.errors, None
        feats, values = a.feats, a.values
        if len(ids) < len(step.sessions):  # the sessions refused: out
            sel = torch.tensor(at, device=values.device)
            feats, values = feats.index_select(0, sel), values.index_select(1, sel)
        m0 = step.sessions[at[0]]
        t0, p0 = time.time_ns(), time.perf_counter()
        try:  # the values are clamped into their ranges there
            trees = a.stage.draft(feats, values, self.projected)
        except Exception as e:  # noqa: BLE001 - a model failure fails this step's sessions, not the server
            return [], [], a.errors + self._draft_failed(step.step_id, ids, e), None
        self.metrics.draft_seconds.observe(time.perf_counter() - p0)
        # the spans wait for AheadCommitted: it names the steps that verify these trees
        self.ahead = AheadPending(step.step_id, [m.session_id for m in step.sessions],
                                  [m.ctx_start for m in step.sessions], feats.shape[1], dict(zip(ids, trees.n_nodes)),
                                  m0.budget, t0, time.time_ns())
        return ids, at, a.errors, trees

    def _draft_failed(self, step_id: int, ids: list[str], e: Exception) -> list[drafter_pb2.SessionError]:
        """The model failed on a step: logged, its sessions forgotten -> an INTERNAL error for each."""
        log.exception("stream %d: draft step %d failed", self.number, step_id, exc_info=e)
        for sid in ids:
            self.forget(sid)
        return [drafter_pb2.SessionError(session_id=sid, code=grpc.StatusCode.INTERNAL.value[0],
                                         message=f"drafting failed: {e!r}") for sid in ids]

    def finish(self, work: StepWork, out: drafter_pb2.DraftTrees | None = None) -> drafter_pb2.DraftTrees:
        """The answer to a begun step: its trees encoded (into the response region and handed over, or as bytes
        once their host copy is done: waited for here if the caller has not), into `out` when given (the empty
        `trees` of the response to send: no copy into it afterwards)."""
        if work.copied is not None:
            work.copied.synchronize()
        arena = RegionArena(work.region) if work.region is not None else None
        if work.in_place is not None:
            try:
                msg = trees_in_place(work.trees, work.ids, work.step_id, work.in_place[2], work.in_place[1],
                                     work.in_place[0], arena, self.trees_event, work.bell, out)
            except ValueError as e:
                raise ProtocolError(f"step {work.step_id}: {e}") from None
        else:
            msg = trees_to_pb(work.trees, work.ids, work.step_id, arena, self.trees_event, work.bell, out)
        host_timeline.mark("trees_encoded")
        msg.errors.extend(work.errors)
        msg.compute_us = max(1, round((time.perf_counter() - work.t_start) * 1e6))
        return msg

    @staticmethod
    def _in_place_width(step: drafter_pb2.DraftStep, region: SharedRegion | None) -> int:
        """DraftStep.trees_in_place's width (0: not asked); ProtocolError when it cannot be honoured."""
        if not step.HasField("trees_in_place"):
            return 0
        width = step.trees_in_place
        if region is None or not 1 <= width <= MAX_BUDGET + 1:
            raise ProtocolError(f"step {step.step_id}: trees_in_place {width} " + (
                "without a response region" if region is None else f"is outside 1..{MAX_BUDGET + 1} (nodes per tree)"))
        return width

    def _bell(self, step: drafter_pb2.DraftStep, region: SharedRegion | None) -> tuple[Doorbell, int] | None:
        """(the doorbell, the value to ring) when the step asks for one; ProtocolError when it cannot be rung."""
        if not step.HasField("doorbell_value"):
            return None
        if self.doorbell is None or region is None:
            raise ProtocolError(f"step {step.step_id}: doorbell_value without "
                                f"{'a doorbell on this stream' if self.doorbell is None else 'a response region'}")
        return self.doorbell, step.doorbell_value

    # --- telemetry -----------------------------------------------------------------------------------
    def _count(self, ok: int, errors: list[drafter_pb2.SessionError]) -> None:
        if ok:
            self.metrics.draft_requests.labels(status="ok").inc(ok)
        for e in errors:
            code = next((c for c in grpc.StatusCode if c.value[0] == e.code), grpc.StatusCode.UNKNOWN)
            self.metrics.draft_requests.labels(status=code.name.lower()).inc()

    def _spans(self, ids: list[str], reqs: list[DraftRequest], trees: TreeBatch, t0: int, t1: int) -> None:
        """One `ddtree.draft` span per traced session, under the traceparent its request carried."""
        for j, (sid, r) in enumerate(zip(ids, reqs)):
            if r.traceparent:
                self._span(sid, r.traceparent, trees.n_nodes[j], r.budget, len(reqs), t0, t1)

    def _span(self, sid: str, traceparent: str, tree_size: int, budget: int, batch: int, t0: int, t1: int) -> None:
        """One session's `ddtree.draft` span of a draft call [t0, t1] (time_ns) shared by `batch` sessions."""
        attrs = tracing.step_attributes(tree_size=tree_size, budget=budget, batch_sessions=batch)
        attrs[tracing.GEN_AI_CONVERSATION_ID] = sid
        tracing.record_span(self.tracer, tracing.SPAN_DRAFT, tracing.context_from_traceparent(traceparent), t0, t1,
                            attrs)
