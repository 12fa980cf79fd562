"""The drafter behind a Draft stream: the engine's DraftClient for the co-located and gRPC transports.

One bidirectional `ddtree.v1.Drafter/Draft` stream is open at a time. Each engine step sends one
`DraftStep` control message and waits for its trees, with a deadline. Tensors travel inline as
bytes (`grpc`) or through two shared regions registered once when the stream opens
(`colocated`: /dev/shm files on CPU, CUDA IPC allocations on GPU; see `protos.shared_region`).
Co-located, the messages after `open` also leave gRPC for a unix socket (`protos.control_socket`):
the engine thread writes each request and reads its answer itself, with no thread hand-offs. With CUDA
regions the two sides also exchange IPC events when the stream opens (`protos.shared_region.IpcEvent`):
neither process then waits for its GPU before sending; the receiver polls the sender's event (bounded by
the step deadline) before touching the regions, so encoding, the socket and decoding overlap the
sender's GPU work. With the verifier's trees doorbell (`protos.doorbell`, `OpenStream.doorbell_region_id`)
the verifier does not poll at all: the drafter's stream rings a counter in the verifier's GPU memory after its
writes, and the verifier queues a wait for it on its own stream, then its whole verify step behind it, while
the drafter's GPU still works; `protos.doorbell_watch` releases that wait if the drafter never rings.
Trees from a CUDA region never leave the GPU. Over gRPC on a GPU the step is queued as soon as the request is
sent, behind a `protos.doorbell.HostBell` that the stream's reader thread rings once it has put the answer's
trees in pinned memory (`verifier_service.tree_landing`; the same watch rings it at the deadline).

Trees are checked where they arrive (`verifier_service.tree_verdicts`): node counts on the host, the
rest by one kernel on the engine's device whose verdicts are read after the step (`take_errors`); a
tree that fails is verified as one that cannot be accepted past its root.

Faults never change the output, only the speed: when the stream breaks, the deadline passes or the
drafter answers with something that does not decode, the affected sessions get a root-only tree
(an autoregressive step), the stream is dropped and a background thread reconnects with backoff.
Context rows are kept per session until a drafter has acknowledged them (a valid tree came back),
so a new stream receives every row the old one may have missed (bounded by the draft window).
Rows acknowledged by a drafter that later died are not replayed: acceptance recovers as the new
drafter's window refills. A tree that fails validation fails only its session (`take_errors`).
Every session-step without a tree because of the drafter counts in `ddtree_drafter_fallbacks{reason}`:
unavailable (no stream), timeout, stream_broken (the stream failed or answered garbage), invalid_tree,
not_ready (the drafter refused the session, e.g. no room or a context gap; its context is re-sent).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
import torch

from drafter_service.api import DraftRequest
from kernels.tree_build import TreeBatch, tree_size
from protos.codec import WireError, answer_errors, trees_from_pb
from protos.control_socket import ControlListener
from protos.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from protos.doorbell import Doorbell, reached, supported
from protos.doorbell_watch import DoorbellWatch, shared_counter
from protos.shared_region import IpcEvent, RegionArena, SharedRegion
from telemetry import host_timeline
from telemetry.metrics import Metrics
from verifier_service.ahead_steps import AheadStep, AheadSteps
from verifier_service.draft_call import DraftCall, DraftTimeout, StreamBroken
from verifier_service.in_place import InPlacePlan, InPlaceStep
from verifier_service.queued_steps import REQUEST_REGION, RESPONSE_REGION, QueuedSteps
from verifier_service.step_message import PendingRows, step_message
from verifier_service.transport import DrafterModel, StreamClientConfig, projection_refusal
from verifier_service.tree_assembly import assemble_trees
from verifier_service.tree_check_graphs import CheckGraphs
from verifier_service.tree_landing import Landing, TreeLandings
from verifier_service.tree_verdicts import TreeChecker

log = logging.getLogger(__name__)
DOORBELL_REGION = 3  # and REQUEST_REGION, RESPONSE_REGION (1, 2: `queued_steps`)
REQUEST_DOORBELL_REGION = 4


class DraftStreamClient(QueuedSteps, AheadSteps):
    """DraftClient over a Draft stream; thread-safe for one engine thread plus the reconnect thread. Its steps are
    answered (here: the engine's verify step is queued once the answer is read), landed or in place (`QueuedSteps`),
    and may go out before the engine has read its last step back (`AheadSteps`)."""

    def __init__(self, cfg: StreamClientConfig, metrics: Metrics | None = None):
        self.cfg = cfg
        self.metrics = metrics if metrics is not None else Metrics()
        opts = [("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", int(cfg.retry_max_s * 1000))]
        self._channel = grpc.insecure_channel(cfg.address, options=opts)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        self.model: DrafterModel | None = None
        self._stream: DraftCall | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._ready = threading.Event()
        self._pending = PendingRows(cfg.window)  # the rows no drafter has acknowledged yet
        self._errors: dict[str, str] = {}
        self._checker: TreeChecker | None = None  # once the drafter's model is known
        # region_tensors: tensors this client placed in a shared region; region_trees: steps whose trees
        # came back through one (both stay 0 for grpc, and for a co-located stream that fell back to bytes)
        # event_steps: steps whose regions were handed over by CUDA IPC events (no host wait on either side);
        # request_rings: ahead steps sent with a ring of the request doorbell (the drafter may queue them at once)
        self.stats = {"steps": 0, "fallback_steps": 0, "reconnects": 0, "invalid_trees": 0, "region_tensors": 0,
                      "region_trees": 0, "event_steps": 0, "doorbell_steps": 0, "doorbell_timeouts": 0,
                      "landed_steps": 0, "in_place_steps": 0, "ring_first": 0, "keepwarm_sent": 0, "ahead_steps": 0,
                      "request_rings": 0}
        self.last_error = ""
        # the drafter's Info names another context projection than cfg.context_projection: a configuration error
        # (wait_ready raises it; after the first stream the client keeps retrying, autoregressive meanwhile)
        self.refused = ""
        self._use_control = cfg.colocated and cfg.control_socket
        self._use_events = cfg.colocated and cfg.ipc_events
        self._use_doorbell = self._use_events and cfg.doorbell
        # with the doorbell: one counter for the client's life, offered to every stream (made by the first)
        self._watch: DoorbellWatch | None = None
        # with the doorbell: the request doorbell, rung after an ahead step's writes, the same for every stream (its
        # region, the bell, the last value rung: it increases across streams, as `_bell_value`)
        self._use_request_bell = self._use_doorbell and cfg.request_doorbell
        self._request_bell: tuple[SharedRegion, Doorbell] | None = None
        self._request_value = 0
        # gRPC on a GPU with the doorbell: verify steps queued behind a host doorbell (verifier_service.tree_landing)
        self._use_landing = not cfg.colocated and cfg.doorbell
        self._landings: TreeLandings | None = None  # where trees from bytes go on the GPU (set with the device)
        self._landed: tuple[DraftCall, Landing, float, float] | None = None  # the last landing step, until settled
        self._in_flight: InPlaceStep | None = None  # the last in-place step, until its answer is read (`_settle`)
        self._ahead: AheadStep | None = None  # the ahead step on the wire, until the engine takes its trees
        self._bell_value = 0  # increases across streams: a dead stream's late ring never satisfies a newer wait
        # the last exchanged step, in ms: round_trip (request sent -> answer read), drafter (its compute_us),
        # transport (round_trip - drafter), decode (trees off the wire / out of the region), validate
        self.last_step_ms: dict[str, float] = {}
        # the engine's device: the regions live there (co-located) and the trees are delivered there
        self._device = torch.device(cfg.region_device)
        if self._device.type == "cuda" and self._device.index is None:
            # this (the engine's) thread's GPU: the connect thread that allocates the regions would use cuda:0
            self._device = torch.device("cuda", torch.cuda.current_device())
        if self._device.type == "cuda":
            self._landings = TreeLandings(self._device)
        self._thread = threading.Thread(target=self._connector, name="draft-stream-connect", daemon=True)

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, stop: threading.Event | None = None, timeout: float | None = None) -> DrafterModel:
        """Block until the first stream is open (the drafter's model is known)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if (stop is not None and stop.is_set()) or self._closed.is_set():
                raise RuntimeError("stopped while waiting for the drafter")
            if self.refused:
                raise ValueError(self.refused)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the drafter at {self.cfg.address} did not answer: {self.last_error}")
        assert self.model is not None
        return self.model

    @property
    def depth(self) -> int:
        if self.model is None:
            raise RuntimeError("the drafter's depth is unknown until wait_ready() returns")
        return self.model.block_size - 1

    @property
    def connected(self) -> bool:
        s = self._stream
        return s is not None and not s.broken

    @property
    def region_devices(self) -> dict[int, str]:
        """Region id -> device of the open stream's shared regions ("cuda:0": CUDA IPC); {} without them."""
        s = self._stream
        return {} if s is None else {rid: str(r.device) for rid, r in s.regions.items()}

    @property
    def ipc_events(self) -> bool:
        """Whether the open stream hands its CUDA regions over with IPC events (no host waits)."""
        s = self._stream
        return s is not None and s.trees_event is not None

    @property
    def doorbell(self) -> bool:
        """Whether the open stream's answers ring the trees doorbell (the verifier waits on its GPU)."""
        s = self._stream
        return s is not None and s.doorbell

    @property
    def control_socket(self) -> bool:
        """Whether the open stream's messages travel over a control socket (co-located)."""
        s = self._stream
        return s is not None and s.control is not None

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._drop("client closed")
        self._channel.close()
        if self._watch is not None:
            self._watch.close()  # releases a wait still armed, then frees the counter
        if self._request_bell is not None:
            region, bell = self._request_bell
            bell.close()  # our last ring has landed
            region.close()

    def _connector(self) -> None:
        delay = self.cfg.retry_min_s
        while not self._closed.is_set():
            current = self._stream
            if current is not None and not current.broken:
                self._wake.wait(1.0)  # woken when the stream breaks; the timeout is a safety net
                self._wake.clear()
                continue
            if current is not None:  # broke before it was installed: clear it first
                self._on_broken(current, str(current.error or "stream closed"))
            try:
                stream = self._open()
            except Exception as e:  # noqa: BLE001 - reported, retried
                if self._closed.is_set():
                    break
                if str(e) != self.last_error:
                    log.warning("drafter %s unavailable: %s (retrying)", self.cfg.address, e)
                self.last_error = str(e)
                self._closed.wait(delay)
                delay = min(2 * delay, self.cfg.retry_max_s)
                continue
            with self._lock:
                if self._closed.is_set():  # close() ran while this stream was opening
                    stream.close()
                    break
                self._stream = stream
            if self._ready.is_set():
                self.stats["reconnects"] += 1
            log.info("drafter stream open to %s (%s)", self.cfg.address, "colocated" if self.cfg.colocated else "grpc")
            self._ready.set()
            delay = self.cfg.retry_min_s

    def _open(self) -> DraftCall:
        if self.cfg.context_projection:  # the drafter would refuse the stream: say why in terms of the flags
            info = self._stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=self.cfg.connect_timeout_s)
            self.refused = projection_refusal(self.cfg, info)
            if self.refused:
                raise StreamBroken(self.refused)
        regions: dict[int, SharedRegion] = {}
        try:  # nothing of a stream that does not open may outlive it (a CPU region is a file in /dev/shm)
            if self.cfg.colocated:
                if self._device.type == "cuda":
                    # regions of earlier streams whose drafter has let go of them (torch keeps an exported
                    # allocation until its peer does, then frees it on demand): free them before allocating
                    torch.cuda.ipc_collect()
                for rid, nbytes in ((REQUEST_REGION, self.cfg.request_region_bytes),
                                    (RESPONSE_REGION, self.cfg.response_region_bytes)):
                    regions[rid] = SharedRegion.create(rid, nbytes, self._device)
            stream = DraftCall(self._stub, regions, self._on_broken, self.stats)  # raises on a closed channel
        except Exception:
            for r in regions.values():
                r.close()
            raise
        listener = None
        try:
            if self._use_events and self._device.type == "cuda":
                stream.request_event = IpcEvent.create(self._device)
            bell = self._doorbell_region() if stream.request_event is not None else None
            asked = self._request_region() if bell is not None else None
            if self._use_control:
                listener = ControlListener(self.cfg.max_message_bytes)
            stream.send(drafter_pb2.DraftStreamRequest(open=drafter_pb2.OpenStream(
                client_id=self.cfg.client_id,
                regions=[r.to_pb() for r in [*regions.values(), *(x for x in (bell, asked) if x is not None)]],
                control_socket=listener.path if listener else "",
                request_event=stream.request_event.handle if stream.request_event else b"",
                doorbell_region_id=bell.region_id if bell is not None else None,
                request_doorbell_region_id=asked.region_id if asked is not None else None,
                context_projection=self.cfg.context_projection)))
            try:
                resp = stream.recv(self.cfg.connect_timeout_s)
            except StreamBroken as e:
                if listener is not None and "control socket" in str(e):
                    self._use_control = False  # e.g. another /dev/shm: messages stay on gRPC from now on
                    log.warning("drafter %s cannot use a control socket (%s): using the gRPC stream",
                                self.cfg.address, e)
                raise
            if resp.WhichOneof("kind") != "opened":
                raise StreamBroken(f"the drafter answered open with {resp.WhichOneof('kind')}")
            if self.cfg.context_projection and resp.opened.context_projection != self.cfg.context_projection:
                raise StreamBroken("the drafter does not take this verifier's projected context rows (its projection "
                                   f"is {resp.opened.context_projection[:16] or 'none'}...)")
            stream.step_features = resp.opened.step_features
            if listener is not None:  # the drafter connected before answering
                stream.control = listener.accept(self.cfg.connect_timeout_s, self.cfg.control_spin_s)
            elif resp.opened.keep_warm:  # steps travel on the gRPC stream: keep it warm between them
                stream.keepwarm.period_s = self.cfg.keepwarm_ms / 1e3
            if stream.request_event is not None and resp.opened.trees_event:
                try:
                    stream.trees_event = IpcEvent.open(resp.opened.trees_event, self._device)
                except ValueError as e:  # the drafter would not wait for its GPU: this stream cannot be used
                    self._use_events = False  # the next stream goes without events
                    raise StreamBroken(f"the drafter's trees event: {e}") from None
            else:
                stream.request_event = None  # the drafter waits for its GPU: so do we
            stream.doorbell = bell is not None and stream.request_event is not None and resp.opened.trees_doorbell
            stream.draft_ahead = bool(regions) and resp.opened.draft_ahead
            stream.request_doorbell = stream.doorbell and asked is not None and resp.opened.request_doorbell
            if stream.doorbell and resp.opened.trees_in_place and self.cfg.trees_in_place != "off":
                stream.in_place = InPlacePlan(self.cfg.trees_in_place)
            for r in regions.values():
                r.unlink()  # the drafter has mapped them: nothing may outlive the two processes
            model = DrafterModel.from_pb(resp.opened)
            if self.model is not None and not self.model.same_shape(model):
                raise StreamBroken(f"the drafter changed: was {self.model}, now {model}; refusing it")
            if self.model is None:
                self.model = model
                graphs = CheckGraphs(self._device, model.vocab_size, model.block_size - 1) \
                    if self.cfg.check_graphs and self._device.type == "cuda" else None
                self._checker = TreeChecker(model.vocab_size, model.block_size - 1, graphs)
            elif self._checker.graphs is not None:
                self._checker.graphs.clear()  # they read the old stream's region
            return stream
        except Exception:
            stream.close()
            raise
        finally:
            if listener is not None:
                listener.close()

    def _doorbell_region(self) -> SharedRegion | None:
        """The trees doorbell's region (made once, offered to every stream; its counter only grows), or None
        when the client does not use one or this process cannot wait on one."""
        if not self._use_doorbell or not supported(self._device):
            return None
        if self._watch is None:
            try:
                self._watch = DoorbellWatch.open(DOORBELL_REGION, self._device, self._bell_expired)
            except RuntimeError as e:
                log.warning("no trees doorbell (%s): the drafter's IPC event is polled instead", e)
                self._use_doorbell = False
                return None
        return self._watch.region

    def _request_region(self) -> SharedRegion | None:
        """The request doorbell's region (made once, offered to every stream with the trees doorbell), or None when
        the client does not use one."""
        if not self._use_request_bell:
            return None
        if self._request_bell is None:
            try:
                self._request_bell = shared_counter(REQUEST_DOORBELL_REGION, self._device)
            except RuntimeError as e:
                log.warning("no request doorbell (%s): the drafter polls the request event", e)
                self._use_request_bell = False
                return None
        return self._request_bell[0]

    def _bell_expired(self, stream: DraftCall) -> None:
        """The watch released a step the drafter never rang for (it died, or hangs): drop that stream."""
        self.stats["doorbell_timeouts"] += 1
        self._on_broken(stream, "the drafter did not ring its trees doorbell within the step's deadline")

    def _on_broken(self, stream: DraftCall, reason: str) -> None:
        if self._watch is not None:
            self._watch.release(stream)  # its step in flight reads what is in the region: nothing waits for more
        with self._lock:
            if self._stream is not stream:
                return
            self._stream = None
        stream.close()
        self.last_error = reason
        if not self._closed.is_set():
            log.warning("drafter stream to %s lost: %s; drafting paused, reconnecting", self.cfg.address, reason)
        self._wake.set()

    def _drop(self, reason: str) -> None:
        s = self._stream
        if s is not None:
            self._on_broken(s, reason)

    # --- DraftClient -----------------------------------------------------------------------------
    def release(self, session_id: str) -> None:
        self._pending.acknowledge(session_id)
        self._errors.pop(session_id, None)
        s = self._stream
        if s is not None and session_id in s.synced:
            s.synced.discard(session_id)
            try:
                s.send(drafter_pb2.DraftStreamRequest(release=drafter_pb2.ReleaseSessions(session_ids=[session_id])))
            except StreamBroken:
                pass  # the drafter drops the stream's contexts itself

    def take_errors(self) -> dict[str, str]:
        """Sessions whose tree failed validation since the last call: sid -> message. Reads the verdicts
        of the device checks: call it after the step's results have been read back (no wait then)."""
        self._settle()
        self._collect_verdicts()
        errs, self._errors = self._errors, {}
        return errs

    def _collect_verdicts(self) -> None:
        if self._checker is None:
            return
        self._invalid(self._checker.verdicts())

    def _invalid(self, bad: dict[str, str]) -> None:
        """Sessions whose tree from the drafter was refused (sid -> why): told at `take_errors`, counted."""
        for sid, problem in bad.items():
            self._errors[sid] = f"the drafter sent an invalid tree: {problem}"
            log.warning("session %s: invalid tree from the drafter: %s", sid, problem)
        if bad:
            self.stats["invalid_trees"] += len(bad)
            self.metrics.record_fallback("invalid_tree", len(bad))

    def _acknowledge(self, s: DraftCall, answered: list[str], errors: dict[str, str]) -> None:
        """A step's answer: the sessions that got a tree (valid or not), whose rows the drafter holds now, and those
        it refused (sid -> "CODE: message"), whose context it dropped (their rows stay pending for a resend)."""
        for sid, msg in errors.items():
            log.info("drafter could not draft for %s: %s (autoregressive step)", sid, msg)
            s.synced.discard(sid)
        if errors:
            self.metrics.record_fallback("not_ready", len(errors))
        for sid in answered:
            self._pending.acknowledge(sid)
            s.synced.add(sid)

    def draft(self, requests: list[DraftRequest]) -> TreeBatch:
        return self.draft_begin(requests)()

    def draft_begin(self, requests: list[DraftRequest]) -> Callable[[], TreeBatch]:
        """Send the step's requests and return at once -> a function that waits for the trees (the engine
        prepares the tree-independent part of its verify step in between, while the drafter works)."""
        self._settle()  # the last step's answer, landed by now (no-op after take_errors)
        self._collect_verdicts()  # the last step's, read back by now (no-op after take_errors)
        if self._watch is not None:
            self._watch.disarm()  # the last step was read back: its doorbell wait is behind us
        for r in requests:
            self._pending.queue(r)
        self.stats["steps"] += 1
        s = self._stream
        if s is None or s.broken:
            self.stats["fallback_steps"] += 1
            self.metrics.record_fallback("unavailable", len(requests))
            return lambda: assemble_trees(requests)
        caps = [tree_size(r.budget, r.topk, self.depth) for r in requests]
        plan, response = s.in_place, s.regions.get(RESPONSE_REGION)
        width = plan.width(caps, response.nbytes) if plan is not None and response is not None else 0
        try:
            t_sent, deadline = self._send_step(s, requests, width)
        except Exception as e:  # noqa: BLE001 - whatever went wrong on the wire, this step goes on without trees
            self._step_failed(s, e, len(requests))
            return lambda: assemble_trees(requests)
        if width:  # the trees' place is known now: the verify step is queued behind the doorbell, not the answer
            return self._queue_in_place(s, requests, caps, width, t_sent, deadline)
        watch = self._landing_watch(s)
        if watch is not None:  # the verify step is queued now, behind the trees' landing (tree_landing)
            return self._queue_landing(s, watch, requests, caps, t_sent, deadline)
        # while the drafter works: each tree's node count (full trees) and root, uploaded for the checks
        self._checker.expect([r.session_id for r in requests], [r.root_token for r in requests], caps, self._device)
        return lambda: self._draft_end(s, requests, caps, t_sent, deadline)

    def _draft_end(self, s: DraftCall, requests: list[DraftRequest], caps: list[int], t_sent: float, deadline: float
                   ) -> TreeBatch:
        try:
            answered, trees, good, errors = self._receive_step(s, requests, caps, t_sent, deadline)
        except Exception as e:  # noqa: BLE001 - whatever went wrong on the wire, this step goes on without trees
            self._step_failed(s, e, len(requests))
            return assemble_trees(requests)
        self._acknowledge(s, answered, errors)
        return assemble_trees(requests, answered, trees, good)

    def _step_failed(self, s: DraftCall, e: Exception, sessions: int) -> None:
        if not isinstance(e, (StreamBroken, WireError)):
            log.exception("draft step failed")
        self.stats["fallback_steps"] += 1
        self.metrics.record_fallback("timeout" if isinstance(e, DraftTimeout) else "stream_broken", sessions)
        self._on_broken(s, str(e))

    # --- internals -------------------------------------------------------------------------------
    def _send_step(self, s: DraftCall, requests: list[DraftRequest], in_place: int = 0) -> tuple[float, float]:
        """Send one step's requests (in_place > 0: ask for the trees as a [6, R, in_place] block at the response
        region's start) -> (when it left, perf_counter; its deadline, monotonic)."""
        s.step_id += 1
        msg = drafter_pb2.DraftStreamRequest()
        step = msg.step  # filled in place: DraftStreamRequest(step=step) would copy its rows (up to megabytes)
        step.SetInParent()
        step.step_id = s.step_id
        if in_place:
            step.trees_in_place = in_place
        arena = RegionArena(s.regions[REQUEST_REGION]) if s.regions else None
        # context bytes one step message may carry; longer windows go ahead in context messages
        for ahead in step_message(step, requests, self._pending, s.synced, arena, self.cfg.max_message_bytes // 2,
                                  s.step_features):
            s.send(ahead)
        host_timeline.mark("step_built")
        return self._hand_over_and_send(s, msg, arena), time.monotonic() + self.cfg.draft_timeout_s

    def _hand_over_and_send(self, s: DraftCall, msg: drafter_pb2.DraftStreamRequest, arena: RegionArena | None
                            ) -> float:
        """A built step: the request region handed over (its tensors are in, and our reads of the last trees are
        done), the response region and the doorbell value named, the message sent -> when it left (perf_counter)."""
        step = msg.step
        if arena is not None:
            arena.hand_over(s.request_event)
            self.stats["region_tensors"] += arena.placed
            step.response_region_id = RESPONSE_REGION
            if s.request_doorbell and step.HasField("ahead_values"):  # after the writes, in our stream's order
                self._request_value += 1
                self._request_bell[1].ring(self._request_value)
                step.request_doorbell_value = self._request_value
                self.stats["request_rings"] += 1
        if s.doorbell:
            self._bell_value += 1
            s.bell_value = step.doorbell_value = self._bell_value
        t_sent = time.perf_counter()
        host_timeline.mark("step_sent")
        s.send(msg)
        return t_sent

    def _receive_step(self, s: DraftCall, requests: list[DraftRequest], caps: list[int], t_sent: float,
                      deadline: float) -> tuple[list[str], TreeBatch | None, set[str], dict[str, str]]:
        """The step's answer -> (sessions that got a tree, the decoded trees in that order, the sessions whose
        tree may be verified, drafter-side errors)."""
        answer, t_answer = self._answer(s, deadline)
        if s.doorbell:
            # our stream waits for the drafter's ring; everything after it (the check's copy of the trees, the
            # verify step) is queued now, while the drafter's GPU works; the watch keeps the step's deadline
            self._watch.bell.wait(s.bell_value)
            self._watch.arm(s, s.bell_value, deadline, s.released)
            self.stats["doorbell_steps"] += 1
        elif answer.after_event:
            event = s.trees_event  # once: another thread may close the stream meanwhile
            if event is None or event.event is None:
                raise StreamBroken(f"step {s.step_id}: the answer waits for an event this stream does not have")
            # the drafter's writes are done; a drafter that dies meanwhile breaks the stream: stop polling then
            if not event.wait_host(max(0.0, deadline - time.monotonic()), abort=lambda: s.broken):
                raise DraftTimeout(f"step {s.step_id}: the drafter's trees event did not complete in time")
            self.stats["event_steps"] += 1
        # a view of the response region: the check copies it on the GPU and verifies its copy (tree_verdicts)
        ids, trees = trees_from_pb(answer, s.regions, copy=False)
        in_region = answer.tokens.WhichOneof("storage") == "region"
        if in_region:
            self.stats["region_trees"] += 1
        errors = answer_errors(answer, ids, [r.session_id for r in requests])
        if not ids:
            return ids, None, set(), errors
        fixed = in_region
        if not in_region:
            trees, fixed = self._land(trees)
        t_decoded = time.perf_counter()
        by_id = {r.session_id: (r.root_token, cap) for r, cap in zip(requests, caps)}
        trees, refused = self._checker.check(ids, trees, [by_id[i][0] for i in ids], [by_id[i][1] for i in ids],
                                             fixed=fixed, void=s.released if s.doorbell else None)
        host_timeline.mark("trees_checked")
        plan = s.in_place
        if plan is not None:
            plan.ready = in_region  # the check's kernels have run: later steps may go in place
            if plan.mode == "auto" and plan.looks():
                # had the drafter rung before we had its answer decoded and checked? then its GPU step is shorter than
                # the answer's way here, and a step queued before the answer would have started sooner
                self.stats["ring_first"] += plan.observe(reached(self._watch.bell.read(), s.bell_value))
        self._time_step(answer.compute_us, t_sent, t_answer, t_decoded)
        self._invalid(refused)
        return ids, trees, set(ids) - set(refused), errors

    def _answer(self, s: DraftCall, deadline: float, step_id: int | None = None
                ) -> tuple[drafter_pb2.DraftTrees, float]:
        """The trees answer to step `step_id` (the stream's last step when None; earlier answers skipped) and when it
        was read; WireError for anything else, or, for the last step, a doorbell value other than the step's."""
        target = s.step_id if step_id is None else step_id
        while True:
            resp = s.recv(max(0.0, deadline - time.monotonic()))
            if resp.WhichOneof("kind") == "trees" and resp.trees.step_id == target:
                break
            if resp.WhichOneof("kind") != "trees" or resp.trees.step_id > target:
                raise WireError(f"unexpected answer to step {target}: {resp.WhichOneof('kind')}")
        t_answer = time.perf_counter()
        if target != s.step_id:
            return resp.trees, t_answer
        if s.doorbell and (not resp.trees.HasField("doorbell_value") or resp.trees.doorbell_value != s.bell_value):
            got = resp.trees.doorbell_value if resp.trees.HasField("doorbell_value") else "none"
            raise WireError(f"step {s.step_id}: the answer rings doorbell value {got}, expected {s.bell_value}")
        return resp.trees, t_answer

    def _time_step(self, compute_us: int, t_sent: float, t_answer: float, t_decoded: float) -> None:
        round_trip, drafter = t_answer - t_sent, compute_us * 1e-6
        self.last_step_ms = {"round_trip": round_trip * 1e3, "drafter": drafter * 1e3,
                             "transport": (round_trip - drafter) * 1e3, "decode": (t_decoded - t_answer) * 1e3,
                             "check": (time.perf_counter() - t_decoded) * 1e3}
        if compute_us:
            self.metrics.draft_transport_seconds.observe(max(0.0, round_trip - drafter))
