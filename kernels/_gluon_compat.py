"""Names of Triton's Gluon dialect that moved between the Triton versions we run (3.6 on the GPU, 3.9 in CI)."""

from __future__ import annotations

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    # renamed in Triton 3.7+: async_copy_global_to_shared -> async_load (same arguments)
    cp_async = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed barrier() in Triton 3.7+
    from triton.experimental.gluon.language.nvidia.hopper import tma as _tma

    # TMA tile load (descriptor, coordinates, mbarrier, destination): async_copy_global_to_shared in 3.6, async_load
    # from 3.7 (where the old name raises)
    tma_load = getattr(_tma, "async_load", None) or _tma.async_copy_global_to_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

if HAVE_GLUON:
    from triton.language.core import builtin

    @builtin
    def smem_reinterpret(desc, dtype, shape, layout, _semantic=None):
        """A shared-memory view as another dtype, shape or layout (the same bytes): `_reinterpret` in Triton 3.6,
        `reinterpret` from 3.7 (where the old name is gone)."""
        fn = getattr(desc, "reinterpret", None) or desc._reinterpret
        return fn(dtype, shape, layout, _semantic=_semantic)
