"""DDTree tree construction on the device (DESIGN 3.1), plus its pure-Python references.

Owns `tree_size`, the `TreeBatch` container and `build_tree`: the N best-scoring prefixes of
per-depth top-K token lists, built with fixed-shape torch ops only (no host synchronisation,
no data-dependent shapes), so the build can run inside a CUDA graph. Also owns the two
references the tests compare it against: an explicit enumeration (`build_tree_reference`)
and the best-first heap of the DDTree paper (`best_first_heap_reference`).

Node order (total, deterministic): x before y iff score_x > score_y; or equal score and
depth_x < depth_y; or equal score and depth and parent(x) before parent(y); or same parent
and rank_x < rank_y. Ranks at each depth sort tokens by (logq desc, token id asc).
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kernels.stable_topk import top_k_stable

LOGQ_FLOOR = -1e30  # -inf log-probs become very low but valid candidates; -inf marks padding


def tree_size(budget: int, topk: int, depth: int) -> int:
    """Nodes in the tree incl. the root: 1 + min(budget, sum_{d=1..depth} topk**d)."""
    if budget < 0 or topk < 0 or depth < 0:
        raise ValueError(f"negative tree parameter: budget={budget} topk={topk} depth={depth}")
    if topk == 1:
        return 1 + min(budget, depth)
    total, level = 0, 1
    for _ in range(depth):
        level *= topk
        total += level
        if total >= budget:  # cap early: topk**depth can be astronomically large
            break
    return 1 + min(budget, total)


@dataclass
class TreeBatch:
    """R trees padded to M nodes; node 0 is the root, parents precede children."""

    tokens: Tensor  # [R, M] int32, -1 = padding
    parent: Tensor  # [R, M] int32, -1 = root or padding
    depth: Tensor  # [R, M] int32, 0 = root, -1 = padding
    first_child: Tensor  # [R, M] int32, smallest child index, -1 = none
    next_sibling: Tensor  # [R, M] int32, smallest later index with the same parent, -1 = none
    logw: Tensor  # [R, M] float32, cumulative log-weight (0 at the root), -inf = padding
    n_nodes: list[int]  # host ints, per request, from tree_size (no sync needed)
    # [6, R, M] int32 whose rows are the six arrays above (logw's float32 bits last) when they are views of one
    # buffer (`from_packed`): the per-step wire and check paths then move one tensor instead of six
    packed: Tensor | None = field(default=None, repr=False, compare=False)

    _FIELDS = ("tokens", "parent", "depth", "first_child", "next_sibling", "logw")

    @classmethod
    def from_packed(cls, packed: Tensor, n_nodes: list[int]) -> TreeBatch:
        """[6, R, M] int32 (TreeBatch._FIELDS order, logw bit-cast) -> a batch whose arrays are views of it."""
        rows = packed.unbind(0)  # one op for the six views (this runs on every draft step's path)
        return cls(*rows[:5], rows[5].view(torch.float32), list(n_nodes), packed)

    def pack(self) -> Tensor:
        """[6, R, M] int32 in _FIELDS order (logw bit-cast): `packed` itself when set, else one stacked copy."""
        if self.packed is not None:
            return self.packed
        return torch.stack([self.tokens, self.parent, self.depth, self.first_child, self.next_sibling,
                            self.logw.view(torch.int32)])

    def to(self, device: torch.device | str) -> TreeBatch:
        if self.packed is not None:
            return TreeBatch.from_packed(self.packed.to(device), self.n_nodes)
        moved = {f: getattr(self, f).to(device) for f in self._FIELDS}
        return TreeBatch(**moved, n_nodes=list(self.n_nodes))

    def select(self, r: int) -> dict[str, Tensor]:
        """Request r's arrays as 1-D tensors trimmed to n_nodes[r]."""
        n = self.n_nodes[r]
        return {f: getattr(self, f)[r, :n] for f in self._FIELDS}

    def n_nodes_device(self) -> Tensor:
        """[R] int32 node counts computed on the tensors' device (no host-to-device copy)."""
        return (self.depth >= 0).sum(-1, dtype=torch.int32)


def _row_values(values: list[int], device: torch.device) -> Tensor:
    """[R] int64 on `device` from host ints without a blocking copy: one fill per run of equal
    values (graph-capturable; the values are baked into the launches)."""
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out[start:i] = values[start]
            start = i
    return out


def _fcns(parent: Tensor) -> tuple[Tensor, Tensor]:
    """First-child / next-sibling arrays ([R, M] int32, -1 = none) from parent ([R, M], -1 = none)."""
    R, M = parent.shape
    dev = parent.device
    idx = torch.arange(M, device=dev).expand(R, M)
    has_parent = parent >= 0
    key = torch.where(has_parent, parent.long(), M)  # [R, M] int64, M = "no parent" group
    # first child: min child index per parent (column M collects the parentless nodes).
    fc = torch.full((R, M + 1), M, dtype=torch.int64, device=dev)
    fc.scatter_reduce_(1, key, idx, reduce="amin", include_self=True)
    first_child = torch.where(fc[:, :M] == M, -1, fc[:, :M]).int()
    # next sibling: stable sort by parent keeps siblings in index order; neighbours in a group link.
    skey, perm = torch.sort(key, dim=1, stable=True)  # [R, M]
    same = (skey[:, :-1] == skey[:, 1:]) & (skey[:, :-1] < M)  # [R, M-1]
    nxt = torch.where(same, perm[:, 1:], -1)
    ns_sorted = torch.cat([nxt, torch.full((R, 1), -1, dtype=torch.int64, device=dev)], dim=1)
    next_sibling = torch.empty_like(ns_sorted).scatter_(1, perm, ns_sorted).int()
    return first_child, next_sibling


def build_tree(logq: Tensor, roots: Tensor, budgets: list[int], topks: list[int]) -> TreeBatch:
    """Build R DDTree draft trees from per-depth log-probs, exactly and without host sync.

    logq: [R, L, V] float, logq[r, d-1, v] = log q(token v at depth d); should be log-probs
      (<= 0). It is clamped to [-1e30, 0]; the upper clamp keeps the tree prefix-closed.
    roots: [R] int, the root (last committed) token of each request.
    budgets / topks: host ints per request: draft nodes N_r and rank cap K_r (min'd with V).
    Method (DESIGN 3.1): level-wise beam of width W = max_r(n_nodes_r - 1) over the per-depth
    top-K lists, then one global stable sort of all kept nodes; see the module docstring.
    """
    R, L, V = logq.shape
    dev = logq.device
    if len(budgets) != R or len(topks) != R or roots.shape != (R,):
        raise ValueError(
            f"expected {R} roots/budgets/topks, got {tuple(roots.shape)}/{len(budgets)}/{len(topks)}"
        )
    kcap = [min(k, V) for k in topks]
    n_nodes = [tree_size(b, k, L) for b, k in zip(budgets, kcap)]
    M = max(n_nodes, default=1)
    W, K = M - 1, max(kcap, default=0)  # beam width; top-K list length
    i32 = torch.int32

    tokens = torch.full((R, M), -1, dtype=i32, device=dev)
    tokens[:, 0] = roots.to(i32)
    parent = torch.full((R, M), -1, dtype=i32, device=dev)
    depth = torch.full((R, M), -1, dtype=i32, device=dev)
    depth[:, 0] = 0
    logw = torch.full((R, M), float("-inf"), dtype=torch.float32, device=dev)
    logw[:, 0] = 0.0
    if W == 0:
        fc, ns = _fcns(parent)
        return TreeBatch(tokens, parent, depth, fc, ns, logw, n_nodes)

    lq = logq.float().clamp(min=LOGQ_FLOOR, max=0.0)
    # Per-depth ranking: the first K of a stable descending sort => ties broken by token id ascending.
    top_lq, top_ids = top_k_stable(lq, K)  # [R, L, K]
    rank_ok = torch.arange(K, device=dev) < _row_values(kcap, dev)[:, None]  # [R, K]
    top_lq = torch.where(rank_ok[:, None, :], top_lq, float("-inf"))

    # Level-wise beam. Beam at depth 0 = the root alone (score 0), the rest invalid (-inf).
    beam = torch.full((R, W), float("-inf"), dtype=torch.float32, device=dev)
    beam[:, 0] = 0.0
    scores, parents, ranks = [], [], []  # per depth: [R, W] float32 / int64 / int64
    for d in range(L):
        # candidates enumerated in (parent beam position, rank) order: [R, W*K]
        cand = (beam[:, :, None] + top_lq[:, d, None, :]).reshape(R, W * K)
        cs, order = torch.sort(cand, dim=1, descending=True, stable=True)
        beam, order = cs[:, :W], order[:, :W]
        scores.append(beam)
        parents.append(order // K)
        ranks.append(order % K)

    # Global order: kept nodes concatenated depth by depth; stable sort keeps (depth, beam pos).
    all_s = torch.cat(scores, dim=1)  # [R, L*W] float32
    all_pp = torch.cat(parents, dim=1)  # [R, L*W] parent beam position at the previous depth
    all_rk = torch.cat(ranks, dim=1)  # [R, L*W] rank at own depth
    gs, gorder = torch.sort(all_s, dim=1, descending=True, stable=True)
    gs, flat = gs[:, :W], gorder[:, :W]  # [R, W]: output node i+1 = kept node flat[:, i]

    pos = torch.arange(W, device=dev)
    valid = pos[None, :] < _row_values(n_nodes, dev)[:, None] - 1  # [R, W]
    out_of_flat = torch.full((R, L * W), -1, dtype=torch.int64, device=dev)
    out_of_flat.scatter_(1, flat, (pos + 1).expand(R, W))  # kept node -> output index
    d0 = flat // W  # [R, W] depth - 1
    pflat = (d0 - 1).clamp(min=0) * W + all_pp.gather(1, flat)
    par = torch.where(d0 == 0, 0, out_of_flat.gather(1, pflat))
    tok = top_ids.reshape(R, L * K).gather(1, d0 * K + all_rk.gather(1, flat))

    parent[:, 1:] = torch.where(valid, par, -1).to(i32)
    depth[:, 1:] = torch.where(valid, d0 + 1, -1).to(i32)
    tokens[:, 1:] = torch.where(valid, tok, -1).to(i32)
    logw[:, 1:] = torch.where(valid, gs, float("-inf"))
    fc, ns = _fcns(parent)
    return TreeBatch(tokens, parent, depth, fc, ns, logw, n_nodes)


# ----------------------------------------------------------------------------------------
# Pure-Python references (tests only). Scores use float32 arithmetic like the device path.


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _ranked(logq_1req: Tensor, topk: int) -> list[list[tuple[float, int]]]:
    """Per depth: [(clamped logq, token)] sorted by (logq desc, token asc), first topk."""
    rows = logq_1req.float().clamp(min=LOGQ_FLOOR, max=0.0).tolist()
    return [sorted(((v, t) for t, v in enumerate(row)), key=lambda p: (-p[0], p[1]))[:topk] for row in rows]


def _finish(nodes: list[tuple[int, int, int, float]], root: int) -> dict[str, list]:
    """nodes: [(parent, depth, token, score)] in output order, root first -> array dict."""
    n = len(nodes)
    fc, ns, last = [-1] * n, [-1] * n, {}
    for i, (p, _, _, _) in enumerate(nodes):
        if p < 0:
            continue
        if fc[p] == -1:
            fc[p] = i
        else:
            ns[last[p]] = i
        last[p] = i
    return {
        "tokens": [root] + [t for _, _, t, _ in nodes[1:]],
        "parent": [p for p, _, _, _ in nodes],
        "depth": [d for _, d, _, _ in nodes],
        "first_child": fc,
        "next_sibling": ns,
        "logw": [s for _, _, _, s in nodes],
    }


def build_tree_reference(logq_1req: Tensor, root: int, budget: int, topk: int) -> dict[str, list]:
    """Enumerate every rank path up to depth L, order by the total order, keep budget nodes.

    logq_1req: [L, V]. Cost is sum_d min(topk, V)**d prefixes: keep it small."""
    ranked = _ranked(logq_1req, topk)
    # levels[d]: depth-d nodes as (score, parent pos in levels[d-1], rank) in depth order.
    levels: list[list[tuple[float, int, int]]] = [[(0.0, -1, 0)]]
    for lst in ranked:
        cands = [
            (_f32(s + v), pi, k) for pi, (s, _, _) in enumerate(levels[-1]) for k, (v, _) in enumerate(lst)
        ]
        levels.append(sorted(cands, key=lambda c: (-c[0], c[1], c[2])))
    # Merge depths: (score desc, depth asc, position within depth asc).
    merged = sorted(
        ((s, d, j) for d, lv in enumerate(levels) for j, (s, _, _) in enumerate(lv)),
        key=lambda x: (-x[0], x[1], x[2]),
    )[: budget + 1]
    out_idx = {(d, j): i for i, (_, d, j) in enumerate(merged)}
    nodes = []
    for s, d, j in merged:
        _, pj, k = levels[d][j]
        p = -1 if d == 0 else out_idx[(d - 1, pj)]  # prefix closure: the parent is kept
        nodes.append((p, d, ranked[d - 1][k][1] if d else root, s))
    return _finish(nodes, root)


def best_first_heap_reference(logq_1req: Tensor, root: int, budget: int, topk: int) -> dict[str, list]:
    """DDTree best-first heap: pop best; push next sibling (rank+1) and first child (rank 0).

    Agrees with build_tree when no two candidate scores tie (ties are broken by push order)."""
    ranked = _ranked(logq_1req, topk)
    L = len(ranked)
    nodes = [(-1, 0, root, 0.0)]
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, seq, parent, depth, rank)
    seq = 0
    if L and ranked[0]:
        heap.append((-_f32(ranked[0][0][0]), seq, 0, 1, 0))
    while heap and len(nodes) < budget + 1:
        neg, _, p, d, k = heapq.heappop(heap)
        i = len(nodes)
        nodes.append((p, d, ranked[d - 1][k][1], -neg))
        base = nodes[p][3]
        if k + 1 < len(ranked[d - 1]):
            seq += 1
            heapq.heappush(heap, (-_f32(base + ranked[d - 1][k + 1][0]), seq, p, d, k + 1))
        if d < L:
            seq += 1
            heapq.heappush(heap, (-_f32(-neg + ranked[d][0][0]), seq, i, d + 1, 0))
    return _finish(nodes, root)
