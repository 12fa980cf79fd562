"""Shared comparison for kernel tests: relative Frobenius error, NaN never passes, the worst element named; and
whether the Triton interpreter's dot can give bitwise claims about row tiles on this CPU."""

from __future__ import annotations

import functools

import numpy as np
import torch


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """Relative Frobenius error <= tol; NaN never passes; on failure name the worst element."""
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    o, r = out.double().cpu(), ref.double().cpu()
    nan = torch.isnan(o)
    err = (o - r).norm() / r.norm().clamp_min(1e-30)
    if nan.any() or not err <= tol:
        diff = torch.where(nan, torch.full_like(o, float("inf")), (o - r).abs())
        i = tuple(int(v) for v in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{what}: rel err {float(err):.3e} > {tol:.1e} (NaNs: {int(nan.sum())}); "
                             f"worst at {i}: out {float(o[i]):.6g} ref {float(r[i]):.6g}")


@functools.cache
def interpreter_dot_row_invariant(dtype: torch.dtype, k: int = 256, n: int = 128) -> bool:
    """Whether the Triton interpreter's tl.dot (`np.matmul(a, b, dtype=float32)`, i.e. numpy's BLAS on this CPU)
    gives a row the same bits whatever the number of rows in its tile (16, 32 or 64). A GPU's MMA does; OpenBLAS
    need not (seen: AMD EPYC, OpenBLAS 0.3.31 DYNAMIC_ARCH, both fp32 and fp16 inputs), and where it does not, a
    kernel's bits under the interpreter depend on its row tile for reasons that are not the kernel's."""
    rng = np.random.default_rng(0)
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}[dtype]
    a = rng.standard_normal((64, k)).astype(np_dtype)
    b = rng.standard_normal((k, n)).astype(np_dtype)
    full = np.matmul(a, b, dtype=np.float32)
    return all(np.array_equal(np.matmul(a[:m], b, dtype=np.float32), full[:m]) for m in (16, 32))
