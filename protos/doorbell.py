"""A GPU doorbell: a 64-bit counter in GPU memory that one process's stream rings and another's waits for.

The co-located stream's answer path (`verifier_service.transport_stream`). The drafter's stream writes
the step's value into the counter after its writes of the trees (`ring`, cuStreamWriteValue64: a memory
fence, then the write, in stream order); the verifier queues a wait for that value on its own stream
(`wait`, cuStreamWaitValue64, GEQ: a 64-bit cyclic comparison that never wraps in practice) and queues
its whole verify step behind it without waiting on the host. The drafter's GPU work and the
verifier's host work for the same step then overlap, as they do when both run in one process.

Why not a wait on the peer's IPC event: a stream waiting on the event of a process killed before its
work completed never resumes (`protos.shared_region.IpcEvent`). The doorbell's memory belongs to the
waiting side, so the waiter can always release itself: `release` writes the value from a side stream
(the verifier does it when the step's deadline passes or the stream breaks). What the released step
then reads from the region is whatever is there; the verifier checks every tree on the GPU and a
verified tree never changes the output, so a release costs speed, never correctness.

The CUDA driver's stream memory operations are reached through ctypes (torch does not expose them);
`supported` says whether this process can use them (GPU present, driver entry points, device attribute).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)
NBYTES = 8  # one little-endian uint64 at offset 0 of its region
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int64_t)(*addr - value) >= 0
_WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write
_ATTR_64_BIT_MEM_OPS = 93  # CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS


@functools.cache
def _driver() -> tuple[object, object, object] | None:
    """(cuStreamWaitValue64, cuStreamWriteValue64, cuDeviceGetAttribute) from libcuda, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fns = []
    for name in ("cuStreamWaitValue64", "cuStreamWriteValue64"):
        fn = getattr(lib, f"{name}_v2", None) or getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns.append(fn)
    attr = lib.cuDeviceGetAttribute
    attr.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    attr.restype = ctypes.c_int
    return fns[0], fns[1], attr


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether this process can ring and wait for doorbells on `device` (a CUDA device)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    drv = _driver()
    if drv is None:
        return False
    torch.cuda.init()  # the driver API needs the runtime's primary context
    value = ctypes.c_int(0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if drv[2](ctypes.byref(value), _ATTR_64_BIT_MEM_OPS, index) != 0:
        # the attribute is gone from newer drivers, where 64-bit stream memory operations are always there
        return True
    return value.value == 1


class Doorbell:
    """The counter: the first 8 bytes of `buf`, a CUDA tensor (the waiter's allocation, or the ringer's
    mapping of it)."""

    def __init__(self, buf: torch.Tensor):
        if buf.device.type != "cuda" or buf.numel() * buf.element_size() < NBYTES or buf.data_ptr() % 8:
            raise ValueError(f"a doorbell needs 8 aligned bytes of GPU memory, got {buf.numel()} "
                             f"{buf.dtype} on {buf.device}")
        self.word = buf.view(torch.uint8)[:NBYTES].view(torch.int64)
        self.device = buf.device
        self._side: torch.cuda.Stream | None = None

    def _op(self, which: int, value: int, flags: int, stream: torch.cuda.Stream | None) -> None:
        drv = _driver()
        if drv is None:
            raise RuntimeError("the CUDA driver's stream memory operations are not available")
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        rc = drv[which](ctypes.c_void_p(s.cuda_stream), self.word.data_ptr(), value & (1 << 64) - 1, flags)
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
        """The counter now (a copy on a side stream: never behind a wait). For tests and diagnostics."""
        with torch.cuda.device(self.device):
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._side):
                out = self.word.to("cpu", non_blocking=False)
        return int(out.item())
