"""A GPU doorbell: a 32-bit counter in GPU memory that one process's stream rings and another's waits for.

The co-located stream's answer path (`verifier_service.transport_stream`). The drafter's stream writes
the step's value into the counter after its writes of the trees (`ring`, cuStreamWriteValue32: a memory
fence, then the write, in stream order); the verifier queues a wait for that value on its own stream
(`wait`, cuStreamWaitValue32 GEQ, a cyclic comparison: (int32)(counter - value) >= 0, so the counter may
wrap, values in use are never 2^31 apart) and queues its whole verify step behind it without waiting on
the host. The drafter's GPU work and the
verifier's host work for the same step then overlap, as they do when both run in one process.

Why not a wait on the peer's IPC event: a stream waiting on the event of a process killed before its
work completed never resumes (`protos.shared_region.IpcEvent`). The doorbell's memory belongs to the
waiting side, so the waiter can always release itself: `release` writes the value from a side stream
(the verifier does it when the step's deadline passes or the stream breaks). What the released step
then reads from the region is whatever is there; the verifier checks every tree on the GPU and a
verified tree never changes the output, so a release costs speed, never correctness.

The CUDA driver's stream memory operations are reached through ctypes (torch does not expose them).
32-bit ones: the v2 entry points have them on every platform, while the 64-bit ones depend on the device
(an H200 with driver 580 reports no 64-bit support, and a 64-bit wait queued there did not wait).
`supported` checks the behaviour itself once per device: a queued wait must hold its stream back until
the ring.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time

import torch

log = logging.getLogger(__name__)
NBYTES = 4  # one little-endian uint32 at offset 0 of its region
_MASK = (1 << 32) - 1
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
_WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write


def reached(counter: int, value: int) -> bool:
    """Whether a counter reading satisfies a wait for `value` (the GPU's cyclic comparison)."""
    return (counter - value) & _MASK < 1 << 31


@functools.cache
def _driver() -> tuple[object, object] | None:
    """(cuStreamWaitValue32_v2, cuStreamWriteValue32_v2) from libcuda, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
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
    queued on a stream really holds it until another stream rings (checked once, ~10 ms)."""
    if device.type != "cuda" or not torch.cuda.is_available() or _driver() is None:
        return False
    try:
        with torch.cuda.device(device):
            waiter, ringer = torch.cuda.Stream(device), torch.cuda.Stream(device)
            with torch.cuda.stream(waiter):
                bell = Doorbell(torch.zeros(1, dtype=torch.int32, device=device))
                zeroed = torch.cuda.Event()
                zeroed.record(waiter)
                bell.wait(1, waiter)
                marker = torch.ones(1, dtype=torch.int32, device=device)  # a kernel behind the wait
            time.sleep(0.005)
            held = not waiter.query()
            ringer.wait_event(zeroed)
            bell.ring(1, ringer)
            waiter.synchronize()
            ok = held and int(marker.item()) == 1 and bell.read() == 1
    except RuntimeError as e:
        log.warning("GPU doorbells unavailable on %s: %s", device, e)
        return False
    if not ok:
        log.warning("GPU doorbells unavailable on %s: a queued wait did not hold its stream", device)
    return ok


class Doorbell:
    """The counter: the first 4 bytes of `buf`, a CUDA tensor (the waiter's allocation, or the ringer's
    mapping of it)."""

    def __init__(self, buf: torch.Tensor):
        if buf.device.type != "cuda" or buf.numel() * buf.element_size() < NBYTES or buf.data_ptr() % 4:
            raise ValueError(f"a doorbell needs 4 aligned bytes of GPU memory, got {buf.numel()} "
                             f"{buf.dtype} on {buf.device}")
        self.word = buf.view(torch.uint8)[:NBYTES].view(torch.int32)
        self.device = buf.device
        self._side: torch.cuda.Stream | None = None

    def _op(self, which: int, value: int, flags: int, stream: torch.cuda.Stream | None) -> None:
        drv = _driver()
        if drv is None:
            raise RuntimeError("the CUDA driver's stream memory operations are not available")
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        rc = drv[which](ctypes.c_void_p(s.cuda_stream), self.word.data_ptr(), value & _MASK, flags)
        if rc != 0:
            raise RuntimeError(f"CUDA driver error {rc} from a stream {'wait' if which == 0 else 'write'} "
                               f"on the doorbell")

    def ring(self, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue the write of `value` on `stream` (default: the current one), after its earlier work."""
        self._op(1, value, _WRITE_DEFAULT, stream)

    def wait(self, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue a wait on `stream` (default: the current one): its later work runs once the counter >= value."""
        self._op(0, value, _WAIT_GEQ, stream)

    def release(self, value: int) -> None:
        """Write `value` from a stream of our own (not behind a waiting stream): unblocks our waits for
        values <= `value` whatever the peer does. Thread-safe against the engine's use of the device."""
        with torch.cuda.device(self.device):
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            self.ring(value, self._side)

    def read(self) -> int:
        """The counter now, as an unsigned value (a copy on a side stream: never behind a wait)."""
        with torch.cuda.device(self.device):
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._side):
                out = self.word.to("cpu", non_blocking=False)
        return int(out.item()) & _MASK
