"""glibc malloc settings for the commands that run a model on the host (`ddtree ... serve`, `demo`, `generate`).

Two glibc defaults make CPU model steps slow and uneven (kimi-mini drafter, 32 sessions, one thread, measured
on a 2-core box: 290 ms per draft step with the settings below, 450-500 ms without):
- every thread other than the main one gets its own arena, whose heaps are capped at 64 MiB, so a step's
  large temporaries on the services' worker threads (the model thread, the control-socket threads, the
  engine thread) are mapped and page-faulted afresh every step: `M_ARENA_MAX` 1 keeps them in the main heap;
- the dynamic mmap threshold decides by the process's allocation history whether megabyte temporaries are
  reused or mapped afresh: a fixed 1 GiB threshold, and a 2 GiB trim threshold so the heap is not handed
  back between steps, keep them reused.
The cost is a resident size that stays at its peak. Nothing happens where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, 1 << 30), (M_TRIM_THRESHOLD, 2**31 - 1))


def tune_glibc_malloc(libc: ctypes.CDLL | None = None) -> bool:
    """Apply SETTINGS with mallopt (call it before the threads that run models start) -> whether all took."""
    if libc is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:
            libc = None
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None or getattr(libc, "gnu_get_libc_version", None) is None:
        return False  # not glibc (musl, macOS): its allocator, its defaults
    if hasattr(mallopt, "argtypes"):  # a ctypes function (tests pass plain callables)
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    if not ok:
        log.warning("mallopt refused a setting: host-side model steps may be slower (see gateway.commands.host_memory)")
    return ok
