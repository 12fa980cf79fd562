"""Absorbed MLA attention over the paged latent cache `[c_kv | k_pe]` (DESIGN 2.1, 3.4, 4).

One launch serves a flat (varlen) batch of sessions. Session s owns `cu_q[s+1]-cu_q[s]` new query
tokens whose latent KV rows were already written at logical cache indices
`prefix_lens[s] + j` (j = 0..n_s-1) of its block table. New token j sees:
  - every committed row 0 .. prefix_lens[s]-1 (no mask), and
  - new row k iff bit k of `tree_bits[t]` is set (tree verify: ancestors and itself), or k <= j
    when `tree_bits is None` (causal prefill / plain decode).
Scores: (q_lat . c_kv + q_pe . k_pe) * sm_scale; output is the latent-space value p . c_kv
([T, H, kv_lora_rank]); the caller applies W_UV and o_proj.

`mla_attention_ref` is the definition of correctness. `mla_attention` is the launcher: GPU kernels
on CUDA, the reference elsewhere. The tile kernels share the work split, the chunks and the combine:
`_mla_gluon_seesaw` (sm_90 with the Kimi head shapes, FlashMLA's two-warpgroup "seesaw" schedule: the default there
since 2026-12-05, 1.01-1.29x `_mla_gluon` on the H200 bench; `_mla_gluon_seesaw_persistent` runs its items from one
program per SM, opt-in: persistent=True, the same bits; on an H100 1.4-4.4% slower with a case-sized block
table, faster at batch 16 with a serving pool's wide one), `_mla_gluon` (the
same shapes, one warpgroup, S computed once per tile; `_mla_gluon_persistent` runs the same tiles from one program
per SM, opt-in: persistent=True),
`_mla_gluon_ws` (the same shapes, warp-specialized; experimental, only when asked for: impl="gluon_ws"),
`_mla_kernels` (any GPU and the interpreter); `impl` / `DEFAULT_IMPL` pick one. The kernels are position aligned: a
query at absolute position p (L + depth for a tree node, L + j for a causal row) reduces over its
keys at positions 0..p (committed rows, then its ancestors by depth, then itself) in an order that
depends only on p: split-KV chunks of whole tiles (`chunk_spans`; the default "balanced" rule
takes round((p + 1) / 512) chunks, at most 16, of equal tile counts up to one), tiles of BLOCK_N
keys aligned at absolute positions, chunks merged by log-sum-exp in order. So a tree node at depth
d computes bit for bit what the AR step at position L + d computes once the accepted path is
compacted to L + depth (DESIGN 3.3, 3.5), a causal prefill row what the decode step at its
position computes, and no row depends on the other rows or sessions of the launch (batch
invariance). Tested bitwise in fp32 under the interpreter and in bf16 on the GPU.
The seesaw kernel may split a (query tile, chunk)'s value columns over 2 or 4 programs (`vsplit`, "auto" by
default: the same bits, more programs for a small launch).
Launches: one attention kernel, plus one combine kernel when some row has more than one chunk.
Grid sizes depend only on host-known shapes (T, H, block table width): no host sync, CUDA-graph
capturable. Limits: tree_bits <= 2 words (128 nodes); page_size is a compile-time constant.
Bit alignment needs parents to precede children in each session's node order (DESIGN 3.1);
without it the result is still the reference's, only not aligned.
"""

from __future__ import annotations

import functools

import torch
import triton

from kernels import (
    _mla_gluon,
    _mla_gluon_persistent,
    _mla_gluon_seesaw,
    _mla_gluon_seesaw_persistent,
    _mla_gluon_ws,
    pdl,
)
from kernels._mla_kernels import _mla_combine_kernel, _mla_fwd_kernel, chunk_span

_BLOCK_M = 64  # largest query tile: the heads of one token (64 at Kimi)
DEFAULT_BLOCK_N = 64  # keys per tile; tiles sit at absolute multiples of BLOCK_N (64: 5-19% faster than 32 on the H200)
_NCH = 16  # at most this many KV chunks per query row
_C_MIN = 512  # base chunk size (keys) for rows of < NCH * C_MIN keys: bounds the partial traffic
CHUNK_RULES = {"legacy": 0, "balanced": 1}  # `_mla_kernels.chunk_span`'s RULE
DEFAULT_CHUNK_RULE = "balanced"
PARTIALS = ("fp32", "out")  # how a multi-chunk row's partial O goes through memory (`mla_attention_triton`)
DEFAULT_PARTIALS = "out"  # bf16 partials at Kimi: 3-16% faster than "fp32" in every bench case (H200, 2026-12-05)
DEFAULT_FOLD = False  # `mla_attention_triton(fold=)`: the same bits; slower than the bf16 split (H200, 2026-12-05)
FOLD_MIN_TILES_PER_SM = 4  # fold="auto" folds launches of at least this many query tiles per SM (a cost-model guess)
DEFAULT_VSPLIT = "auto"  # `mla_attention_triton(vsplit=)`: the same bits at any value (GPU tests); auto 5-12% faster
# than 1 on an H100 at batch 1 / 1k with 9-33 nodes, where it splits, and the same elsewhere (forty-fifth session)
VSPLITS = (1, 2, 4, "auto")
DEFAULT_SKIP_PHANTOM = False  # `mla_attention_triton(skip_phantom=)`: the same values, less work in an odd chunk;
# off until a GPU has run its bits test and bench (written in the forty-eighth session, which got no GPU after it)
IMPLS = ("triton", "gluon", "gluon_ws", "gluon_seesaw", "auto")  # tile kernel: `_mla_kernels` (any GPU, the
# interpreter), `_mla_gluon_seesaw` (sm_90, warp-specialized: what "auto" picks there), `_mla_gluon` (sm_90; "auto"
# picks it for the option only it has: fold), `_mla_gluon_ws` (sm_90, warp-specialized, experimental)
_GLUON_IMPLS = ("gluon", "gluon_ws", "gluon_seesaw")  # all need `gluon_unsupported(...) is None`
DEFAULT_IMPL = "auto"  # the seesaw Gluon kernel where it runs (H200, Kimi shapes), else Triton
_LOG2E = 1.4426950408889634


def _visible_new(tree_bits: torch.Tensor | None, t0: int, n: int, device) -> torch.Tensor:
    """bool [n, n]: which of the session's new rows each new query row sees."""
    if tree_bits is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    words = tree_bits[t0 : t0 + n]  # [n, W] int64
    k = torch.arange(n, device=device)
    W = words.shape[1]
    bits = (words[:, (k // 64).clamp(max=W - 1)] >> (k % 64)) & 1  # [n, n]
    return bits.bool() & (k < 64 * W)  # rows past the W words are never visible (as in the kernel)


def session_slots(block_table: torch.Tensor, page_size: int, s: int, length: int) -> torch.Tensor:
    """int64 [length]: physical cache slots of logical rows 0..length-1 of session row s."""
    idx = torch.arange(length, device=block_table.device)
    return block_table[s, idx // page_size].long() * page_size + idx % page_size


def _rule_id(chunk_rule: str) -> int:
    if chunk_rule not in CHUNK_RULES:
        raise ValueError(f"mla_attention: chunk_rule {chunk_rule!r} is not one of {sorted(CHUNK_RULES)}")
    return CHUNK_RULES[chunk_rule]


def chunk_spans(p: int, chunk_rule: str = DEFAULT_CHUNK_RULE, block_n: int = DEFAULT_BLOCK_N,
                nch: int = _NCH, c_min: int = _C_MIN) -> list[tuple[int, int]]:
    """Positions [start, end) of each KV chunk of the query at position p, in reduction order: the
    kernel's own `chunk_span`, evaluated on host ints (a function of p and the fixed knobs alone)."""
    rule = _rule_id(chunk_rule)
    nc = chunk_span.fn(p + 1, 0, rule, block_n, nch, c_min)[0]
    return [tuple(chunk_span.fn(p + 1, c, rule, block_n, nch, c_min)[1:]) for c in range(nc)]


def max_chunks(cap: int, chunk_rule: str = DEFAULT_CHUNK_RULE, block_n: int = DEFAULT_BLOCK_N,
               nch: int = _NCH, c_min: int = _C_MIN) -> int:
    """Grid size along chunks: >= the chunk count of every position < cap (checked by the tests).
    balanced: its count does not decrease with the position, so that of K = cap keys;
    legacy: its count is <= cdiv(K, C_MIN) and <= NCH (it can decrease with small knobs)."""
    if _rule_id(chunk_rule) == CHUNK_RULES["balanced"]:
        return chunk_span.fn(max(cap, 1), 0, CHUNK_RULES["balanced"], block_n, nch, c_min)[0]
    return max(1, min(nch, triton.cdiv(cap, c_min)))


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # asked once per device: the launcher runs every layer


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _gluon_unsupported_shape(device: torch.device, heads: int, latent: int, rope: int, dtype: torch.dtype,
                             block_n: int = DEFAULT_BLOCK_N, num_warps: int = 8) -> str | None:
    if not _mla_gluon.HAVE_GLUON:
        return "this Triton has no Gluon"
    if device.type != "cuda" or _capability(device.index) != (9, 0):
        return "the Gluon kernel needs an sm_90 GPU"
    if (latent, rope) != (_mla_gluon.GLUON_DL, _mla_gluon.GLUON_DR) or heads % _mla_gluon.GLUON_BLOCK_M:
        return f"the Gluon kernel needs latent {_mla_gluon.GLUON_DL} + rope {_mla_gluon.GLUON_DR} and a multiple of " \
               f"{_mla_gluon.GLUON_BLOCK_M} heads (got {latent} + {rope}, {heads} heads)"
    if block_n != _mla_gluon.GLUON_BLOCK_N or num_warps != _mla_gluon.GLUON_WARPS:
        return f"the Gluon kernel has {_mla_gluon.GLUON_BLOCK_N}-key tiles and {_mla_gluon.GLUON_WARPS} warps"
    if dtype not in (torch.bfloat16, torch.float16):
        return "the Gluon kernel needs a bf16 or fp16 cache"
    return None


def gluon_unsupported(q_lat, q_pe, kv_cache, block_n: int, num_warps: int) -> str | None:
    """Why the Gluon tile kernel cannot run these inputs (None: it can): sm_90 only, the Kimi head
    shapes (64-head tiles, latent 512 + rope 64), 64-key tiles, 16-bit data aligned for 16-byte copies."""
    why = _gluon_unsupported_shape(kv_cache.device, q_lat.shape[1], q_lat.shape[2], q_pe.shape[2], kv_cache.dtype,
                                   block_n, num_warps)
    if why is None and (kv_cache.stride(0) % 8 or kv_cache.data_ptr() % 16):
        return "the Gluon kernel needs cache rows aligned to 16 bytes"
    return why


def configure(impl: str, device, heads: int, latent: int, rope: int, dtype: torch.dtype,
              page_size: int | None = None) -> str:
    """Fix the tile kernel of a deployment: set `DEFAULT_IMPL` (every later launch that does not pass
    `impl` uses it) and return what it runs for this device and model: "gluon", "gluon_ws", "gluon_seesaw", "triton" or
    "reference" (not CUDA: `mla_attention` runs the torch reference). ValueError, with the reason, for
    one of the Gluon kernels where it cannot run, so a server refuses the flag at start rather than failing
    requests."""
    global DEFAULT_IMPL
    kernel = resolved_impl(impl, device, heads, latent, rope, dtype, page_size)
    DEFAULT_IMPL = impl
    return kernel


def resolved_impl(impl: str, device, heads: int, latent: int, rope: int, dtype: torch.dtype,
                  page_size: int | None = None) -> str:
    """What `impl` runs for this device and model (as `configure` says, without setting anything); with `page_size`,
    also whether "auto" has the seesaw kernel's TMA boxes at it (see `_auto_gluon`; the query tile's TMA depends on
    each launch's views and is not known here)."""
    if impl not in IMPLS:
        raise ValueError(f"mla kernel {impl!r} is not one of {IMPLS}")
    device = torch.device(device)
    why = _gluon_unsupported_shape(device, heads, latent, rope, dtype)
    if impl in _GLUON_IMPLS and why is not None:
        raise ValueError(f"mla kernel {impl!r}: {why}")
    if device.type != "cuda":
        return "reference"
    if impl == "triton" or why is not None:
        return "triton"
    if impl in _GLUON_IMPLS:
        return impl
    kernel = _auto_gluon(DEFAULT_FOLD)
    if kernel == "gluon_seesaw" and page_size is not None and not _tma_box(page_size, None):
        return "gluon"
    return kernel


def _auto_vsplit(items: int, device_index: int | None) -> int:
    """vsplit="auto": the largest of 4 and 2 whose grid of `items` (query tile, chunk slot) programs times it fits
    one program per SM, else 1 (a launch that fills the GPU gains nothing from computing S more than once)."""
    sms = _sm_count(device_index)
    return next((v for v in (4, 2) if items * v <= sms), 1)


def _auto_gluon(fold) -> str:
    """The Gluon kernel "auto" runs where Gluon can: the seesaw kernel (1.01-1.29x the one-warpgroup kernel in every
    case of the H200 bench, 2026-12-05), or `_mla_gluon` when the launch asks for what only it has (fold=True). The
    launcher also keeps `_mla_gluon` for a launch without both TMA paths (the query tile of one 2D view, pages of 16,
    32 or a multiple of 64 rows, tma not off): the seesaw kernel ran on the GPU with them only. The serving path has
    both (contiguous queries, pages of 16). `persistent` then picks the form of whichever kernel runs."""
    return "gluon" if fold is True else "gluon_seesaw"


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


def _tma_descriptors(q_lat, q_pe, kv_cache, page_size: int, block_n: int, tma: bool | None):
    """The Gluon kernels' TMA inputs: (BOX, the query tile's descriptors or None, the pool's descriptors)."""
    use_tma = _mla_gluon.GLUON_TMA if tma is None else tma
    box = _tma_box(page_size, tma)
    qdesc = _mla_gluon.q_descriptors(q_lat, q_pe) if use_tma else None
    return box, qdesc, _mla_gluon.kv_descriptors(kv_cache, box or block_n)


def _tma_box(page_size: int, tma: bool | None) -> int:
    """Rows of the Gluon kernels' TMA box for this page size (0: whole committed tiles go by cp.async too)."""
    return _mla_gluon.tma_box_rows(page_size) if (_mla_gluon.GLUON_TMA if tma is None else tma) else 0


def mla_attention_triton(q_lat, q_pe, kv_cache, block_table, page_size, cu_q, prefix_lens, tree_bits,
                         sm_scale, *, out=None, block_n: int = DEFAULT_BLOCK_N, num_warps: int = 8,
                         num_stages: int = 2, nch: int = _NCH, c_min: int = _C_MIN,
                         chunk_rule: str = DEFAULT_CHUNK_RULE, impl: str | None = None, tma: bool | None = None,
                         persistent: bool | None = None, partials: str | None = None,
                         fold: bool | str | None = None, vsplit: int | str | None = None,
                         skip_phantom: bool | None = None):
    """The Triton path on any device (tests call it on CPU under TRITON_INTERPRET=1).

    q_lat/q_pe are cast to the cache dtype; `out` ([T, H, Dl], optional) is written in place.
    The keywords are tuning knobs for benchmarks; `block_n`/`nch`/`c_min`/`chunk_rule` define the
    reduction order, so a deployment must keep them fixed (position alignment holds for any fixed
    value; "legacy" is the previous chunk rule, kept for comparisons). `impl` picks the tile kernel:
    "triton", "gluon" (`_mla_gluon`: sm_90, Kimi head shapes; ValueError elsewhere, with the reason),
    "gluon_ws" (`_mla_gluon_ws`: the same, warp-specialized, experimental), "gluon_seesaw" (`_mla_gluon_seesaw`:
    the same, two consumer warpgroups on pairs of tiles) or "auto" (gluon_seesaw where Gluon can run, gluon for
    fold=True, triton elsewhere); None: the
    module's `DEFAULT_IMPL`, read at each call. They give different bits from each other, so the impl is fixed per
    deployment too. `tma` (gluon and gluon_seesaw; None: `_mla_gluon.GLUON_TMA`): the query tile and
    whole tiles of committed rows by TMA (as runs of a page's rows: pages of 16, 32 or a multiple of 64 rows), the
    other tiles by cp.async; the same data lands in the same layout, so the same bits either way. `persistent` (gluon
    and gluon_seesaw with the query tile by TMA; None: `_mla_gluon_persistent.GLUON_PERSISTENT` for gluon,
    `_mla_gluon_seesaw_persistent.SEESAW_PERSISTENT` for gluon_seesaw): one program per SM runs its share of the
    (query tile, chunk) items (`_mla_gluon_persistent`: as one stream of tiles; `_mla_gluon_seesaw_persistent`: its
    producer warp loads the next item's tiles while the consumers finish the current one), the same bits again.
    `partials` (None: the module's `DEFAULT_PARTIALS`, read at each call): the dtype of the unnormalized partial O
    that a row of several KV chunks writes per chunk and the combine kernel reads back: "fp32", or "out" (the
    output's dtype: bf16 at Kimi, half the bytes; the row max and sum stay fp32, the combine's arithmetic stays fp32).
    It rounds each chunk's partial once more, so it changes the bits of multi-chunk rows: fixed per deployment too
    (batch invariance and position alignment hold either way: a row's chunks do not depend on the batch).
    `fold` (impl "triton" and "gluon", not the persistent form; None: the module's `DEFAULT_FOLD`): one program per
    query tile computes its chunks one after the other and folds each chunk's partial, rounded as `partials` says,
    with the combine kernel's arithmetic (`_mla_kernels._fold`): no partials through memory and no combine launch,
    and the same bits as the split launch, so a launcher may pick either per launch (split for parallelism when a
    launch has few query tiles, fold when it has enough to fill the GPU): "auto" folds on a GPU when the launch has
    at least `FOLD_MIN_TILES_PER_SM` query tiles per SM (the cost model of docs/performance.md; nothing here reads the
    GPU's data, so the choice costs no synchronisation).
    `vsplit` (the seesaw grid kernel only; None: the module's `DEFAULT_VSPLIT`): 1, 2 or 4 programs per (query tile,
    chunk), each computing the tile's whole S and softmax and 512 / vsplit of its value columns. Every column gets
    the arithmetic it gets at 1, provided a warpgroup MMA's sum over the keys does not depend on its width N (the GPU
    tests compare the bits), so a launcher may pick it per launch: more programs for a launch with fewer (query
    tile, chunk) items than SMs, at the price of S computed vsplit times. "auto": `_auto_vsplit`.
    `skip_phantom` (the seesaw grid kernel; None: the module's `DEFAULT_SKIP_PHANTOM`): an odd chunk's last pair has
    a phantom tile past the chunk's end; True neither loads it nor computes its S and products, whose results are
    known (-inf scores, zero weights: `_mla_gluon_seesaw._ss_consumer`); False loads it zero-filled and multiplies,
    as before the forty-eighth session. The same values either way (the GPU tests compare the bits)."""
    T, H, Dl = q_lat.shape
    Dr = q_pe.shape[-1]
    S = prefix_lens.shape[0]
    rule = _rule_id(chunk_rule)
    partials = DEFAULT_PARTIALS if partials is None else partials
    fold = DEFAULT_FOLD if fold is None else fold
    if fold not in (True, False, "auto"):
        raise ValueError(f"mla_attention: fold must be True, False or 'auto', got {fold!r}")
    if partials not in PARTIALS:
        raise ValueError(f"mla_attention: partials {partials!r} is not one of {PARTIALS}")
    impl = DEFAULT_IMPL if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"mla_attention: impl {impl!r} is not one of {IMPLS}")
    auto = impl == "auto"  # (its seesaw pick is kept only with both TMA paths, below)
    if impl != "triton":
        why = gluon_unsupported(q_lat, q_pe, kv_cache, block_n, num_warps)
        if why is not None and impl in _GLUON_IMPLS:
            raise ValueError(f"mla_attention: impl {impl!r}: {why}")
        impl = "triton" if why else (_auto_gluon(fold) if auto else impl)
    if block_n not in (16, 32, 64, 128) or c_min < block_n or c_min % block_n or nch < 1:
        raise ValueError("mla_attention: block_n must be 16, 32, 64 or 128 and divide c_min > 0; nch >= 1")
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
    block_m = min(_BLOCK_M, max(16, triton.next_power_of_2(H)))  # one token's heads (tl.dot needs >= 16)
    ht = triton.cdiv(H, block_m)  # query tiles per token
    tiles = T * ht
    cap = block_table.shape[1] * page_size  # every position a row can see is < cap
    grid_c = max_chunks(cap, chunk_rule, block_n, nch, c_min)  # >= nc(p) for any p < cap
    if fold == "auto":
        fold = (q_lat.is_cuda and impl in ("triton", "gluon")
                and tiles >= FOLD_MIN_TILES_PER_SM * _sm_count(q_lat.device.index))
    if fold and impl not in ("triton", "gluon"):
        raise ValueError(f"mla_attention: fold runs in the Triton and gluon tile kernels (impl {impl!r})")
    vsplit = DEFAULT_VSPLIT if vsplit is None else vsplit
    if vsplit not in VSPLITS:
        raise ValueError(f"mla_attention: vsplit {vsplit!r} is not one of {VSPLITS}")
    if vsplit not in (1, "auto") and impl != "gluon_seesaw":
        raise ValueError(f"mla_attention: vsplit {vsplit} runs in the seesaw grid kernel only (impl {impl!r})")
    parts = tiles * grid_c if grid_c > 1 and not fold else 1  # partials stored (fold: none)
    if fold and impl == "gluon":  # po: the running O of each query tile (fp32), the rounding a constexpr
        po = torch.empty(tiles if grid_c > 1 else 1, block_m, bdl, dtype=torch.float32, device=q_lat.device)
    else:  # (Triton fold: po only gives the rounding dtype)
        po = torch.empty(parts, block_m, bdl, dtype=torch.float32 if partials == "fp32" else out.dtype,
                         device=q_lat.device)
    pml = torch.empty(parts, 2, block_m, dtype=torch.float32, device=q_lat.device)
    nc = torch.empty(tiles, dtype=torch.int32, device=q_lat.device)
    bits = tree_bits if tree_bits is not None else prefix_lens  # dummy pointer when causal
    prec = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    s_pad = max(16, triton.next_power_of_2(S))
    common = (q_lat, q_pe, kv_cache, block_table, cu_q, prefix_lens, bits, out, po, pml, nc,
              S, H, ht, grid_c, sm_scale * _LOG2E,
              q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0),
              block_table.stride(0), bits.stride(0), out.stride(0), out.stride(1))
    nb = 64 * (tree_bits.shape[1] if tree_bits is not None else 1)
    if impl == "gluon_ws":  # num_warps: the kernel's own (consumer 0; the other partitions add theirs)
        _mla_gluon_ws._mla_fwd_gluon_ws_kernel[(tiles, grid_c)](
            *common, DL=Dl, DR=Dr, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, NCH=nch, C_MIN=c_min,
            RULE=rule, S_PAD=s_pad, TREE=tree_bits is not None, NB=nb, STAGES=_mla_gluon_ws.WS_STAGES,
            num_warps=_mla_gluon_ws.WS_WARPS)
    elif impl in ("gluon", "gluon_seesaw"):
        box, qdesc, kvdesc = _tma_descriptors(q_lat, q_pe, kv_cache, page_size, block_n, tma)
        if auto and impl == "gluon_seesaw" and (not box or qdesc is None):  # the seesaw kernel as validated on
            impl = "gluon"  # the GPU (both TMA paths); its cp.async-only forms have not run on one yet
        shape = dict(DL=Dl, DR=Dr, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, NCH=nch, C_MIN=c_min, RULE=rule,
                     S_PAD=s_pad, TREE=tree_bits is not None, NB=nb, BOX=box)
        if persistent is None:
            persistent = (_mla_gluon_seesaw_persistent.SEESAW_PERSISTENT if impl == "gluon_seesaw"
                          else _mla_gluon_persistent.GLUON_PERSISTENT)
        seesaw_grid = impl == "gluon_seesaw" and not (persistent and qdesc is not None)
        if vsplit not in (1, "auto") and not seesaw_grid:
            raise ValueError(f"mla_attention: vsplit {vsplit} runs in the seesaw grid kernel only (impl {impl!r}, "
                             f"persistent {bool(persistent)})")
        if impl == "gluon_seesaw" and not seesaw_grid:  # (the persistent form loads every query tile by TMA)
            nprog = min(tiles * grid_c, _sm_count(q_lat.device.index))
            _mla_gluon_seesaw_persistent._mla_fwd_gluon_seesaw_persistent_kernel[(nprog,)](
                *common[:11], *kvdesc, *qdesc, *common[11:], tiles, nprog, STAGES=_mla_gluon_seesaw.SEESAW_STAGES,
                num_warps=_mla_gluon_seesaw.SEESAW_WARPS, **shape)
        elif seesaw_grid:  # num_warps: the kernel's own (consumer 0; the other partitions add theirs)
            nv = _auto_vsplit(tiles * grid_c, q_lat.device.index) if vsplit == "auto" else vsplit
            _mla_gluon_seesaw._mla_fwd_gluon_seesaw_kernel[(tiles, grid_c) + ((nv,) if nv > 1 else ())](
                *common[:11], *kvdesc, *(qdesc or kvdesc), *common[11:], QTMA=qdesc is not None,
                STAGES=_mla_gluon_seesaw.SEESAW_STAGES, num_warps=_mla_gluon_seesaw.SEESAW_WARPS, VSPLIT=nv,
                SKIP_PHANTOM=DEFAULT_SKIP_PHANTOM if skip_phantom is None else bool(skip_phantom), **shape)
        elif persistent and qdesc is not None and not fold:  # (it loads every query tile by TMA)
            nprog = min(tiles * grid_c, _sm_count(q_lat.device.index))
            _mla_gluon_persistent._mla_fwd_gluon_persistent_kernel[(nprog,)](
                *common[:11], *kvdesc, *qdesc, *common[11:], tiles, nprog, STAGES=_mla_gluon.GLUON_STAGES,
                num_warps=num_warps, **shape)
        else:
            _mla_gluon._mla_fwd_gluon_kernel[(tiles, 1 if fold else grid_c)](
                *common[:11], *kvdesc, *(qdesc or kvdesc), *common[11:], QTMA=qdesc is not None,
                STAGES=_mla_gluon.GLUON_STAGES, num_warps=num_warps, **shape,
                **({"FOLD": True, "ROUND": partials == "out"} if fold else {}))
    else:
        _mla_fwd_kernel[(tiles, 1 if fold else grid_c)](
            *common, DL=Dl, DR=Dr, BDL=bdl, BDR=bdr, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, NCH=nch,
            C_MIN=c_min, RULE=rule, S_PAD=s_pad, TREE=tree_bits is not None, NB=nb, PREC=prec, FOLD=fold,
            num_warps=num_warps, num_stages=num_stages)
    if grid_c > 1 and not fold:
        block_d = min(bdl, 128)
        _mla_combine_kernel[(tiles, triton.cdiv(bdl, block_d))](
            po, pml, nc, out, H, ht, grid_c, out.stride(0), out.stride(1),
            DL=Dl, BDL=bdl, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=4, **pdl.trigger(out))
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
