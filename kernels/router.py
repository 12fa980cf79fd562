"""The MoE router's selection after its GEMM (DeepSeek-V3 noaux_tc, sigmoid scores): torch reference + one Triton
kernel.

  scores = sigmoid(logits)  [T, E] fp32;  choice = scores + correction bias (selects only)
  ids    = the k experts of largest choice (grouped routing first masks all but the top `topk_group` groups,
           ranked by the sum of their two best choices)
  w      = scores at ids, divided by their sum (+ 1e-20) when norm_topk_prob, times routed_scaling_factor

`route_ref` is that in torch ops: about ten launches on a GPU (sigmoid, the bias add, a top-k in two kernels, the
gather, the sum, the add, the division, the scale), each a few microseconds of a one-token MoE layer's ~80.
`_route_kernel` does it in one program per token: the row's E scores in registers, k max-reductions for the
selection (ties: the lower expert id first; a NaN choice ranks below every number, so the ids are always k distinct
experts), the normalisation summed in slot order. A row's result depends only on its logits, so the kernel is
batch invariant. It keeps the reference's ranking (its order: choice descending), but not necessarily its last
bits: its sigmoid is Triton's, not torch's (a few ulps), so weights agree to ~1e-6 and ids agree wherever two
choices are more than that apart; the served model runs the one or the other everywhere, never a mix.

`route` is the launcher: the kernel on CUDA without grouped routing (Kimi K2.6: one group), the reference elsewhere
(CPU, and grouped routing such as DeepSeek-V3's 8 groups).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 4096  # a row's scores in one program's registers


def route_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1,
              norm_topk_prob: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32 or wider), bias [E] -> (ids [T, k] int64, weights [T, k] fp32)."""
    acc = logits.dtype
    scores = torch.sigmoid(logits)
    choice = scores + bias.to(acc)
    if n_group > 1:
        T, E = logits.shape
        group_scores = choice.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = group_scores.topk(topk_group, dim=-1).indices
        gmask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(E // n_group, 1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, (w * scaling).to(torch.float32)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, scaling, K: tl.constexpr, KP: tl.constexpr,
                  NORM: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    live = offs < E
    logit = tl.load(logits_ptr + row * stride_l + offs, mask=live, other=0.0).to(tl.float32)
    score = tl.sigmoid(logit)
    choice = score + tl.load(bias_ptr + offs, mask=live, other=0.0).to(tl.float32)
    choice = tl.where(live & (choice == choice), choice, float("-inf"))  # NaN and padding rank last
    avail = live
    slot = tl.arange(0, KP)  # K slots, padded to a power of 2
    ids = tl.zeros([KP], tl.int32)
    w = tl.zeros([KP], tl.float32)
    total = 0.0  # the picked scores summed in slot order
    for j in tl.static_range(K):
        c = tl.where(avail, choice, float("-inf"))
        best = tl.max(c, axis=0)
        pick = tl.min(tl.where(avail & (c == best), offs, BLOCK_E), axis=0)  # the lowest id among the best
        avail = avail & (offs != pick)
        picked = tl.sum(tl.where(offs == pick, score, 0.0), axis=0)
        ids = tl.where(slot == j, pick, ids)
        w = tl.where(slot == j, picked, w)
        total += picked
    if NORM:
        w = w / (total + 1e-20)
    tl.store(ids_ptr + row * K + slot, ids.to(tl.int64), mask=slot < K)
    tl.store(w_ptr + row * K + slot, w * scaling, mask=slot < K)


def route_triton(logits: torch.Tensor, bias: torch.Tensor, k: int, norm_topk_prob: bool = True,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on any device (tests call it on CPU under TRITON_INTERPRET=1): ungrouped routing only."""
    T, E = logits.shape
    if bias.shape != (E,) or not 1 <= k <= E or E > MAX_EXPERTS:
        raise ValueError(f"route: logits {tuple(logits.shape)}, bias {tuple(bias.shape)}, k = {k} (1 <= k <= E <= "
                         f"{MAX_EXPERTS})")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, bias, ids, w, E, logits.stride(0), float(scaling), K=k,
                            KP=triton.next_power_of_2(k), NORM=norm_topk_prob, BLOCK_E=triton.next_power_of_2(E),
                            num_warps=4)
    return ids, w


def route(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1,
          norm_topk_prob: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's selection (module doc): the kernel on CUDA for fp32 logits without grouped routing, the
    reference otherwise."""
    grouped = n_group > 1 and topk_group < n_group
    if (logits.is_cuda and logits.dtype == torch.float32 and not grouped and logits.shape[-1] <= MAX_EXPERTS
            and not (torch.is_grad_enabled() and logits.requires_grad)):
        return route_triton(logits, bias, k, norm_topk_prob, scaling)
    return route_ref(logits, bias, k, n_group, topk_group, norm_topk_prob, scaling)
