"""Compressed-tensors `pack-quantized` INT4 (symmetric, group-wise) packing: the reference rule.

Layout of one projection (an nn.Linear weight W [out, in]) in a checkpoint:
  weight_packed  int32 [out, in/8]   nibble k (bits 4k..4k+3) of word j holds column 8j+k as u = q + 8
  weight_scale   bf16  [out, in/G]   G = group size (32 for Kimi K2.x)
  weight_shape   int32 [2]           (out, in)
Dequantisation: W[r, c] = (u - 8) * scale[r, c // G].  This file defines correctness; kernels
and loaders may repack, but must reproduce `dequantize_int4` bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_FACTOR = 8  # int4 values per int32 word
ZERO_POINT = 8  # u = q + 8 stored unsigned in a nibble


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed int4 values q in [-8, 7], [out, in] (in % 8 == 0) -> int32 [out, in/8]."""
    if q.dim() != 2 or q.shape[1] % PACK_FACTOR:
        raise ValueError(f"pack_int4 wants [out, in] with in % 8 == 0, got {tuple(q.shape)}")
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise ValueError("pack_int4: values outside [-8, 7]")
    u = (q.to(torch.int64) + ZERO_POINT).view(q.shape[0], -1, PACK_FACTOR)  # [out, in/8, 8]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (u << shifts).sum(-1)  # fits in uint32
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as int32
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor, in_features: int | None = None) -> torch.Tensor:
    """int32 [..., out, in/8] -> signed int8 values [..., out, in] in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    u = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift then mask: sign bits drop out
    q = (u - ZERO_POINT).to(torch.int8).flatten(-2)
    if in_features is not None:
        q = q[..., :in_features]
    return q


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest group quantisation of w [out, in] -> (q int8 [out, in], scale [out, in/G]).

    scale = max|w| / 7 per group (the compressed-tensors minmax observer for symmetric int4 uses
    the same ratio); scales are rounded to bf16 first so that dequantisation reproduces exactly
    what a checkpoint stores.
    """
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of group size {group_size}")
    g = w.float().view(out_f, in_f // group_size, group_size)
    scale = (g.abs().amax(-1) / 7.0).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return q.view(out_f, in_f), scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequant: int32 [..., out, in/8] + scale [..., out, in/G] -> W [..., out, in] in `dtype`."""
    in_f = packed.shape[-1] * PACK_FACTOR
    group = in_f // scale.shape[-1]
    q = unpack_int4(packed).to(dtype)
    s = scale.to(dtype).repeat_interleave(group, dim=-1)
    return q * s


def permute_steps(packed: torch.Tensor, scale: torch.Tensor, phys: torch.Tensor, k_align: int,
                  step_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel layout that permutes the columns inside each step of 256: int32 [E, N, K/8] + scale [E, N, K/32]
    -> words [E, N, Kp/8] whose nibble n of word w of a step (w = 0..31, n = 0..7) holds the step's column
    phys[w, n], with K padded to a multiple of `k_align` (zero weights: q = 0, nibble 8) and the scales padded
    with zeros. `step_major`: each expert's words and scales stored step by step instead (the same shapes; step s
    of row n at [s, n] of `.view(E, Kp/256, N, -1)`). One expert at a time (bounded temporaries); run once at
    load."""
    E, N, k8 = packed.shape
    K = k8 * PACK_FACTOR
    kp = -(-K // k_align) * k_align
    phys = phys.to(packed.device).reshape(-1)  # [256]: word-major, nibble position minor
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    out = torch.empty(E, N, kp // PACK_FACTOR, dtype=torch.int32, device=packed.device)
    steps = kp // 256
    dst = out.view(E, steps, N, -1) if step_major else out
    for e in range(E):
        u = ((packed[e].long().unsqueeze(-1) >> shifts) & 0xF).flatten(-2)  # [N, K] column order
        u = F.pad(u, (0, kp - K), value=8).view(N, steps, 256)
        u = u[..., phys].view(N, steps, 32, 8)  # [N, step, word, nibble position]
        words = (u << shifts).sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # [N, step, word]
        dst[e] = words.transpose(0, 1) if step_major else words.view(N, -1)
    scale = F.pad(scale, (0, kp // 32 - scale.shape[-1]))
    if step_major:
        return out, scale.view(E, N, steps, -1).transpose(1, 2).contiguous().view(E, N, -1)
    return out, scale.contiguous()
