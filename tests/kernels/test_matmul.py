"""Batch-invariant GEMMs (kernels/matmul.py) against their torch references.

CPU: the Triton kernel under TRITON_INTERPRET=1 in fp32/fp16 (the interpreter has no bf16) at
awkward shapes (one row, non-multiples of every block, K = 0), strided views like the absorbed-MLA
operands, outputs poisoned with NaN. GPU (marked `gpu`): bf16 at Kimi K2.6 shapes, a row computed
alone vs inside M = 64 / 300 / 1100 rows: bitwise equal, for matmul, fp32-output matmul (router),
head_matmul (both MLA einsums) and batched_matmul, plus the zero-padding neutrality that
`verifier_service.aligned_attention` relies on.
"""

from __future__ import annotations

import pytest
import torch

from kernels.matmul import (
    CONFIGS,
    MAX_SPLITS,
    TILES_BY_M,
    batched_matmul,
    batched_matmul_ref,
    batched_matmul_triton,
    head_matmul,
    head_matmul_ref,
    matmul,
    matmul_ref,
    matmul_triton,
    split_k,
    tile_config,
)
from tests.kernels.compare import assert_close

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # ||out - ref|| / ||ref||
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def rand(*shape, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


# --- CPU: the kernel under the interpreter ----------------------------------------------------------
def test_exact_small_integers():
    """Integer operands: every product and partial sum is exact, so the result is exact."""
    x = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.0, 4.0]])
    w = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [2.0, -1.0, 5.0], [1.0, 1.0, 1.0]])
    want = torch.tensor([[1.0, 2.0, 15.0, 6.0], [-1.0, 0.0, 18.0, 3.0]])
    for dtype in (torch.float32, torch.float16):
        out = poisoned(1, 2, 4, dtype=dtype)
        batched_matmul_triton(x[None].to(dtype), w[None].to(dtype), out)
        assert torch.equal(out[0].float(), want), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 70, 33), (7, 65, 130), (65, 129, 97), (130, 17, 64)])
def test_matmul_kernel_vs_reference(M, N, K, dtype):
    x, w = rand(M, K, dtype=dtype, seed=M), rand(N, K, dtype=dtype, seed=N + 1)
    out = poisoned(1, M, N, dtype=dtype)
    batched_matmul_triton(x[None], w[None], out)
    assert_close(out[0], matmul_ref(x, w), TOL[dtype], f"matmul {M}x{N}x{K} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_output_from_16bit_operands(dtype):
    x, w = rand(9, 100, dtype=dtype, seed=3), rand(24, 100, dtype=dtype, seed=4)
    out = poisoned(1, 9, 24, dtype=torch.float32)
    batched_matmul_triton(x[None], w[None], out)
    assert_close(out[0], matmul_ref(x, w, torch.float32), 1e-5, "fp32 out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_views_like_the_mla_einsums(dtype):
    """q_nope is a head-dim slice of q; W_UK is read transposed out of kv_b_proj's weight."""
    T, H, nope, rope, v, Dl = 5, 3, 24, 8, 16, 40
    q = rand(T, H, nope + rope, dtype=dtype, seed=5)
    kv_b = rand(H * (nope + v), Dl, dtype=dtype, seed=6).view(H, nope + v, Dl)
    q_nope, w_uk, w_uv = q[..., :nope], kv_b[:, :nope], kv_b[:, nope:]
    out = poisoned(T, H, Dl, dtype=dtype)
    batched_matmul_triton(q_nope.transpose(0, 1), w_uk.transpose(1, 2), out.transpose(0, 1))
    assert_close(out, torch.einsum("thn,hnl->thl", q_nope.float(), w_uk.float()), TOL[dtype], "absorb W_UK")
    o_lat = rand(T, H, Dl, dtype=dtype, seed=7)
    out = poisoned(T, H, v, dtype=dtype)
    batched_matmul_triton(o_lat.transpose(0, 1), w_uv, out.transpose(0, 1))
    assert_close(out, torch.einsum("thl,hvl->thv", o_lat.float(), w_uv.float()), TOL[dtype], "apply W_UV")
    x = rand(6, 50, dtype=dtype, seed=8)[:, 7:40]  # a column slice: row stride 50
    w = rand(33, 21, dtype=dtype, seed=9).T  # [21, 33] with a K stride of 21
    out = poisoned(1, 6, 21, dtype=dtype)
    batched_matmul_triton(x[None], w[None], out)
    assert_close(out[0], matmul_ref(x, w), TOL[dtype], "strided 2-D")


def test_batched_kernel_vs_reference():
    x, w = rand(3, 17, 45, seed=10), rand(3, 70, 45, seed=11)
    out = poisoned(3, 17, 70, dtype=torch.float32)
    batched_matmul_triton(x, w, out)
    assert_close(out, batched_matmul_ref(x, w), TOL[torch.float32], "bmm")


def test_empty_and_zero_k():
    out = batched_matmul_triton(torch.zeros(1, 0, 8), torch.zeros(1, 5, 8), torch.empty(1, 0, 5))
    assert out.shape == (1, 0, 5)
    out = batched_matmul_triton(torch.zeros(1, 3, 0), torch.zeros(1, 5, 0), poisoned(1, 3, 5, dtype=torch.float32))
    assert torch.equal(out, torch.zeros(1, 3, 5))


def test_split_rule_depends_on_the_weight_only():
    """Splits cover K exactly once in whole K tiles; skinny K2.6 weights split, wide ones do not."""
    for dtype in CONFIGS:
        block_k = CONFIGS[dtype][2]
        for N in (1, 5, 40, 64, 65, 576, 1536, 8191, 163840):
            for K in (1, 31, 64, 1000, 2048, 7168, 18432):
                splits, per = split_k(N, K, dtype)
                assert 1 <= splits <= MAX_SPLITS and per % block_k == 0, (N, K, splits, per)
                assert (splits - 1) * per < K <= splits * per, (N, K, splits, per)
    bf = torch.bfloat16
    assert split_k(576, 7168, bf)[0] == 8 and split_k(1536, 7168, bf)[0] == 5  # kv_a_proj, q_a_proj
    assert split_k(163840, 7168, bf)[0] == 1 and split_k(7168, 8192, bf)[0] == 1  # lm_head, o_proj


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 40, 1000), (5, 33, 2048), (70, 65, 777)])
def test_split_matmul_vs_reference(M, N, K, dtype):
    assert split_k(N, K, dtype)[0] > 1
    x, w = rand(M, K, dtype=dtype, seed=M + 3), rand(N, K, dtype=dtype, seed=N + 4)
    out = poisoned(M, N, dtype=dtype)
    matmul_triton(x, w, out)
    assert_close(out, matmul_ref(x, w), TOL[dtype], f"split matmul {M}x{N}x{K} {dtype}")
    out32 = poisoned(M, N, dtype=torch.float32)
    matmul_triton(x, w, out32)  # 16-bit operands, fp32 out (the router)
    assert_close(out32, matmul_ref(x, w, torch.float32), 1e-5, f"split matmul fp32 out {M}x{N}x{K} {dtype}")


def test_split_row_alone_equals_row_in_batch_interpreted():
    x, w = rand(70, 1000, dtype=torch.float16, seed=21), rand(40, 1000, dtype=torch.float16, seed=22)
    assert split_k(40, 1000, torch.float16)[0] > 1
    full = matmul_triton(x, w, poisoned(70, 40, dtype=torch.float16))
    for r in (0, 63, 69):
        alone = matmul_triton(x[r : r + 1], w, poisoned(1, 40, dtype=torch.float16))
        assert torch.equal(alone[0], full[r]), r


def test_row_alone_equals_row_in_batch_interpreted():
    x, w = rand(70, 90, dtype=torch.float16, seed=12), rand(40, 90, dtype=torch.float16, seed=13)
    full = poisoned(1, 70, 40, dtype=torch.float16)
    batched_matmul_triton(x[None], w[None], full)
    for r in (0, 63, 69):
        alone = poisoned(1, 1, 40, dtype=torch.float16)
        batched_matmul_triton(x[None, r : r + 1], w[None], alone)
        assert torch.equal(alone[0, 0], full[0, r]), r


def test_launchers_dispatch_to_the_reference_on_cpu():
    x, w = rand(4, 10, seed=14), rand(6, 10, seed=15)
    assert torch.equal(matmul(x, w), matmul_ref(x, w))
    assert matmul(x.half(), w.half(), torch.float32).dtype == torch.float32
    xh, wh = rand(4, 2, 10, seed=16), rand(2, 6, 10, seed=17)
    assert torch.equal(head_matmul(xh, wh), head_matmul_ref(xh, wh))
    assert torch.equal(batched_matmul(xh.transpose(0, 1), wh), batched_matmul_ref(xh.transpose(0, 1), wh))
    x64, w64 = x.double(), w.double()
    assert torch.equal(matmul(x64, w64), x64 @ w64.T)


def test_launchers_check_shapes_and_dtypes():
    x, w = rand(4, 10), rand(6, 10)
    with pytest.raises(ValueError, match="must be"):
        matmul(x, w.T)
    with pytest.raises(ValueError, match="cast one first"):
        matmul(x, w.half())
    with pytest.raises(ValueError, match="must be"):
        head_matmul(rand(4, 2, 10), rand(3, 6, 10))
    with pytest.raises(ValueError, match="must be"):
        batched_matmul(rand(2, 4, 10), rand(3, 6, 10))
    with pytest.raises(ValueError, match="do not agree"):
        batched_matmul_triton(rand(1, 4, 10), rand(1, 6, 10), torch.empty(1, 4, 5))
    with pytest.raises(ValueError, match="unsupported"):
        batched_matmul_triton(rand(1, 4, 10).double(), rand(1, 6, 10).double(), torch.empty(1, 4, 6).double())


# --- GPU: bitwise row invariance in bf16 at Kimi shapes ---------------------------------------------
KIMI_LINEARS = [  # (N, K): q_a, q_b, kv_a, o_proj, shared gate/up, shared down, an awkward one
    (1536, 7168), (12288, 1536), (576, 7168), (7168, 8192), (2048, 7168), (7168, 2048), (1000, 999)]
BATCHES = (64, 300, 1100)


def rows_to_check(M: int) -> list[int]:
    return sorted({0, 1, 37 % M, M // 2, M - 1})


ROWS = sorted({r for M in BATCHES for r in rows_to_check(M)})  # every row some batch checks


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N,K", KIMI_LINEARS)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_matmul_row_invariance_bf16(N, K, out_dtype):
    x = rand(max(BATCHES), K, dtype=torch.bfloat16, seed=N, device="cuda")
    w = rand(N, K, dtype=torch.bfloat16, seed=K, device="cuda") * K**-0.5
    alone = {r: matmul(x[r : r + 1], w, out_dtype)[0] for r in ROWS}
    for M in BATCHES:
        y = matmul(x[:M], w, out_dtype)
        for r in rows_to_check(M):
            assert torch.equal(y[r], alone[r]), f"[{N}x{K}] row {r} of M={M} differs from the row alone"
    assert_close(y, matmul_ref(x, w, out_dtype), 1e-5 if out_dtype else TOL[torch.bfloat16], f"{N}x{K}")


@pytest.mark.gpu
@needs_cuda
def test_lm_head_and_router_shapes_row_invariance():
    x = rand(max(BATCHES), 7168, dtype=torch.bfloat16, seed=1, device="cuda")
    for N, out_dtype in ((163840, None), (384, torch.float32)):
        w = rand(N, 7168, dtype=torch.bfloat16, seed=N, device="cuda") * 7168**-0.5
        alone = matmul(x[5:6], w, out_dtype)[0]
        for M in BATCHES:
            assert torch.equal(matmul(x[:M], w, out_dtype)[5], alone), f"N={N} M={M}"


@pytest.mark.gpu
@needs_cuda
def test_head_matmul_row_invariance_bf16():
    """Both absorbed-MLA einsums at K2.6 shapes: 64 heads, nope 128, v 128, latent 512."""
    H, nope, rope, v, Dl = 64, 128, 64, 128, 512
    Tm = max(BATCHES)
    q = rand(Tm, H, nope + rope, dtype=torch.bfloat16, seed=2, device="cuda")
    kv_b = rand(H, nope + v, Dl, dtype=torch.bfloat16, seed=3, device="cuda") * Dl**-0.5
    o_lat = rand(Tm, H, Dl, dtype=torch.bfloat16, seed=4, device="cuda")
    w_uk, w_uv = kv_b[:, :nope].transpose(1, 2), kv_b[:, nope:]
    cases = {"absorb_uk": (q[..., :nope], w_uk), "apply_uv": (o_lat, w_uv)}
    for name, (x, w) in cases.items():
        alone = {r: head_matmul(x[r : r + 1], w)[0] for r in ROWS}
        for T in BATCHES:
            y = head_matmul(x[:T], w)
            for r in rows_to_check(T):
                assert torch.equal(y[r], alone[r]), f"{name}: token {r} of T={T}"
        assert_close(y, head_matmul_ref(x, w), TOL[torch.bfloat16], name)


@pytest.mark.gpu
@needs_cuda
def test_batched_matmul_invariance_and_zero_padding_bf16():
    """Rows (M) and batch entries are independent, and zero-padding K (and N) changes no bit: the
    contract `aligned_mla_attention` relies on (keys padded to the longest list of the batch)."""
    B, M, N, K = 12, 64, 300, 576
    x = rand(B, M, K, dtype=torch.bfloat16, seed=5, device="cuda")
    w = rand(B, N, K, dtype=torch.bfloat16, seed=6, device="cuda")
    y = batched_matmul(x, w, torch.float32)
    assert torch.equal(batched_matmul(x[3:4, 10:11], w[3:4], torch.float32)[0, 0], y[3, 10])
    for pad_k in (1, 37, 200):
        xp = torch.cat((x, torch.zeros(B, M, pad_k, dtype=x.dtype, device="cuda")), -1)
        wp = torch.cat((w, torch.zeros(B, N, pad_k, dtype=w.dtype, device="cuda")), -1)
        assert torch.equal(batched_matmul(xp, wp, torch.float32), y), f"K padded by {pad_k}"
    wp = torch.cat((w, rand(B, 77, K, dtype=w.dtype, seed=7, device="cuda")), 1)
    assert torch.equal(batched_matmul(x, wp, torch.float32)[:, :, :N], y)
    assert_close(y, batched_matmul_ref(x, w, torch.float32), 1e-5, "bmm fp32 out")


def test_configs_are_fixed_per_dtype():
    """The split rule's tiles are a function of the dtype alone (never of M); bf16 and fp16 must agree; fp32 has one
    tile shape for every M; 16-bit tiles follow M only through `TILES_BY_M` (a growing table)."""
    assert CONFIGS[torch.bfloat16] == CONFIGS[torch.float16]
    assert all(len(c) == 5 for c in CONFIGS.values())
    assert {tile_config(M, 10**6, torch.float32) for M in (1, 65, 300, 5000)} == {CONFIGS[torch.float32]}
    tops = [top for top, _, _ in TILES_BY_M]
    assert tops[-1] is None and tops[:-1] == sorted(tops[:-1])
    for _top, tiles, wide in TILES_BY_M:
        for t in (tiles, wide):
            assert t is None or (len(t) == 5 and t[0] % 64 == 0 and t[3] % 4 == 0), t  # wgmma: 64-row warpgroups
    assert tile_config(1, 1, torch.bfloat16) == TILES_BY_M[0][1] == tile_config(1, 1, torch.float16)
    assert tile_config(10**5, 1, torch.bfloat16) == TILES_BY_M[-1][1]


# every 16-bit tile shape the launchers may pick, and the ones the sweeps time (bench/bench_matmul.py --configs)
TILE_SHAPES = sorted({CONFIGS[torch.bfloat16], *(t for _, tiles, wide in TILES_BY_M for t in (tiles, wide) if t),
                      (64, 128, 64, 4, 4), (64, 64, 128, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                      (128, 64, 64, 4, 4), (64, 256, 64, 4, 3), (128, 128, 64, 8, 4)})


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N,K", [(576, 7168), (7168, 8192), (2112, 7168), (12288, 1536), (300, 1000)])
def test_tile_shapes_give_the_same_bits(N, K):
    """What lets the tiles follow M (module doc): every tile shape gives every element the same bits, split or not
    (kv_a / q_a + kv_a split 8 / 4 ways, o_proj and q_b one pass, an awkward shape), for bf16 and fp32 outputs, and
    for the per-head products."""
    x = rand(300, K, dtype=torch.bfloat16, seed=N + K, device="cuda")
    w = rand(N, K, dtype=torch.bfloat16, seed=N, device="cuda") * K**-0.5
    for out_dtype in (torch.bfloat16, torch.float32):
        want = matmul_triton(x, w, torch.empty(300, N, dtype=out_dtype, device="cuda"), CONFIGS[torch.bfloat16])
        for t in TILE_SHAPES:
            got = matmul_triton(x, w, torch.full((300, N), float("nan"), dtype=out_dtype, device="cuda"), t)
            assert torch.equal(got, want), f"[{N}x{K}] {out_dtype} tiles {t} differ from {CONFIGS[torch.bfloat16]}"
    xh = rand(70, 64, 512, dtype=torch.bfloat16, seed=9, device="cuda").transpose(0, 1)  # [H, T, Dl] strided
    wh = rand(64, 128, 512, dtype=torch.bfloat16, seed=10, device="cuda")
    want = batched_matmul_triton(xh, wh, torch.empty(64, 70, 128, dtype=torch.bfloat16, device="cuda"),
                                 CONFIGS[torch.bfloat16])
    for t in TILE_SHAPES:
        got = batched_matmul_triton(xh, wh, torch.empty(64, 70, 128, dtype=torch.bfloat16, device="cuda"), t)
        assert torch.equal(got, want), f"head products: tiles {t}"


# --- programmatic dependent launch (`kernels.pdl`, opt-in) -------------------------------------------
def test_pdl_stays_off_the_cpu_path_and_wide_grids(monkeypatch):
    """`kernels.pdl.ENABLED` changes nothing off CUDA (the interpreter has no griddepcontrol): the same results with
    it on; on CUDA only launches whose programs fit at once (<= PIPELINED_GRID per SM) and whose weight rows are
    contiguous get it."""
    import kernels.matmul as mm
    from kernels import pdl

    x, w = rand(3, 200, seed=1), rand(70, 200, seed=2)
    want = matmul_triton(x, w, poisoned(3, 70, dtype=torch.float32))
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert torch.equal(matmul_triton(x, w, poisoned(3, 70, dtype=torch.float32)), want)
    assert mm._pdl_options(x, w, 1) == {}

    class OnGpu:  # what _pdl_options reads of a CUDA tensor
        is_cuda, device = True, torch.device("cuda", 0)

        def __init__(self, last_stride=1):
            self.last = last_stride

        def stride(self, dim):
            return self.last

    monkeypatch.setattr(mm, "_sm_count", lambda index: 132)
    monkeypatch.setattr(pdl, "_capable", lambda device: True)
    on = dict(PDL=True, PREFETCH=mm.PDL_PREFETCH, launch_pdl=True)
    assert mm._pdl_options(OnGpu(), OnGpu(), 264) == on
    assert pdl.trigger(OnGpu()) == {"TRIGGER": True}
    assert mm._pdl_options(OnGpu(), OnGpu(), 265) == {}  # more programs than fit: they would hold SMs waiting
    assert mm._pdl_options(OnGpu(), OnGpu(last_stride=3), 10) == {}  # prefetches assume rows contiguous in K
    monkeypatch.setattr(pdl, "_capable", lambda device: False)  # before sm_90: no griddepcontrol
    assert mm._pdl_options(OnGpu(), OnGpu(), 10) == {} and pdl.trigger(OnGpu()) == {}
    monkeypatch.setattr(pdl, "_capable", lambda device: True)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert mm._pdl_options(OnGpu(), OnGpu(), 10) == {} and pdl.trigger(OnGpu()) == {}


def test_pdl_switch_from_the_environment():
    """DDTREE_PDL: unset / empty / 1 on (the default), 0 off, anything else refused with a message naming the
    variable."""
    from kernels import pdl

    assert [pdl._from_env(v) for v in (None, "", "1", "0")] == [True, True, True, False]
    for bad in ("true", "2", "on"):
        with pytest.raises(ValueError, match="DDTREE_PDL"):
            pdl._from_env(bad)


_SM90_PDL = r"""
import json, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kernels import matmul as mm

def ptx(pdl, split):
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*fp32" if split else "*bf16", "M": "i32", "N": "i32",
           "K": "i32"}
    sig.update({n: "i32" for n in ("stride_xb", "stride_xm", "stride_xk", "stride_wb", "stride_wn", "stride_wk",
                                   "stride_yb", "stride_ym", "stride_yn", "K_SPLIT")})
    cst = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, PREC="tf32", SPLIT=split, PDL=pdl, PREFETCH=4 if pdl else 0)
    sig.update({k: "constexpr" for k in cst})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("x_ptr", "w_ptr", "y_ptr")}
    k = compile(ASTSource(fn=mm._matmul_kernel, signature=sig, constexprs=cst, attrs=attrs),
                target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=6))
    return k.asm["ptx"].splitlines()

out = {}
for pdl in (False, True):
    for split in (False, True):
        lines = ptx(pdl, split)
        first = lambda pat: next((i for i, l in enumerate(lines) if re.search(pat, l)), -1)
        out[f"{int(pdl)}{int(split)}"] = dict(
            wait=first(r"griddepcontrol\.wait"), launch=first(r"griddepcontrol\.launch_dependents"),
            prefetch=sum("prefetch.global.L2" in l for l in lines), first_prefetch=first(r"prefetch\.global\.L2"),
            last_prefetch=max((i for i, l in enumerate(lines) if "prefetch.global.L2" in l), default=-1),
            first_load=first(r"cp\.async|ld\.global"), mmas=sum("wgmma.mma_async" in l for l in lines))
from kernels import _mla_kernels, rmsnorm
feeders = {  # the plainly launched kernels that let a PDL launch after them start early: (fn, signature, constexprs)
    "norm": (rmsnorm._rmsnorm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "D": "i32",
                                       "stride_xr": "i32", "stride_yr": "i32", "eps": "fp32"},
             dict(BLOCK_D=2048, ONE_CHUNK=True)),
    "combine": (_mla_kernels._mla_combine_kernel, {"po_ptr": "*bf16", "pml_ptr": "*fp32", "nc_ptr": "*i32",
                                                   "out_ptr": "*bf16", "H": "i32", "HT": "i32", "GC": "i32",
                                                   "stride_ot": "i32", "stride_oh": "i32"},
                dict(DL=512, BDL=512, BLOCK_D=128, BLOCK_M=64)),
}
for name, (fn, sig, cst0) in feeders.items():
    for trig in (False, True):
        cst = dict(cst0, TRIGGER=trig)
        k = compile(ASTSource(fn=fn, signature={**sig, **{n: "constexpr" for n in cst}}, constexprs=cst),
                    target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        lines = k.asm["ptx"].splitlines()
        first = lambda pat: next((i for i, l in enumerate(lines) if re.search(pat, l)), -1)
        out[f"{name}{int(trig)}"] = dict(launch=first(r"griddepcontrol\.launch_dependents"),
                                         wait=first(r"griddepcontrol\.wait"), first_load=first(r"ld\.global"))
print(json.dumps(out))
"""


def test_pdl_matmul_compiles_for_sm90_in_the_right_order(tmp_path):
    """The PDL kernel for sm_90 (PTX, no GPU needed): its weight prefetches come before the wait for the previous
    grid, every global load of data (x, and the weights' real loads) after it, the next grid's launch is allowed
    after the wait, and the loop's MMAs are the plain kernel's; without PDL none of it is there. The RMSNorm and MLA
    combine kernels with TRIGGER let the next grid launch at their start and wait for nothing."""
    from tests.kernels.sm90_compile import run_sm90_script

    facts = run_sm90_script(tmp_path, _SM90_PDL)
    for split in "01":
        off, on = facts["0" + split], facts["1" + split]
        assert off["wait"] == off["launch"] == off["first_prefetch"] == -1 and off["prefetch"] == 0, off
        assert on["prefetch"] >= 4 and 0 <= on["first_prefetch"] <= on["last_prefetch"] < on["wait"], on
        assert on["wait"] < on["launch"] < on["first_load"], on
        assert on["mmas"] == off["mmas"] > 0, (on, off)
    for name in ("norm", "combine"):  # these only let the next grid start, before their first load
        plain, trig = facts[name + "0"], facts[name + "1"]
        assert plain["launch"] == plain["wait"] == trig["wait"] == -1, (name, plain, trig)
        assert 0 <= trig["launch"] < trig["first_load"], (name, trig)


@pytest.mark.gpu
@needs_cuda
def test_pdl_gives_the_same_bits_eager_and_in_a_graph(monkeypatch):
    """A chain of decode-sized GEMMs as a layer runs them (q_a + kv_a split 4 ways -> an RMSNorm that triggers the
    next launch -> q_b in one pass -> o_proj-like, each reading the one before): with PDL the bits of the plain
    launches, eagerly and replayed from a CUDA graph with new inputs (a missing wait would read the previous kernel's
    output before it is written)."""
    import kernels.matmul as mm
    from kernels import pdl
    from kernels.rmsnorm import rms_norm

    dev = "cuda"
    w1 = rand(2112, 7168, dtype=torch.bfloat16, seed=1, device=dev) * 7168**-0.5
    w2 = rand(12288, 2112, dtype=torch.bfloat16, seed=2, device=dev) * 2112**-0.5
    w3 = rand(7168, 12288, dtype=torch.bfloat16, seed=3, device=dev) * 12288**-0.5

    norm = rand(2112, dtype=torch.bfloat16, seed=4, device=dev)

    def chain(x):  # the norm before q_b lets the PDL GEMM after it start early (`TRIGGER`)
        return matmul(matmul(rms_norm(matmul(x, w1), norm, 1e-6), w2), w3)

    for M in (1, 3):
        x = rand(M, 7168, dtype=torch.bfloat16, seed=M, device=dev)
        monkeypatch.setattr(pdl, "ENABLED", False)
        want = chain(x)
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert mm._pdl_options(x, w1, 33 * 4) != {}, "the test's first GEMM must take the PDL path"
        assert torch.equal(chain(x), want), f"M={M}: eager PDL launches differ"
        static = x.clone()
        chain(static)  # compiled outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(static)
        for seed in (11, 12):
            x2 = rand(M, 7168, dtype=torch.bfloat16, seed=seed, device=dev)
            monkeypatch.setattr(pdl, "ENABLED", False)
            want2 = chain(x2)
            static.copy_(x2)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want2), f"M={M}: graph replay with PDL differs (seed {seed})"
        monkeypatch.setattr(pdl, "ENABLED", True)
