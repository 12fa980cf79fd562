"""Routed-expert MoE with INT4 (compressed-tensors pack-quantized, group 32) weights (DESIGN 2.1, 4).

Weights per layer, stacked over experts at load time (gate and up concatenated on the out axis):
  w13_packed int32 [E, 2I, D/8], w13_scale [E, 2I, D/G]   (rows 0..I-1 = gate, I..2I-1 = up)
  w2_packed  int32 [E, D, I/8],  w2_scale  [E, D, I/G]
y[t] = sum_k topk_w[t, k] * down(silu(gate(x_t)) * up(x_t)) for the experts topk_ids[t, k].
The shared expert is not part of this op.

`moe_dense_ref` is the math on dequantised (or bf16-checkpoint) weights; `int4_moe_ref` composes it
with the reference dequant in `kernels.int4_pack`. `int4_moe` is the launcher (GPU kernel path added
by the kernels work; the reference elsewhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.int4_pack import dequantize_int4


def moe_dense_ref(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_w: torch.Tensor,  # [T, k] fp32 routing weights (already normalised and scaled)
    w13: torch.Tensor,  # [E, 2I, D]
    w2: torch.Tensor,  # [E, D, I]
) -> torch.Tensor:
    T, D = x.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    inter = w2.shape[-1]
    out = torch.zeros(T, D, dtype=acc, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # group (token, slot) pairs by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        pairs = order[start : start + c]
        start += c
        tok = pairs // topk_ids.shape[1]
        h = x[tok].to(acc) @ w13[e].to(acc).T  # [c, 2I]
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = a @ w2[e].to(acc).T  # [c, D]
        out.index_add_(0, tok, y * topk_w.reshape(-1)[pairs].to(acc)[:, None])
    return out.to(x.dtype)


def int4_moe_ref(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale):
    acc = torch.promote_types(x.dtype, torch.float32)
    w13 = dequantize_int4(w13_packed, w13_scale, acc)
    w2 = dequantize_int4(w2_packed, w2_scale, acc)
    return moe_dense_ref(x, topk_ids, topk_w, w13, w2)


def int4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale):
    """Launcher: checks shapes; dispatches to the Triton kernel on CUDA, the reference elsewhere."""
    T, D = x.shape
    E, two_i, d8 = w13_packed.shape
    if d8 * 8 != D or w2_packed.shape[:2] != (E, D) or w2_packed.shape[2] * 8 * 2 != two_i:
        raise ValueError(f"int4_moe: x {tuple(x.shape)}, w13 {tuple(w13_packed.shape)}, "
                         f"w2 {tuple(w2_packed.shape)} do not agree")
    if topk_ids.shape != topk_w.shape or topk_ids.shape[0] != T:
        raise ValueError("int4_moe: topk_ids/topk_w must both be [T, k]")
    return int4_moe_ref(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale)
