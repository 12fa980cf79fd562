"""Batch-invariant GEMMs (DESIGN 3.5): y = x @ W^T, and its per-head batched form for absorbed MLA.

A row's result must not depend on how many rows share the launch, so that a token computed alone
(an AR step: 1 row) and inside a tree batch (many rows) gets the same bits. cuBLAS picks kernels,
tile shapes and split-K by M; here nothing that decides a row's summation order depends on M:
  - K is cut into a number of splits that depends only on the weight's shape (N, K) and the dtype
    (`split_k`, never on M): each split's program walks its K range from its start in steps of
    BLOCK_K, accumulating in fp32 with `tl.dot` (acc += a @ b, the same order every time), and the
    fp32 partials are summed in split order by `_sum_splits_kernel`. Skinny weights at decode sizes
    (kv_a_proj 7168 -> 576 is 9 output tiles) would otherwise leave most SMs idle; wide ones keep
    one split (no partials),
  - each output element is then one chain of the tensor cores' k16 MMAs (m64nNk16 wgmma on sm_90) over its
    split in ascending K from the split's start, accumulated in fp32; the tile shape (BLOCK_M / BLOCK_N /
    BLOCK_K, warps, pipeline stages) decides which elements a program computes and how many K columns one
    loop step covers, not that chain (a BLOCK_K of 128 is two 64-column steps' MMAs in the same order; zero
    columns past a split's end add exact zeros). So 16-bit operands take their tile shape by the row count
    (`tile_config`: pipelined 64 x 64 tiles for a few rows, wider ones for many), which a GPU test checks
    bit for bit against every other shape in use; fp32 keeps one (`CONFIGS`; its dot is not the tensor
    cores' chain),
  - M is not specialised by the compiler (`do_not_specialize`), so M = 1 runs the same machine code as
    any other M of its tile shape,
  - rows past M are masked to zero; they never touch another row's accumulator.
So a row's reduction order depends only on (N, K) and the dtype. `batched_matmul`/`head_matmul` never
split; there trailing zero padding of K is neutral (whole extra K tiles add exact zeros), which
`verifier_service.aligned_attention` relies on.

Launchers (check shapes, dtypes, devices; Triton on CUDA, the torch reference elsewhere):
  matmul(x [M, K], w [N, K])              -> [M, N]       (nn.Linear without bias, lm_head, router)
  head_matmul(x [T, H, K], w [H, N, K])   -> [T, H, N]    y[t, h] = w[h] @ x[t, h]; the absorbed MLA
      products are head_matmul(q_nope, w_uk.transpose(1, 2)) and head_matmul(o_lat, w_uv)
  batched_matmul(x [B, M, K], w [B, N, K]) -> [B, M, N]   any strides
fp32 operands use IEEE fp32 products (`input_precision="ieee"`, no TF32); bf16/fp16 products are
exact in fp32, so `out_dtype=torch.float32` on 16-bit operands equals an fp32 GEMM up to order.
Grid: (M tiles, N tiles, batch); M tiles vary fastest so the programs reading one W tile run
together and W streams from HBM about once (x is small at decode/verify sizes and stays in L2).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import pdl

# dtype of x/w -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the split rule's tiles (its bits: a deployment
# keeps them constant), fp32's only tiles, and 16-bit tiles where `tile_config` has no better one
CONFIGS = {
    torch.bfloat16: (64, 64, 64, 4, 4),
    torch.float16: (64, 64, 64, 4, 4),
    torch.float32: (64, 64, 32, 4, 3),
}


# split-K (2-D `matmul` only): enough programs per row tile to cover this many SMs (a constant, not the
# device's count: the bits must not depend on which GPU runs), at most MAX_SPLITS partials, and at
# least MIN_SPLIT_TILES K tiles per split
FILL_SMS = 132
MAX_SPLITS = 8
MIN_SPLIT_TILES = 4


# 16-bit tiles by row count (sm_90 sweep, `bench/bench_matmul.py --configs`): (largest M, tiles, tiles when the grid
# is wider than PIPELINED_GRID programs per SM); None: any M
TILES_BY_M = (
    (64, (64, 64, 64, 4, 6), (64, 64, 64, 4, 4)),  # decode / one tree: deeper pipelines while the grid fits twice
    (192, (64, 64, 64, 4, 4), None),  # up to three 64-row tiles (16 sessions x 9 nodes)
    (768, (64, 128, 64, 4, 3), None),
    (None, (128, 128, 64, 8, 3), None),  # prefill-sized: two warpgroups
)
PIPELINED_GRID = 2

# Programmatic dependent launch (`kernels.pdl.ENABLED`, default on): a launch whose programs all fit on the GPU at once
# (<= PIPELINED_GRID per SM: the decode-sized GEMMs) goes out with the launch_pdl attribute. Each program first
# prefetches its first PDL_PREFETCH K tiles of weights into L2 (the weights are not written by the kernels before it),
# then waits for the previous grid (`gdc_wait`: its writes, e.g. x, are visible after it) and lets the next grid
# launch (`gdc_launch_dependents`). The same bits: only when the data arrive changes. A grid larger than that would
# hold SMs with waiting programs (the MoE's PDL measured erratic there: docs/performance.md, fifteenth session).
PDL_PREFETCH = 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tile_config(M: int, programs: int, dtype: torch.dtype, device: torch.device | None = None) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for M rows; `programs`: the launch's programs per M tile (N tiles
    x splits x batch). Only speed depends on it (module doc), so it may follow M and the GPU."""
    if dtype not in (torch.bfloat16, torch.float16):
        return CONFIGS[dtype]
    for top, tiles, wide in TILES_BY_M:
        if top is None or M <= top:
            if wide is not None and device is not None and device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                if programs * triton.cdiv(M, tiles[0]) > PIPELINED_GRID * _sm_count(index):
                    return wide
            return tiles
    return CONFIGS[dtype]


def split_k(N: int, K: int, dtype: torch.dtype) -> tuple[int, int]:
    """(splits, K positions per split) for a weight [N, K] of `dtype`; a function of (N, K, dtype) only."""
    _, block_n, block_k, _, _ = CONFIGS[dtype]
    n_tiles, k_tiles = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    splits = max(1, min(MAX_SPLITS, FILL_SMS // n_tiles, k_tiles // MIN_SPLIT_TILES))
    per = triton.cdiv(k_tiles, splits) * block_k
    return triton.cdiv(K, per), per


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,  # [B, M, K]
    w_ptr,  # [B, N, K]
    y_ptr,  # out: [B, M, N]
    M, N, K,
    stride_xb, stride_xm, stride_xk,
    stride_wb, stride_wn, stride_wk,
    stride_yb, stride_ym, stride_yn,
    K_SPLIT,  # K positions per program (a multiple of BLOCK_K); with several splits, program_id(2) is the
    # split and y is the fp32 partials [splits, M, N] (stride_yb between splits); else it is the batch
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # split mode: x and w strides over b are 0, y's is the split's
    k_lo, k_hi = 0, K
    if SPLIT:
        k_lo = tl.program_id(2) * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + b * stride_xb + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + b * stride_wb + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    if PDL:  # launched with launch_pdl: the first weight tiles into L2, then wait for the grid before this one
        _prefetch_weights(w_rows, k_lo, k_hi, n_ok, stride_wk, BLOCK_K, PREFETCH)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # fixed order over this program's K range
        kk = k0 + offs_k
        k_ok = kk < k_hi
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
    y_ptrs = y_ptr + b * stride_yb + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _prefetch_weights(w_rows, k_lo, k_hi, n_ok, stride_wk, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """`prefetch.global.L2` of the program's first PREFETCH K tiles of its weight rows, one 128-byte line at a time
    (rows are contiguous in K: stride_wk 1 in every caller that sets PDL)."""
    LINE: tl.constexpr = 1024 // w_rows.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    rows = tl.reshape(w_rows, [w_rows.shape[0]])
    for t in tl.static_range(PREFETCH):
        for j in tl.static_range(max(1, BLOCK_K // LINE)):
            k = k_lo + t * BLOCK_K + j * LINE
            ptrs = rows + k * stride_wk
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }", "=r,l,r",
                [ptrs, (n_ok & (k < k_hi)).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _sum_splits_kernel(p_ptr, y_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y[i] = sum over s = 0, 1, ... of p[s, i] (fp32, in split order), cast to y's dtype."""
    if PDL:  # the partials are the previous grid's writes
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


# --- torch references ------------------------------------------------------------------------------
def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def matmul_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K], w [N, K] -> x @ w^T [M, N], products and sums in at least fp32, one final rounding."""
    acc = _acc(x.dtype)
    return (x.to(acc) @ w.to(acc).T).to(out_dtype or x.dtype)


def head_matmul_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, H, K], w [H, N, K] -> [T, H, N]."""
    acc = _acc(x.dtype)
    return torch.einsum("thk,hnk->thn", x.to(acc), w.to(acc)).to(out_dtype or x.dtype)


def batched_matmul_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [B, M, K], w [B, N, K] -> [B, M, N]."""
    acc = _acc(x.dtype)
    return torch.bmm(x.to(acc), w.to(acc).transpose(1, 2)).to(out_dtype or x.dtype)


# --- launchers -------------------------------------------------------------------------------------
def _check(name: str, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: x is {x.dtype} but w is {w.dtype} (cast one first)")
    if x.device != w.device:
        raise ValueError(f"{name}: x on {x.device}, w on {w.device}")
    out_dtype = out_dtype or x.dtype
    if x.is_cuda and (x.dtype not in CONFIGS or out_dtype not in CONFIGS):
        raise ValueError(f"{name}: CUDA path supports {sorted(map(str, CONFIGS))}, got {x.dtype} -> {out_dtype}")
    return out_dtype


def batched_matmul_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiles: tuple | None = None
                          ) -> torch.Tensor:
    """The Triton path on any device (tests call it on CPU under TRITON_INTERPRET=1).

    x [B, M, K], w [B, N, K], out [B, M, N] (written in place): any strides, including views such as
    a head slice of [T, H, K] or a transposed weight. tiles: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) instead of
    `tile_config`'s (tests)."""
    B, M, K = x.shape
    N = w.shape[1]
    if w.shape != (B, N, K) or out.shape != (B, M, N):
        raise ValueError(f"batched_matmul: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} "
                         "do not agree")
    if x.dtype not in CONFIGS or w.dtype != x.dtype or out.dtype not in CONFIGS:
        raise ValueError(f"batched_matmul: unsupported dtypes x {x.dtype}, w {w.dtype}, out {out.dtype}")
    if B == 0 or M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if tiles is None:
        tiles = tile_config(M, triton.cdiv(N, CONFIGS[x.dtype][1]) * B, x.dtype, x.device)
    block_m, block_n, block_k, warps, stages = tiles
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), B)
    if grid[1] > 65535 or B > 65535:
        raise ValueError(f"batched_matmul: N = {N} or B = {B} too large for one launch")
    _matmul_kernel[grid](
        x, w, out, M, N, K,
        x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), out.stride(2), K,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PREC=_prec(x.dtype), SPLIT=False,
        num_warps=warps, num_stages=stages, **_pdl_options(x, w, grid[0] * grid[1] * grid[2]))
    return out


def _pdl_options(x: torch.Tensor, w: torch.Tensor, programs: int) -> dict:
    """The kernel's PDL constexprs and launch option for a launch of `programs` programs (`PDL_PREFETCH`)."""
    if not (pdl.active(x) and w.stride(-1) == 1):
        return {}
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if programs > PIPELINED_GRID * _sm_count(index):
        return {}
    return dict(PDL=True, PREFETCH=PDL_PREFETCH, launch_pdl=True)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


def matmul_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiles: tuple | None = None) -> torch.Tensor:
    """The 2-D Triton path on any device: x [M, K] @ w [N, K]^T -> out [M, N] (written in place), split
    over K by `split_k(N, K)` (fp32 partials summed in split order), else one pass as batched_matmul.
    tiles: as `batched_matmul_triton`'s."""
    (M, K), N = x.shape, w.shape[0]
    if x.dtype not in CONFIGS or w.dtype != x.dtype or out.dtype not in CONFIGS:
        raise ValueError(f"matmul: unsupported dtypes x {x.dtype}, w {w.dtype}, out {out.dtype}")
    splits, per = split_k(N, K, x.dtype) if K > 0 else (1, 0)
    if splits == 1 or M == 0 or N == 0:
        return batched_matmul_triton(x[None], w[None], out[None], tiles)[0]
    if tiles is None:
        tiles = tile_config(M, triton.cdiv(N, CONFIGS[x.dtype][1]) * splits, x.dtype, x.device)
    block_m, block_n, block_k, warps, stages = tiles
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), splits)
    pdl_opts = _pdl_options(x, w, grid[0] * grid[1] * grid[2])
    _matmul_kernel[grid](
        x, w, part, M, N, K,
        0, x.stride(0), x.stride(1), 0, w.stride(0), w.stride(1),
        part.stride(0), part.stride(1), part.stride(2), per,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PREC=_prec(x.dtype), SPLIT=True,
        num_warps=warps, num_stages=stages, **pdl_opts)
    y = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(M * N, block),)](part, y, M * N, SPLITS=splits, BLOCK=block,
                                                      **({"PDL": True, "launch_pdl": True} if pdl_opts else {}))
    if y is not out:
        out.copy_(y)
    return out


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in out_dtype (default x.dtype). Batch invariant on CUDA."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    out_dtype = _check("matmul", x, w, out_dtype)
    if not x.is_cuda:
        return matmul_ref(x, w, out_dtype)
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
    return matmul_triton(x, w, out)


def head_matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, H, K], w [H, N, K] -> y [T, H, N], y[t, h] = w[h] @ x[t, h]. Batch invariant in T on CUDA."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"head_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} must be [T, H, K] and [H, N, K]")
    out_dtype = _check("head_matmul", x, w, out_dtype)
    if not x.is_cuda:
        return head_matmul_ref(x, w, out_dtype)
    out = torch.empty(x.shape[0], x.shape[1], w.shape[1], dtype=out_dtype, device=x.device)  # [T, H, N]
    batched_matmul_triton(x.transpose(0, 1), w, out.transpose(0, 1))  # batch over heads: [H, T, *]
    return out


def batched_matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [B, M, K], w [B, N, K] -> [B, M, N]. Batch invariant in M (and in B) on CUDA."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"batched_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} must be [B, M, K] and "
                         "[B, N, K]")
    out_dtype = _check("batched_matmul", x, w, out_dtype)
    if not x.is_cuda:
        return batched_matmul_ref(x, w, out_dtype)
    out = torch.empty(x.shape[0], x.shape[1], w.shape[1], dtype=out_dtype, device=x.device)
    return batched_matmul_triton(x, w, out)
