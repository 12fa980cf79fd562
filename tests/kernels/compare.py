"""Shared comparison for kernel tests: relative Frobenius error, NaN never passes, the worst element named."""

from __future__ import annotations

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
