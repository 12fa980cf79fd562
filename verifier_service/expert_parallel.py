"""Expert parallelism as a transform around the model (DESIGN 7): which routed experts a rank holds, and how
the ranks' partial MoE outputs become every rank's exact output.

Placement. Rank r of `ep_size` holds a contiguous range of experts (`expert_range`), balanced when the count
does not divide (the first `E % ep_size` ranks hold one more). Contiguous ranges keep a rank's experts
adjacent in the checkpoint (fewer shards to map) and make the global->local expert id map a subtraction.
`shard_experts` shrinks every MoE's stacked expert tensors to the local experts and records them in
`MoE.expert_ids`; apply it to a model still on the meta device, before allocation, so a rank never
allocates or reads the other ranks' experts (`checkpoint.load_target(..., ep_rank=, ep_size=)`).
Everything else -- attention and its latent KV, the dense layer, shared experts, router, embeddings,
lm_head -- is replicated on every rank, and every rank runs it on every token.

Forward (`use_expert_group` gives each MoE the process group). Per MoE layer, on every rank:
  1. the router runs on all tokens: identical inputs and kernels give identical ids and weights;
  2. the rank's experts run on the (token, slot) pairs routed to them (`kernels.int4_moe`, `experts=`):
     one row per pair, [T*k, D] fp32 (unweighted on the GPU kernel, weighted in the CPU reference);
     pairs routed to other ranks' experts hold -0.0;
  3. all-reduce (sum) of the pair rows over the group: every row is non-zero on exactly one rank and
     x + (-0.0) == x for every float x, so the sum is exact whatever order NCCL or gloo adds in;
  4. the single-process combine runs unchanged on every rank (fixed order per token: slot order in the
     kernel, ascending expert id in the reference), then the shared expert is added once.
So an expert-parallel rank's MoE output, hence its logits and KV, is bitwise the single-process model's
at any world size (tests/unit/test_ep_distributed.py: fp32 on CPU with gloo). A float all-reduce of the
combined [T, D] outputs would move k = 8 times fewer bytes but add partial sums in a backend-defined
order: not exact, so greedy DDTree could drift from AR between world sizes.

Communication at Kimi K2.6 shapes (k = 8, D = 7168, fp32 rows): 8 * 7168 * 4 = 229 KB of pair rows per
token per MoE layer (60 of the 61 layers), i.e. 13.8 MB per token per forward; a ring all-reduce moves
2 (W-1)/W of that per rank (1.75x at W = 8: 401 KB per token per layer). Estimates at ~350 GB/s NCCL bus
bandwidth on H200 NVLink (not measured here): a decode step (one token per session) is latency-bound,
~20 us per all-reduce, ~1.2 ms per forward; a 4-session step of 65-node trees (260 tokens) moves ~104 MB
per layer per rank, ~0.3 ms, about as long as the rank reads its share of the experts (~1.1 GB at
4.2 TB/s), so at large trees exactness roughly doubles the MoE time. Per step rank 0 also broadcasts the
ForwardBatch (8 B x (3T + 2S + 1 + S x pages + T x mask words)) and the commit's moves: negligible.
Rank 0 alone keeps the scheduler, sampling, acceptance and the drafter (`verifier_service.distributed`).

Left out: tensor-parallel attention (each rank reads all attention and shared-expert weights, ~290 MB per
layer, as one GPU does: TP would divide that by W); compacting the all-reduce to the held rows
(all-gather-v: 1/1.75 of the bytes, variable sizes); overlapping the all-reduce with the next layer's
attention; CUDA graphs across the collective. The NCCL path has not been run on GPUs here (only gloo on
CPU); `docs/scale-out.md` has the smoke command.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

STACKED = ("w13_packed", "w13_scale", "w2_packed", "w2_scale", "w13", "w2")


def expert_range(n_experts: int, ep_rank: int, ep_size: int) -> range:
    """Global expert ids held by `ep_rank` (contiguous, balanced)."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert parallel: need 0 <= ep_rank < ep_size, got ep_rank={ep_rank} ep_size={ep_size}")
    if ep_size > n_experts:
        raise ValueError(f"expert parallel: ep_size {ep_size} exceeds the {n_experts} routed experts")
    base, extra = divmod(n_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def max_local_experts(n_experts: int, ep_size: int) -> int:
    return -(-n_experts // ep_size)


@torch.no_grad()
def shard_experts(model: nn.Module, ep_rank: int, ep_size: int) -> range:
    """Keep only this rank's experts in every MoE module (sliced along dim 0); returns the range."""
    rng: range | None = None
    for mod in model.modules():
        if not hasattr(mod, "expert_ids"):
            continue
        n = len(mod.expert_ids)
        rng = expert_range(n, ep_rank, ep_size)
        for name in STACKED:
            t = getattr(mod, name, None)
            if t is None:
                continue
            local = t.data[rng.start : rng.stop]
            if isinstance(t, nn.Parameter):
                setattr(mod, name, nn.Parameter(local, requires_grad=t.requires_grad))
            else:
                setattr(mod, name, local)
        mod.expert_ids = tuple(rng)
    return rng if rng is not None else range(0)


def use_expert_group(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Give every MoE the group whose ranks hold the other experts; checks each holds its rank's range."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for mod in model.modules():
        if not hasattr(mod, "ep_group"):
            continue
        want = expert_range(mod.gate.cfg.n_routed_experts, rank, size)
        if mod.expert_ids != tuple(want):
            raise ValueError(f"expert parallel: rank {rank} of {size} should hold experts {want.start}.."
                             f"{want.stop - 1}, the model holds {len(mod.expert_ids)} others (loaded with another "
                             "ep_rank / ep_size?)")
        mod.ep_group = group if size > 1 else None
