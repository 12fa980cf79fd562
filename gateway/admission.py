"""Admission control: at most `max_running` requests generate at once, at most `max_queue` wait.

A request takes a slot with `async with admission.slot():`. When every slot is busy it waits in a FIFO
queue; when the queue is full it is refused at once with RESOURCE_EXHAUSTED (HTTP 429), so overload
is visible to clients instead of piling up latency. A waiter that is cancelled (client gone, deadline)
leaves the queue; a slot handed to a waiter that was cancelled at the same moment passes on to the
next one, so slots are never lost. `on_change(running, queued)` reports the counts (metrics).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from contextlib import asynccontextmanager

from gateway.errors import GatewayError


class Admission:
    def __init__(self, max_running: int, max_queue: int, on_change: Callable[[int, int], None] | None = None):
        if max_running < 1 or max_queue < 0:
            raise ValueError(f"admission: max_running must be >= 1 and max_queue >= 0, got {max_running}, "
                             f"{max_queue}")
        self.max_running = max_running
        self.max_queue = max_queue
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._on_change = on_change or (lambda running, queued: None)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _changed(self) -> None:
        self._on_change(self.running, self.queued)

    async def _acquire(self) -> None:
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            self._changed()
            return
        if len(self._waiters) >= self.max_queue:
            raise GatewayError("RESOURCE_EXHAUSTED", f"the gateway is at capacity: {self.running} requests "
                                                     f"generating and {len(self._waiters)} waiting (queue limit "
                                                     f"{self.max_queue}); retry later")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._changed()
        try:
            await fut  # resolved by _release, which has already counted us as running
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot arrived as we were cancelled: pass it on
            elif fut in self._waiters:  # (_release may have skipped it already)
                self._waiters.remove(fut)
                self._changed()
            raise

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to this waiter: running stays the same
                self._changed()
                return
        self.running -= 1
        self._changed()

    @asynccontextmanager
    async def slot(self):
        await self._acquire()
        try:
            yield
        finally:
            self._release()
