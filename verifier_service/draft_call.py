"""One open `ddtree.v1.Drafter/Draft` call of the stream client (`verifier_service.transport_stream`).

A request queue feeds gRPC and a reader thread fills a response queue; once `control` is set (a co-located stream
after `opened`) messages go over that socket and answers are read from it. A landing step's answer
(`verifier_service.tree_landing`) is taken by the reader thread itself (`land`), and a call that breaks or closes
releases the landing it holds.

With steps on the gRPC stream and a drafter that takes them, gRPC's request thread also sends `KeepWarm` messages
shortly before the next step's request or answer is expected (`verifier_service.keepwarm`; `keepwarm.period_s` 0:
none).
"""

from __future__ import annotations

import queue
import threading

import grpc

from protos.control_socket import ControlClosed, ControlSocket
from protos.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from protos.shared_region import IpcEvent, SharedRegion
from telemetry import host_timeline
from verifier_service.in_place import InPlacePlan
from verifier_service.keepwarm import KeepWarmPlan, paced
from verifier_service.tree_landing import Landing

KEEP_WARM = drafter_pb2.DraftStreamRequest(keep_warm=drafter_pb2.KeepWarm())


class StreamBroken(Exception):
    pass


class DraftTimeout(StreamBroken):
    """No answer within the deadline."""


class DraftCall:
    """One open Draft call: a request queue feeding gRPC, a reader thread filling a response queue; once
    `control` is set (after `opened`), messages go over that socket and answers are read from it."""

    def __init__(self, stub: drafter_pb2_grpc.DrafterStub, regions: dict[int, SharedRegion], on_broken,
                 stats: dict[str, int] | None = None):
        self.regions = regions
        self.control: ControlSocket | None = None
        # CUDA regions: ours, recorded after our work on the regions; the drafter's, waited for before reading
        self.request_event: IpcEvent | None = None
        self.trees_event: IpcEvent | None = None
        self.doorbell = False  # the drafter rings the client's trees doorbell after each step's writes
        self.request_doorbell = False  # ahead steps ring the client's request doorbell (the drafter may wait on it)
        self.bell_value = 0  # the value the step in flight rings
        # when steps ask for their trees in place (the drafter writes them there, the stream has a doorbell and the
        # client's trees_in_place is not "off"); None: never
        self.in_place: InPlacePlan | None = None
        self.released = threading.Event()  # the doorbell watch released a wait of this stream (trees unreliable)
        self.synced: set[str] = set()  # sessions whose context this drafter holds
        self.step_features = False  # the drafter reads a step's rows from DraftStep.ctx_features (one tensor)
        self.draft_ahead = False  # the drafter takes steps with their counts and roots on our GPU (ahead_values)
        self.step_id = 0
        self.broken = False
        self.error: StreamBroken | None = None
        self.landing: Landing | None = None  # the step in flight whose trees the reader thread lands itself
        self._route = threading.Lock()  # who takes that step's answer: the reader (landing set) or `recv`
        self._requests: queue.Queue = queue.Queue()
        self._responses: queue.Queue = queue.Queue()
        self._on_broken = on_broken
        self._stats = stats if stats is not None else {}  # counts "keepwarm_sent" (the client's stats)
        # period_s set once the drafter said it takes KeepWarm and the steps stay on gRPC (0: never sent)
        self.keepwarm = KeepWarmPlan(0.0, self._kept_warm)
        self.call = stub.Draft(paced(self._requests, KEEP_WARM, self.keepwarm))
        self._reader = threading.Thread(target=self._read, name="draft-stream-reader", daemon=True)
        self._reader.start()

    def _kept_warm(self) -> None:
        self._stats["keepwarm_sent"] = self._stats.get("keepwarm_sent", 0) + 1  # gRPC's request thread alone

    def _read(self) -> None:
        try:
            for resp in self.call:
                if resp.WhichOneof("kind") == "trees":
                    host_timeline.mark("answer_in")
                    self.keepwarm.answered()
                with self._route:
                    landing = self.landing
                    if landing is not None and resp.WhichOneof("kind") == "trees" \
                            and resp.trees.step_id == landing.step_id:
                        self.landing = None
                    else:
                        landing = None
                        self._responses.put(resp)
                if landing is not None:
                    landing.deliver(resp.trees)
                    host_timeline.mark("answer_landed")
            err: Exception = StreamBroken("the drafter closed the stream")
        except grpc.RpcError as e:
            err = StreamBroken(f"stream failed: {e.code().name}: {e.details()}")
        except Exception as e:  # noqa: BLE001 - anything here means the stream is unusable
            err = StreamBroken(f"stream reader failed: {e!r}")
        self.error = err
        self.broken = True
        self._responses.put(err)
        self._drop_landing(str(err))
        self._on_broken(self, str(err))

    def land(self, landing: Landing) -> None:
        """Let the reader thread take `landing`'s answer from now on (one it queued already is delivered here)."""
        with self._route:
            early = []
            while True:
                try:
                    early.append(self._responses.get_nowait())
                except queue.Empty:
                    break
            mine = [r for r in early if not isinstance(r, Exception) and r.WhichOneof("kind") == "trees"
                    and r.trees.step_id == landing.step_id]
            for r in early:
                if not any(r is m for m in mine):
                    self._responses.put(r)
            if not mine:
                self.landing = landing
        if mine:
            landing.deliver(mine[0].trees)
        elif self.broken:
            self._drop_landing(str(self.error or "stream closed"))

    def _drop_landing(self, reason: str) -> None:
        with self._route:
            landing, self.landing = self.landing, None
        if landing is not None:
            landing.release(reason)

    def send(self, msg: drafter_pb2.DraftStreamRequest) -> None:
        if self.broken:
            raise self.error or StreamBroken("stream is closed")
        if self.control is None:
            if msg.WhichOneof("kind") == "step":
                self.keepwarm.sent()
            self._requests.put(msg)
            return
        try:
            self.control.send(msg)
        except (OSError, ValueError) as e:
            raise StreamBroken(f"control socket: {e}") from None

    def recv(self, timeout: float) -> drafter_pb2.DraftStreamResponse:
        if self.control is not None and not self.broken:
            try:
                resp = self.control.recv(drafter_pb2.DraftStreamResponse, timeout)
                host_timeline.mark("answer_taken")
                return resp
            except TimeoutError:
                raise DraftTimeout(f"no answer within {timeout:.2f} s") from None
            except (ControlClosed, OSError, ValueError) as e:
                # the gRPC reader may know why (the drafter aborted the stream): prefer its error
                raise self.error or StreamBroken(f"control socket: {e}") from None
        try:
            item = self._responses.get(timeout=timeout)
        except queue.Empty:
            raise DraftTimeout(f"no answer within {timeout:.2f} s") from None
        host_timeline.mark("answer_taken")
        if isinstance(item, Exception):
            self._responses.put(item)  # later readers see it too
            raise item
        return item

    def close(self) -> None:
        self.broken = True
        self._drop_landing("stream closed")
        if self.control is not None:
            self.control.close()
        self.call.cancel()
        self._requests.put(None)
        for r in self.regions.values():
            r.close()
        for e in (self.request_event, self.trees_event):
            if e is not None:
                e.close()
        self.request_event = self.trees_event = None


