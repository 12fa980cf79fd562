"""RMSNorm, shared by the Kimi target and the DFlash drafter: torch reference + row-wise Triton kernel.

y = x / sqrt(mean(x^2) + eps) * weight, fp32 accumulation, returned in x.dtype.

`rms_norm_ref` defines correctness (and runs off CUDA). torch's CUDA mean picks its
reduction layout from the number of rows (one row gets a block-wide split, many rows a warp each),
so a row's bits depend on the batch. `_rmsnorm_kernel` runs one program per row and reduces the
row in a fixed order that depends only on the row length D (chunks of BLOCK_D, lane-wise fp32
partial sums, one `tl.sum` at the end): batch invariant (DESIGN 3.5).

`rms_norm` is the launcher: Triton on CUDA for fp32/bf16/fp16 rows, the reference elsewhere and
whenever autograd needs a gradient (training runs the same modules).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl

_MAX_BLOCK = 8192  # the whole row in one chunk up to D = 8192 (Kimi: 7168, 1536, 512)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [R, D] rows at stride_xr, contiguous inside a row
    w_ptr,  # [D]
    y_ptr,  # out: [R, D] rows at stride_yr
    D, stride_xr, stride_yr, eps,
    BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr, TRIGGER: tl.constexpr = False,
):
    if TRIGGER:  # `kernels.pdl`: a PDL launch after this one may start now (it waits for our end to read)
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    x_row = x_ptr + row * stride_xr
    y_row = y_ptr + row * stride_yr
    if ONE_CHUNK:
        x = tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
        ss = tl.sum(x * x, 0)
    else:
        part = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):  # fixed order: lane-wise partial sums over chunks
            c = d0 + cols
            x = tl.load(x_row + c, mask=c < D, other=0.0).to(tl.float32)
            part += x * x
        ss = tl.sum(part, 0)
    inv = tl.rsqrt(ss / D + eps)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        x = tl.load(x_row + c, mask=c < D, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
        tl.store(y_row + c, (x * inv * w).to(y_ptr.dtype.element_ty), mask=c < D)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in at least fp32, returned in x.dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(acc)).to(x.dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                    block_d: int | None = None) -> torch.Tensor:
    """The Triton path on any device (tests call it on CPU under TRITON_INTERPRET=1).

    x [..., D] (rows may be strided, e.g. a column slice of a wider tensor); weight [D];
    out [..., D] in x.dtype, written in place when given. block_d (power of 2) is a test knob; it
    fixes the reduction order, so production keeps the default (a function of D only)."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match rows of {D}")
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: unsupported dtypes x {x.dtype}, weight {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x on {x.device}, weight on {weight.device}")
    x2 = x.reshape(-1, D)  # a view for contiguous rows and for column slices of 2-D tensors
    if x2.shape[0] > 0 and D > 0 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError("rms_norm: out must be a contiguous tensor of x's shape and dtype")
    R = x2.shape[0]
    if R == 0 or D == 0:
        return out
    bd = block_d or min(_MAX_BLOCK, triton.next_power_of_2(D))
    y2 = out.view(-1, D)
    warps = 4 if bd <= 2048 else 8
    _rmsnorm_kernel[(R,)](x2, weight, y2, D, x2.stride(0), y2.stride(0), eps, BLOCK_D=bd, ONE_CHUNK=bd >= D,
                          num_warps=warps, **pdl.trigger(x))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launcher: the batch-invariant kernel on CUDA (no autograd), the reference otherwise."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if x.is_cuda and not needs_grad and x.dtype in _DTYPES and weight.dtype in _DTYPES:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
