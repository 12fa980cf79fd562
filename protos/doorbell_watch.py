"""The deadline of a step whose verify work waits on the GPU for the drafter's doorbell.

With a trees doorbell (`protos.doorbell`) the verifier queues its step behind a GPU-side wait and its
host then blocks in the step's read-back, with no deadline of its own. If the drafter never rings (it
died mid-step, or hangs), this watch releases the wait at the step's deadline: it writes the value
into the counter itself (from a release stream set up in advance, `Doorbell.prepare_release`) and
reports the stream as broken, so the step completes (with whatever trees the region holds, checked
on the GPU and unable to change the output) and the client reconnects. A stream that breaks for another
reason (its socket closed) is released at once.

One step is in flight at a time: `arm` after queueing the wait, `disarm` once the engine has read the
step back (the client's next step). The watch reads the counter before it acts, so a drafter that
rang just in time is never taken for a dead one.

The drafter watches its own waits the same way: with the verifier's request doorbell it queues a step drafted
ahead behind a wait for the verifier's ring (`drafter_service.draft_stream.DraftStream.queue_request_wait`), and a
watch of the stream's ends that wait at its deadline and fails the stream (the counter is then the verifier's,
mapped; a stream that closes releases its wait at once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from protos.doorbell import NBYTES, Doorbell, reached
from protos.shared_region import SharedRegion

log = logging.getLogger(__name__)


def shared_counter(region_id: int, device: torch.device) -> tuple[SharedRegion, Doorbell]:
    """A zeroed counter in a new shareable region on `device` (zeroed before any peer can map it) and its doorbell;
    RuntimeError where the doorbell cannot be set up (the region is freed)."""
    region = SharedRegion.create(region_id, NBYTES, device)
    try:
        region.buf.zero_()
        torch.cuda.current_stream(device).synchronize()
        return region, Doorbell(region.buf)
    except RuntimeError:
        region.close()
        raise


class DoorbellWatch:
    def __init__(self, bell: Doorbell, on_expired: Callable[[object], None], region: SharedRegion | None = None):
        """on_expired(owner): called on the watch's thread after it released an expired wait of `owner`.
        region: the bell's own region, closed with the watch (see `open`)."""
        self.bell = bell
        self.region = region
        self._on_expired = on_expired
        self._cv = threading.Condition()
        # (owner, value, deadline on time.monotonic, the event set when the wait is released rather than rung)
        self._armed: tuple[object, int, float, threading.Event] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="doorbell-watch", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, region_id: int, device: torch.device, on_expired: Callable[[object], None]) -> DoorbellWatch:
        """A zeroed counter in a new shareable region on `device`, ready to be released, and its watch (the
        region lives as long as the watch); RuntimeError where the doorbell cannot be set up."""
        region, bell = shared_counter(region_id, device)
        try:
            bell.prepare_release()
        except RuntimeError:
            region.close()
            raise
        return cls(bell, on_expired, region)

    def arm(self, owner: object, value: int, deadline: float, released: threading.Event) -> None:
        """Watch `owner`'s wait for `value` until `deadline`; `released` is set if the watch releases it
        (before the release, so whoever reads the step back afterwards sees it)."""
        with self._cv:
            self._armed = (owner, value, deadline, released)
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._armed = None

    def release(self, owner: object) -> bool:
        """Release `owner`'s armed wait now (its stream broke) -> whether one was armed."""
        with self._cv:
            armed = self._armed
            if armed is None or armed[0] is not owner:
                return False
            self._armed = None
        self._release(armed[1], armed[3])
        return True

    def close(self) -> None:
        """Stop the thread; an armed wait is released first (nothing is left blocked behind it). A watch made by
        `open` also lets the bell's queued work finish and frees its region."""
        with self._cv:
            armed, self._armed, self._closed = self._armed, None, True
            self._cv.notify()
        if armed is not None:
            self._release(armed[1], armed[3])
        self._thread.join(timeout=5)
        if self.region is not None:
            self.bell.close()
            self.region.close()

    def _release(self, value: int, released: threading.Event) -> bool:
        """End our wait for `value` -> whether the peer had not rung it (then `released` is set first: the step
        reads trees the peer may not have finished). A rung wait is left alone, its step's verdicts stand."""
        if reached(self.bell.read(), value):
            return False
        released.set()
        self.bell.release(value)
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._armed is None or time.monotonic() < self._armed[2]):
                    self._cv.wait(None if self._armed is None else max(0.0, self._armed[2] - time.monotonic()))
                if self._closed:
                    return
                owner, value, _, released = self._armed
                self._armed = None
            try:
                if not self._release(value, released):
                    continue  # rung in time: the engine has not read its step back yet, that is all
            except Exception:  # noqa: BLE001 - the watch must outlive a failing GPU call
                log.exception("releasing the trees doorbell failed")
                continue
            self._on_expired(owner)
