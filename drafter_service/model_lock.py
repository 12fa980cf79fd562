"""The drafter server's one model lock, which also tells whether another thread is waiting for it.

A co-located stream's ahead step polls the verifier's request event while holding the model (its plan sits in
the draft graph's static input); `contended` lets it stop polling and let go as soon as another stream needs the
model, so one verifier's slow or dead GPU never holds up another's steps for more than a poll.
"""

from __future__ import annotations

import threading


class ModelLock:
    """A non-reentrant lock (`with`, `acquire(blocking=False)`, `release`) that counts the threads blocked on it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0

    def acquire(self, blocking: bool = True) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        with self._count:
            self._waiting += 1
        try:
            return self._lock.acquire()
        finally:
            with self._count:
                self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def contended(self) -> bool:
        """Whether a thread is blocked waiting for the lock now."""
        return self._waiting > 0

    def __enter__(self) -> ModelLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
