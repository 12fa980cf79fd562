"""Expert parallelism as a transform around the model (DESIGN 7): which routed experts a rank holds.

Rank r of `ep_size` holds a contiguous range of experts (`expert_range`), balanced when the count
does not divide (the first `E % ep_size` ranks hold one more). Contiguous ranges keep a rank's
experts adjacent in the checkpoint (fewer shards to map) and make the global->local expert id map a
subtraction. `shard_experts` shrinks every MoE's stacked expert tensors to the local experts and
records them in `MoE.expert_ids`; apply it to a model still on the meta device, before allocation,
so a rank never allocates or reads the other ranks' experts.
"""

from __future__ import annotations

import torch
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
