"""Absorbed MLA attention over the paged latent cache `[c_kv | k_pe]` (DESIGN 2.1, 3.4, 4).

One launch serves a flat (varlen) batch of sessions. Session s owns `cu_q[s+1]-cu_q[s]` new query
tokens whose latent KV rows were already written at logical cache indices
`prefix_lens[s] + j` (j = 0..n_s-1) of its block table. New token j sees:
  - every committed row 0 .. prefix_lens[s]-1 (no mask), and
  - new row k iff bit k of `tree_bits[t]` is set (tree verify: ancestors and itself), or k <= j
    when `tree_bits is None` (causal prefill / plain decode).
Scores: (q_lat . c_kv + q_pe . k_pe) * sm_scale; output is the latent-space value p . c_kv
([T, H, kv_lora_rank]); the caller applies W_UV and o_proj.

`mla_attention_ref` is the definition of correctness. `mla_attention` is the launcher: Triton
kernels on CUDA (`_mla_kernels`: split-KV over chunks whose size depends only on the session's own
committed length, tree/causal rows masked at the end of the last chunk, chunks merged by
log-sum-exp in a fixed order, so results are batch invariant), the reference elsewhere.
Launches: one attention kernel, plus one combine kernel. Grid sizes depend only on host-known
shapes (T, S, block table width): no host sync, CUDA-graph capturable. Because the chunking does
not depend on how many new rows a session has, a tree's root row equals the single-token (AR)
result at the same prefix bit for bit (tested on the GPU). Limits: tree_bits <= 2 words (128
nodes); page_size is a compile-time constant of the kernel.
"""

from __future__ import annotations

import torch
import triton

from kernels._mla_kernels import _mla_combine_kernel, _mla_fwd_kernel

_BLOCK_M = 64  # query rows (token, head) per tile: one token at 64 heads
_BLOCK_N = 32  # KV rows per step (divides 32: a tree tile reads one 32-bit half of the bits)
_NCH = 16  # at most this many KV chunks per session
_C_MIN = 512  # smallest chunk: bounds the partial traffic for short prefixes
_LOG2E = 1.4426950408889634


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


def mla_attention_triton(q_lat, q_pe, kv_cache, block_table, page_size, cu_q, prefix_lens, tree_bits,
                         sm_scale, *, out=None, block_n: int = _BLOCK_N, num_warps: int = 8,
                         num_stages: int = 2, nch: int = _NCH, c_min: int = _C_MIN):
    """The Triton path on any device (tests call it on CPU under TRITON_INTERPRET=1).

    q_lat/q_pe are cast to the cache dtype; `out` ([T, H, Dl], optional) is written in place.
    The keywords are tuning knobs for benchmarks; `nch`/`c_min` define the KV chunking, so a
    deployment must keep them fixed (batch invariance holds for any fixed value)."""
    T, H, Dl = q_lat.shape
    Dr = q_pe.shape[-1]
    S = prefix_lens.shape[0]
    if block_n not in (16, 32):
        raise ValueError("mla_attention: block_n must divide 32 (tree tiles read 32-bit halves of the bits)")
    q_lat = q_lat.to(kv_cache.dtype)
    q_pe = q_pe.to(kv_cache.dtype)
    if out is None:
        out = torch.empty_like(q_lat)
    elif out.shape != q_lat.shape or out.stride(-1) != 1:
        raise ValueError("mla_attention: out must be [T, H, Dl] with a contiguous last dim")
    if T == 0 or S == 0:
        return out
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"mla_attention: {name} must be contiguous in its last dim")
    if block_table.dtype != torch.int32 or cu_q.dtype != torch.int32 or prefix_lens.dtype != torch.int32:
        raise ValueError("mla_attention: block_table, cu_q, prefix_lens must be int32")
    if tree_bits is not None and (tree_bits.dtype != torch.int64 or tree_bits.shape[1] > 2
                                  or tree_bits.stride(-1) != 1):
        raise ValueError("mla_attention: tree_bits must be int64 [T, W], W <= 2 (trees <= 128 nodes), "
                         "contiguous rows")
    bdl = max(16, triton.next_power_of_2(Dl))
    bdr = max(16, triton.next_power_of_2(Dr))
    tiles = triton.cdiv(T * H, _BLOCK_M) + S  # >= sum over sessions of cdiv(n_s * H, BLOCK_M)
    cap = block_table.shape[1] * page_size  # no session holds more rows than its block table maps
    grid_c = max(1, min(nch, triton.cdiv(cap, c_min)))  # >= chunks of any length <= cap (C >= c_min, L/nch)
    parts = tiles * grid_c if grid_c > 1 else 1
    po = torch.empty(parts, _BLOCK_M, bdl, dtype=torch.float32, device=q_lat.device)
    pml = torch.empty(parts, 2, _BLOCK_M, dtype=torch.float32, device=q_lat.device)
    bits = tree_bits if tree_bits is not None else prefix_lens  # dummy pointer when causal
    prec = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    s_pad = max(16, triton.next_power_of_2(S + 1))
    _mla_fwd_kernel[(tiles, grid_c)](
        q_lat, q_pe, kv_cache, block_table, cu_q, prefix_lens, bits, out, po, pml,
        S, H, sm_scale * _LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0),
        block_table.stride(0), bits.stride(0), out.stride(0), out.stride(1),
        DL=Dl, DR=Dr, BDL=bdl, BDR=bdr, PAGE=page_size, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, NCH=nch,
        C_MIN=c_min, S_PAD=s_pad, TREE=tree_bits is not None,
        TWO_WORDS=tree_bits is not None and tree_bits.shape[1] > 1, PREC=prec,
        num_warps=num_warps, num_stages=num_stages)
    if grid_c > 1:
        block_d = min(bdl, 128)
        _mla_combine_kernel[(tiles, triton.cdiv(bdl, block_d))](
            po, pml, cu_q, prefix_lens, out, S, H, out.stride(0), out.stride(1),
            DL=Dl, BDL=bdl, BLOCK_D=block_d, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, NCH=nch, C_MIN=c_min,
            S_PAD=s_pad, num_warps=4)
    return out


def mla_attention(q_lat, q_pe, kv_cache, block_table, page_size, cu_q, prefix_lens, tree_bits, sm_scale):
    """Launcher: checks shapes; dispatches to the Triton kernel on CUDA, the reference elsewhere."""
    T, H, Dl = q_lat.shape
    if q_pe.shape[:2] != (T, H) or kv_cache.shape[-1] != Dl + q_pe.shape[-1]:
        raise ValueError(f"mla_attention: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, "
                         f"kv_cache {tuple(kv_cache.shape)} do not agree")
    if tree_bits is not None and tree_bits.shape[0] != T:
        raise ValueError(f"mla_attention: tree_bits has {tree_bits.shape[0]} rows for {T} queries")
    if cu_q.shape[0] != prefix_lens.shape[0] + 1 or block_table.shape[0] != prefix_lens.shape[0]:
        raise ValueError("mla_attention: cu_q must be [S+1], block_table [S, P] for prefix_lens [S]")
    if q_lat.is_cuda:
        return mla_attention_triton(q_lat, q_pe, kv_cache, block_table, page_size, cu_q, prefix_lens,
                                    tree_bits, sm_scale)
    return mla_attention_ref(q_lat, q_pe, kv_cache, block_table, page_size, cu_q, prefix_lens, tree_bits, sm_scale)
