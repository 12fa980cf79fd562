"""The launches around the two expert GEMMs that the Gluon paths share (`int4_moe_gluon`, `int4_moe_wgmma`).

`routed_moe` checks the weights' shapes, pads the activations to the layout's K, groups the pairs by expert
(`moe_align`, no host sync), allocates the per-pair buffers, calls the path's w13 and w2 launches and ends with the
slot-ordered combine: everything but the GEMMs, so both paths keep one definition of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels._int4_moe_kernels import _moe_combine_kernel
from kernels._moe_align import moe_align
from kernels.int4_moe import _local_ids, _pair_buffer
from kernels.int4_pack import PACK_FACTOR

# (x [T, Kp13], a [P, Kp2], sorted_pairs, block_expert, topk, P) -> None: writes a (w13) / y (w2)
Gemm = Callable[..., None]


def routed_moe(name: str, x, topk_ids, topk_w, w13, s13, w2, s2, out, *, k_align: int, block_pairs: int,
               experts: range | None, reduce_pairs, w13_gemm: Gemm, w2_gemm: Gemm, pdl: bool = False,
               direct: bool = False, fused: Callable[..., None] | None = None,
               combined: bool = False) -> torch.Tensor:
    """The routed-expert op around `w13_gemm(x, a, pairs, bexp, topk, P)` (a [P, Kp2] = silu(gate) * up, zeros
    past I) and `w2_gemm(a, y, pairs, bexp, topk, P)` (y [P, D] fp32, unweighted); `name` labels the errors. `pdl`:
    the combine is launched with programmatic dependent launch (it waits for the previous grid before it reads).
    `direct` (one token, all experts held): no grouping launch; the GEMMs get as bexp the pairs' expert ids (int64,
    one block per pair: a token's top-k experts are distinct) and the same tensor, not to be read, as pairs.
    `fused(x, a, y, out, topk_ids[0], topk_w[0])` (one token, all experts held): the whole layer as one launch
    instead of the grouping, the GEMMs and the combine. `combined`: `w2_gemm` also wrote the combine into `out`
    (one token, no `reduce_pairs`), so no combine launch follows it."""
    T, D = x.shape
    E, two_i, kw13 = w13.shape
    inter = two_i // 2
    kp13, kp2 = kw13 * PACK_FACTOR, w2.shape[2] * PACK_FACTOR
    if kp13 % k_align or kp2 % k_align or kp13 < D or kp2 < inter or w2.shape[:2] != (E, D):
        raise ValueError(f"{name}: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} are not "
                         f"weights of this shape in its layout (K padded to a multiple of {k_align})")
    if out is None:
        out = torch.empty_like(x)
    if T == 0:
        return out
    topk = topk_ids.shape[1]
    P = T * topk
    if D != kp13:  # the kernels read whole steps: zeros past D (the weights there are 0 too, but 0 * NaN is not)
        x = F.pad(x, (0, kp13 - D))
    x = x.contiguous()
    if combined and (T != 1 or reduce_pairs is not None):
        raise ValueError(f"{name}: the combine in w2 needs one token and no reduce_pairs")
    if direct or fused is not None:
        if T != 1 or experts is not None:
            raise ValueError(f"{name}: direct blocks and the fused decode need one token and every expert held")
        sorted_pairs = bexp = topk_ids.reshape(-1)
    else:
        sorted_pairs, bexp = moe_align(_local_ids(topk_ids, experts, E), E, block_pairs)
    a = (torch.zeros if kp2 != inter else torch.empty)(P, kp2, dtype=x.dtype, device=x.device)
    y = _pair_buffer(P, D, torch.float32, x.device, experts is not None)
    if fused is not None:
        fused(x, a, y, out, topk_ids.reshape(-1), topk_w.reshape(-1).contiguous())
        return out
    w13_gemm(x, a, sorted_pairs, bexp, topk, P)
    w2_gemm(a, y, sorted_pairs, bexp, topk, P)
    if combined:
        return out
    if reduce_pairs is not None:
        reduce_pairs(y)
    _moe_combine_kernel[(T, -(-D // 1024))](
        y, topk_w.contiguous(), out, D, y.stride(0), out.stride(0), TOPK=topk, BLOCK=1024, num_warps=4,
        **({"PDL": True, "launch_pdl": True} if pdl else {}))
    return out
