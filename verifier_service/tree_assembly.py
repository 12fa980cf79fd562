"""A step's trees in request order (`assemble_trees`): the drafter's valid trees, a root-only tree (an
autoregressive step) for every session without one."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import torch

from drafter_service.api import DraftRequest
from kernels.tree_build import TreeBatch


def assemble_trees(requests: list[DraftRequest], ids: Sequence[str] = (), trees: TreeBatch | None = None,
                   good: AbstractSet[str] = frozenset()) -> TreeBatch:
    """[R, M] trees in request order: `trees` (row j for session ids[j]) where the session is in `good`, root-only
    trees for everyone else. Validated trees are -1 / -inf beyond their n_nodes, so whole rows are copied (one
    indexed copy per field), and when every session got a valid tree in request order the batch is used as is."""
    if trees is not None and len(good) == len(ids) == len(requests) and \
            all(i == r.session_id for i, r in zip(ids, requests)):
        return trees
    R = len(requests)
    col = {sid: j for j, sid in enumerate(ids)}
    src = [col[r.session_id] if r.session_id in good else -1 for r in requests]
    n = [trees.n_nodes[j] if j >= 0 else 1 for j in src]
    M = max(n, default=1)
    dev = trees.tokens.device if trees is not None else torch.device("cpu")
    i32 = torch.int32
    out = {f: torch.full((R, M), -1, dtype=i32, device=dev) for f in TreeBatch._FIELDS if f != "logw"}
    out["logw"] = torch.full((R, M), float("-inf"), dtype=torch.float32, device=dev)
    out["tokens"][:, 0] = torch.tensor([r.root_token for r in requests], dtype=i32)
    out["depth"][:, 0] = 0
    out["logw"][:, 0] = 0.0
    dst = [i for i, j in enumerate(src) if j >= 0]
    if dst:
        w = min(M, trees.tokens.shape[1])
        at, take = torch.tensor(dst, device=dev), torch.tensor([src[i] for i in dst], device=dev)
        for f in TreeBatch._FIELDS:
            out[f][at, :w] = getattr(trees, f)[take, :w].to(out[f].dtype)
    return TreeBatch(**out, n_nodes=n)
