"""INT4 MoE kernels (kernels/int4_moe.py) against the torch reference `int4_moe_ref`.

CPU: the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at small awkward shapes in
fp32/fp16 (the interpreter has no bf16 dot). GPU (marked `gpu`): the same kernels at Kimi K2.6
shapes in bf16, plus batch invariance (a token alone vs inside a batch of 64: bitwise equal).
Variants that change the schedule or the loads (persistent grid, k_unroll, scale_tile) must give their
base configuration's bits, on CPU and GPU.
Outputs are poisoned with NaN before every launch; NaN never passes.
"""

from __future__ import annotations

import pytest
import torch

from kernels._moe_align import moe_align, moe_align_torch
from kernels.int4_moe import (
    int4_moe,
    int4_moe_ref,
    int4_moe_triton,
    repack_int4_moe_for_gpu,
    tile_int4_moe_weights,
    unrepack_int4_moe,
)
from kernels.int4_pack import dequantize_int4, pack_int4
from tests.kernels.compare import assert_close, interpreter_dot_row_invariant

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}  # ||out - ref|| / ||ref||
ROW_TILE_TOL = {torch.float32: 1e-6, torch.float16: 1e-3}  # same kernel, a BLAS that rounds by row count (CPU)
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def make_experts(E: int, D: int, inter: int, device=DEV, seed: int = 0):
    """Random checkpoint-layout INT4 experts: packed int32 + bf16 scales, (w13, w2)."""
    g = torch.Generator().manual_seed(seed)

    def proj(n_out: int, n_in: int):
        q = torch.randint(-8, 8, (E * n_out, n_in), generator=g, dtype=torch.int8)
        packed = pack_int4(q).view(E, n_out, n_in // 8)
        scale = (torch.rand(E, n_out, n_in // 32, generator=g) * 0.02 + 0.005).to(torch.bfloat16)
        return packed.to(device), scale.to(device)

    return (*proj(2 * inter, D), *proj(D, inter))


def make_routing(T: int, k: int, E: int, device=DEV, seed: int = 1, experts=None):
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(E) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(T)]).reshape(T, k)
    w = torch.rand(T, k, generator=g) + 0.1
    return ids.to(device), (w / w.sum(-1, keepdim=True) * 2.5).to(device)


def run_kernel(x, ids, w, weights_gpu, **config):
    """Triton path into an output poisoned with NaN (every element must be written)."""
    out = torch.full_like(x, float("nan"))
    int4_moe_triton(x, ids, w, *weights_gpu, out=out, **config)
    return out


def _cfg_id(config: dict | str) -> str:
    if isinstance(config, str):
        return config.replace(" ", "+")
    return "-".join(f"{k}={v}" for k, v in config.items()) or "default"


def assert_bitwise(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Same bits (-0.0 != 0.0), no NaN (outputs are poisoned with it); on failure name the first difference."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape, out.dtype, ref.dtype)
    assert not torch.isnan(out).any(), f"{what}: {int(torch.isnan(out).sum())} NaNs (elements never written?)"
    bits = {2: torch.int16, 4: torch.int32}[out.element_size()]
    diff = (out.view(bits) != ref.view(bits)).nonzero()
    if len(diff):
        i = tuple(int(v) for v in diff[0])
        raise AssertionError(f"{what}: {len(diff)} elements differ; first at {i}: "
                             f"{float(out[i])!r} vs {float(ref[i])!r}")


# ---------------------------------------------------------------- grouping (moe_align)

@pytest.mark.parametrize("T,k,E", [(1, 8, 384), (5, 3, 7), (40, 3, 4), (3, 2, 100), (17, 8, 64)])
def test_align_kernel_matches_torch(T, k, E):
    ids, _ = make_routing(T, k, E)
    sp, be = moe_align(ids, E, 16)
    sp_t, be_t = moe_align_torch(ids, E, 16)
    assert torch.equal(sp.cpu(), sp_t.cpu()) and torch.equal(be.cpu(), be_t.cpu())
    # every pair appears exactly once, grouped under its expert's blocks
    P = T * k
    valid = sp[sp < P].long().cpu()
    assert torch.equal(valid.sort().values, torch.arange(P))
    blocks = sp.view(-1, 16).cpu()
    for b, e in enumerate(be.cpu().tolist()):
        members = blocks[b][blocks[b] < P].long()
        if e < 0:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and (ids.reshape(-1).cpu()[members] == e).all()
    used = (be >= 0).cpu()  # the persistent kernels walk blocks 0..n_used-1: the used blocks come first
    assert torch.equal(used, torch.arange(len(used)) < int(used.sum()))


# ---------------------------------------------------------------- layout

def test_repack_roundtrip_and_dequant():
    D, inter = 96, 160  # K not a multiple of 256: padded on repack
    w = make_experts(3, D, inter)
    g = repack_int4_moe_for_gpu(*w)
    assert g[0].shape == (3, 2 * inter, 256 // 8) and g[1].shape == (3, 1, 8, 2 * inter)
    back = unrepack_int4_moe(*g, D)
    for a, b in zip(back, w):
        assert torch.equal(a, b)
    # nibble k of word j of a 256-column block is column 32k + j
    blk = g[0][0, 0, :32].long()
    u = (blk.unsqueeze(-1) >> (4 * torch.arange(8, device=blk.device))) & 0xF  # [j, k]
    ref = dequantize_int4(w[0][0, :1], torch.ones_like(w[1][0, :1]))[0]  # q values of row 0
    assert torch.equal((u - 8).T.reshape(-1)[:D].to(ref.dtype), ref)


# ---------------------------------------------------------------- kernels vs reference

CASES = [  # T, k, E, D, I
    (1, 2, 5, 256, 256),  # one token
    (7, 3, 33, 96, 160),  # many experts with no token; K padded (96 -> 256, 160 -> 256)
    (40, 3, 4, 256, 96),  # experts with > 16 pairs: several blocks per expert
    (3, 1, 2, 512, 64),  # top-1
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,k,E,D,inter", CASES)
def test_int4_moe_kernel_vs_reference(T, k, E, D, inter, dtype):
    w = make_experts(E, D, inter, seed=T + E)
    ids, tw = make_routing(T, k, E, seed=D + k)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    out = run_kernel(x, ids, tw, repack_int4_moe_for_gpu(*w))
    ref = int4_moe_ref(x.float(), ids, tw, *w)
    assert_close(out, ref, TOL[dtype], f"int4_moe T={T} k={k} E={E} D={D} I={inter} {dtype}")


# the kernel variants the benchmarks sweep (MMA orientation, where the scale is applied, tiles)
VARIANTS = [dict(swap=s, prescale=p) for s in (False, True) for p in (False, True)] + [
    dict(swap=True, prescale=True, block_i=64, block_d=128, num_warps=8),
    dict(swap=True, prescale=True, block_i=16, block_d=32), dict(swap=True, prescale=True, block_i=32, block_d=32),
    # the zero point by an MMA on group sums (other arithmetic than the default: against the reference)
    dict(zp_mma=True), dict(zp_mma=True, swap=False), dict(zp_mma=True, block_i=64, block_d=128, num_warps=8),
    # independent accumulator chains per K step (other summation order)
    dict(acc_chains=2), dict(acc_chains=4), dict(acc_chains=2, swap=False), dict(acc_chains=4, zp_mma=True)]


@pytest.mark.parametrize("config", VARIANTS, ids=_cfg_id)
def test_int4_moe_variants(config):
    T, k, E, D, inter = 7, 3, 33, 96, 160
    w = make_experts(E, D, inter, seed=2)
    ids, tw = make_routing(T, k, E, seed=4)
    for dtype in DTYPES[1:]:  # fp16 (and bf16 on a GPU)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
        out = run_kernel(x, ids, tw, repack_int4_moe_for_gpu(*w), **config)
        assert_close(out, int4_moe_ref(x.float(), ids, tw, *w), TOL[dtype], f"{config} {dtype}")


# Options that change how the work is scheduled or loaded, not the arithmetic: (base config, extra options,
# dtypes); the variant must be bitwise equal to the base. persistent: a 1-D grid walking (block, row tile)
# tiles in one flattened loop (4 programs by default on CPU); k_unroll: K blocks per loop iteration;
# scale_tile: a step's scales as one [ROWS, 8] load. In `same_bits_case` w13 has 3 K blocks and w2 2, so
# k_unroll=2 runs w13's first block before the loop and k_unroll=3 runs all of w2's that way.
SAME_BITS_VARIANTS = [
    ({}, dict(k_unroll=2), "fp32 fp16"),
    ({}, dict(k_unroll=3), "fp32 fp16"),
    (dict(scale_tile=False), {}, "fp32 fp16"),  # the 2-byte scale loads vs the scale-tile default
    ({}, dict(persistent=True), "fp32 fp16"),
    ({}, dict(persistent=True, num_programs=1), "fp32 fp16"),  # one program walks every tile
    (dict(scale_tile=False), dict(persistent="w2", k_unroll=2, num_programs=5, scale_tile=True), "fp32 fp16"),
    ({}, dict(persistent="w13", k_unroll=3, num_programs=1000), "fp32 fp16"),  # more programs than tiles
    (dict(swap=False, prescale=False, scale_tile=False), dict(persistent=True, num_programs=3, scale_tile=True),
     "fp16"),
    (dict(prescale=False, scale_tile=False), dict(persistent="w2", k_unroll=2, scale_tile=True), "fp16"),
    (dict(block_m=16), dict(block_m=32), "fp32 fp16"),  # 17 pairs on expert 1: two blocks of 16, one of 32
    (dict(block_m=16), dict(block_m=64), "fp32 fp16"),
    (dict(block_m=16), dict(block_m=32, persistent=True, num_programs=3), "fp16"),
    # zp_mma: its own bits, kept by the same schedule options (the correction runs after the K loop in every one)
    (dict(zp_mma=True), dict(k_unroll=2), "fp32 fp16"),
    (dict(zp_mma=True), dict(persistent=True, num_programs=3), "fp32 fp16"),
    (dict(zp_mma=True, scale_tile=False), dict(persistent="w2", k_unroll=2, scale_tile=True), "fp16"),
    (dict(zp_mma=True), dict(block_m=32), "fp16"),
    (dict(acc_chains=2), dict(k_unroll=2, persistent="w2", num_programs=3), "fp32 fp16"),
    (dict(acc_chains=4), dict(block_m=32, persistent="w13"), "fp16"),
]
# interpreter: few, large tiles (its cost is per program and K block); GPU: the default tiles (fast to compile)
_BIG = {} if CUDA else dict(block_i=128, block_d=256)
_DT = {"fp32": torch.float32, "fp16": torch.float16}


@pytest.fixture(scope="module")
def same_bits_case():
    """K blocks: w13 3 (D 544 -> 768), w2 2 (I 352 -> 512), the last one partial; N not a multiple of the
    tiles (interpreter 352 / 128, 544 / 256; GPU 544 / 64); expert 1 with 17 pairs (two blocks, the second
    15 padding pairs), expert 3 with none, unused blocks at the end. Base outputs are cached per dtype."""
    T, E, D, inter = 17, 4, 544, 352
    w = make_experts(E, D, inter, seed=11)
    ids = torch.tensor([[1, 0]] * 15 + [[2, 1]] * 2, device=DEV)
    tw = (torch.rand(T, 2, generator=torch.Generator().manual_seed(12)) + 0.1).to(DEV)
    xs = {dt: torch.randn(T, D, generator=torch.Generator().manual_seed(13)).to(DEV, dt) for dt in DTYPES}
    return dict(w=w, wg=repack_int4_moe_for_gpu(*w), ids=ids, tw=tw, xs=xs, base={})


@pytest.mark.parametrize("base,extra,dtypes", SAME_BITS_VARIANTS, ids=_cfg_id)
def test_int4_moe_same_bits_variants(same_bits_case, base, extra, dtypes):
    c = same_bits_case
    for dtype in (_DT[d] for d in dtypes.split()):
        x = c["xs"][dtype]
        key = (dtype, _cfg_id(base))
        if key not in c["base"]:
            c["base"][key] = run_kernel(x, c["ids"], c["tw"], c["wg"], **_BIG, **base)
            assert_close(c["base"][key], int4_moe_ref(x.float(), c["ids"], c["tw"], *c["w"]), TOL[dtype],
                         f"{base} {dtype}")
        out = run_kernel(x, c["ids"], c["tw"], c["wg"], **_BIG, **{**base, **extra})  # extra overrides base
        if base.get("block_m") != extra.get("block_m", base.get("block_m")) and not CUDA \
                and not interpreter_dot_row_invariant(dtype):
            # another row tile, and this CPU's BLAS (the interpreter's dot) rounds a row by its tile's row count:
            # the values are checked here, the bits on a GPU (the same test there; test_int4_moe_batch_invariance*)
            assert_close(out, c["base"][key], ROW_TILE_TOL[dtype], f"{base} + {extra} {dtype} (BLAS rows vary)")
        else:
            assert_bitwise(out, c["base"][key], f"{base} + {extra} {dtype}")


# the tiled weight layout against the "gpu" layout with the same tiles: only addresses change, so the bits do not
TILED_CASES = [((32, 64), {}), ((32, 64), dict(persistent=True, num_programs=3)), ((32, 64), dict(zp_mma=True)),
               ((64, 128), dict(k_unroll=2)), ((32, 32), dict(block_m=32))]


@pytest.mark.parametrize("tiles,config", TILED_CASES, ids=[f"{t[0]}x{t[1]}-{_cfg_id(c)}" for t, c in TILED_CASES])
def test_int4_moe_tiled_layout_same_bits(same_bits_case, tiles, config):
    c = same_bits_case
    bi, bd = tiles
    wt = tile_int4_moe_weights(*c["wg"], block_i=bi, block_d=bd)
    assert wt[0].shape == (4, -(-352 // bi), 3, 2 * bi, 32) and wt[2].shape == (4, -(-544 // bd), 2, bd, 32)
    x = c["xs"][torch.float16]
    base = run_kernel(x, c["ids"], c["tw"], c["wg"], block_i=bi, block_d=bd, **config)
    assert_bitwise(run_kernel(x, c["ids"], c["tw"], wt, **config), base, f"tiled {tiles} {config}")
    with pytest.raises(ValueError, match="tiled weights"):
        run_kernel(x, c["ids"], c["tw"], wt, block_i=2 * bi, block_d=bd)
    with pytest.raises(ValueError, match="3-D"):  # the public launcher takes the "gpu" layout, not the tiles
        int4_moe(x, c["ids"], c["tw"], *wt, layout="gpu")


def test_tiled_layout_words():
    """Word (tile r, K block b, tile row j, word w) of the tiled w13 is gate row r*bi + j (j < bi) or up row
    I + r*bi + j - bi of the "gpu" layout, word 32 b + w; rows past I are zero; w2 likewise with its rows."""
    w13 = torch.randint(-2**31, 2**31 - 1, (2, 2 * 40, 64), dtype=torch.int32)  # I = 40, Dp = 512
    w2 = torch.randint(-2**31, 2**31 - 1, (2, 70, 32), dtype=torch.int32)  # D = 70, Ip = 256
    t13, _, t2, _ = tile_int4_moe_weights(w13, None, w2, None, block_i=16, block_d=32)
    assert t13.shape == (2, 3, 2, 32, 32) and t2.shape == (2, 3, 1, 32, 32)
    assert torch.equal(t13[1, 1, 1, 3], w13[1, 16 + 3, 32:64])  # gate row 19
    assert torch.equal(t13[1, 1, 1, 16 + 3], w13[1, 40 + 19, 32:64])  # up row 19
    assert torch.equal(t13[0, 2, 0, 8:16], torch.zeros(8, 32, dtype=torch.int32))  # gate rows 40..47 do not exist
    assert torch.equal(t2[1, 2, 0, 5], w2[1, 69, :]) and not t2[1, 2, 0, 6:].any()


def test_int4_moe_variant_options_checked():
    w = repack_int4_moe_for_gpu(*make_experts(2, 96, 160))  # one K block each side
    ids, tw = make_routing(2, 1, 2)
    x = torch.randn(2, 96, device=DEV)
    for bad in (dict(k_unroll=0), dict(persistent=True, k_unroll=2), dict(persistent="w2", k_unroll=2),
                dict(num_programs=4), dict(persistent=True, num_programs=0), dict(persistent="w3"),
                dict(block_m=8), dict(block_m=48), dict(zp_mma=True, prescale=False), dict(zp_mma=True, block_i=16),
                dict(acc_chains=3), dict(acc_chains=2, prescale=False)):
        with pytest.raises(ValueError):
            int4_moe_triton(x, ids, tw, *w, **bad)


@pytest.mark.parametrize("zp_mma", [False, True])
def test_int4_moe_exact_small_integers(zp_mma):
    """Hand-built: integer activations and power-of-two scales make fp32 sums exact (with zp_mma too: u * s,
    the group sums and their products are exact)."""
    E, D, inter, T = 2, 256, 64, 2
    g = torch.Generator().manual_seed(5)
    q13 = torch.randint(-2, 3, (E * 2 * inter, D), generator=g, dtype=torch.int8)
    q2 = torch.randint(-2, 3, (E * D, inter), generator=g, dtype=torch.int8)
    w = (pack_int4(q13).view(E, 2 * inter, D // 8).to(DEV),
         torch.full((E, 2 * inter, D // 32), 0.125, dtype=torch.bfloat16, device=DEV),
         pack_int4(q2).view(E, D, inter // 8).to(DEV),
         torch.full((E, D, inter // 32), 0.25, dtype=torch.bfloat16, device=DEV))
    x = torch.randint(-3, 4, (T, D), generator=g).float().to(DEV)
    ids = torch.tensor([[1, 0], [0, 1]], device=DEV)
    tw = torch.tensor([[0.5, 0.25], [1.0, 2.0]], device=DEV)
    out = run_kernel(x, ids, tw, repack_int4_moe_for_gpu(*w), zp_mma=zp_mma)
    ref = int4_moe_ref(x, ids, tw, *w)
    assert_close(out, ref, 1e-6, "exact small integers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zp_group_sums(dtype):
    """x's group sums for zp_mma: per 256-column block, -8 x the sums of its 8 groups of 32 columns (zero past
    K) as hi (8) then lo (8) in x's dtype, hi + lo within 2^-16 of the fp32 sum; rows do not see each other."""
    from kernels.int4_moe import _zp_sums

    T, D = 3, 300  # 2 K blocks, the second partial (groups 9 and 10 partly / not at all in x)
    x = (torch.randn(T, D, generator=torch.Generator().manual_seed(9)) * 3).to(DEV, dtype)
    xs, a_sums = _zp_sums(x, 5, 2, 1, 160, 32, True)
    assert xs.shape == (T, 32) and xs.dtype == dtype and a_sums.shape == (5, 16)
    ref = -8 * torch.nn.functional.pad(x.double(), (0, 512 - D)).view(T, 2, 8, 32).sum(-1)  # [T, block, group]
    got = xs.view(T, 2, 2, 8).double()  # [T, block, hi/lo, group]
    hi, both = got[:, :, 0], got[:, :, 0] + got[:, :, 1]
    assert torch.equal(hi, ref.to(dtype).double()) or (hi - ref).abs().max() <= ref.abs().max() * 2 ** -8
    assert (both - ref).abs().max() <= ref.abs().max() * 2 ** -16
    assert torch.equal(got[:, 1, :, 3:], torch.zeros_like(got[:, 1, :, 3:]))  # groups past K
    one, _ = _zp_sums(x[1:2].clone(), 5, 2, 1, 160, 32, True)
    assert torch.equal(one[0], xs[1])


def test_launcher_dispatch_and_layouts():
    E, D, inter, T = 4, 256, 64, 3
    w = make_experts(E, D, inter)
    ids, tw = make_routing(T, 2, E)
    x = torch.randn(T, D, device=DEV)
    ref = int4_moe_ref(x, ids, tw, *w)
    assert_close(int4_moe(x, ids, tw, *w), ref, TOL[torch.float32], "checkpoint layout")
    assert_close(int4_moe(x, ids, tw, *repack_int4_moe_for_gpu(*w), layout="gpu"), ref, TOL[torch.float32],
                 "gpu layout")
    with pytest.raises(ValueError):
        int4_moe(x[:, :128], ids, tw, *w)


# ---------------------------------------------------------------- expert parallel

def test_align_skips_experts_not_held():
    """Id == num_experts (another rank's expert) gets no slot and opens no block, in both implementations."""
    ids, _ = make_routing(9, 3, 7, seed=3)
    local = torch.where(ids < 4, ids, 4)  # this rank holds experts 0..3
    sp, be = moe_align(local, 4, 16)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip((sp, be), moe_align_torch(local, 4, 16)))
    P = ids.numel()
    held = (local.reshape(-1) < 4).nonzero().reshape(-1).cpu()
    assert torch.equal(sp[sp < P].long().cpu().sort().values, held)
    assert set(be[be >= 0].tolist()) == set(local[local < 4].tolist())


@pytest.mark.parametrize("world", [2, 3])
def test_expert_slices_sum_to_the_full_kernel_bitwise(world):
    """Each rank's launch over its contiguous expert slice leaves -0.0 rows for the others' pairs; their sum
    (what the all-reduce computes, in any order), fed to the combine, is the single-launch output bit for bit."""
    from verifier_service.expert_parallel import expert_range

    T, k, E, D, inter = 5, 3, 7, 96, 160
    w = repack_int4_moe_for_gpu(*make_experts(E, D, inter, seed=9))
    ids, tw = make_routing(T, k, E, seed=8)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2)).to(DEV)
    full = run_kernel(x, ids, tw, w)
    rows = []
    for r in range(world):
        rng = expert_range(E, r, world)
        run_kernel(x, ids, tw, [t[rng.start:rng.stop] for t in w], experts=rng,
                   reduce_pairs=lambda y: rows.append(y.clone()))
    total = rows[-1].clone()
    for y in rows[-2::-1]:
        total += y
    rng = expert_range(E, 0, world)
    out = run_kernel(x, ids, tw, [t[rng.start:rng.stop] for t in w], experts=rng, reduce_pairs=lambda y: y.copy_(total))
    assert torch.equal(out.view(torch.int32), full.view(torch.int32))


@pytest.mark.parametrize("config", [dict(persistent=True, num_programs=3), dict(k_unroll=2, scale_tile=True)],
                         ids=_cfg_id)
def test_expert_slice_same_bits_variants(config):
    """A rank's launch over its expert slice leaves the same per-pair rows (-0.0 for the pairs of experts it
    does not hold) with the variants of SAME_BITS_VARIANTS as with the default, bit for bit. One K block per
    projection: persistent starts a tile at every step, k_unroll=2 runs the block before its (empty) loop."""
    from verifier_service.expert_parallel import expert_range

    T, k, E, D, inter = 5, 3, 7, 96, 160
    w = repack_int4_moe_for_gpu(*make_experts(E, D, inter, seed=9))
    ids, tw = make_routing(T, k, E, seed=8)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2)).to(DEV)
    rng = expert_range(E, 1, 3)
    held = [t[rng.start:rng.stop] for t in w]
    rows = []
    for cfg in ({}, config):
        run_kernel(x, ids, tw, held, experts=rng, reduce_pairs=lambda y: rows.append(y.clone()), **cfg)
    assert_bitwise(rows[1], rows[0], f"pair rows, {config} vs default")
    assert (rows[0].view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).all(1).any()  # pairs not held


# ---------------------------------------------------------------- GPU: Kimi K2.6 shapes

KIMI = dict(E=384, D=7168, inter=2048, k=8)


def kimi_checkpoint_experts():
    """All 384 Kimi K2.6 experts of one layer on the GPU, checkpoint layout: random words (valid packings)."""
    E, D, inter = KIMI["E"], KIMI["D"], KIMI["inter"]
    g = torch.Generator(device="cuda").manual_seed(0)

    def proj(n_out, n_in):
        packed = torch.randint(-2**31, 2**31 - 1, (E, n_out, n_in // 8), generator=g, device="cuda",
                               dtype=torch.int32)
        scale = (torch.rand(E, n_out, n_in // 32, generator=g, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        return packed, scale

    return (*proj(2 * inter, D), *proj(D, inter))


@pytest.fixture(scope="module")
def kimi_experts():
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    w = kimi_checkpoint_experts()
    return w, repack_int4_moe_for_gpu(*w)


def run_poisoned(run, x, ids, tw, weights, **kw):
    """A repacked-layout path `run(x, ids, tw, *weights, out=, **kw)` into an output poisoned with NaN first."""
    out = torch.full_like(x, float("nan"))
    run(x, ids, tw, *weights, out=out, **kw)
    return out


def check_layout_path(run, repack, T, k, E, D, inter, **kw):
    """A repacked-layout path at an awkward shape (K and rows not multiples of its tiles: padding, masked rows)
    against int4_moe_ref."""
    w = make_experts(E, D, inter, device="cuda", seed=5)
    ids, tw = make_routing(T, k, E, device="cuda", seed=6)
    x = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    out = run_poisoned(run, x, ids, tw, repack(*w), **kw)
    assert not torch.isnan(out).any()
    assert_close(out, int4_moe_ref(x.float(), ids, tw, *w), TOL[torch.bfloat16], f"T={T} E={E}")


def check_kimi_path(run, w, repacked, T):
    """A repacked-layout path at Kimi K2.6 shapes with T tokens against the reference, expert by expert."""
    ids, tw = make_routing(T, KIMI["k"], KIMI["E"], device="cuda", seed=T)
    x = torch.randn(T, KIMI["D"], device="cuda").to(torch.bfloat16)
    assert_close(run_poisoned(run, x, ids, tw, repacked), ref_by_expert(x, ids, tw, w), TOL[torch.bfloat16],
                 f"T={T}")


def ref_by_expert(x, ids, tw, w):
    """int4_moe_ref applied expert by expert (dequantising all 384 experts at once needs 67 GB)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        sub = [t[e:e + 1] for t in w]
        y = int4_moe_ref(x[tok].float(), torch.zeros_like(slot)[:, None], tw[tok, slot][:, None], *sub)
        out.index_add_(0, tok, y)
    return out


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", [{}, dict(zp_mma=True), dict(acc_chains=2), dict(acc_chains=4)], ids=_cfg_id)
@pytest.mark.parametrize("T", [1, 9, 64])
def test_int4_moe_kimi_shapes_bf16(kimi_experts, T, config):
    w, wg = kimi_experts
    ids, tw = make_routing(T, KIMI["k"], KIMI["E"], seed=T)
    x = torch.randn(T, KIMI["D"], device="cuda").to(torch.bfloat16)
    out = run_kernel(x, ids, tw, wg, **config)
    ref = ref_by_expert(x, ids, tw, w)
    assert_close(out, ref, TOL[torch.bfloat16], f"Kimi T={T} {config}")
    print(f"Kimi T={T} {config}: relative error {float((out.float() - ref).norm() / ref.norm()):.2e}")


# SAME_BITS_VARIANTS at Kimi shapes (D 7168 = 28 K blocks, I 2048 = 8, so k_unroll=2 divides both): (base, extra)
KIMI_SAME_BITS_VARIANTS = [
    ({}, dict(k_unroll=2)), (dict(scale_tile=False), {}), ({}, dict(persistent=True)), ({}, dict(persistent="w2")),
    ({}, dict(persistent=True, k_unroll=2)), ({}, dict(persistent=True, num_programs=132)),
    ({}, dict(persistent=True, maxnreg=128)), ({}, dict(scale_tile=True, k_unroll=2)),
    ({}, dict(scale_tile=True, persistent=True)), (dict(prescale=False, scale_tile=False), dict(prescale=False)),
    (dict(block_m=16), dict(block_m=32)), (dict(block_m=16), dict(block_m=64)),
    (dict(block_m=16), dict(block_m=32, persistent=True)),
    (dict(zp_mma=True), dict(persistent=True)), (dict(zp_mma=True), dict(k_unroll=2)),
    (dict(zp_mma=True), dict(block_m=32)), (dict(zp_mma=True), dict(maxnreg=96)),
    (dict(acc_chains=2), dict(persistent=True)), (dict(acc_chains=2), dict(maxnreg=96)),
    (dict(acc_chains=4), dict(k_unroll=2)), (dict(acc_chains=2), dict(block_m=32)),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", [{}, dict(persistent=True), dict(num_stages=4), dict(acc_chains=2)], ids=_cfg_id)
def test_int4_moe_tiled_layout_kimi(kimi_experts, config):
    """bf16, PTX dequant, Kimi shapes: the tiled layout gives the "gpu" layout's bits (T = 1, 9, 64 with crowded
    experts), and a token alone equals its row in a batch of 64."""
    _, wg = kimi_experts
    wt = tile_int4_moe_weights(*wg)
    for T in (1, 9, 64):
        ids, tw = make_routing(T, KIMI["k"], KIMI["E"], seed=200 + T)
        if T == 64:
            ids[:, :3] = ids[0, :3]
        x = torch.randn(T, KIMI["D"], device="cuda").to(torch.bfloat16)
        tiled = run_kernel(x, ids, tw, wt, **config)
        assert_bitwise(tiled, run_kernel(x, ids, tw, wg, **config), f"tiled {config} T={T}")
        if T == 64:
            assert torch.equal(run_kernel(x[37:38], ids[37:38], tw[37:38], wt, **config)[0], tiled[37])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("base,extra", KIMI_SAME_BITS_VARIANTS, ids=_cfg_id)
def test_int4_moe_same_bits_variants_kimi(kimi_experts, base, extra):
    """bf16, PTX dequant: each variant gives its base's bits (T = 1, 9, 64; at 64 some experts have four
    blocks)."""
    _, wg = kimi_experts
    for T in (1, 9, 64):
        ids, tw = make_routing(T, KIMI["k"], KIMI["E"], seed=100 + T)
        if T == 64:
            ids[:, :3] = ids[0, :3]  # 64 pairs on each of three experts
        x = torch.randn(T, KIMI["D"], device="cuda").to(torch.bfloat16)
        assert_bitwise(run_kernel(x, ids, tw, wg, **{**base, **extra}), run_kernel(x, ids, tw, wg, **base),
                       f"{base} + {extra} T={T}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", VARIANTS + [{**b, **e} for b, e in KIMI_SAME_BITS_VARIANTS], ids=_cfg_id)
def test_int4_moe_batch_invariance(kimi_experts, config):
    """Token 37 computed alone and as row 37 of a batch of 64: bitwise equal (DESIGN 3.5)."""
    w, wg = kimi_experts
    ids, tw = make_routing(64, KIMI["k"], KIMI["E"], seed=7)
    x = torch.randn(64, KIMI["D"], device="cuda").to(torch.bfloat16)
    batch = run_kernel(x, ids, tw, wg, **config)
    alone = run_kernel(x[37:38], ids[37:38], tw[37:38], wg, **config)
    assert torch.equal(alone[0], batch[37])
    assert_close(alone, ref_by_expert(x[37:38], ids[37:38], tw[37:38], w), TOL[torch.bfloat16], f"{config}")
    # and with its experts crowded by other tokens (several blocks per expert)
    ids2 = ids.clone()
    ids2[:, :4] = ids[37, :4]
    batch2 = run_kernel(x, ids2, tw, wg, **config)
    alone2 = run_kernel(x[37:38], ids2[37:38], tw[37:38], wg, **config)
    assert torch.equal(alone2[0], batch2[37])


@gpu
@pytest.mark.gpu
def test_int4_moe_batch_invariance_across_block_sizes(kimi_experts):
    """Rows of a 300-token launch (2400 pairs) in 32-pair blocks equal the same tokens computed alone and in
    a 9-token launch in the default 16-pair blocks, bit for bit (the block size may follow the launch)."""
    _, wg = kimi_experts
    T = 300
    ids, tw = make_routing(T, KIMI["k"], KIMI["E"], seed=21)
    ids[:40, :4] = ids[0, :4]  # 40+ pairs on four experts: several 32-pair blocks
    x = torch.randn(T, KIMI["D"], device="cuda").to(torch.bfloat16)
    batch = run_kernel(x, ids, tw, wg, block_m=32)
    for r in (0, 17, 299):
        assert torch.equal(run_kernel(x[r:r + 1], ids[r:r + 1], tw[r:r + 1], wg)[0], batch[r]), r
    assert torch.equal(run_kernel(x[:9], ids[:9], tw[:9], wg), batch[:9])

