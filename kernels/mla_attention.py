"""Absorbed MLA attention over the paged latent cache `[c_kv | k_pe]` (DESIGN 2.1, 3.4, 4).

One launch serves a flat (varlen) batch of sessions. Session s owns `cu_q[s+1]-cu_q[s]` new query
tokens whose latent KV rows were already written at logical cache indices
`prefix_lens[s] + j` (j = 0..n_s-1) of its block table. New token j sees:
  - every committed row 0 .. prefix_lens[s]-1 (no mask), and
  - new row k iff bit k of `tree_bits[t]` is set (tree verify: ancestors and itself), or k <= j
    when `tree_bits is None` (causal prefill / plain decode).
Scores: (q_lat . c_kv + q_pe . k_pe) * sm_scale; output is the latent-space value p . c_kv
([T, H, kv_lora_rank]); the caller applies W_UV and o_proj.

`mla_attention` is the launcher (the GPU kernel path is added by the kernels work; on CPU it runs
`mla_attention_ref`, the definition of correctness).
"""

from __future__ import annotations

import torch


def _visible_new(tree_bits: torch.Tensor | None, t0: int, n: int, device) -> torch.Tensor:
    """bool [n, n]: which of the session's new rows each new query row sees."""
    if tree_bits is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    words = tree_bits[t0 : t0 + n]  # [n, W] int64
    k = torch.arange(n, device=device)
    bits = (words[:, k // 64] >> (k % 64)) & 1  # [n, n]
    return bits.bool()


def session_slots(block_table: torch.Tensor, page_size: int, s: int, length: int) -> torch.Tensor:
    """int64 [length]: physical cache slots of logical rows 0..length-1 of session row s."""
    idx = torch.arange(length, device=block_table.device)
    return block_table[s, idx // page_size].long() * page_size + idx % page_size


def mla_attention_ref(
    q_lat: torch.Tensor,  # [T, H, Dl] queries already multiplied by W_UK
    q_pe: torch.Tensor,  # [T, H, Dr] rope applied
    kv_cache: torch.Tensor,  # [num_slots, Dl + Dr] flat view of the paged pool (one layer)
    block_table: torch.Tensor,  # [S, max_pages] int32
    page_size: int,
    cu_q: torch.Tensor,  # [S+1] int32
    prefix_lens: torch.Tensor,  # [S] int32 committed rows per session
    tree_bits: torch.Tensor | None,  # [T, W] int64 ancestor bitmask, None = causal
    sm_scale: float,
) -> torch.Tensor:
    T, H, Dl = q_lat.shape
    acc = torch.promote_types(q_lat.dtype, torch.float32)
    out = torch.empty(T, H, Dl, dtype=q_lat.dtype, device=q_lat.device)
    cu = cu_q.tolist()
    prefix = prefix_lens.tolist()
    for s in range(len(prefix)):
        t0, t1 = cu[s], cu[s + 1]
        n = t1 - t0
        if n == 0:
            continue
        L = prefix[s]
        rows = kv_cache[session_slots(block_table, page_size, s, L + n)].to(acc)  # [L+n, Dl+Dr]
        c_kv, k_pe = rows[:, :Dl], rows[:, Dl:]
        scores = torch.einsum("thd,kd->thk", q_lat[t0:t1].to(acc), c_kv)
        scores = scores + torch.einsum("thd,kd->thk", q_pe[t0:t1].to(acc), k_pe)
        scores = scores * sm_scale
        visible = torch.ones(n, L + n, dtype=torch.bool, device=q_lat.device)
        visible[:, L:] = _visible_new(tree_bits, t0, n, q_lat.device)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[t0:t1] = torch.einsum("thk,kd->thd", p, c_kv).to(q_lat.dtype)
    return out


def mla_attention(q_lat, q_pe, kv_cache, block_table, page_size, cu_q, prefix_lens, tree_bits, sm_scale):
    """Launcher: checks shapes; dispatches to the Triton kernel on CUDA, the reference elsewhere."""
    T, H, Dl = q_lat.shape
    if q_pe.shape[:2] != (T, H) or kv_cache.shape[-1] != Dl + q_pe.shape[-1]:
        raise ValueError(f"mla_attention: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, "
                         f"kv_cache {tuple(kv_cache.shape)} do not agree")
    if tree_bits is not None and tree_bits.shape[0] != T:
        raise ValueError(f"mla_attention: tree_bits has {tree_bits.shape[0]} rows for {T} queries")
    return mla_attention_ref(q_lat, q_pe, kv_cache, block_table, page_size, cu_q, prefix_lens, tree_bits, sm_scale)
