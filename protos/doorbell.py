"""A GPU doorbell: a 32-bit counter that one process's GPU stream rings and another's waits for.

The co-located stream's answer path (`verifier_service.transport_stream`). The drafter's stream writes
the step's value into the counter after its writes of the trees (`ring`, cuStreamWriteValue32: a memory
fence, then the write, in stream order); the verifier queues a wait for that value on its own stream
(`wait`, cuStreamWaitValue32 GEQ, a cyclic comparison: (int32)(counter - value) >= 0, so the counter may
wrap, values in use are never 2^31 apart) and queues its whole verify step behind it without waiting on
the host. The drafter's GPU work and the verifier's host work for the same step then overlap, as they
do when both run in one process.

The counter is GPU memory of the waiting side (the verifier's, shared with the drafter by CUDA IPC), so the
waiter can always end its own wait: a stream waiting on the event of a process killed before its work
completed never resumes (`protos.shared_region.IpcEvent`), a wait on our counter ends when we write it
(`release`, the verifier does it when the step's deadline passes or the stream breaks). What a released
step reads from the response region is whatever is there; the verifier checks every tree on the GPU and a
verified tree never changes the output, so a release costs speed, never tokens.

What the H200 taught (`.devscripts/bell_diag2.py`: one process, a stream blocked in a wait, then a release):
- where every kernel used after the wait had run once before it was queued, a write from another stream
  of ours (a memory op or a kernel, normal or high priority, the blocked stream a pool stream or the legacy
  default one) ended the wait in 0.06-1 ms;
- where a kernel ran for the FIRST time in the process behind the wait (`torch.ones(1) + 1`: the add
  kernel), the process hung right at that launch, before any release was tried. Our reading, which fits
  all five hangs of the session and every run that did not hang: CUDA's lazy module loading (the default)
  synchronizes the context to load a kernel, and the context cannot go idle while a stream waits for a
  write that this same thread would issue next. So the release (`prepare_release`: stream and read buffer
  set up in advance) and the watch's reads launch no kernel at all (a memory op, an async copy), and
  tests and the self-test run each kernel once before they queue a wait. In the engine, a first launch
  behind the wait only stalls it until the drafter rings, from its own process. (A host store into
  registered host memory could not be judged: that run hung the same way. The counter stays GPU memory.)
- 64-bit waits: the device reports no 64-bit stream memory operations, and one queued anyway did not
  wait; the 32-bit ones (v2 entry points) are on every platform.

The driver's stream memory operations are reached through ctypes (torch does not expose them). `supported`
checks the behaviour once per device: a wait must hold its stream until the counter is written.

`HostBell` is the same counter in pinned host memory, for a peer that answers over the network (the gRPC
transport): the verifier queues its step behind a wait for it before the answer arrives, and the thread that
receives the answer copies the trees into pinned memory and rings it with a plain store. Ringing it needs no
CUDA call at all, so nothing that blocks inside CUDA (a first launch behind the wait, see above) can keep it from
being rung by another thread. `host_supported` checks it once per device.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)
NBYTES = 4  # the counter: a little-endian uint32 at offset 0 of its region
_MASK = (1 << 32) - 1
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
_WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write


def poll_until(done: Callable[[], bool], timeout_s: float, abort: Callable[[], bool] | None = None) -> bool:
    """Poll `done()` until it is true -> True, or False after `timeout_s` or once `abort()` (checked between polls)
    is; the process's other threads run between polls."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline or (abort is not None and abort()):
            return False
        time.sleep(0)
    return True


def reached(counter: int, value: int) -> bool:
    """Whether a counter reading satisfies a wait for `value` (the GPU's cyclic comparison)."""
    return (counter - value) & _MASK < 1 << 31


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def _driver() -> tuple[object, object] | None:
    """(cuStreamWaitValue32_v2, cuStreamWriteValue32_v2) from libcuda, or None."""
    lib = _libcuda()
    if lib is None:
        return None
    fns = []
    for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
        fn = getattr(lib, name, None)
        if fn is None:  # a driver older than CUDA 11.7: only the v1 calls, off unless the module enables them
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns.append(fn)
    return fns[0], fns[1]


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether this process can ring and wait for doorbells on `device`: the driver has the calls, and a wait
    queued on a stream really holds it until the counter is written (checked once, ~10 ms). Never hangs the
    caller: the one kernel queued behind the test's wait is launched from a thread of its own, and the wait is
    released from the prepared stream whatever that thread does; a test that does not finish is a False."""
    if device.type != "cuda" or not torch.cuda.is_available() or _driver() is None:
        return False
    try:
        with torch.cuda.device(device):
            bell = Doorbell(torch.zeros(1, dtype=torch.int32, device=device))
            bell.prepare_release()
            waiter = torch.cuda.Stream(device)
            with torch.cuda.stream(waiter):
                marker = torch.zeros(1, dtype=torch.int32, device=device)
                marker.add_(1)  # loads the kernel: none may load for the first time behind a wait (see above)
            waiter.synchronize()
            bell.wait(1, waiter)
            launched = threading.Event()

            def behind() -> None:
                with torch.cuda.device(device), torch.cuda.stream(waiter):
                    marker.add_(1)
                launched.set()

            threading.Thread(target=behind, name="doorbell-self-test", daemon=True).start()
            launched.wait(2.0)
            time.sleep(0.005)
            held = not waiter.query()
            bell.release(1)
            if not launched.wait(5.0):
                log.warning("GPU doorbells unavailable on %s: a launch behind a queued wait did not return", device)
                return False
            waiter.synchronize()
            ok = held and int(marker.item()) == 2 and bell.read() == 1
    except RuntimeError as e:
        log.warning("GPU doorbells unavailable on %s: %s", device, e)
        return False
    if not ok:
        log.warning("GPU doorbells unavailable on %s: a queued wait did not hold its stream", device)
    return ok


class Doorbell:
    """The counter: the first 4 bytes of `buf`, a CUDA tensor (the waiter's allocation, or the ringer's IPC
    mapping of it)."""

    def __init__(self, buf: torch.Tensor):
        nbytes = buf.numel() * buf.element_size()
        if buf.device.type != "cuda" or nbytes < NBYTES or buf.data_ptr() % 4:
            raise ValueError(f"a doorbell needs 4 aligned bytes of GPU memory, got {nbytes} bytes on {buf.device}")
        if _driver() is None:
            raise RuntimeError("the CUDA driver's stream memory operations are not available")
        self.word = buf.view(torch.uint8)[:NBYTES].view(torch.int32)
        self.device = buf.device
        self._side: torch.cuda.Stream | None = None
        self._host: torch.Tensor | None = None
        self._waiter: tuple[torch.cuda.Stream, torch.cuda.Event] | None = None  # `wait_host`'s

    def _op(self, which: int, value: int, flags: int, stream: torch.cuda.Stream | None) -> None:
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        rc = _driver()[which](ctypes.c_void_p(s.cuda_stream), self.word.data_ptr(), value & _MASK, flags)
        if rc != 0:
            raise RuntimeError(f"CUDA driver error {rc} from a stream {'wait' if which == 0 else 'write'} "
                               f"on the doorbell")

    def ring(self, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue the write of `value` on `stream` (default: the current one), after its earlier work."""
        self._op(1, value, _WRITE_DEFAULT, stream)

    def wait(self, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue a wait on `stream` (default: the current one): its later work runs once the counter >= value."""
        self._op(0, value, _WAIT_GEQ, stream)

    def prepare_release(self) -> None:
        """Make the release stream, the read buffer and `wait_host`'s stream and event, and use them once, before
        any wait is queued: then neither `release`, `read` nor `wait_host` sets anything up behind a queued wait
        (see the module's notes)."""
        with torch.cuda.device(self.device):
            self._side = torch.cuda.Stream(self.device)
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self.read()
            waiter = torch.cuda.Stream(self.device)
            done = torch.cuda.Event()
            done.record(waiter)
            done.synchronize()
            self._waiter = waiter, done

    def wait_host(self, value: int, timeout_s: float, abort: Callable[[], bool] | None = None) -> bool:
        """Until the counter reaches `value` -> True, or False after `timeout_s` (or once `abort()` says so). The
        host polls an event queued behind a GPU wait on a stream of ours, so no GPU work of ours runs while the
        ringer works: each `read` would be a copy on our context, which the GPU time-slices with the ringer's (a loop
        of them slows the ringer's work). After False that wait stays queued until the counter reaches `value`: the
        caller sees to it as for any wait of ours (`release`, or its watch). Not thread-safe against itself;
        `prepare_release` first."""
        if self._waiter is None:
            raise RuntimeError("Doorbell.wait_host before prepare_release")
        waiter, done = self._waiter
        self.wait(value, waiter)
        done.record(waiter)
        return poll_until(done.query, timeout_s, abort)

    def release(self, value: int) -> None:
        """Write `value` from our warmed-up release stream: ends our waits for values <= `value` whatever the peer
        does. Thread-safe against the engine's use of the device; allocates nothing."""
        if self._side is None:
            raise RuntimeError("Doorbell.release before prepare_release")
        self.ring(value, self._side)
        self._side.query()  # submit it now

    def read(self) -> int:
        """The counter now, as an unsigned value (a copy on the release stream: never behind a wait)."""
        if self._side is None:
            raise RuntimeError("Doorbell.read before prepare_release")
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            self._host.copy_(self.word, non_blocking=True)
        self._side.synchronize()
        return int(self._host.item()) & _MASK

    def close(self) -> None:
        """Before the memory goes: let this device's queued work (a ring still in flight) finish."""
        torch.cuda.synchronize(self.device)


class HostBell:
    """The counter in pinned host memory (4 bytes of its own): GPU streams wait for it (`wait`), any thread rings
    it with a store (`ring`, `release`), with no CUDA call. Has what `DoorbellWatch` needs of a bell."""

    def __init__(self, device: torch.device):
        if device.type != "cuda" or _driver() is None:
            raise RuntimeError(f"host doorbells need a CUDA device and the driver's stream memory operations, "
                               f"not {device}")
        self.device = device
        self.word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._store = self.word.numpy()  # stores through numpy: no torch dispatch, no CUDA
        ptr = ctypes.c_uint64()
        fn = _libcuda().cuMemHostGetDevicePointer_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)  # the context exists before the driver is asked
            rc = fn(ctypes.byref(ptr), ctypes.c_void_p(self.word.data_ptr()), 0)
        if rc != 0:
            raise RuntimeError(f"CUDA driver error {rc}: pinned memory has no device address here")
        self._dptr = ptr.value

    def wait(self, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue a wait on `stream` (default: the device's current one): its later work runs once the counter
        >= value (cyclic)."""
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        rc = _driver()[0](ctypes.c_void_p(s.cuda_stream), self._dptr, value & _MASK, _WAIT_GEQ)
        if rc != 0:
            raise RuntimeError(f"CUDA driver error {rc} from a stream wait on the host doorbell")

    def ring(self, value: int) -> None:
        """Store `value` (after the caller's earlier stores to pinned memory: x86 keeps stores in order)."""
        self._store[0] = value - (1 << 32) if value & _MASK >= 1 << 31 else value & _MASK

    release = ring  # the watch's name for it: ours to ring whatever the peer does

    def read(self) -> int:
        return int(self._store[0]) & _MASK

    def wait_host(self, value: int, timeout_s: float, abort: Callable[[], bool] | None = None) -> bool:
        """Until the counter reaches `value` -> True, or False after `timeout_s` (or once `abort()` says so): a
        poll of host memory, no CUDA call."""
        return poll_until(lambda: reached(self.read(), value), timeout_s, abort)

    def prepare_release(self) -> None:
        """Nothing to set up: a store needs no stream."""

    def close(self) -> None:
        """Before the memory goes: let this device's queued work (a wait still queued) finish."""
        torch.cuda.synchronize(self.device)


_STUCK: list = []  # what a failed self-test left a stream waiting on (never freed)


@functools.cache
def host_supported(device: torch.device) -> bool:
    """Whether streams on `device` can wait for a `HostBell` (checked once, ~10 ms): a wait holds its stream until
    the host's store, then releases it. Never hangs the caller: the store needs no CUDA call."""
    if device.type != "cuda" or not torch.cuda.is_available() or _driver() is None or _libcuda() is None:
        return False
    try:
        with torch.cuda.device(device):
            bell = HostBell(device)
            waiter = torch.cuda.Stream(device)
            with torch.cuda.stream(waiter):
                marker = torch.zeros(1, dtype=torch.int32, device=device)
                marker.add_(1)  # loads the kernel before any wait (see the module's notes)
            waiter.synchronize()
            bell.wait(1, waiter)
            with torch.cuda.stream(waiter):
                marker.add_(1)
            time.sleep(0.005)
            held = not waiter.query()
            bell.ring(1)
            deadline = time.monotonic() + 5.0
            while not waiter.query():
                if time.monotonic() > deadline:
                    log.warning("host doorbells unavailable on %s: a wait was not released by the host's store",
                                device)
                    _STUCK.append((bell, waiter, marker))  # a stream may still poll that memory: keep it
                    return False
                time.sleep(0.0005)
            ok = held and int(marker.item()) == 2
    except (RuntimeError, AttributeError) as e:
        log.warning("host doorbells unavailable on %s: %s", device, e)
        return False
    if not ok:
        log.warning("host doorbells unavailable on %s: a queued wait did not hold its stream", device)
    return ok
