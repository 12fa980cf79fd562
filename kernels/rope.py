"""Rotary position embeddings with YaRN scaling, shared by the Kimi target and the DFlash drafter.

Two rotation layouts:
- interleaved (DeepSeek-V3 / Kimi MLA `q_pe`/`k_pe`): pairs (x[2i], x[2i+1]) rotate by angle pos*f_i.
  (HF transformers de-interleaves first; dot products between q and k are identical either way, and
  we keep the interleaved layout in the latent cache.)
- neox (Qwen3 / DFlash drafter): halves (x[i], x[i+d/2]) rotate by pos*f_i.

YaRN frequencies follow DeepSeek-V3's `DeepseekV3YarnRotaryEmbedding` (= HF `_compute_yarn_parameters`
with truncation). `Rope.apply` rotates with torch ops (`rotate_ref`: about ten elementwise launches per tensor on a
GPU) or, on CUDA, with one Triton kernel (`_rotate_kernel`: a program per token reads its rows, the cos/sin the
caller computed, and writes the rotated rows contiguous); both compute a * cos - b * sin and a * sin + b * cos in
fp32 from the same cos/sin, the kernel with fused multiply-adds where the compiler makes them, so their last bits
may differ (a few ulps of fp32, before the rounding to x's dtype). Each row's result depends on that row alone.
The cos/sin amplitude differs between the two reference implementations:
- DeepSeek rule (target): mscale(factor, mscale) / mscale(factor, mscale_all_dim) -> 1.0 for Kimi.
- HF rule (drafter): `attention_factor` if given, else that ratio when both mscale keys are set,
  else mscale(factor) -> 1.41589 for factor 64 (the Kimi DFlash drafter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(n_rot: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (n_rot * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """fp32 [dim/2] inverse frequencies, with YaRN blending when scaling['type'] == 'yarn'."""
    exps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extra = 1.0 / (base**exps)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return extra
    if kind != "yarn":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: yarn, default)")
    factor = float(scaling["factor"])
    orig = int(scaling.get("original_max_position_embeddings", 4096))
    beta_fast = float(scaling.get("beta_fast", 32))
    beta_slow = float(scaling.get("beta_slow", 1))
    inter = 1.0 / (factor * base**exps)
    low = max(math.floor(_correction_dim(beta_fast, dim, base, orig)), 0)
    high = min(math.ceil(_correction_dim(beta_slow, dim, base, orig)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra_mask = 1.0 - ramp  # 1 = keep the original (extrapolated) frequency
    return inter * (1 - extra_mask) + extra * extra_mask


def rope_amplitude(scaling: dict | None, rule: str) -> float:
    """cos/sin multiplier; rule 'deepseek' (Kimi target) or 'hf' (transformers, DFlash drafter)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind != "yarn":
        return 1.0
    factor = float(scaling["factor"])
    if rule == "deepseek":
        return yarn_mscale(factor, float(scaling.get("mscale", 1))) / yarn_mscale(
            factor, float(scaling.get("mscale_all_dim", 0))
        )
    if rule != "hf":
        raise ValueError(f"unknown rope amplitude rule {rule!r}")
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, float(scaling["mscale"])) / yarn_mscale(factor, float(scaling["mscale_all_dim"]))
    return yarn_mscale(factor)


@dataclass(frozen=True)
class Rope:
    """Precomputed rotary parameters for one head dim; `cos_sin(positions)` is per token (batch invariant)."""

    inv_freq: torch.Tensor  # fp32 [dim/2]
    amplitude: float
    interleaved: bool

    @classmethod
    def build(cls, dim: int, base: float, scaling: dict | None, rule: str, interleaved: bool) -> Rope:
        return cls(rope_inv_freq(dim, base, scaling), rope_amplitude(scaling, rule), interleaved)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> cos, sin fp32 [T, dim/2] (amplitude folded in)."""
        ang = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return ang.cos() * self.amplitude, ang.sin() * self.amplitude

    def apply(self, x: torch.Tensor, positions: torch.Tensor,
              cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, ..., dim] -> rotated x, same dtype. Math in fp32 (or fp64 when x is fp64). `cos_sin`: this
        `cos_sin(positions)`, computed once by a caller that rotates several tensors at the same positions."""
        cos, sin = self.cos_sin(positions) if cos_sin is None else cos_sin
        if (x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16) and x.dim() >= 2
                and not (torch.is_grad_enabled() and x.requires_grad)):
            return rotate_triton(x, cos, sin, self.interleaved)
        return rotate_ref(x, cos, sin, self.interleaved)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, ..., dim] rotated by cos, sin [T, dim/2] (fp32): torch ops, math in fp32 (fp64 for fp64 x)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.to(acc).view(shape), sin.to(acc).view(shape)
    xf = x.to(acc)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return out.to(x.dtype)


@triton.jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, R, stride_xt, stride_xr, stride_c, HALF: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, BLOCK_H)
    ok = (r < R)[:, None] & (i < HALF)[None, :]
    c = tl.load(cos_ptr + t * stride_c + i, mask=i < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_c + i, mask=i < HALF, other=0.0)[None, :]
    src = x_ptr + t * stride_xt + r.to(tl.int64)[:, None] * stride_xr
    dst = out_ptr + (t * R + r.to(tl.int64))[:, None] * (2 * HALF)
    if INTERLEAVED:
        ia, ib = 2 * i, 2 * i + 1
    else:
        ia, ib = i, i + HALF
    a = tl.load(src + ia[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(src + ib[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(dst + ia[None, :], (a * c - b * s).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + ib[None, :], (a * s + b * c).to(out_ptr.dtype.element_ty), mask=ok)


def rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """`rotate_ref` as one kernel launch (any device: tests run it on CPU under TRITON_INTERPRET=1). x [T, ..., dim]
    with contiguous last dims after the first (any row stride, e.g. a column slice), cos / sin fp32 [T, dim/2];
    returns a contiguous tensor of x's shape and dtype."""
    T, dim = x.shape[0], x.shape[-1]
    if dim % 2 or cos.shape != (T, dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope: x {tuple(x.shape)} needs cos / sin [{T}, {dim // 2}], got {tuple(cos.shape)} / "
                         f"{tuple(sin.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x3 = x.reshape(T, -1, dim) if x.dim() > 2 else x[:, None]
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    R = x3.shape[1]
    block_r = min(triton.next_power_of_2(R), 64)
    _rotate_kernel[(T, triton.cdiv(R, block_r))](x3, cos, sin, out, R, x3.stride(0), x3.stride(1), cos.stride(0),
                                                 HALF=dim // 2, BLOCK_R=block_r,
                                                 BLOCK_H=triton.next_power_of_2(dim // 2), INTERLEAVED=interleaved)
    return out
