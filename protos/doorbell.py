"""A GPU doorbell: a 32-bit counter that one process's GPU stream rings and another's waits for.

The co-located stream's answer path (`verifier_service.transport_stream`). The drafter's stream writes
the step's value into the counter after its writes of the trees (`ring`, cuStreamWriteValue32: a memory
fence, then the write, in stream order); the verifier queues a wait for that value on its own stream
(`wait`, cuStreamWaitValue32 GEQ, a cyclic comparison: (int32)(counter - value) >= 0, so the counter may
wrap, values in use are never 2^31 apart) and queues its whole verify step behind it without waiting on
the host. The drafter's GPU work and the verifier's host work for the same step then overlap, as they
do when both run in one process.

The counter lives in HOST memory both processes map (a /dev/shm region, `protos.shared_region`), which
each registers with CUDA (cudaHostRegister, mapped): the GPU rings and polls it over PCIe, and either
host reads or writes it with a plain load or store. That is what makes a waiter safe from its peer:
- a stream waiting on the event of a process killed before its work completed never resumes
  (`protos.shared_region.IpcEvent`), and a wait on any counter can be satisfied only by a write;
- the waiter can always write its own counter (`release`, the verifier does it when the step's deadline
  passes or the stream breaks), and from the host, not from a GPU stream: a stream of ours may share a
  hardware queue with the blocked one (CUDA multiplexes streams onto a few connections), and a release
  queued there would wait behind the very wait it should end (seen on an H200: a test hung that way).
What a released step reads from the response region is whatever is there; the verifier checks every
tree on the GPU and a verified tree never changes the output, so a release costs speed, never tokens.

The CUDA driver's stream memory operations are reached through ctypes (torch does not expose them):
32-bit ones, which the v2 entry points have on every platform (the 64-bit ones depend on the device:
an H200 with driver 580 reports none, and a 64-bit wait queued there did not wait). `supported` checks
the behaviour once per device: a wait must hold its stream until the counter is written.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time

import torch

log = logging.getLogger(__name__)
NBYTES = 4096  # the region: one page; the counter is the little-endian uint32 at offset 0
_MASK = (1 << 32) - 1
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
_WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write
_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def reached(counter: int, value: int) -> bool:
    """Whether a counter reading satisfies a wait for `value` (the GPU's cyclic comparison)."""
    return (counter - value) & _MASK < 1 << 31


@functools.cache
def _driver() -> tuple[object, object, object] | None:
    """(cuStreamWaitValue32_v2, cuStreamWriteValue32_v2, cuMemHostGetDevicePointer_v2) from libcuda, or None."""
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
    dptr = lib.cuMemHostGetDevicePointer_v2
    dptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    dptr.restype = ctypes.c_int
    return fns[0], fns[1], dptr


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether this process can ring and wait for doorbells on `device`: the driver has the calls, host memory
    registers, and a wait queued on a stream really holds it until the counter is written (checked once, ~10 ms)."""
    if device.type != "cuda" or not torch.cuda.is_available() or _driver() is None:
        return False
    from protos.shared_region import SharedRegion  # a page of /dev/shm, like the real ones

    region = SharedRegion.create(0, NBYTES, "cpu")
    region.unlink()
    bell = None
    try:
        bell = Doorbell(region.buf, device)
        with torch.cuda.device(device):
            waiter = torch.cuda.Stream(device)
            bell.wait(1, waiter)
            with torch.cuda.stream(waiter):
                marker = torch.ones(1, dtype=torch.int32, device=device)  # a kernel behind the wait
            time.sleep(0.005)
            held = not waiter.query()
            bell.release(1)  # the host's store ends the wait
            bell.ring(2, waiter)  # and a ring lands where the host reads it
            waiter.synchronize()
            ok = held and int(marker.item()) == 1 and bell.read() == 2
    except RuntimeError as e:
        log.warning("GPU doorbells unavailable on %s: %s", device, e)
        return False
    finally:
        if bell is not None:
            bell.close()
        region.close()
    if not ok:
        log.warning("GPU doorbells unavailable on %s: a queued wait did not hold its stream", device)
    return ok


class Doorbell:
    """The counter: the first 4 bytes of `buf`, a page-aligned CPU tensor of shared memory (a /dev/shm region
    this process mapped), registered with CUDA for `device` while the Doorbell is open."""

    def __init__(self, buf: torch.Tensor, device: torch.device):
        nbytes = buf.numel() * buf.element_size()
        if buf.device.type != "cpu" or nbytes < 4 or buf.data_ptr() % 4:
            raise ValueError(f"a doorbell needs 4 aligned bytes of host memory, got {nbytes} bytes on {buf.device}")
        drv = _driver()
        if drv is None or device.type != "cuda":
            raise RuntimeError(f"no CUDA stream memory operations for a doorbell on {device}")
        self.word = buf.view(torch.uint8)[:4].view(torch.int32)
        self.device = device
        self._buf, self._nbytes = buf, nbytes
        with torch.cuda.device(device):
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, _REGISTER_FLAGS)
            if rc != 0:
                raise RuntimeError(f"cudaHostRegister of the doorbell failed ({rc})")
            self._registered = True
            out = ctypes.c_uint64(0)
            rc = drv[2](ctypes.byref(out), ctypes.c_void_p(buf.data_ptr()), 0)
            if rc != 0:
                self.close()
                raise RuntimeError(f"cuMemHostGetDevicePointer of the doorbell failed ({rc})")
        self.dptr = out.value

    def _op(self, which: int, value: int, flags: int, stream: torch.cuda.Stream | None) -> None:
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        rc = _driver()[which](ctypes.c_void_p(s.cuda_stream), self.dptr, value & _MASK, flags)
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
        """Write `value` from the host: ends our waits for values <= `value` whatever the peer does."""
        v = value & _MASK
        self.word[0] = v - (1 << 32) if v >= 1 << 31 else v

    def read(self) -> int:
        """The counter now, as an unsigned value (a host load)."""
        return int(self.word[0]) & _MASK

    def close(self) -> None:
        """Unregister, after this device's queued work (a ring or a wait still in flight reads the page)."""
        if getattr(self, "_registered", False):
            self._registered = False
            with torch.cuda.device(self.device):
                torch.cuda.synchronize(self.device)
                torch.cuda.cudart().cudaHostUnregister(self._buf.data_ptr())
