"""The drafter as a gRPC service (`ddtree.v1.Drafter`): Draft streams from verifiers, one batched
DFlash pass per step, FCNS trees back (DESIGN 3.1, 5).

Each Draft stream owns the context caches of its sessions (`drafter_service.draft_stream`), so a
verifier that disconnects leaves nothing behind and two verifiers never collide on session ids. This
module is the gRPC edge: it reads the stream, hands each message to the stream's `DraftStream` on
the model thread (arrival order, so the event loop keeps answering health, reflection and Info
while a step runs) and writes the answers. A step whose trees travel as bytes runs its model part on the
event loop itself when the model is free (no thread hand-off on the step's critical path; the loop is held for
that host part only, never for the GPU: `_answer`). On drain, streams end after their current step. A co-located
verifier may move the stream's messages to a unix socket (`protos.control_socket`, fewer hops per
step): a socket thread per stream then reads and runs them itself; all model work holds one lock. With CUDA
regions the verifier may also offer an IPC event (`OpenStream.request_event`): the stream then answers a
step as soon as its work is queued on the GPU, recording an event of its own for the verifier to poll, and
polls the verifier's before it touches the regions (`protos.shared_region.IpcEvent`). With the verifier's
trees doorbell (`OpenStream.doorbell_region_id`, `protos.doorbell`) the stream rings it on the GPU after its
writes instead of recording its trees event. With the verifier's request doorbell as well
(`OpenStream.request_doorbell_region_id`) a step drafted ahead that replays a captured graph is queued at once behind a
GPU wait on that counter, which the verifier's stream writes after its writes into the request region, instead of
polling the event on the host (`DraftStream.queue_request_wait`; a watch of the stream's ends the wait at the deadline
and fails the stream). While such a wait is queued, the other streams' drafter work queues behind it (one CUDA stream):
a verifier that stops mid-step holds them until the deadline, or until its stream ends.

Observability: Info calls run in SERVER spans continuing the caller's W3C context; the long-lived Draft
stream does not (it carries many requests: each session's draft span follows the traceparent in its
request, see `draft_stream`). Metrics (`--metrics-listen`): draft call time, per-session draft requests
by status, and the sessions holding a context cache (read at scrape time).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from opentelemetry import trace

from drafter_service.api import DraftRequest
from drafter_service.context_projection import ContextProjection
from drafter_service.draft_stream import DraftStream, ProtocolError, StagedStep, StepWork
from drafter_service.drafter import Drafter
from protos.control_socket import ControlClosed, ControlSocket
from protos.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from protos.doorbell import Doorbell, supported
from protos.doorbell_watch import DoorbellWatch
from protos.serving import GrpcServer, cancel_quietly
from protos.shared_region import IpcEvent, SharedRegion
from telemetry import host_timeline, tracing
from telemetry.grpc_tracing import DEFAULT_EXCLUDE, TracingServerInterceptor
from telemetry.metrics import Metrics, parse_hostport, process_metrics
from telemetry.torch_trace import StepTrace, parse_spec
from verifier_service.session import MAX_BUDGET, DecodeParams

log = logging.getLogger(__name__)
SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
MID_STREAM = ("step", "context", "release", "ahead_committed")  # the message kinds after `open`
Failure = tuple[grpc.StatusCode, str]  # how a control-socket stream ends with an error


@dataclass(frozen=True)
class DrafterServerConfig:
    listen: str
    target_dir: str
    drafter_dir: str
    device: str | None = None
    dtype: str | None = None
    max_sessions: int = 64
    draft_window: int = 2048
    max_message_bytes: int = 64 << 20
    grace_s: float = 30.0
    metrics_listen: str | None = None  # HOST:PORT of the Prometheus endpoint; None = not served
    cuda_graphs: bool | None = None  # draft steps through CUDA graphs; None = the Drafter's rule (on for CUDA)
    control_spin_ms: float = 0.0  # control sockets: poll this long for the next step before sleeping
    torch_trace: str | None = None  # DIR[:FIRST[:COUNT]]: steps profiled by torch.profiler (telemetry.torch_trace)

    def __post_init__(self):
        if self.metrics_listen is not None:
            parse_hostport(self.metrics_listen)  # ValueError naming the expected form
        for f in ("max_sessions", "draft_window", "max_message_bytes"):
            if getattr(self, f) <= 0:
                raise ValueError(f"drafter server: {f} must be positive, got {getattr(self, f)}")
        if self.grace_s < 0:
            raise ValueError(f"drafter server: grace period must be >= 0, got {self.grace_s}")
        if self.control_spin_ms < 0:
            raise ValueError(f"drafter server: control_spin_ms must be >= 0, got {self.control_spin_ms}")
        if self.torch_trace is not None:
            parse_spec(self.torch_trace)  # ValueError naming the expected form


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, max_sessions: int, window: int, metrics: Metrics | None = None,
                 tracer: trace.Tracer | None = None, max_message_bytes: int = 64 << 20, control_spin_s: float = 0.0,
                 step_trace: StepTrace | None = None):
        self.drafter: Drafter | None = None  # set by attach() once loaded
        self.model_name = ""
        self.projection_fingerprint = ""  # the fingerprint of the drafter's context projection (set by attach)
        self.target_hidden = 0
        self.max_sessions, self.window = max_sessions, window
        self.max_message_bytes = max_message_bytes  # also the control socket's frame limit
        self.control_spin_s = control_spin_s  # ControlSocket.spin_s of every stream's socket
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="drafter-model")  # gRPC messages' model work, in order
        # all model work holds this lock: the pool's thread and the control-socket threads (which run their
        # stream's messages themselves: no hand-off to another thread and back on each step)
        self._model_lock = threading.Lock()
        self._closed = False
        self._streams: dict[int, DraftStream] = {}
        self._streams_lock = threading.Lock()  # opened on the event loop, closed on the model thread
        self._numbers = itertools.count(1)
        self._drain = asyncio.Event()
        self.metrics = metrics if metrics is not None else process_metrics()
        self.metrics.draft_sessions.set_function(self.active_sessions)  # evaluated at scrape time
        self.tracer = tracer  # None: no draft spans (tracing off in this process)
        self.step_trace = step_trace  # None: no torch.profiler window (the usual case)

    def attach(self, drafter: Drafter, model_name: str, target_hidden: int) -> None:
        self.drafter, self.model_name, self.target_hidden = drafter, model_name, target_hidden
        # what a verifier must hold to send projected context rows (DrafterInfo.context_projection)
        self.projection_fingerprint = ContextProjection.from_model(drafter.model).fingerprint
        if drafter.graphs is not None:  # how its steps ran (replayed, captured, eager), read at scrape time
            self.metrics.watch_draft_graphs(lambda: drafter.graphs.stats)

    @property
    def feature_dim(self) -> int:
        return self.drafter.cfg.num_taps * self.target_hidden

    def begin_drain(self) -> None:
        """Streams end after their current step; new streams are refused."""
        self._drain.set()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)

    def active_sessions(self) -> int:
        """Sessions holding a context cache, all streams together."""
        with self._streams_lock:
            return sum(len(s.sessions) for s in self._streams.values())

    # --- Info --------------------------------------------------------------------------------------
    def info(self) -> drafter_pb2.DrafterInfo:
        d = self.drafter
        if d is None:
            return drafter_pb2.DrafterInfo(max_budget=MAX_BUDGET, max_sessions=self.max_sessions)
        with self._streams_lock:
            streams = list(self._streams.values())
        return drafter_pb2.DrafterInfo(
            model=self.model_name, vocab_size=d.cfg.vocab_size, block_size=d.cfg.block_size,
            target_layer_ids=list(d.cfg.target_layer_ids), target_hidden_size=self.target_hidden,
            max_budget=MAX_BUDGET, max_sessions=self.max_sessions,
            active_sessions=sum(len(s.sessions) for s in streams), draft_window=self.window,
            streams=len(streams), device=str(d.device), dtype=str(d.dtype).removeprefix("torch."),
            step_features=True, keep_warm=True, trees_in_place=True, context_projection=self.projection_fingerprint,
            hidden_size=d.cfg.hidden_size)

    async def Info(self, request, context):
        return self.info()

    # --- Draft stream ------------------------------------------------------------------------------
    async def _read(self, context):
        """Next request, or None at the end of the stream or when draining. KeepWarm messages are dropped here
        (the verifier sends them between steps so that gRPC's threads on both sides stay warm)."""
        while True:
            read = asyncio.ensure_future(context.read())
            drain = asyncio.ensure_future(self._drain.wait())
            try:
                await asyncio.wait({read, drain}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when this handler is cancelled: leave no task behind, and no exception unread (a
                # read that failed in the turn this handler was cancelled is done, yet nobody will take its result)
                cancel_quietly(drain)
                got = read.done()
                cancel_quietly(read)
            if not got:
                return None  # draining
            msg = read.result()
            if msg is grpc.aio.EOF:
                return None
            if msg.WhichOneof("kind") != "keep_warm":
                return msg

    async def Draft(self, request_iterator, context):
        if self.drafter is None or self._drain.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is loading or draining")
        first = await self._read(context)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the first message of a Draft stream must be `open`, got {first.WhichOneof('kind')}")
        try:
            st, control = self._open(first.open)
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        log.info("stream %d open (client %r, %d shared regions%s)", st.number, st.client_id, len(st.regions),
                 ", control socket" if control else "")
        try:
            opened = self.info()
            if st.trees_event is not None:
                opened.trees_event = st.trees_event.handle
            opened.trees_doorbell = st.doorbell is not None
            opened.request_doorbell = st.request_watch is not None
            opened.draft_ahead = st.draft_ahead
            await context.write(drafter_pb2.DraftStreamResponse(opened=opened))
            if control is not None:
                failure = await self._serve_control(st, control, context)
                if failure is not None:
                    await context.abort(*failure)
                return
            while (req := await self._read(context)) is not None:
                kind = req.WhichOneof("kind")
                if kind == "step":
                    host_timeline.mark("step_in")
                if kind not in MID_STREAM:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"unexpected `{kind}` mid-stream")
                try:
                    resp = await self._answer(st, req)
                except ProtocolError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                if resp is not None:
                    host_timeline.mark("answer_sent")
                    await context.write(resp)
        finally:
            if control is not None:
                control.close()
            # runs on cancellation too: queue the cleanup on the model thread without awaiting it
            try:
                self._pool.submit(self._close, st)
            except RuntimeError:  # the pool is shut down (the process is exiting): release it here
                self._close(st)

    async def _answer(self, st: DraftStream, req: drafter_pb2.DraftStreamRequest
                      ) -> drafter_pb2.DraftStreamResponse | None:
        """One mid-stream gRPC message -> the answer to send (steps only). A step whose trees travel as bytes (a
        stream without shared regions) runs its model part right here on the event loop when the model is free,
        and waits for its trees' host copy without blocking the loop (`_copied`): no hand-off to the model thread
        and back on the step's critical path (two thread wake-ups). Other messages, steps of streams with regions
        (they may poll the verifier's IPC event) and steps that find the model busy go to the model thread."""
        if req.WhichOneof("kind") != "step" or st.regions or not self._model_lock.acquire(blocking=False):
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._handle, st, req)
        try:
            host_timeline.mark("draft_begin")
            work = st.begin(req.step)
            host_timeline.mark("draft_queued")
        finally:
            self._model_lock.release()
        st.copy_wait_s = await _copied(work, st.copy_wait_s)
        host_timeline.mark("trees_copied")
        return _trees_answer(st, work)

    def _handle(self, st: DraftStream, req: drafter_pb2.DraftStreamRequest) -> drafter_pb2.DraftStreamResponse | None:
        """One mid-stream message, under the model lock -> the answer to send (steps only)."""
        kind = req.WhichOneof("kind")
        if st.fault is not None:
            raise ProtocolError(st.fault)
        if kind == "step":
            return self._step(st, req.step)
        with self._model_lock, torch.no_grad():
            if kind == "context":
                st.context(req.context)
            elif kind == "ahead_committed":
                st.ahead_committed(req.ahead_committed)
            else:
                st.release(list(req.release.session_ids))
        return None

    def _step(self, st: DraftStream, step: drafter_pb2.DraftStep) -> drafter_pb2.DraftStreamResponse:
        """A step on the model thread or a control socket's -> its answer. Its host part (`DraftStream.stage`: for an
        ahead step the checks and the plan, which read nothing the verifier writes for it) runs at once, then the
        verifier's request event is polled without the model (a dead verifier's event must not stall the other
        streams), then the draft launches. An ahead step is sent before the verifier's writes are even queued, so its
        host part overlaps the verifier's GPU work and its draft launches right when the rows land."""
        with self._model_lock, torch.no_grad():
            host_timeline.mark("draft_begin")
            staged = st.stage(step)
            if st.queue_request_wait(staged):  # behind a GPU wait for the verifier's ring: launched right away
                return self._launch(st, staged)
        st.await_request(step)
        with self._model_lock, torch.no_grad():
            return self._launch(st, staged)

    @staticmethod
    def _launch(st: DraftStream, staged: StagedStep) -> drafter_pb2.DraftStreamResponse:
        work = st.launch(staged)
        host_timeline.mark("draft_queued")
        return _trees_answer(st, work)

    async def _serve_control(self, st: DraftStream, control: ControlSocket, context) -> Failure | None:
        """Serve the stream's messages from its control socket until either side ends; -> the error to end
        the gRPC stream with, if any. A message on the gRPC stream itself is a protocol error."""
        loop = asyncio.get_running_loop()
        finished: asyncio.Future = loop.create_future()

        def run() -> None:
            out = self._control_loop(st, control)
            try:
                loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(out))
            except RuntimeError:  # the event loop is closed: the server is gone, nobody waits
                pass

        threading.Thread(target=run, name=f"drafter-control-{st.number}", daemon=True).start()
        reader = asyncio.ensure_future(self._read(context))
        try:
            await asyncio.wait({finished, reader}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not reader.done():
                cancel_quietly(reader)
        if finished.done():
            return finished.result()
        control.close()  # the verifier ended the stream, or we drain: the socket thread stops
        if reader.result() is not None:
            return (grpc.StatusCode.FAILED_PRECONDITION,
                    "with a control socket, the messages after `open` must travel over that socket")
        return None

    def _control_loop(self, st: DraftStream, control: ControlSocket) -> Failure | None:
        """The socket thread: each message handled here in arrival order (under the model lock), each answer back."""
        while True:
            try:
                req = control.recv(drafter_pb2.DraftStreamRequest)
            except (ControlClosed, OSError):
                return None  # the verifier closed it, or the gRPC side did
            except ValueError as e:
                return grpc.StatusCode.INVALID_ARGUMENT, f"control socket: {e}"
            kind = req.WhichOneof("kind")
            if kind == "step":
                host_timeline.mark("step_in")
            if kind not in MID_STREAM:
                return grpc.StatusCode.FAILED_PRECONDITION, f"unexpected `{kind}` mid-stream"
            if self._closed:  # the process is exiting
                return None
            try:
                resp = self._handle(st, req)
            except ProtocolError as e:
                return grpc.StatusCode.INVALID_ARGUMENT, str(e)
            if resp is not None:
                host_timeline.mark("answer_sent")
                try:
                    control.send(resp)
                except OSError:
                    return None

    def _open(self, msg: drafter_pb2.OpenStream) -> tuple[DraftStream, ControlSocket | None]:
        projected = bool(msg.context_projection)
        if projected and msg.context_projection != self.projection_fingerprint:
            raise ValueError(f"context projection {msg.context_projection[:16]}... is not this drafter's "
                             f"({self.projection_fingerprint[:16]}...): the verifier's --context-projection must be "
                             "this drafter's checkpoint (or leave it out: the verifier then sends taps)")
        regions: dict[int, SharedRegion] = {}
        control = None
        try:
            for r in msg.regions:
                if r.region_id in regions:
                    raise ValueError(f"shared region id {r.region_id} appears twice")
                regions[r.region_id] = SharedRegion.attach(r)
            if msg.control_socket:
                try:
                    control = ControlSocket.connect(msg.control_socket, self.max_message_bytes,
                                                    spin_s=self.control_spin_s)
                except OSError as e:
                    raise ValueError(f"control socket: cannot connect to {msg.control_socket!r} ({e}); is "
                                     "the drafter on the verifier's host, sharing its /dev/shm?") from None
            width = self.drafter.cfg.hidden_size if projected else self.feature_dim
            st = DraftStream(next(self._numbers), msg.client_id, regions, self.drafter, width, metrics=self.metrics,
                             tracer=self.tracer, step_trace=self.step_trace, projected=projected)
            st.request_event, st.trees_event = self._events(msg, regions)
            st.doorbell = self._doorbell(msg, regions, st.request_event)
            # ahead steps read the verifier's device values from the regions: behind its request event on a GPU;
            # host regions are written before the message leaves
            st.draft_ahead = bool(regions) and self.drafter.drafts_ahead and (
                st.request_event is not None or all(r.device.type == "cpu" for r in regions.values()))
            st.request_watch = self._request_watch(msg, regions, st)
        except Exception:
            for r in regions.values():
                r.close()
            if control is not None:
                control.close()
            raise
        with self._streams_lock:
            self._streams[st.number] = st
        return st, control

    @staticmethod
    def _events(msg: drafter_pb2.OpenStream, regions: dict[int, SharedRegion]) -> tuple[IpcEvent | None,
                                                                                          IpcEvent | None]:
        """(the verifier's request event, our trees event) when it sent one and the regions are on a GPU; a
        handle that does not open is logged and the stream goes on with host-synchronised hand-overs."""
        gpus = {r.device for r in regions.values() if r.device.type == "cuda"}
        if not msg.request_event or len(gpus) != 1:
            return None, None
        (device,) = gpus
        try:
            return IpcEvent.open(msg.request_event, device), IpcEvent.create(device)
        except ValueError as e:
            log.warning("stream from %r: %s; waiting for the GPU before each answer instead", msg.client_id, e)
            return None, None

    @staticmethod
    def _doorbell(msg: drafter_pb2.OpenStream, regions: dict[int, SharedRegion], request_event: IpcEvent | None
                  ) -> Doorbell | None:
        """The verifier's trees doorbell (OpenStream.doorbell_region_id) when offered with events and this
        process can ring it; ValueError for an id that names no region of the stream."""
        if not msg.HasField("doorbell_region_id"):
            return None
        region = regions.get(msg.doorbell_region_id)
        if region is None:
            raise ValueError(f"doorbell region {msg.doorbell_region_id} is not one of the stream's regions")
        if request_event is None or region.device != request_event.device or not supported(region.device):
            return None  # the verifier then waits for our trees event, or for our answer
        try:
            return Doorbell(region.buf)
        except RuntimeError as e:
            log.warning("stream from %r: cannot ring its doorbell (%s); recording the trees event instead",
                        msg.client_id, e)
            return None

    @staticmethod
    def _request_watch(msg: drafter_pb2.OpenStream, regions: dict[int, SharedRegion], st: DraftStream
                       ) -> DoorbellWatch | None:
        """The watch of our waits on the verifier's request doorbell (OpenStream.request_doorbell_region_id) when
        offered on a stream that takes ahead steps and rings the trees doorbell; ValueError for an id that names no
        region of the stream."""
        if not msg.HasField("request_doorbell_region_id"):
            return None
        region = regions.get(msg.request_doorbell_region_id)
        if region is None:
            raise ValueError(f"request doorbell region {msg.request_doorbell_region_id} is not one of the stream's "
                             "regions")
        if st.doorbell is None or not st.draft_ahead or region.device != st.doorbell.device:
            return None  # ahead steps then wait for the request event on our host
        try:
            bell = Doorbell(region.buf)
            bell.prepare_release()
        except (RuntimeError, ValueError) as e:
            log.warning("stream from %r: cannot wait on its request doorbell (%s); polling its event instead",
                        msg.client_id, e)
            return None
        return DoorbellWatch(bell, st.request_expired)

    def _close(self, st: DraftStream) -> None:
        with self._model_lock:
            st.close()
        with self._streams_lock:
            self._streams.pop(st.number, None)
        log.info("stream %d closed", st.number)


POLL_MARGIN_S = 0.002  # the event loop's timers fire up to ~1 ms late (epoll has ms resolution)


def _trees_answer(st: DraftStream, work: StepWork) -> drafter_pb2.DraftStreamResponse:
    """A begun step's answer, its trees encoded straight into the response (no copy into a wrapper)."""
    answer = drafter_pb2.DraftStreamResponse()
    st.finish(work, answer.trees)
    host_timeline.mark("answer_ready")
    return answer


async def _copied(work: StepWork, expected_s: float) -> float:
    """Wait until a begun step's trees are on the host, letting the loop serve other calls meanwhile -> the wait
    to expect next time. Sleeps (1 ms timers) until POLL_MARGIN_S before `expected_s`, then checks at every turn
    of the loop, so the answer leaves within microseconds of the copy. A copy first seen done right after a sleep
    may have waited for the timer: the expectation is halved then, else it becomes the wait measured."""
    t0 = time.perf_counter()
    sleep_until = t0 + expected_s - POLL_MARGIN_S
    slept = False
    while not work.ready():
        slept = time.perf_counter() < sleep_until
        await asyncio.sleep(0.001 if slept else 0)
    return expected_s / 2 if slept else time.perf_counter() - t0


# --- building and serving ------------------------------------------------------------------------------
def load_drafter_service(cfg: DrafterServerConfig, service: DrafterService, make_drafter=Drafter) -> None:
    """Load the drafter and the target's embed/lm_head, run one warm-up step, capture the context-append
    graphs and the draft graphs of the default (budget, top-k) for every bucket (with CUDA graphs; other keys
    are captured on first use), attach to the service. `make_drafter` builds the engine object (a Drafter
    subclass may change the proposal source)."""
    from drafter_service.checkpoint import check_pair, load_drafter
    from drafter_service.config import DFlashConfig
    from drafter_service.target_head import load_target_head
    from verifier_service.config import KimiConfig
    from verifier_service.local import DTYPES, default_device

    device = cfg.device or default_device()
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    dtype = DTYPES[cfg.dtype] if cfg.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tcfg = KimiConfig.from_file(cfg.target_dir)
    check_pair(DFlashConfig.from_file(cfg.drafter_dir), tcfg)  # before any weights move
    _, embed, head = load_target_head(cfg.target_dir, dtype, device, tcfg)
    model = load_drafter(cfg.drafter_dir, tcfg, dtype, device)
    drafter = make_drafter(model, embed, head, max_sessions=cfg.max_sessions, window=cfg.draft_window,
                           cuda_graphs=cfg.cuda_graphs)
    F = model.cfg.num_taps * tcfg.hidden_size
    warm = DraftRequest("warm-up", 0, torch.zeros(1, F, dtype=dtype, device=device), 0, 1, 4, 2)
    drafter.draft([warm])
    drafter.release("warm-up")
    defaults = DecodeParams()
    if graphs := drafter.warmup(defaults.budget, defaults.topk):
        log.info("captured %d CUDA graphs (context appends; drafts at budget %d, top-k %d)", graphs,
                 defaults.budget, defaults.topk)
    service.attach(drafter, Path(cfg.drafter_dir).name, tcfg.hidden_size)


async def serve(cfg: DrafterServerConfig, make_drafter=Drafter) -> int:
    service = DrafterService(cfg.max_sessions, cfg.draft_window,
                             tracer=tracing.get_tracer() if tracing.is_configured() else None,
                             max_message_bytes=cfg.max_message_bytes, control_spin_s=cfg.control_spin_ms / 1e3,
                             step_trace=StepTrace.from_spec(cfg.torch_trace, "drafter"))
    # the Draft stream lives as long as the verifier's connection: no span for it (see the module docstring)
    interceptor = TracingServerInterceptor(exclude_prefixes=(*DEFAULT_EXCLUDE, f"/{SERVICE_NAME}/Draft"))
    server = GrpcServer(cfg.listen, [SERVICE_NAME], cfg.max_message_bytes, cfg.grace_s, interceptors=[interceptor],
                        metrics_listen=cfg.metrics_listen)
    drafter_pb2_grpc.add_DrafterServicer_to_server(service, server.server)
    await server.start()
    loaded = asyncio.ensure_future(asyncio.to_thread(load_drafter_service, cfg, service, make_drafter))
    stop = asyncio.ensure_future(server.stop_requested.wait())
    await asyncio.wait({loaded, stop}, return_when=asyncio.FIRST_COMPLETED)
    if loaded.done() and loaded.exception() is not None:
        log.error("drafter failed to load: %s", loaded.exception())
        await server.drain()
        raise loaded.exception()
    if loaded.done():
        await server.set_serving()
        log.info("drafter serving on %s (%s)", server.address, service.info().device)
        await stop
    service.begin_drain()
    await server.drain()
    service.close()
    if service.step_trace is not None:
        service.step_trace.close()
    return 0
