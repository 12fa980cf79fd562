"""Absorbed MLA attention kernel (kernels/mla_attention.py) against `mla_attention_ref`.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small shapes (4 heads, latent 32 + rope 8) in
fp32/fp16: prefix 0, ragged and multi-chunk prefixes, trees of 1 and 65 nodes, causal prefill,
pages shuffled in the pool and every unused slot NaN; both chunk rules with small chunk knobs at
prefixes on and off chunk multiples. Position alignment (exact equality): every tree node's row
equals the causal decode, the 1-node-tree AR step and the causal prefill row at its position in a
cache holding the AR layout (prefix + its ancestors + itself). The chunk rules themselves (pure
Python, the kernel's own `chunk_span` on host ints): no empty or short chunk, grid bound.
GPU (marked `gpu`): 64 heads, 512 + 64, bf16, prefixes up to 33k, batch invariance (a session
alone vs inside a batch of 64: bitwise equal) and the same position alignment in bf16, for every tile
kernel (`impl` "triton" and the sm_90 Gluon kernels "gluon" and "gluon_ws"). On the CPU the Gluon kernels
are compiled for sm_90 (no GPU needed) and their PTX and ptxas log are checked (S computed once per tile;
for the warp-specialized one also its partitions, registers, barriers and that no wgmma is serialized).
"""

from __future__ import annotations

import json

import pytest
import torch

from kernels.mla_attention import (
    _C_MIN,
    _NCH,
    CHUNK_RULES,
    DEFAULT_BLOCK_N,
    chunk_spans,
    max_chunks,
    mla_attention,
    mla_attention_ref,
    mla_attention_triton,
    session_slots,
)
from kernels.tree_mask import ancestor_mask, pack_mask_bits
from tests.kernels.compare import assert_close
from tests.kernels.sm90_compile import run_sm90_script

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # ||out - ref|| / ||ref||
SCALE_CPU = 0.05
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def random_tree_bits(n: int, g: torch.Generator) -> torch.Tensor:
    """[n, W] int64 ancestor bits of a random tree (parents precede children), W = 1 or 2."""
    parent = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    bits = pack_mask_bits(ancestor_mask(parent[None])[0])
    return bits if bits.shape[1] == 2 else torch.cat([bits, torch.zeros_like(bits)], 1)


def make_batch(prefix, ns, H, Dl, Dr, page, dtype, tree, seed=0, device=DEV):
    """Paged pool with shuffled pages; every slot no session owns is NaN."""
    g = torch.Generator().manual_seed(seed)
    S = len(prefix)
    lens = [p + n for p, n in zip(prefix, ns)]
    P = max(1, max(-(-ln // page) for ln in lens)) + 1  # one spare page per row of the table
    pages = S * P + 2
    bt = torch.randperm(pages, generator=g)[: S * P].view(S, P).int()
    kv = torch.full((pages * page, Dl + Dr), float("nan"))
    for s in range(S):
        idx = torch.arange(lens[s])
        kv[bt[s, idx // page].long() * page + idx % page] = torch.randn(lens[s], Dl + Dr, generator=g)
    T = sum(ns)
    cu = torch.tensor([0] + torch.tensor(ns).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(T, H, Dl, generator=g)
    qpe = torch.randn(T, H, Dr, generator=g)
    bits = None
    if tree:
        bits = torch.cat([random_tree_bits(n, g) for n in ns if n > 0]) if T else torch.zeros(0, 2, dtype=torch.int64)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), qpe.to(dtype=dtype, **to), kv.to(dtype=dtype, **to), bt.to(**to), page,
            cu.to(**to), torch.tensor(prefix, dtype=torch.int32, device=device),
            None if bits is None else bits.to(**to))


def run_kernel(args, scale, **kw):
    out = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
    mla_attention_triton(*args, scale, out=out, **kw)
    return out


def reference(args, scale):
    q, qpe, kv, *rest = args
    return mla_attention_ref(q.float(), qpe.float(), kv.float(), *rest, scale)


CASES = [  # prefix lens, new tokens per session, tree?
    ([5], [1], False),  # decode
    ([0], [1], True),  # tree of 1 node, empty prefix
    ([0, 37, 3 * _C_MIN - 100], [3, 1, 5], True),  # prefix 0, ragged, 3 KV chunks
    ([530, 0, 64], [65, 2, 0], True),  # 65-node tree (two bit words, one chunk), a session with no query
    ([0], [70], False),  # causal prefill
    ([129, 3], [33, 4], False),  # chunked prefill after a prefix
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix,ns,tree", CASES)
def test_mla_kernel_vs_reference(prefix, ns, tree, dtype):
    args = make_batch(prefix, ns, 4, 32, 8, 16, dtype, tree, seed=sum(prefix) + len(ns))
    out = run_kernel(args, 0.3)
    assert_close(out, reference(args, 0.3), TOL[dtype], f"prefix={prefix} ns={ns} tree={tree} {dtype}")


RULES = sorted(CHUNK_RULES)


@pytest.mark.parametrize("chunk_rule", RULES)
@pytest.mark.parametrize("nch,c_min,block_n", [(16, 32, 32), (4, 64, 16)])
def test_mla_chunking_knobs(nch, c_min, block_n, chunk_rule):
    """Many small chunks (16 of 32 rows), block table wider than the prefix, BLOCK_N 16."""
    args = make_batch([512, 300, 0], [2, 9, 4], 4, 32, 8, 16, torch.float32, True, seed=nch)
    out = run_kernel(args, 0.3, nch=nch, c_min=c_min, block_n=block_n, chunk_rule=chunk_rule)
    assert_close(out, reference(args, 0.3), TOL[torch.float32], f"nch={nch} c_min={c_min} {chunk_rule}")


@pytest.mark.parametrize("chunk_rule", RULES)
@pytest.mark.parametrize("tree", [True, False])
def test_mla_chunk_rules_awkward_prefixes(chunk_rule, tree):
    """Chunk base 32, at most 4 chunks, 16-key tiles: prefixes on multiples of the base and of the
    capped length (legacy's one-key last chunks), between them and past the cap, fp16."""
    kw = dict(nch=4, c_min=32, block_n=16, chunk_rule=chunk_rule)
    prefix, ns = [64, 95, 128, 161, 7], [6, 3, 9, 1, 2]
    args = make_batch(prefix, ns, 4, 32, 8, 8, torch.float16, tree, seed=5 + tree)
    assert_close(run_kernel(args, 0.3, **kw), reference(args, 0.3), TOL[torch.float16], f"{kw} tree={tree}")


def test_mla_odd_heads_and_pages():
    """3 heads (tiles span tokens unevenly), latent 48 + rope 16 (padded to 64 / 16), page size 1."""
    args = make_batch([40, 9], [7, 20], 3, 48, 16, 1, torch.float32, True, seed=11)
    assert_close(run_kernel(args, 0.2), reference(args, 0.2), TOL[torch.float32], "odd shapes")


def test_mla_launcher_dispatch():
    args = make_batch([20], [3], 4, 32, 8, 16, torch.float32, True)
    assert_close(mla_attention(*args, 0.3), reference(args, 0.3), TOL[torch.float32], "launcher")
    with pytest.raises(ValueError):
        mla_attention(args[0][:, :2], *args[1:], 0.3)


@pytest.mark.skipif(CUDA, reason="the CPU side of the dispatch")
def test_mla_impl_choice_off_hopper():
    """impl="gluon" where it cannot run is refused with the reason; "auto" falls back to the Triton
    kernel (same bits); an unknown impl is refused."""
    args = make_batch([70], [5], 4, 32, 8, 16, torch.float32, True)
    for impl in ("gluon", "gluon_ws", "gluon_seesaw"):
        with pytest.raises(ValueError, match=f"{impl}.*(sm_90|Gluon)"):
            run_kernel(args, 0.3, impl=impl)
    with pytest.raises(ValueError, match="impl"):
        run_kernel(args, 0.3, impl="cuda")
    assert torch.equal(run_kernel(args, 0.3, impl="auto"), run_kernel(args, 0.3, impl="triton"))


def test_mla_launcher_routes_the_gluon_kernels(monkeypatch):
    """Which Gluon kernel a launch runs, on which grid, with which TMA constexprs (the kernels themselves need an
    sm_90 GPU; here they are replaced by recorders and the launcher is told Gluon can run): the grid kernel by
    default, the persistent one on min(items, SMs) programs when asked for and the query tile goes by TMA (the grid
    kernel otherwise), the seesaw one for impl="gluon_seesaw"; the combine after each."""
    from kernels import mla_attention as mla

    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((self.name, grid, len(a), kw))

    monkeypatch.setattr(mla, "gluon_unsupported", lambda *a: None)
    monkeypatch.setattr(mla, "_sm_count", lambda index: 7)
    monkeypatch.setattr(mla._mla_gluon, "_mla_fwd_gluon_kernel", Recorder("grid"))
    monkeypatch.setattr(mla._mla_gluon_persistent, "_mla_fwd_gluon_persistent_kernel", Recorder("persistent"))
    monkeypatch.setattr(mla._mla_gluon_seesaw, "_mla_fwd_gluon_seesaw_kernel", Recorder("seesaw"))
    monkeypatch.setattr(mla, "_mla_combine_kernel", Recorder("combine"))
    # Kimi head shapes (the descriptors are host objects), page 16: TMA boxes of one page; 2 sessions, 3 tokens
    args = make_batch([1500, 40], [2, 1], 64, 512, 64, 16, torch.float16, True, device="cpu")
    tiles, grid_c = 3, max_chunks(args[3].shape[1] * 16)

    def launch(*a, **kw):
        calls.clear()
        mla.mla_attention_triton(*a, SCALE_CPU, out=torch.empty_like(a[0]), **kw)
        return [(n, g, kw_.get("QTMA"), kw_.get("BOX"), kw_.get("STAGES"), kw_.get("num_warps")) for n, g, _, kw_
                in calls if n != "combine"], [n for n, *_ in calls]

    assert launch(*args, impl="gluon") == ([("grid", (tiles, grid_c), True, 16, 2, 8)], ["grid", "combine"])
    assert launch(*args, impl="gluon", tma=False)[0] == [("grid", (tiles, grid_c), False, 0, 2, 8)]
    assert launch(*args, impl="gluon", persistent=True)[0] == [("persistent", (7,), None, 16, 2, 8)]
    assert calls[0][2] == 11 + 4 + 5 + 9 + 2  # pointers, descriptors, scalars, strides, then TILES and NPROG
    # no query TMA (tma off): the persistent kernel cannot run, the grid kernel does
    assert launch(*args, impl="gluon", persistent=True, tma=False)[0] == [("grid", (tiles, grid_c), False, 0, 2, 8)]
    assert launch(*args, impl="gluon_seesaw") == ([("seesaw", (tiles, grid_c), True, 16, 2, 4)], ["seesaw", "combine"])
    assert launch(*args, impl="gluon_seesaw", tma=False)[0] == [("seesaw", (tiles, grid_c), False, 0, 2, 4)]


def test_mla_configure_fixes_the_deployment_kernel(monkeypatch):
    """`configure` sets DEFAULT_IMPL (read by every later launch) and says what runs: off CUDA the
    reference; "gluon" where it cannot run is refused with the reason; an unknown name is refused."""
    from kernels import mla_attention as mla

    monkeypatch.setattr(mla, "DEFAULT_IMPL", mla.DEFAULT_IMPL)  # restored after the test
    assert mla.configure("triton", "cpu", 64, 512, 64, torch.bfloat16) == "reference"
    assert mla.DEFAULT_IMPL == "triton"
    assert mla.configure("auto", "cpu", 8, 512, 64, torch.float32) == "reference" and mla.DEFAULT_IMPL == "auto"
    for impl in ("gluon", "gluon_ws"):
        with pytest.raises(ValueError, match=f"{impl}.*sm_90"):
            mla.configure(impl, "cpu", 64, 512, 64, torch.bfloat16)
        assert mla.DEFAULT_IMPL == "auto"  # unchanged by the refusal
    with pytest.raises(ValueError, match="one of"):
        mla.configure("flash", "cpu", 64, 512, 64, torch.bfloat16)
    if CUDA:
        return
    args = make_batch([70], [5], 4, 32, 8, 16, torch.float32, True)
    mla.configure("triton", "cpu", 4, 32, 8, torch.float32)
    assert torch.equal(run_kernel(args, 0.3), run_kernel(args, 0.3, impl="triton"))  # impl=None reads it


_SM90_COMPILE = r"""
import contextlib, io, json, re, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import compile
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
mod = __import__(sys.argv[1], fromlist=[sys.argv[2]])
kernel, num_warps, stages = getattr(mod, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
box = json.loads(sys.argv[5])  # None: a kernel without TMA descriptors, else its BOX constexpr (0: no TMA)
persistent = len(sys.argv) > 6 and sys.argv[6] == "persistent"  # (TILES, NPROG after the strides; no QTMA)
out = {}
for tree in (True, False):
    sig = {n: "*bf16" for n in ("q_ptr", "qpe_ptr", "kv_ptr", "out_ptr")}
    sig.update({"bt_ptr": "*i32", "cu_ptr": "*i32", "pre_ptr": "*i32", "bits_ptr": "*i64" if tree else "*i32",
                "po_ptr": "*fp32", "pml_ptr": "*fp32", "nc_ptr": "*i32"})
    if box is not None:  # TMA descriptors: BOX rows of the pool's latent [., 512] and rope [., 64] columns, then
        # the query tile's (64 rows of each)
        for name, rows, cols in (("desc_l", box or 64, 512), ("desc_r", box or 64, 64), ("desc_q", 64, 512),
                                 ("desc_qpe", 64, 64)):
            lay = gl.NVMMASharedLayout.get_default_for([64, cols], gl.bfloat16)
            sig[name] = f"tensordesc<bf16[{rows},{cols}],{lay!r}>"
    sig.update({"S": "i32", "H": "i32", "HT": "i32", "GC": "i32", "qk_scale": "fp32"})
    strides = ("stride_qt", "stride_qh", "stride_pt", "stride_ph", "stride_kv", "stride_bt", "stride_bits",
               "stride_ot", "stride_oh")
    sig.update({n: "i32" for n in strides})
    if persistent:
        sig.update({"TILES": "i32", "NPROG": "i32"})
    cst = dict(DL=512, DR=64, PAGE=box or 64, BLOCK_M=64, BLOCK_N=64, NCH=16, C_MIN=512, RULE=1, S_PAD=16,
               TREE=tree, NB=128 if tree else 64, STAGES=stages,
               **({} if box is None else {"BOX": box} if persistent else {"BOX": box, "QTMA": box > 0}))
    sig.update({k: "constexpr" for k in cst})
    names = list(sig)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if n.endswith("_ptr") or (n in strides and n != "stride_bits")}
    log = io.StringIO()  # the ptxas -v log (TRITON_DUMP_PTXAS_LOG; the cache is empty, so ptxas runs)
    with contextlib.redirect_stdout(log):
        k = compile(GluonASTSource(fn=kernel, signature=sig, constexprs=cst, attrs=aligned),
                    target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptx, log = k.asm["ptx"], log.getvalue()
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.\S+ \{[^}]*\}, (\S)", ptx)
    rs = {"{": "_rs", "%": ""}  # operand A in registers (a "{...}" list) or a shared-memory descriptor
    out[str(tree)] = {
        "wgmma": {shape + rs[a]: sum(w == (shape, a) for w in wgmma) for shape, a in set(wgmma)},
        "cp_async": ptx.count("cp.async.cg"), "cp_async_arrive": ptx.count("cp.async.mbarrier.arrive.noinc"),
        # TMA loads: shared::cta in Triton 3.9's PTX, shared::cluster in 3.6's
        "tma": len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cta|cluster)\.global", ptx)),
        "expect_tx": ptx.count("arrive.expect_tx"),
        "mbarrier_wait": ptx.count("mbarrier.try_wait"), "cta_bar": re.findall(r"\bbar\.sync\s+\d+;", ptx),
        "setmaxnreg": sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "shared": k.metadata.shared, "warps": k.metadata.num_warps,
        "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log)),
        "ptxas_perf": [ln for ln in log.splitlines() if "Performance Loss" in ln or "injected" in ln]}
print(json.dumps(out))
"""
_SM90_SMEM = 232448  # bytes of shared memory one block may have on sm_90 (227 KB)


def compile_for_sm90(tmp_path, module: str, kernel: str, num_warps: int, stages: int, box: int | None = None,
                     persistent: bool = False) -> dict:
    """Compile a Gluon tile kernel for sm_90 in a subprocess (no GPU needed; this process may run Triton in
    interpreter mode), bf16, tree and causal: {"True"/"False": PTX counts, shared bytes, ptxas -v facts}. `box`:
    None for a kernel without TMA descriptors, else its BOX constexpr (the page size is the box, 64 for 0);
    `persistent`: the signature of `_mla_gluon_persistent`'s kernel."""
    return run_sm90_script(tmp_path, _SM90_COMPILE, module, kernel, str(num_warps), str(stages), json.dumps(box),
                           "persistent" if persistent else "grid", timeout=300)


def test_mla_gluon_kernel_compiles_for_sm90_with_s_once(tmp_path):
    """The Gluon tile kernel compiled for sm_90 (PTX, no GPU): S = Q K^T as 36 m64n32k16 wgmma per site
    (K = 576 in steps of 16, each warpgroup its 32 of the 64 keys: S once, not per warpgroup; two sites, the
    first tile's and the loop's) and O += P V as 4 m64n256k16 (64 keys in steps of 16, each warpgroup its 256
    value columns), no other MMA shape, 16-byte cp.async copies for the gathered KV rows, and shared memory
    within the sm_90 limit (227 KB per block)."""
    from kernels import _mla_gluon

    for box in (0, 64, 16):
        for tree, n in compile_for_sm90(tmp_path, "kernels._mla_gluon", "_mla_fwd_gluon_kernel",
                                        _mla_gluon.GLUON_WARPS, _mla_gluon.GLUON_STAGES, box).items():
            what = f"box={box} tree={tree}: {n}"
            assert n["wgmma"] == {"m64n32k16": 2 * 36, "m64n256k16": 4}, what
            assert n["cp_async"] > 0 and 0 < n["shared"] <= _SM90_SMEM, what
            # TMA (with the query tile's, compiled with it): three tile load sites (tiles 0, 1, j + 2), each one
            # expect_tx and, per box of rows, the latent's 8 column blocks of 64 (one per warp: one copy
            # instruction) + the rope's one, as 2D tensor copies; the query tile one expect_tx and two copies
            boxes = 64 // box if box else 0
            assert (n["tma"], n["expect_tx"]) == ((3 * 2 * boxes + 2, 4) if box else (0, 0)), what


def test_mla_gluon_persistent_kernel_compiles_for_sm90(tmp_path):
    """The persistent Gluon kernel compiled for sm_90 (PTX, no GPU): the grid kernel's MMAs (S as 36 m64n32k16 per
    site: tile 0's and the stream's; O += P V as 4 m64n256k16), TMA at its two load sites (tile 0 and the stream's
    tile g + 1, each with a query tile for a new item), one expect_tx per tile and per query tile, and the grid
    kernel's shared memory."""
    from kernels import _mla_gluon, _mla_gluon_persistent

    for box in (0, 64, 16):
        for tree, n in compile_for_sm90(tmp_path, "kernels._mla_gluon_persistent", "_mla_fwd_gluon_persistent_kernel",
                                        _mla_gluon.GLUON_WARPS, _mla_gluon.GLUON_STAGES, box, persistent=True).items():
            what = f"box={box} tree={tree}: {n}"
            assert n["wgmma"] == {"m64n32k16": 2 * 36, "m64n256k16": 4}, what
            assert n["cp_async"] > 0 and 0 < n["shared"] <= _SM90_SMEM, what
            boxes = 64 // box if box else 0
            assert n["tma"] == 2 * 2 * boxes + 2 * 2 and n["expect_tx"] == (2 if box else 0) + 2, what
    assert _mla_gluon_persistent.HAVE_GLUON


def test_mla_gluon_seesaw_kernel_compiles_for_sm90(tmp_path):
    """The seesaw kernel (`_mla_gluon_seesaw`) compiled for sm_90 (PTX and the ptxas -v log, no GPU), per consumer:
    S of its whole tile as 32 m64n64k16 with Q's latent columns from shared memory plus 4 with the rope columns from
    registers (K = 512 + 64), O += P V for both tiles of a pair as 4 m64n256k16 with its own P from registers and 4
    with the other's from shared memory; no other shape. 12 warps (two consumer warpgroups + the producer warp,
    padded), setmaxnreg for both consumers and the producer; TMA for whole tiles (one expect_tx, the latent's eight
    column blocks and the rope per box) and the query tile (latent into Q's buffer, rope into P0's) when the page size
    allows, the rest by
    cp.async arriving on mbarriers (query and gathered tiles without TMA); ptxas neither serializes the wgmma nor
    injects waits; shared memory within 227 KB; spills bounded."""
    import triton

    from kernels import _mla_gluon_seesaw as ss

    # Triton 3.6's ptxas (the H200's): 0-36 bytes over these variants (hoisted wgmma descriptors once made it ~550)
    max_spill = 64 if triton.__version__.startswith("3.6") else 512
    for box in (0, 16, 64):
        for tree, n in compile_for_sm90(tmp_path, "kernels._mla_gluon_seesaw", "_mla_fwd_gluon_seesaw_kernel",
                                        ss.SEESAW_WARPS, ss.SEESAW_STAGES, box).items():
            what = f"box={box} tree={tree}: {n}"
            assert n["wgmma"] == {"m64n64k16": 2 * 32, "m64n64k16_rs": 2 * 4, "m64n256k16_rs": 2 * 4,
                                  "m64n256k16": 2 * 4}, what
            assert n["warps"] == 12 and {ss.CONSUMER_REGS, ss.PRODUCER_REGS} <= set(n["setmaxnreg"]), what
            boxes = 64 // box if box else 0
            # one producer warp issues every 128-byte column block of a box itself: 8 latent + 1 rope copies per
            # box of a tile, and the same for the query tile
            assert (n["tma"], n["expect_tx"]) == ((9 * boxes + 9, 2) if box else (0, 0)), what
            assert n["cp_async"] > 0 and n["cp_async_arrive"] == (1 if box else 2) and n["mbarrier_wait"] > 0, what
            assert n["ptxas_perf"] == [] and n["spill_bytes"] <= max_spill, what
            assert 0 < n["shared"] <= _SM90_SMEM, what


def test_mla_gluon_ws_kernel_compiles_for_sm90(tmp_path):
    """The warp-specialized kernel (`_mla_gluon_ws`) compiled for sm_90 (PTX and the ptxas -v log, no GPU):
    S as 36 m64n64k16 wgmma per site (one warpgroup computes all 64 keys of its tile over K = 576; three
    sites: consumer 0's first tile and loop, consumer 1's loop), O += P V as 4 m64n256k16 per site (7 sites:
    4 with P from shared, 3 with the owner's P from registers), no other shape; 12 warps (2 consumer
    warpgroups + the producer warp, padded); setmaxnreg gives the consumers and the producer their registers;
    cp.async copies arrive on mbarriers (Q and the tiles), no CTA-wide barrier inside the partitions; ptxas
    neither serializes the wgmma nor injects waits (an accumulator in flight across control flow would); spills:
    at most a few bytes with Triton 3.6's ptxas (the H200's; 12.8), a few hundred with newer ones (Triton
    3.9's ptxas 13 allocates differently; 1 KB and more is the hoisted-descriptor failure `_opaque_zero`
    prevents); shared memory within 227 KB."""
    import triton

    from kernels import _mla_gluon_ws as ws

    max_spill = 16 if triton.__version__.startswith("3.6") else 512

    for tree, n in compile_for_sm90(tmp_path, "kernels._mla_gluon_ws", "_mla_fwd_gluon_ws_kernel", ws.WS_WARPS,
                                    ws.WS_STAGES).items():
        what = f"tree={tree}: {n}"
        assert n["wgmma"] == {"m64n64k16": 3 * 36, "m64n256k16": 4 * 4, "m64n256k16_rs": 3 * 4}, what
        assert n["warps"] == 12 and {ws.CONSUMER_REGS, ws.PRODUCER_REGS} <= set(n["setmaxnreg"]), what
        assert n["cp_async"] > 0 and n["cp_async_arrive"] == 2 and n["mbarrier_wait"] > 0, what
        assert n["cta_bar"] == [] and n["ptxas_perf"] == [] and n["spill_bytes"] <= max_spill, what
        assert 0 < n["shared"] <= _SM90_SMEM, what


# ------------------------------------------- position alignment: tree node == AR step at its position


def deep_tree_bits(n: int, words: int, g: torch.Generator) -> torch.Tensor:
    """[n, words] int64 ancestor bits of a random tree with long chains (parent among the 3 latest nodes)."""
    parent = torch.tensor([-1] + [max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=g))) for i in range(1, n)])
    bits = pack_mask_bits(ancestor_mask(parent[None])[0])
    return torch.cat([bits, torch.zeros(n, words - bits.shape[1], dtype=torch.int64)], 1)


def ancestors(bits_row: list[int]) -> list[int]:
    """Node indices whose bit is set, in index order = depth order (parents precede children)."""
    return [k for k in range(64 * len(bits_row)) if (bits_row[k // 64] >> (k % 64)) & 1]


def paged(rows: torch.Tensor, page: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [R, D] -> (pool holding them at shuffled pages, NaN elsewhere; block table [1, P] int32)."""
    P = -(-rows.shape[0] // page) + 1
    bt = torch.randperm(P + 1, generator=g)[:P]
    kv = torch.full(((P + 1) * page, rows.shape[1]), float("nan"), dtype=rows.dtype, device=rows.device)
    idx = torch.arange(rows.shape[0])
    kv[(bt[idx // page] * page + idx % page).to(rows.device)] = rows
    return kv, bt[None].int().to(rows.device)


def assert_bitwise(out: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(out, want):
        diff = (out.double() - want.double()).abs().nan_to_num(float("inf"))
        i = tuple(int(v) for v in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{what}: not bitwise equal ({int((diff > 0).sum())} elements differ); worst at {i}: "
                             f"{float(out[i]):.9g} vs {float(want[i]):.9g}")


def check_alignment(prefix, ns, checked, H, Dl, Dr, page, dtype, words, scale, nodes=None, **kw):
    """Tree verify of several sessions; each node of the sessions in `checked` (optionally only
    `nodes`) must give, bit for bit, the row computed in a cache holding the AR layout (committed
    rows, the node's ancestors at L..L+d-1, itself at L+d; on other pages) by a causal decode at
    L+d and by the 1-node tree the engine's AR step sends; and each leaf's whole path the rows of a
    causal chain prefill from L (the prefill rows of the AR layout)."""
    g = torch.Generator().manual_seed(sum(prefix) + words)
    args = make_batch(prefix, ns, H, Dl, Dr, page, dtype, True, seed=len(ns) + words)
    bits = torch.cat([deep_tree_bits(n, words, g) for n in ns]).to(DEV)
    args = (*args[:7], bits)
    q, qpe, kv, bt, _, cu, _, _ = args
    out = run_kernel(args, scale, **kw)
    host_bits = bits.tolist()
    i32 = dict(dtype=torch.int32, device=DEV)
    root = torch.zeros(1, words, dtype=torch.int64, device=DEV)
    root[0, 0] = 1
    for s in checked:
        L, t0, n = prefix[s], int(cu[s]), ns[s]
        rows = kv[session_slots(bt, page, s, L + n)]  # [L + n, Dl + Dr] session s in logical order
        paths = {i: ancestors(host_bits[t0 + i]) for i in (nodes or range(n))}
        inner = {a for path in paths.values() for a in path[:-1]}
        for i, path in paths.items():
            d, t = len(path) - 1, t0 + i
            kv_ar, bt_ar = paged(torch.cat([rows[:L], rows[L + torch.tensor(path, device=DEV)]]), page, g)
            for name, tb in (("causal decode", None), ("AR step (1-node tree)", root)):
                one = (q[t : t + 1], qpe[t : t + 1], kv_ar, bt_ar, page, torch.tensor([0, 1], **i32),
                       torch.tensor([L + d], **i32), tb)
                assert_bitwise(run_kernel(one, scale, **kw)[0], out[t], f"session {s} node {i} depth {d}: {name}")
            if i not in inner:  # a leaf of the checked set: its chain covers its ancestors
                idx = t0 + torch.tensor(path, device=DEV)
                chain = (q[idx], qpe[idx], kv_ar, bt_ar, page, torch.tensor([0, d + 1], **i32),
                         torch.tensor([L], **i32), None)
                assert_bitwise(run_kernel(chain, scale, **kw), out[idx], f"session {s} path to {i}: causal prefill")


SMALL = dict(nch=4, c_min=32, block_n=16)
ALIGN_CASES = [  # prefix lens, tree sizes, sessions checked, H, Dl, Dr, page, bit words, knobs
    # default knobs; balanced: 1 -> 2 chunks (combine) at p = 767 inside session 0's tree, a one-chunk session
    ([764, 40], [10, 5], [0, 1], 4, 32, 8, 16, 1, {}),
    # p = 120..129; balanced: 4 chunks of 2 tiles, the last one 3 tiles from p = 128; legacy: C 32 -> 48 there
    ([120, 3], [16, 5], [0], 4, 32, 8, 16, 2, SMALL),
    ([0, 45], [14, 9], [0, 1], 3, 48, 16, 3, 1, dict(nch=4, c_min=16, block_n=16)),  # tree at position 0
]


@pytest.mark.parametrize("prefix,ns,checked,H,Dl,Dr,page,words,kw,chunk_rule", [
    (*case, rule) for case in ALIGN_CASES for rule in RULES if case[-1] or rule == "balanced"])  # legacy: small knobs
def test_mla_tree_node_equals_ar_step_bitwise(prefix, ns, checked, H, Dl, Dr, page, words, kw, chunk_rule):
    """fp32 under the interpreter: exact equality (the GPU test below does the same in bf16)."""
    check_alignment(prefix, ns, checked, H, Dl, Dr, page, torch.float32, words, 0.3, chunk_rule=chunk_rule, **kw)


@pytest.mark.parametrize("chunk_rule", RULES)
def test_mla_alignment_fp16_and_second_bit_word(chunk_rule):
    """fp16; nodes 64.. of a 66-node tree (their paths read the second bit word); paths up to p = 66:
    balanced 1 -> 2 chunks at p = 47, legacy 1 -> 2 -> 3 at p = 32, 64."""
    check_alignment([29], [66], [0], 4, 32, 8, 16, torch.float16, 2, 0.3, nodes=[5, 40, 63, 64, 65],
                    chunk_rule=chunk_rule, **SMALL)


# ------------------------------------------- the chunk rules (pure Python: the kernel's chunk_span on ints)

KNOBS = [  # block_n, nch, c_min
    (DEFAULT_BLOCK_N, _NCH, _C_MIN), (16, 4, 32), (16, 4, 16), (16, 8, 64), (64, 16, 64), (32, 3, 96)]


def chunk_lengths(p: int, rule: str, block_n: int, nch: int, c_min: int) -> list[int]:
    """Key counts of the chunks of position p; checks they tile 0..p in order at tile boundaries."""
    spans = chunk_spans(p, rule, block_n, nch, c_min)
    assert 1 <= len(spans) <= nch, (p, spans)
    assert spans[0][0] == 0 and spans[-1][1] == p + 1, (p, spans)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (p, spans)
    assert all(s % block_n == 0 and e > s for s, e in spans), f"p={p}: unaligned or empty chunk in {spans}"
    return [e - s for s, e in spans]


@pytest.mark.parametrize("chunk_rule", RULES)
@pytest.mark.parametrize("block_n,nch,c_min", KNOBS)
def test_chunk_rule_properties(block_n, nch, c_min, chunk_rule):
    """For every position up to past the cap (and a sample far beyond): chunks cover 0..p in order,
    start at tile boundaries, none is empty, at most NCH of them, and `max_chunks(cap)` (the
    launcher's grid) covers every position < cap. Balanced: the chunk count is round(K / C_MIN)
    clamped to [1, NCH] and never decreases; chunks are floor or ceil of tiles / nc tiles with the
    ceil last, so the last chunk is never short; a row with several chunks has none below C_MIN / 2.
    The spans depend on p and the fixed knobs alone: `chunk_spans` gets nothing else."""
    top = 2 * nch * c_min + 3 * block_n
    positions = list(range(top)) + list(range(top, 64 * nch * c_min, 997)) + [2**20 - 1, 2**24 + 7]
    seen = 0  # largest chunk count so far
    for p in positions:
        K = p + 1
        lens = chunk_lengths(p, chunk_rule, block_n, nch, c_min)
        nc = len(lens)
        seen = max(seen, nc)
        assert max_chunks(K, chunk_rule, block_n, nch, c_min) >= seen, f"grid of cap {K} misses a chunk"
        if chunk_rule != "balanced":
            continue
        assert nc == max(1, min(nch, (2 * K + c_min) // (2 * c_min))), (p, nc)  # round half up
        assert nc == seen, f"p={p}: chunk count went down"
        assert max_chunks(K, chunk_rule, block_n, nch, c_min) == nc
        tiles = -(-K // block_n)
        counts = [-(-n // block_n) for n in lens]
        assert set(counts) <= {tiles // nc, -(-tiles // nc)} and counts[-1] == -(-tiles // nc), (p, lens)
        assert lens[-1] > max(lens) - block_n, f"p={p}: short last chunk {lens}"
        assert nc == 1 or min(lens) >= c_min // 2, f"p={p}: short chunk {lens}"


def test_chunk_rule_examples():
    """The default knobs at the benchmark's prefixes: legacy's one-key last chunks are gone, and with
    32-key tiles the chunk count never exceeds legacy's (never more partials). With 64-key tiles (the
    default) legacy rounds its chunk size up to 576 keys above 8192 keys and can have one chunk fewer."""
    b32 = dict(block_n=32)
    assert chunk_spans(1024, "legacy", **b32) == [(0, 512), (512, 1024), (1024, 1025)]
    assert chunk_spans(1024, **b32) == [(0, 512), (512, 1025)]
    assert [e - s for s, e in chunk_spans(4096 + 10, **b32)] == [512] * 7 + [523]
    assert len(chunk_spans(4096 + 10, "legacy", **b32)) == 9
    assert chunk_spans(8192, "legacy", **b32)[-1] == (8160, 8193)  # C = 544: a 33-key 16th chunk
    assert chunk_spans(8192, **b32)[-1] == (7680, 8193)
    assert [e - s for s, e in chunk_spans(32768 + 20, **b32)] == [2048] * 15 + [2069]
    assert len(chunk_spans(766, **b32)) == 1 and len(chunk_spans(767, **b32)) == 2  # 1.5 C_MIN: rounds up
    for p in range(0, 40000, 7):
        assert len(chunk_spans(p, **b32)) <= len(chunk_spans(p, "legacy", **b32)), p
    assert DEFAULT_BLOCK_N == 64
    assert chunk_spans(1024) == [(0, 512), (512, 1025)]
    assert [e - s for s, e in chunk_spans(4096 + 10)] == [512] * 7 + [523]
    assert chunk_spans(8192, "legacy")[-1] == (8064, 8193) and len(chunk_spans(8192, "legacy")) == 15
    assert chunk_spans(8192)[-1] == (7680, 8193) and len(chunk_spans(8192)) == 16
    assert [e - s for s, e in chunk_spans(32768 + 20)] == [2048] * 15 + [2069]
    assert len(chunk_spans(766)) == 1 and len(chunk_spans(767)) == 2
    with pytest.raises(ValueError):
        chunk_spans(5, "new")


# ---------------------------------------------------------------- GPU: Kimi K2.6 shapes

KIMI = dict(H=64, Dl=512, Dr=64, page=64)
IMPLS_GPU = ["triton", "gluon", "gluon_ws", "gluon_seesaw"]
SCALE = 192**-0.5 * (0.1 * torch.log(torch.tensor(64.0)).item() + 1) ** 2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS_GPU)
@pytest.mark.parametrize("prefix,ns,tree,page", [
    ([1024, 0, 4097, 33000], [9, 65, 1, 33], True, 64),
    ([0, 300], [257, 64], False, 64),
    ([70, 2047, 5000], [2, 65, 17], True, 16),  # the serving page size: a 64-key tile spans 4 pages
    ([13, 1500], [90, 31], False, 16),
])
def test_mla_kimi_shapes_bf16(prefix, ns, tree, page, impl):
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree)
    assert_close(run_kernel(args, SCALE, impl=impl), reference(args, SCALE), TOL[torch.bfloat16],
                 f"Kimi {prefix} {ns} {impl}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("tree,prefix,ns", [
    # prefixes on, just below and just past tile and page edges; a tree whose first ancestor tile is ragged; 16
    # chunks past 8192 keys; prefix 0 (no whole committed tile: every tile by cp.async)
    (True, [0, 63, 64, 65, 1000, 4097, 33000], [9, 65, 1, 33, 17, 5, 40]),
    (False, [0, 127, 2048, 9001], [70, 3, 64, 1]),
])
def test_mla_gluon_tma_loads_give_the_cp_async_bits(tree, prefix, ns, page):
    """The Gluon kernel with whole committed tiles loaded by TMA (pages of 16 and 32 rows: a tile is 4 or 2 boxes,
    one per page; 64 and 128: a tile is a page or half of one) equals, bit for bit, the same kernel gathering every
    tile with cp.async, and the reference within tolerance; the pool is a layer of a stacked cache (an offset
    view), unused slots NaN."""
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=7)
    q, qpe, kv, *rest = args
    stack = torch.full((3, *kv.shape), float("nan"), dtype=kv.dtype, device=kv.device)
    stack[1] = kv
    layer = (q, qpe, stack[1], *rest)
    with_tma = run_kernel(layer, SCALE, impl="gluon", tma=True)
    assert_bitwise(with_tma, run_kernel(layer, SCALE, impl="gluon", tma=False), f"tma page {page} tree={tree}")
    assert_close(with_tma, reference(args, SCALE), TOL[torch.bfloat16], f"tma page {page} {prefix} {ns}")
    # queries as views: rows of 1024 (the query tile still by TMA), every other token of a larger batch (a token's
    # heads are not rows of one 2D view: plain loads)
    T, H = q.shape[:2]
    wide = torch.full((T, H, 1024), float("nan"), dtype=q.dtype, device=q.device)
    wide[..., :KIMI["Dl"]] = q
    spread = torch.full((2 * T, H, KIMI["Dr"]), float("nan"), dtype=q.dtype, device=q.device)
    spread[::2] = qpe
    views = (wide[..., :KIMI["Dl"]], spread[::2], stack[1], *rest)
    assert_bitwise(run_kernel(views, SCALE, impl="gluon", tma=True), with_tma, f"query views, page {page}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 1, 5])
@pytest.mark.parametrize("page", [8, 16, 64])
@pytest.mark.parametrize("tree,prefix,ns", [
    # one-tile items next to 16-chunk rows, a session without queries, a row with nothing committed
    (True, [0, 63, 64, 65, 1000, 0, 4097, 9001], [9, 65, 1, 33, 17, 0, 5, 40]),
    (False, [0, 127, 2048, 5], [70, 3, 64, 1]),
    (True, [0], [1]),  # one item in all
])
def test_mla_gluon_persistent_gives_the_grid_kernels_bits(tree, prefix, ns, page, programs, monkeypatch):
    """The persistent kernel (one program per SM walking its items as one stream of tiles; here also 1 and 5
    programs, so a program runs hundreds of items and crosses every kind of item boundary) equals, bit for bit, the
    grid kernel (one program per item) with the same loads, and the reference within tolerance. Page 8: every
    tile by cp.async (only the query tiles by TMA); 16 / 64: the TMA tiles too."""
    import kernels.mla_attention as mla

    if programs is not None:
        monkeypatch.setattr(mla, "_sm_count", lambda index: programs)
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=11)
    out = run_kernel(args, SCALE, impl="gluon", persistent=True)
    assert_bitwise(out, run_kernel(args, SCALE, impl="gluon", persistent=False), f"page {page} tree={tree}")
    assert_close(out, reference(args, SCALE), TOL[torch.bfloat16], f"persistent page {page} {prefix} {ns}")
    # launched twice in a row (the stream leaves no state behind) and from a CUDA graph
    assert_bitwise(run_kernel(args, SCALE, impl="gluon", persistent=True), out, "second launch")
    graph_out = torch.full_like(out, float("nan"))
    mla.mla_attention_triton(*args, SCALE, out=graph_out, impl="gluon", persistent=True)  # compiled before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla.mla_attention_triton(*args, SCALE, out=graph_out, impl="gluon", persistent=True)
    graph_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert_bitwise(graph_out, out, "graph replay")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS_GPU)
def test_mla_fp16_and_two_head_tiles(impl):
    """fp16 cache and 128 heads (two 64-head tiles per token), tree and causal, against the reference."""
    for tree, prefix, ns in ((True, [700, 9000], [33, 9]), (False, [5, 1200], [40, 3])):
        args = make_batch(prefix, ns, 128, KIMI["Dl"], KIMI["Dr"], 16, torch.float16, tree, seed=3)
        assert_close(run_kernel(args, SCALE, impl=impl), reference(args, SCALE), TOL[torch.float16],
                     f"fp16 128 heads tree={tree} {impl}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS_GPU)
@pytest.mark.parametrize("n_probe", [1, 9, 65])
def test_mla_batch_invariance(n_probe, impl):
    """A session alone and as session 23 of 64 others (mixed lengths): bitwise equal rows."""
    g = torch.Generator().manual_seed(n_probe)
    prefix = torch.randint(0, 3000, (64,), generator=g).tolist()
    ns = torch.randint(1, 66, (64,), generator=g).tolist()
    prefix[23], ns[23] = 2900, n_probe  # 6 KV chunks
    big = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], KIMI["page"], torch.bfloat16, True)
    q, qpe, kv, bt, page, cu, pre, bits = big
    t0, t1 = int(cu[23]), int(cu[24])
    alone = (q[t0:t1], qpe[t0:t1], kv, bt[23:24], page, torch.tensor([0, t1 - t0], dtype=torch.int32, device=DEV),
             pre[23:24], bits[t0:t1])
    out_big = run_kernel(big, SCALE, impl=impl)
    out_alone = run_kernel(alone, SCALE, impl=impl)
    assert torch.equal(out_alone, out_big[t0:t1])
    # the tree's root alone (= the AR step at the same prefix) gives the root row bit for bit
    root = (q[t0:t0 + 1], qpe[t0:t0 + 1], kv, bt[23:24], page, torch.tensor([0, 1], dtype=torch.int32, device=DEV),
            pre[23:24], bits[t0:t0 + 1])
    assert torch.equal(run_kernel(root, SCALE, impl=impl)[0], out_big[t0])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prefix,ns,checked,words", [
    # 5 -> 6 chunks at p = 2815 inside session 0's tree; session 1: the 16th chunk gains a tile at p = 8192
    ([2810, 8185, 700], [65, 17, 9], [0, 1], 2),
    # one bit word (budgets <= 63); session 0 crosses p = 8192; session 1: 16 chunks of 64-65 tiles; prefix 0
    ([8180, 33000, 0], [40, 9, 20], [0, 1, 2], 1),
])
@pytest.mark.parametrize("impl", IMPLS_GPU)
def test_mla_tree_node_equals_ar_step_bitwise_bf16(prefix, ns, checked, words, impl):
    """The position-alignment invariant at Kimi shapes in bf16: every node of the checked sessions
    equals the causal decode / AR step / prefill row at its position in the AR layout, bitwise."""
    check_alignment(prefix, ns, checked, KIMI["H"], KIMI["Dl"], KIMI["Dr"], KIMI["page"], torch.bfloat16, words,
                    SCALE, impl=impl)
