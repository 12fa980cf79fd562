"""The sm_90 Gluon MLA kernels compiled offline (no GPU needed): their PTX and ptxas facts.

Each kernel of `kernels.mla_attention` that only runs on sm_90 (`_mla_gluon`, `_mla_gluon_persistent`,
`_mla_gluon_seesaw`, `_mla_gluon_ws`) is compiled for sm_90 in a subprocess (this process may run Triton in
interpreter mode), bf16, tree and causal, and the tests check what a wrong change would alter: the MMA shapes and
counts, the TMA copies and expect_tx, the cp.async barrier arrivals, setmaxnreg, CTA barriers, shared memory within
the 227 KB a block may have, ptxas's spills and its serialization warnings; also the grid kernel's fold against its
split form, the 16-bit partials' stores in every kernel and the combine kernel's loads of them. They pass under Triton
3.9 (CI) and 3.6 (the H200's; docs/performance.md "Rerun" says how to install it beside the other). Their numeric
behaviour is `test_mla_attention_gpu.py`'s.
"""

from __future__ import annotations

import json

from tests.kernels.sm90_compile import run_sm90_script

_SM90_COMPILE = r"""
import json, re, sys
from triton.experimental.gluon import language as gl
from tests.kernels.sm90_compile import compile_gluon_sm90, hgmma_loops
mod = __import__(sys.argv[1], fromlist=[sys.argv[2]])
kernel, num_warps, stages = getattr(mod, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
box = json.loads(sys.argv[5])  # None: a kernel without TMA descriptors, else its BOX constexpr (0: no TMA)
persistent = len(sys.argv) > 6 and sys.argv[6] == "persistent"  # (TILES, NPROG after the strides; no QTMA)
po = sys.argv[7] if len(sys.argv) > 7 else "fp32"  # the partial O's dtype (`mla_attention_triton(partials=)`)
fold = json.loads(sys.argv[8]) if len(sys.argv) > 8 else {}  # the grid kernel's FOLD / ROUND constexprs
fold = {k: fold.get(k, False) for k in ("FOLD", "ROUND") if k in kernel.arg_names}
extra = json.loads(sys.argv[9]) if len(sys.argv) > 9 else {}  # more constexprs (the seesaw kernel's VSPLIT)
defaults = {"VSPLIT": 1, "SKIP_PHANTOM": True}  # the seesaw grid kernel's (a compile takes no defaults)
extra = {**{k: v for k, v in defaults.items() if k in kernel.arg_names}, **extra}
out = {}
for tree in (True, False):
    sig = {n: "*bf16" for n in ("q_ptr", "qpe_ptr", "kv_ptr", "out_ptr")}
    sig.update({"bt_ptr": "*i32", "cu_ptr": "*i32", "pre_ptr": "*i32", "bits_ptr": "*i64" if tree else "*i32",
                "po_ptr": "*" + po, "pml_ptr": "*fp32", "nc_ptr": "*i32"})
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
               **({} if box is None else {"BOX": box} if persistent else {"BOX": box, "QTMA": box > 0}), **fold,
               **extra)
    k, ptx, log = compile_gluon_sm90(kernel, sig, cst, [n for n in sig if n.endswith("_ptr")
                                                         or (n in strides and n != "stride_bits")],
                                     num_warps=num_warps)
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.\S+ \{[^}]*\}, (\S)", ptx)
    rs = {"{": "_rs", "%": ""}  # operand A in registers (a "{...}" list) or a shared-memory descriptor
    out[str(tree)] = {
        "wgmma": {shape + rs[a]: sum(w == (shape, a) for w in wgmma) for shape, a in set(wgmma)},
        "cp_async": ptx.count("cp.async.cg"), "cp_async_arrive": ptx.count("cp.async.mbarrier.arrive.noinc"),
        # TMA loads: shared::cta in Triton 3.9's PTX, shared::cluster in 3.6's
        "tma": len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cta|cluster)\.global", ptx)),
        "expect_tx": ptx.count("arrive.expect_tx"),
        "mbarrier_wait": ptx.count("mbarrier.try_wait"), "cta_bar": re.findall(r"\bbar\.sync\s+\d+;", ptx),
        "st_global": {w: len(re.findall(rf"\bst\.global\.{re.escape(w)}\s", ptx)) for w in ("b32", "v2.b32", "v4.b32")},
        "shfl": ptx.count("shfl.sync"), "bar_sync": len(re.findall(r"\bbar\.sync\b", ptx)),
        "setmaxnreg": sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "shared": k.metadata.shared, "warps": k.metadata.num_warps,
        "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log)),
        "ptxas_perf": [ln for ln in log.splitlines() if "Performance Loss" in ln or "injected" in ln],
        "loops": hgmma_loops(k.asm["cubin"])}
print(json.dumps(out))
"""
_SM90_SMEM = 232448  # bytes of shared memory one block may have on sm_90 (227 KB)


def _tile_loops(loops: list[dict]) -> list[dict]:
    """The seesaw kernels' tile loops among a compile's innermost wgmma loops: one per consumer, 44 HGMMA a pair of
    tiles (S: 32 + 4, PV: 2 x 4); the larger loops of 44 are the outer ones around them, as the code is laid out."""
    return sorted((x for x in loops if x["HGMMA"] == 44), key=lambda x: x["n"])[:2]


def compile_for_sm90(tmp_path, module: str, kernel: str, num_warps: int, stages: int, box: int | None = None,
                     persistent: bool = False, po: str = "fp32", fold: dict | None = None,
                     extra: dict | None = None) -> dict:
    """Compile a Gluon tile kernel for sm_90 in a subprocess (no GPU needed; this process may run Triton in
    interpreter mode), bf16, tree and causal: {"True"/"False": PTX counts, shared bytes, ptxas -v facts}. `box`:
    None for a kernel without TMA descriptors, else its BOX constexpr (the page size is the box, 64 for 0);
    `persistent`: the signature of `_mla_gluon_persistent`'s kernel; `po`: the partial O's dtype; `fold`: the grid
    kernel's FOLD / ROUND constexprs; `extra`: more constexprs."""
    return run_sm90_script(tmp_path, _SM90_COMPILE, module, kernel, str(num_warps), str(stages), json.dumps(box),
                           "persistent" if persistent else "grid", po, json.dumps(fold or {}), json.dumps(extra or {}),
                           timeout=300)


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


def test_mla_gluon_fold_compiles_for_sm90_like_the_split_kernel(tmp_path):
    """The grid kernel with FOLD (one program per query tile folding its chunks; ROUND: each chunk's O rounded to
    bf16 first) compiled for sm_90: one tile loop, so the split kernel's MMAs and shared memory exactly, and its TMA
    copies plus one more site (the next chunk's tiles 0 and 1, issued before the fold: one expect_tx each, per box
    the latent's and the rope's copy); spills bounded (Triton 3.6's ptxas, the H200's: 0-192 bytes, none among the
    loop's wgmma by nvdisasm when this was written; the split kernel 4-24)."""
    import triton

    from kernels import _mla_gluon

    max_spill = 256 if triton.__version__.startswith("3.6") else 1024
    for box in (0, 16):
        args = ("kernels._mla_gluon", "_mla_fwd_gluon_kernel", _mla_gluon.GLUON_WARPS, _mla_gluon.GLUON_STAGES, box)
        split = compile_for_sm90(tmp_path, *args)
        fold = compile_for_sm90(tmp_path, *args, fold={"FOLD": True, "ROUND": True})
        boxes = 64 // box if box else 0
        for tree in split:
            a, b, what = split[tree], fold[tree], f"box={box} tree={tree}"
            for key in ("wgmma", "shared"):
                assert a[key] == b[key], (what, key, a[key], b[key])
            assert (b["tma"], b["expect_tx"]) == (a["tma"] + 2 * 2 * boxes, a["expect_tx"] + (2 if box else 0)), what
            assert b["spill_bytes"] <= max_spill and b["ptxas_perf"] == [], (what, b["spill_bytes"], b["ptxas_perf"])


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
    for box, skip in ((0, True), (16, True), (64, True), (16, False)):  # SKIP_PHANTOM: both forms of the last pair
        for tree, n in compile_for_sm90(tmp_path, "kernels._mla_gluon_seesaw", "_mla_fwd_gluon_seesaw_kernel",
                                        ss.SEESAW_WARPS, ss.SEESAW_STAGES, box, extra={"SKIP_PHANTOM": skip}).items():
            what = f"box={box} skip={skip} tree={tree}: {n}"
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


def test_mla_gluon_seesaw_kernel_compiles_for_sm90_with_its_value_columns_split(tmp_path):
    """The seesaw kernel with VSPLIT = 2 and 4 (`mla_attention_triton(vsplit=)`), pages of 16 (the serving path), bf16
    partials: per consumer the same S (32 m64n64k16 + 4 from registers) and O += P V of both tiles of a pair at
    N = 512 / (2 VSPLIT) (4 from registers, 4 from shared memory), the columns taken from a view of the stage as
    blocks (`_ss_values`); the producer's copies as at VSPLIT 1; no serialized wgmma, spills bounded."""
    import collections

    import triton

    from kernels import _mla_gluon_seesaw as ss

    max_spill = 64 if triton.__version__.startswith("3.6") else 512
    for vsplit in (2, 4):
        n_pv = 512 // (2 * vsplit)
        for tree, n in compile_for_sm90(tmp_path, "kernels._mla_gluon_seesaw", "_mla_fwd_gluon_seesaw_kernel",
                                        ss.SEESAW_WARPS, ss.SEESAW_STAGES, 16, po="bf16",
                                        extra={"VSPLIT": vsplit}).items():
            what = f"vsplit={vsplit} tree={tree}: {n}"
            want = collections.Counter({"m64n64k16": 2 * 32, "m64n64k16_rs": 2 * 4})  # S (at VSPLIT 4 PV's too)
            want.update({f"m64n{n_pv}k16_rs": 2 * 4, f"m64n{n_pv}k16": 2 * 4})
            assert n["wgmma"] == dict(want), what
            assert n["warps"] == 12 and {ss.CONSUMER_REGS, ss.PRODUCER_REGS} <= set(n["setmaxnreg"]), what
            assert (n["tma"], n["expect_tx"]) == (9 * 4 + 9, 2), what
            assert n["ptxas_perf"] == [] and n["spill_bytes"] <= max_spill, what
            assert 0 < n["shared"] <= _SM90_SMEM, what


def test_seesaw_value_blocks_are_tiles_of_the_stage_layout():
    """`_ss_values` views a stage [64, 512] (16-bit, the default NVMMA layout: 128-byte swizzle) as blocks of
    [64, HALF] in the default layout of that shape, block b at b * 64 * HALF elements. Checked on the linear layouts
    Triton gives the two (shared-memory offset -> (row, column)): every element of block b of the stage sits at the
    block's base plus its offset in the [64, HALF] tile."""
    import pytest
    import triton

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):  # 3.6 aborts the process on shared layouts
        pytest.skip(f"host-side shared linear layouts need Triton >= 3.9 (this one: {triton.__version__})")
    try:
        from triton._C.libtriton import gluon_ir, ir
        from triton.experimental.gluon import language as gl

        ctx = ir.context()
        ir.load_dialects(ctx)
        builder = gluon_ir.GluonOpBuilder(ctx)
        to_linear = builder.to_linear_layout
    except (ImportError, AttributeError) as e:  # (the host-side builder of Triton 3.9; not in every version)
        pytest.skip(f"this Triton has no host-side linear layouts: {e}")

    def offsets(shape):  # {(row, col): offset} of the default 16-bit NVMMA layout of `shape`
        ll = to_linear(gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)._to_ir(builder), shape)
        bases = ll.offset_bases
        assert len(bases) == (shape[0] * shape[1]).bit_length() - 1
        where = {}
        for off in range(shape[0] * shape[1]):
            r = c = 0
            for i, (br, bc) in enumerate(bases):
                if off >> i & 1:
                    r, c = r ^ br, c ^ bc
            where[(r, c)] = off
        assert len(where) == shape[0] * shape[1]  # a bijection
        return where

    stage = offsets([64, 512])
    for half in (64, 128, 256):
        block = offsets([64, half])
        for (r, c), off in stage.items():
            assert off == (c // half) * 64 * half + block[(r, c % half)], (half, r, c)


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


def test_mla_gluon_kernels_store_bf16_partials_as_16_bit_values(tmp_path):
    """`partials="out"` at Kimi (bf16 partial O, in fragment order): in every Gluon kernel a thread's 8-byte stores of
    two fp32 partial values become half as many 8-byte stores of four bf16 ones (full 32-byte sectors per row), the
    reordering costs no shuffle, barrier or shared memory (a register-only change of layout), and nothing else
    changes: the same MMAs and TMA copies."""
    from kernels import _mla_gluon, _mla_gluon_seesaw, _mla_gluon_ws

    kernels = [("kernels._mla_gluon", "_mla_fwd_gluon_kernel", _mla_gluon.GLUON_WARPS, _mla_gluon.GLUON_STAGES, 64,
                False),
               ("kernels._mla_gluon_persistent", "_mla_fwd_gluon_persistent_kernel", _mla_gluon.GLUON_WARPS,
                _mla_gluon.GLUON_STAGES, 64, True),
               ("kernels._mla_gluon_seesaw", "_mla_fwd_gluon_seesaw_kernel", _mla_gluon_seesaw.SEESAW_WARPS,
                _mla_gluon_seesaw.SEESAW_STAGES, 64, False),
               ("kernels._mla_gluon_ws", "_mla_fwd_gluon_ws_kernel", _mla_gluon_ws.WS_WARPS, _mla_gluon_ws.WS_STAGES,
                None, False)]
    for module, kernel, warps, stages, box, persistent in kernels:
        fp32, bf16 = (compile_for_sm90(tmp_path, module, kernel, warps, stages, box, persistent, po)
                      for po in ("fp32", "bf16"))
        for tree in fp32:
            a, b, what = fp32[tree], bf16[tree], f"{kernel} tree={tree}"
            # 64 8-byte stores a thread (128 fp32 values) in each code path that stores O (two consumers: 128)
            stores = a["st_global"]["v2.b32"]
            assert stores in (64, 128), (what, a["st_global"])
            assert b["st_global"] == {**a["st_global"], "v2.b32": stores // 2}, (what, a["st_global"], b["st_global"])
            for key in ("wgmma", "tma", "expect_tx", "shared", "shfl", "bar_sync"):
                assert a[key] == b[key], (what, key, a[key], b[key])


_COMBINE = r"""
import collections, json, re, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kernels._mla_kernels import _mla_combine_kernel
out = {}
for po in ("fp32", "bf16"):
    sig = {"po_ptr": "*" + po, "pml_ptr": "*fp32", "nc_ptr": "*i32", "out_ptr": "*bf16", "H": "i32", "HT": "i32",
           "GC": "i32", "stride_ot": "i32", "stride_oh": "i32"}
    cst = dict(DL=512, BDL=512, BLOCK_D=128, BLOCK_M=64, TRIGGER=False)
    sig.update({k: "constexpr" for k in cst})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n.endswith("_ptr") or n.startswith("stride")}
    k = compile(ASTSource(fn=_mla_combine_kernel, signature=sig, constexprs=cst, attrs=attrs),
                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    out[po] = {"mem": collections.Counter(re.findall(r"\b((?:ld|st)\.(?:global|shared)[.\w]*)", ptx)),
               "shared": k.metadata.shared, "bar": len(re.findall(r"\bbar\.sync\b", ptx))}
print(json.dumps(out))
"""


def test_mla_combine_reads_bf16_partials_in_stored_order(tmp_path):
    """The combine kernel (a Triton kernel, compiled for sm_90) folds bf16 partials in their stored fragment order:
    16-byte loads, half as many as for fp32 partials, and puts the result back in column order in registers (no
    more shared memory, barriers or shared accesses than the fp32 build; the output still goes out in 16-byte
    stores)."""
    res = run_sm90_script(tmp_path, _COMBINE, timeout=300)
    a, b = res["fp32"], res["bf16"]
    assert a["mem"]["ld.global.v4.b32"] > 0 and b["mem"]["ld.global.v4.b32"] == a["mem"]["ld.global.v4.b32"] // 2, res
    assert b["mem"]["st.global.v4.b32"] == a["mem"]["st.global.v4.b32"] > 0, res
    shared_ops = {k: v for k, v in a["mem"].items() if ".shared" in k}
    assert {k: v for k, v in b["mem"].items() if ".shared" in k} == shared_ops, res
    assert (b["shared"], b["bar"]) == (a["shared"], a["bar"]), res


def test_mla_gluon_seesaw_persistent_kernel_compiles_for_sm90(tmp_path):
    """The persistent seesaw kernel (`_mla_gluon_seesaw_persistent`) compiled for sm_90: the grid seesaw kernel's
    MMAs exactly (the same `_ss_consumer` per item), its warps and setmaxnreg, TMA for the query tile (always) and
    whole committed tiles (BOX > 0), cp.async arriving on mbarriers for the rest; no CTA-wide barrier inside the
    partitions (each consumer's end-of-item barrier is its warpgroup's); shared memory within 227 KB; no wgmma
    serialization; spills bounded (Triton 3.6's ptxas, the H200's: 76-156 bytes, by nvdisasm in the producer warp
    (48 registers) and the consumers' item set-up, and one 4-byte value reloaded in consumer 0's tile loop). The tile
    loops (SASS: the loops of 44 HGMMA, one per consumer) are the grid kernel's size within 5% and build their wgmma
    descriptors as it does (R2UR within 8 of its): under Triton 3.6 the first worker consumer's loop once took 1137
    instructions a pair with 160 R2UR against the grid kernel's 771-832 (see the rows buffer's allocation)."""
    import triton

    from kernels import _mla_gluon_seesaw as ss

    max_spill = 192 if triton.__version__.startswith("3.6") else 512
    for box in (0, 16, 64):
        grid = compile_for_sm90(tmp_path, "kernels._mla_gluon_seesaw", "_mla_fwd_gluon_seesaw_kernel", ss.SEESAW_WARPS,
                                ss.SEESAW_STAGES, box)
        pers = compile_for_sm90(tmp_path, "kernels._mla_gluon_seesaw_persistent",
                                "_mla_fwd_gluon_seesaw_persistent_kernel", ss.SEESAW_WARPS, ss.SEESAW_STAGES, box,
                                persistent=True, po="bf16")
        for tree, n in pers.items():
            what = f"box={box} tree={tree}: {n}"
            assert n["wgmma"] == grid[tree]["wgmma"], what
            assert n["warps"] == 12 and {ss.CONSUMER_REGS, ss.PRODUCER_REGS} <= set(n["setmaxnreg"]), what
            boxes = 64 // box if box else 0
            assert (n["tma"], n["expect_tx"]) == (9 * boxes + 9, 2 if box else 1), what  # tiles' site + the query's
            assert n["cp_async"] > 0 and n["cp_async_arrive"] == 1 and n["cta_bar"] == [], what
            assert n["ptxas_perf"] == [] and n["spill_bytes"] <= max_spill, what
            assert 0 < n["shared"] <= _SM90_SMEM, what
            mine, ref = _tile_loops(n["loops"]), _tile_loops(grid[tree]["loops"])
            assert len(mine) == len(ref) == 2, (what, n["loops"], grid[tree]["loops"])
            assert max(x["n"] for x in mine) <= 1.05 * max(x["n"] for x in ref), (what, mine, ref)
            assert max(x["R2UR"] for x in mine) <= max(x["R2UR"] for x in ref) + 8, (what, mine, ref)
            assert all(x["LDL"] + x["STL"] <= 4 for x in mine), (what, mine)
