"""Position-aligned absorbed MLA attention on the invariant GEMMs: an independent exact construction.

A tree node at depth d must get the bits of the AR step at its position: accepted nodes keep their
KV rows, so any difference reaches every later token, and a near-tie argmax can flip. Different
tile boundaries over a node's keys than over the AR step's (e.g. the prefix tiled from 0 and the
tree rows in a tile of their own) mean a different online-softmax rescaling sequence and different
roundings, which is what `kernels.mla_attention` did before it was made position aligned itself.
This module reaches the same property by another route and stays as a cross-check
(`make_batch_invariant(model, attention="aligned")`, tests/unit/test_gpu_exact.py).

This op orders each query's keys by absolute position (committed rows 0..L-1, then its visible new
rows in node order = ancestors by depth, then itself), so the query at absolute position p sees
the same key sequence p+1 long whether it is an AR step or a tree node, and reduces it with the
batch-invariant GEMMs of `kernels.matmul`, whose K-reduction order depends only on the position of
a key in that sequence (trailing padding adds exact zeros):
  scores = [q_lat | q_pe] . [c_kv | k_pe]       fp32, batched over tokens, K = Dl + Dr (fixed)
  p = exp(scores * scale - max)                 elementwise; max is exact in any order
  [o | l] = bf16(p) . [c_kv | 1]                fp32, K = key position: the normaliser l sums the
                                                same rounded weights as o, in the same order
  out = o / l
Costs O(T x keys) memory and time (keys gathered per query): a checking mode for tests and small
contexts (`make_batch_invariant(model, attention="aligned")`), not the serving path.
Same signature and semantics as `kernels.mla_attention.mla_attention` (its reference defines them).
"""

from __future__ import annotations

import torch

from kernels.matmul import batched_matmul


def key_slots(block_table: torch.Tensor, page_size: int, cu_q: torch.Tensor, prefix_lens: torch.Tensor,
              tree_bits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token, the physical cache slots of the keys it sees, in absolute-position order.

    -> (slots [T, Kmax] int64, -1 padded; valid [T, Kmax] bool). Kmax = the longest key list."""
    dev = block_table.device
    cu = cu_q.long()
    T = int(cu[-1])
    S = prefix_lens.shape[0]
    n = cu[1:] - cu[:-1]  # [S] new rows per session
    sess = torch.repeat_interleave(torch.arange(S, device=dev), n, output_size=T)  # [T]
    j = torch.arange(T, device=dev) - cu[sess]  # new-row index of each query inside its session
    L = prefix_lens.long()[sess]  # [T]
    nmax = int(n.max()) if S else 0
    k = torch.arange(nmax, device=dev)[None, :]  # [1, nmax] candidate new rows
    if tree_bits is None:
        vis = k <= j[:, None]  # causal chain
    else:
        words = tree_bits[:, (k[0] // 64).clamp(max=tree_bits.shape[1] - 1)]  # [T, nmax]
        vis = ((words >> (k % 64)) & 1).bool()
    vis &= k < n[sess][:, None]
    count = L + vis.sum(1)  # [T] keys per query
    kmax = int(count.max()) if T else 0
    pos = torch.arange(kmax, device=dev)[None, :]  # [1, Kmax] key position
    logical = torch.where(pos < L[:, None], pos, -1)  # committed rows: logical row = position
    rank = vis.cumsum(1) - 1  # [T, nmax] position of each visible new row among them
    t_idx, k_idx = vis.nonzero(as_tuple=True)
    logical[t_idx, L[t_idx] + rank[t_idx, k_idx]] = L[t_idx] + k_idx  # new rows: after the prefix
    valid = logical >= 0
    lg = logical.clamp(min=0)
    page = block_table[sess[:, None], lg // page_size].long()
    slots = torch.where(valid, page * page_size + lg % page_size, -1)
    return slots, valid


def aligned_mla_attention(q_lat, q_pe, kv_cache, block_table, page_size, cu_q, prefix_lens, tree_bits, sm_scale):
    """q_lat [T, H, Dl], q_pe [T, H, Dr], kv_cache [slots, Dl + Dr] -> [T, H, Dl] in q_lat.dtype."""
    T, H, Dl = q_lat.shape
    if q_pe.shape[:2] != (T, H) or kv_cache.shape[-1] != Dl + q_pe.shape[-1]:
        raise ValueError(f"aligned_mla_attention: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, "
                         f"kv_cache {tuple(kv_cache.shape)} do not agree")
    if T == 0:
        return torch.empty_like(q_lat)
    dt = kv_cache.dtype
    acc = torch.promote_types(dt, torch.float32)
    slots, valid = key_slots(block_table, page_size, cu_q, prefix_lens, tree_bits)  # [T, Kmax]
    rows = kv_cache[slots.clamp(min=0)]  # [T, Kmax, Dl + Dr]
    rows = torch.where(valid[..., None], rows, torch.zeros((), dtype=dt, device=rows.device))
    q = torch.cat((q_lat.to(dt), q_pe.to(dt)), -1)  # [T, H, Dl + Dr]
    scores = batched_matmul(q, rows, acc) * sm_scale  # [T, H, Kmax]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))  # [T, H, Kmax], 0 on padding
    pad = torch.zeros(T, slots.shape[1], 16, dtype=dt, device=rows.device)
    pad[..., 0] = valid.to(dt)  # the ones column: [o | l] in one product (16 wide keeps strides aligned)
    v = torch.cat((rows[..., :Dl], pad), -1)  # [T, Kmax, Dl + 16]
    o = batched_matmul(p.to(dt), v.transpose(1, 2), acc)  # [T, H, Dl + 16]
    return (o[..., :Dl] / o[..., Dl : Dl + 1]).to(q_lat.dtype)
