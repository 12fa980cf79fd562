"""The wgmma INT4 MoE path (kernels/int4_moe_wgmma.py, kernels/_int4_moe_wgmma.py).

CPU: the wgmma layout decodes back to the checkpoint's weights bit for bit at awkward shapes and moves every column
to one (word, nibble); both GEMM kernels compile for sm_90 (no GPU needed) into what the design says: warpgroup
MMAs m64nNk16 with N = the block's pairs, the A operand never through shared memory, the activations by 16-byte
cp.async, no spills. GPU (marked `gpu`, sm_90 only): the kernels against `int4_moe_ref` at awkward and Kimi K2.6
shapes (outputs poisoned with NaN), and batch invariance (a token alone vs inside a batch of 64, also with its
experts crowded), bitwise.
"""

from __future__ import annotations

import collections
import functools
import re

import pytest
import torch

from kernels.int4_moe_wgmma import (
    BLOCK_PAIRS,
    STAGES,
    auto_schedule,
    int4_moe_wgmma,
    repack_int4_moe_for_wgmma,
    resolve_schedule,
    wgmma_layout_dense,
)
from kernels.int4_pack import dequantize_int4
from tests.kernels.sm90_compile import RING_STEP_SYNC, run_sm90_script
from tests.kernels.test_int4_moe import (
    KIMI,
    assert_bitwise,
    check_kimi_path,
    check_layout_path,
    kimi_checkpoint_experts,
    make_experts,
    make_routing,
    run_poisoned,
)

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU (wgmma)")


@pytest.mark.parametrize("D,inter", [(544, 96), (256, 32), (1056, 160)])
def test_wgmma_layout_decodes_to_the_checkpoint(D, inter):
    """repack -> the kernel's reading of the words and scales (`wgmma_layout_dense`) == dequantize_int4, with K
    padded to a multiple of 256 by zero weights (sliced off)."""
    w13, s13, w2, s2 = make_experts(2, D, inter, device="cpu", seed=3)
    for packed, scale in ((w13, s13), (w2, s2)):
        words, sc = repack_int4_moe_for_wgmma(packed, scale, packed, scale)[:2]
        in_f = packed.shape[2] * 8
        assert words.shape[2] * 8 % 256 == 0 and sc.shape[2] == words.shape[2] // 4
        ref = torch.stack([dequantize_int4(packed[e], scale[e], torch.float32) for e in range(packed.shape[0])])
        assert torch.equal(wgmma_layout_dense(words, sc, in_f), ref)


def test_wgmma_layout_moves_every_column():
    """A one-hot weight lands in exactly one (word, nibble) of the repacked row, in the word of its lane (column
    bits 1-2) and group (column // 32), and decodes to its column."""
    K = 512
    for col in range(K):
        q = torch.zeros(1, 1, K, dtype=torch.int64)
        q[0, 0, col] = 5
        u = q + 8
        words = (u.view(1, 1, K // 8, 8) << torch.arange(0, 32, 4)).sum(-1)
        packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        scale = torch.ones(1, 1, K // 32, dtype=torch.bfloat16)
        gw, gs = repack_int4_moe_for_wgmma(packed, scale, packed, scale)[:2]
        nib = (gw.long().unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF
        hit = (nib != 8).nonzero().tolist()
        assert len(hit) == 1, col
        word = hit[0][2] % 32
        assert (word // 8, word % 8, hit[0][2] // 32) == ((col >> 1) & 3, (col % 256) // 32, col // 256), col
        dense = wgmma_layout_dense(gw, gs, K)
        assert dense[0, 0, col] == 5 and int((dense != 0).sum()) == 1, col


_SM90_COMPILE = r"""
import json, re
from kernels import _int4_moe_wgmma as m
from tests.kernels.sm90_compile import compile_gluon_sm90, ring_loop_syncs
out = {}
configs = ((8, 0, 4, False, False, None, 1, 1, 128), (64, 0, 2, False, False, None, 1, 1, 128),
           (32, 8, 2, False, False, 168, 1, 1, 128), (32, 8, 2, True, False, 168, 1, 1, 128),
           (8, 0, 4, True, True, None, 1, 1, 128), (16, 8, 2, False, False, 128, 1, 1, 128),
           (8, 0, 4, True, True, None, 2, 1, 128), (32, 8, 2, False, False, 168, 4, 1, 128),
           (8, 0, 4, True, True, None, 1, 2, 128), (32, 8, 2, False, False, None, 1, 2, 128),
           (16, 8, 2, False, False, None, 2, 2, 128), (8, 0, 4, True, True, None, 1, 1, 64),
           (16, 8, 2, False, False, 128, 1, 1, 64), (32, 8, 2, False, False, 168, 2, 1, 64))
for gated, np_, small, stages, pdl, direct, cap, rt, wg, rows in [(g, *c) for g in (True, False) for c in configs
                                                                  if not (g and c[6] > 1)]:  # row tiles: w2 only
        sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16" if gated else "*fp32",
               "pairs_ptr": "*i32", "bexp_ptr": "*i64" if direct else "*i32", "P": "i32", "N_OUT": "i32",
               "num_kb": "i32"}
        sig.update({n: "i32" for n in ("stride_x", "stride_we", "stride_wn", "stride_wk", "stride_se8", "stride_sn8",
                                       "stride_sk8", "stride_o")})
        cst = dict(TOPK=8, NP=np_, SMALL=small, STAGES=stages, PDL=pdl, DIRECT=direct, WG=wg,
                   **({} if gated else {"ROW_TILES": rt}), ROWS=rows)
        k, ptx, log = compile_gluon_sm90(m._moe_w13_wgmma_kernel if gated else m._moe_w2_wgmma_kernel, sig, cst,
                                         [n for n in sig if n.endswith("_ptr") or n.startswith("stride")],
                                         num_warps=4 * wg, maxnreg=cap)
        lines = ptx.splitlines()
        first = {key: next((i for i, line in enumerate(lines) if pat in line), -1) for key, pat in
                 (("wait", "griddepcontrol.wait"), ("launch", "griddepcontrol.launch_dependents"),
                  ("cp_async", "cp.async.cg"), ("ld_global", "ld.global"))}
        tag = ("_pdl" if pdl else "") + ("_direct" if direct else "") + (f"_rt{rt}" if rt > 1 else "") \
            + (f"_wg{wg}" if wg > 1 else "") + (f"_r{rows}" if rows != 128 else "")
        out[f"{'w13' if gated else 'w2'}_np{np_}_small{small}_s{stages}{tag}"] = {
            "first": first, "cap": cap,
            "shared": k.metadata.shared,
            "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            "registers": int(re.findall(r"Used (\d+) registers", log)[-1]),
            "n_wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "st_shared": ptx.count("st.shared"), "ld_shared": ptx.count("ld.shared") + ptx.count("ldmatrix"),
            "cp_async_16": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx)),
            "ld_v4": ptx.count("ld.global.v4"), "ld_shared_v4": ptx.count("ld.shared.v4.b32"),
            "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log)),
            "loops": ring_loop_syncs(ptx)}
print(json.dumps(out))
"""


def test_wgmma_moe_kernels_compile_for_sm90(tmp_path):
    """Both GEMMs compiled for sm_90 (PTX + ptxas, no GPU) in the schedules' shapes (8-pair blocks and a 4-slot
    ring, 64-pair blocks and 2 slots, 32-pair blocks with an 8-pair path under a 168-register cap, 16-pair blocks with
    an 8-pair path under a 128-register cap, auto_schedule's middle tier; w2 also with 2 and 4 row tiles per program,
    whose loop over the tiles holds one copy of the step): only m64nNk16 wgmma with N = the block's
    (or the small path's) pairs, 32 per K step and path (4 chunks x 2 weight tensors x 4 k16) plus none outside; the
    A operand built in registers (no shared-memory stores), everything copied by 16-byte cp.async into the ring
    (slots of 4 x N x 64 activations, words [128, 32] and scales [128, 8]), no global vector loads, 12 16-byte shared
    loads per step and path (a lane's 2 x 8 words and 2 x 8 scales of both tensors), no spills (under 168 registers:
    at most 8 bytes; with PDL's early weight copies in w2: 16; under 128: 48), and a capped kernel within its cap (3
    or 4 CTAs per SM). With PDL (programmatic dependent launch) w13 waits for the previous grid before any load and
    only then lets w2 be scheduled; w2 reads its block's expert and issues its first weight copies before it waits;
    without PDL no grid-dependency instruction at all. Direct blocks (the expert id of a pair as its block's, int64)
    compile to the same MMAs and copies. 64-row programs (decode, both tiers, 2 row tiles): half the MMAs, ring rows,
    shared loads; like two warpgroups, w13's epilogue through shared memory; no spills."""
    pytest.importorskip("triton.experimental.gluon")
    facts = run_sm90_script(tmp_path, _SM90_COMPILE)
    assert len(facts) == 24, facts
    for name, f in facts.items():
        n, small, stages = (int(v) for v in re.match(r"w\d+_np(\d+)_small(\d+)_s(\d+)", name).groups())
        wg = 2 if "_wg2" in name else 1
        rows = 64 if "_r64" in name else 128
        half = 2 if wg == 2 or rows == 64 else 1  # one accumulator per warpgroup: MMAs / shared loads per warpgroup
        first = f["first"]
        if "_pdl" not in name:
            assert first["wait"] == first["launch"] == -1, (name, first)
        elif name.startswith("w13"):  # waits before it reads anything, then lets w2 be scheduled
            assert 0 <= first["wait"] < first["launch"] < min(first["ld_global"], first["cp_async"]), (name, first)
        else:  # w2: reads its expert (past L1) and puts weights in flight before it waits for w13
            assert 0 <= first["ld_global"] < first["cp_async"] < first["launch"] < first["wait"], (name, first)
        paths = [n] + ([small] if small else [])
        # two warpgroups: one instruction per chunk and k16 block covers both tensors (each warpgroup its 64 rows)
        assert f["wgmma"] == sorted(f"m64n{p}k16" for p in paths) and f["n_wgmma"] == 32 // half * len(paths), \
            (name, f)
        assert f["cp_async_16"] >= 1 and f["ld_v4"] == 0, (name, f)
        # the A operand never goes through shared memory; with two warpgroups w13's epilogue does (gate and up of
        # a column sit in different warpgroups), and a cross-warp reduction may (the block's fill)
        assert f["st_shared"] == 0 if half == 1 else f["st_shared"] <= 16, (name, f)
        # under 168 registers: none with the GPU's Triton 3.6 ptxas, 4 bytes with 3.9's; under 128 (4 CTAs per SM):
        # a few spills, measured as the faster trade at <= 128 pairs (auto_schedule)
        budget = 0 if half == 2 else 48 if f["cap"] == 128 else 16 if "_pdl" in name else 8 if small else 0
        assert f["spill_bytes"] <= budget, (name, f)
        ring = stages * (4 * n * 64 * 2 + rows * 32 * 4 + rows * 8 * 2)
        assert f["shared"] == ring if half == 1 else ring <= f["shared"] <= ring + rows * n * 4 + 64, (name, f)
        assert f["ld_shared_v4"] == 12 // half * len(paths), (name, f)  # a lane's words and scales, 16 bytes each
        assert half == 2 or f["ld_shared"] == f["ld_shared_v4"], (name, f)
        assert f["cap"] is None or f["registers"] <= f["cap"], (name, f)
        assert wg == 1 or f["registers"] <= 128, (name, f)  # two 8-warp programs per SM
        # each ring step: the compiler's barrier after the wait, the fence, the next step's copies, then one barrier
        # of ours before the slot is read (three before the thirty-fourth session: a second one after the fence)
        assert f["loops"] and all(seq[:len(RING_STEP_SYNC)] == RING_STEP_SYNC for seq in f["loops"]), (name, f)


_SM90_COMPILE_DECODE = r"""
import json, re
from kernels import _int4_moe_decode as m
from tests.kernels.sm90_compile import compile_gluon_sm90, ring_loop_syncs
out = {}


def publishes(ptx):  # per release / acq_rel counter add: [a fence, a CTA barrier] after the last global store
    lines = ptx.splitlines()
    found = []
    for i, ln in enumerate(lines):
        if re.search(r"\b(atom|red)\.global\.gpu\.(release|acq_rel)\.add", ln):
            j = max((n for n in range(i) if re.search(r"\bst\.global\.", lines[n])), default=-1)
            span = lines[j + 1:i]
            found.append([any("fence.acq_rel.gpu" in x for x in span),
                          any(re.search(r"\bbar\.sync\b", x) for x in span)])
    return found


names = ["x_ptr", "w13_ptr", "s13_ptr", "w2_ptr", "s2_ptr", "a_ptr", "y_ptr", "out_ptr", "ids_ptr", "tw_ptr",
         "sync_ptr"]
sig = dict(zip(names, ["*bf16", "*i32", "*bf16", "*i32", "*bf16", "*bf16", "*fp32", "*bf16", "*i64", "*fp32", "*i32"]))
sig.update({n: "i32" for n in ("I", "D", "kb13", "kb2", "stride_x", "stride_a", "stride_y", "stride_w13e",
                               "stride_w13n", "stride_w13k", "stride_s13e8", "stride_s13n8", "stride_s13k8",
                               "stride_w2e", "stride_w2n", "stride_w2k", "stride_s2e8", "stride_s2n8", "stride_s2k8")})
for stages, rt, rows in ((4, 1, 128), (4, 2, 128), (3, 2, 128), (2, 1, 128), (4, 1, 64), (4, 2, 64)):
    cst = dict(TOPK=8, STAGES=stages, ROW_TILES=rt, R=rows)
    k, ptx, log = compile_gluon_sm90(m._moe_decode_kernel, sig, cst,
                                     [n for n in sig if n.endswith("_ptr") or n.startswith("stride")], num_warps=4,
                                     maxnreg=m.DECODE_MAXNREG[rows])
    out[f"s{stages}_rt{rt}_r{rows}"] = {
        "shared": k.metadata.shared, "registers": int(re.findall(r"Used (\d+) registers", log)[-1]),
        "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log)),
        "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
        "n_wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "sync": re.findall(r"(atom\.global\.gpu\.\w+\.add|red\.global\.gpu\.\w+\.add|ld\.global\.gpu\.acquire"
                           r"|fence\.acq_rel\.gpu|griddepcontrol\.\w+)", ptx),
        "publish": publishes(ptx), "loops": ring_loop_syncs(ptx)}
print(json.dumps(out))
"""


def test_wgmma_moe_decode_kernel_compiles_for_sm90(tmp_path):
    """The fused decode kernel compiled for sm_90 (PTX + ptxas, no GPU), with 128- and 64-row programs: its w13 and
    w2 tiles are the 8-pair decode path's MMAs (m64n8k16, 32 or 16 per K step in each), its ring that path's shared
    memory (plus the 4 bytes through which one thread's atomic reaches the CTA), no spills, two (four) CTAs per SM as
    the launcher's grid assumes; and its synchronisation: a
    relaxed ticket, w13's release of ready[slot] after a GPU-scope fence, w2's acquire polls of it followed by a
    fence, its acq_rel count of the row range between fences (the combine's), the next ticket, the exit count, each
    done by one thread; no programmatic dependent launch."""
    pytest.importorskip("triton.experimental.gluon")
    facts = run_sm90_script(tmp_path, _SM90_COMPILE_DECODE)
    assert len(facts) == 6, facts
    for name, f in facts.items():
        stages, rows = int(name[1]), int(name.rsplit("_r", 1)[1])
        per_sm = 2 if rows == 128 else 4  # the launcher's grid: as many as fit
        ring = stages * (4 * 8 * 64 * 2 + rows * 32 * 4 + rows * 8 * 2)
        # + the 4 bytes of the atomics' broadcast; 64 rows: + w13's epilogue buffer [64, 8] fp32 (reusing none)
        assert ring + 4 <= f["shared"] <= ring + 4 + (0 if rows == 128 else 64 * 8 * 4) \
            or ring < f["shared"] == ring + 64 * 8 * 4, (name, f)  # (the broadcast may sit in the buffer's place)
        assert per_sm * (f["shared"] + 1024) <= 228 * 1024, (name, f)
        # 64 rows under DECODE_MAXNREG's 128 registers: a few bytes of spills (4 with Triton 3.9's ptxas, up to 40 with
        # 3.6's, the H200's)
        assert f["spill_bytes"] <= (0 if rows == 128 else 48) and per_sm * 128 * f["registers"] <= 65536, (name, f)
        assert f["wgmma"] == ["m64n8k16"] and f["n_wgmma"] == (64 if rows == 128 else 32), (name, f)
        # (PTX lays the blocks out in its own order: counted, not sequenced; an add whose result is unused is a red
        # in Triton 3.9's PTX, an atom in 3.6's)
        sync = collections.Counter(op.replace("atom.global.gpu.release", "red.global.gpu.release") for op in f["sync"])
        assert sync == {
            "atom.global.gpu.relaxed.add": 2,  # the first ticket and the next one
            "red.global.gpu.release.add": 1,  # w13: ready[slot] + 1
            "ld.global.gpu.acquire": 2,  # w2: the poll of ready[slot], before the loop and in it
            "atom.global.gpu.acq_rel.add": 2,  # w2: its row range's count; the exit count
            "fence.acq_rel.gpu": 4}, (name, f)  # before the release, after the poll, around the row count
        # a tile's stores are announced only after every warp made them: fence, CTA barrier, then thread 0's count
        # (ready[slot], its row range's count); the exit count announces no stores (either way)
        assert len(f["publish"]) == 3 and f["publish"].count([True, True]) >= 2, (name, f)
        assert f["loops"] and all(seq[:len(RING_STEP_SYNC)] == RING_STEP_SYNC for seq in f["loops"]), (name, f)


_SM90_COMPILE_W2_COMBINE = r"""
import json, re
from kernels import _int4_moe_wgmma as m
from tests.kernels.sm90_compile import compile_gluon_sm90
out = {}
for stages, pdl, rt, rows in ((4, True, 1, 128), (4, True, 2, 128), (2, False, 1, 128), (4, True, 1, 64)):
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*fp32", "pairs_ptr": "*i64",
           "bexp_ptr": "*i64", "P": "i32", "N_OUT": "i32", "num_kb": "i32"}
    sig.update({n: "i32" for n in ("stride_x", "stride_we", "stride_wn", "stride_wk", "stride_se8", "stride_sn8",
                                   "stride_sk8", "stride_o")})
    sig.update({"tw_ptr": "*fp32", "comb_ptr": "*bf16", "rows_ptr": "*i32"})
    cst = dict(TOPK=8, NP=8, SMALL=0, STAGES=stages, PDL=pdl, ROW_TILES=rt, ROWS=rows)
    k, ptx, log = compile_gluon_sm90(m._moe_w2_combine_wgmma_kernel, sig, cst,
                                     [n for n in sig if n.endswith("_ptr") or n.startswith("stride")], num_warps=4)
    lines = ptx.splitlines()
    first = {key: next((i for i, line in enumerate(lines) if pat in line), -1) for key, pat in
             (("wait", "griddepcontrol.wait"), ("launch", "griddepcontrol.launch_dependents"),
              ("cp_async", "cp.async.cg"), ("ld_global", "ld.global"))}
    count = next(i for i, ln in enumerate(lines) if re.search(r"\batom\.global\.gpu\.acq_rel\.add", ln))
    last_store = max(i for i in range(count) if re.search(r"\bst\.global\.", lines[i]))
    span = lines[last_store + 1:count]
    out[f"s{stages}_rt{rt}_r{rows}" + ("_pdl" if pdl else "")] = {
        "first": first, "shared": k.metadata.shared,
        "registers": int(re.findall(r"Used (\d+) registers", log)[-1]),
        "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log)),
        "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
        "n_wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "sync": re.findall(r"(atom\.global\.gpu\.\w+\.\w+|red\.global\.gpu\.\w+\.\w+|fence\.acq_rel\.gpu)", ptx),
        "before_count": [any("fence.acq_rel.gpu" in x for x in span),
                         any(re.search(r"\bbar\.sync\b", x) for x in span)],
        "cg_after_count": sum("ld.global.cg" in x for x in lines[count:])}
print(json.dumps(out))
"""


def test_wgmma_moe_w2_combine_kernel_compiles_for_sm90(tmp_path):
    """w2 with the combine (`w2_combine`) compiled for sm_90: the direct decode w2's MMAs (m64n8k16, 32 a K step with
    128 rows, 16 with 64), ring and programmatic-dependent-launch order (its expert read and first weight copies
    before it waits), no spills; then, once a program's y rows are stored, a GPU-scope fence and a CTA barrier before
    thread 0's acq_rel count of its row range (so every warp's stores precede it), a fence after it, the combine's
    TOPK slot rows read past L1 and the count re-armed (a relaxed exchange): nothing else synchronises."""
    pytest.importorskip("triton.experimental.gluon")
    facts = run_sm90_script(tmp_path, _SM90_COMPILE_W2_COMBINE)
    assert len(facts) == 4, facts
    for name, f in facts.items():
        rows = 64 if "_r64" in name else 128
        stages = int(name[1])
        first = f["first"]
        if "_pdl" in name:
            assert 0 <= first["ld_global"] < first["cp_async"] < first["launch"] < first["wait"], (name, first)
        else:
            assert first["wait"] == first["launch"] == -1, (name, first)
        assert f["wgmma"] == ["m64n8k16"] and f["n_wgmma"] == (32 if rows == 128 else 16), (name, f)
        assert f["spill_bytes"] == 0 and f["registers"] <= 255, (name, f)
        ring = stages * (4 * 8 * 64 * 2 + rows * 32 * 4 + rows * 8 * 2)
        assert ring <= f["shared"] <= ring + 16, (name, f)  # + the count's broadcast
        assert f["before_count"] == [True, True], (name, f)
        assert f["sync"] == ["fence.acq_rel.gpu", "atom.global.gpu.acq_rel.add", "fence.acq_rel.gpu",
                             "atom.global.gpu.relaxed.exch"], (name, f)
        assert f["cg_after_count"] >= 8, (name, f)  # the 8 slots' y rows (and, with PDL, nothing else past L1)


# --- GPU ----------------------------------------------------------------------------------------------------
run_wgmma = functools.partial(run_poisoned, int4_moe_wgmma)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("T,k,E,D,inter", [(5, 3, 7, 544, 224), (1, 2, 4, 256, 64), (33, 4, 16, 1024, 160),
                                            (1, 3, 7, 544, 224)])
@pytest.mark.parametrize("sched", [dict(block_pairs=bp, stages=st) for bp in BLOCK_PAIRS for st in (2, 4)]
                         + [dict(block_pairs=8, stages=3), dict(block_pairs=32, small_pairs=8, stages=2, maxnreg=168),
                            dict(block_pairs=16, small_pairs=8, stages=3), {},
                            # row tiles past D (zero-filled, not stored); PDL's early copies crossing into tile 1
                            dict(row_tiles=2), dict(block_pairs=16, small_pairs=8, row_tiles=4),
                            dict(block_pairs=8, stages=4, pdl=True, row_tiles=2),
                            # two warpgroups (one weight tensor each), alone and with the other options
                            dict(warpgroups=2), dict(block_pairs=32, small_pairs=8, stages=2, warpgroups=2),
                            dict(block_pairs=8, stages=4, pdl=True, row_tiles=2, warpgroups=2),
                            # the fused decode (one token: rows and K past the tiles, 2 or 3 slots, 2 row tiles)
                            dict(fused=True), dict(fused=True, stages=3, row_tiles=2), dict(fused=True, stages=2),
                            # 64-row programs: decode, both tiers, row tiles, fused
                            dict(rows=64), dict(rows=64, block_pairs=32, small_pairs=8, stages=2, maxnreg=168),
                            dict(rows=64, block_pairs=16, small_pairs=8, row_tiles=2), dict(rows=64, fused=True),
                            dict(rows=64, fused=True, row_tiles=2, stages=3),
                            # w2 with the combine (one token with direct blocks; other T: ignored)
                            dict(w2_combine=True), dict(w2_combine=True, row_tiles=2, stages=3),
                            dict(w2_combine=True, rows=64), dict(w2_combine=True, pdl=False)])
def test_int4_moe_wgmma_vs_reference(T, k, E, D, inter, sched):
    check_layout_path(int4_moe_wgmma, repack_int4_moe_for_wgmma, T, k, E, D, inter, **sched)


@pytest.fixture(scope="module")
def kimi_wgmma():
    if not SM90:
        pytest.skip("needs an sm_90 GPU (wgmma)")
    w = kimi_checkpoint_experts()
    return w, repack_int4_moe_for_wgmma(*w)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 9, 64])
def test_int4_moe_wgmma_kimi_shapes(kimi_wgmma, T):
    check_kimi_path(int4_moe_wgmma, *kimi_wgmma, T)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("sched", [dict(block_pairs=8, stages=4), dict(block_pairs=16), dict(block_pairs=64),
                                   dict(block_pairs=32, small_pairs=8, stages=2, maxnreg=168), {}, dict(rows=64)])
def test_int4_moe_wgmma_batch_invariance(kimi_wgmma, sched):
    """Token 37 alone, as row 37 of a batch of 64, and with its experts crowded by other tokens (64 pairs on four of
    its experts, 20 on a fifth: full and partly empty blocks): bitwise equal (DESIGN 3.5)."""
    _, ww = kimi_wgmma
    ids, tw = make_routing(64, KIMI["k"], KIMI["E"], device="cuda", seed=7)
    x = torch.randn(64, KIMI["D"], device="cuda").to(torch.bfloat16)
    kw = sched
    alone = run_wgmma(x[37:38], ids[37:38], tw[37:38], ww, **kw)
    assert_bitwise(run_wgmma(x, ids, tw, ww, **kw)[37], alone[0], "batch of 64")
    ids2 = ids.clone()
    ids2[:, :4] = ids[37, :4]
    ids2[:20, 4] = ids[37, 4]
    alone2 = run_wgmma(x[37:38], ids2[37:38], tw[37:38], ww, **kw)
    assert_bitwise(run_wgmma(x, ids2, tw, ww, **kw)[37], alone2[0], "crowded")


@sm90
@pytest.mark.gpu
def test_int4_moe_wgmma_schedules_agree(kimi_wgmma):
    """The schedule (block size = the MMA's N, the small path, the ring depth, a register cap) does not change a
    pair's bits: the launcher picks it per launch from the pair count, so this is what keeps AR and DDTree on the
    same bits. Crowded routing, so the tiered schedule runs both of its paths."""
    _, ww = kimi_wgmma
    ids, tw = make_routing(64, KIMI["k"], KIMI["E"], device="cuda", seed=8)
    ids[:24, :3] = ids[0, :3]  # 24 pairs on three experts: the 32-pair path; the rest: 1-3 pairs, the 8-pair path
    x = torch.randn(64, KIMI["D"], device="cuda").to(torch.bfloat16)
    ref = run_wgmma(x, ids, tw, ww, block_pairs=8, stages=2)
    scheds = [dict(block_pairs=bp, stages=st) for bp in BLOCK_PAIRS for st in STAGES]
    scheds += [dict(block_pairs=32, small_pairs=8, stages=2, maxnreg=168), dict(block_pairs=64, small_pairs=16), {},
               dict(block_pairs=16, small_pairs=8, stages=2, maxnreg=128), dict(block_pairs=8, stages=2, maxnreg=128),
               dict(pdl=True), dict(block_pairs=8, stages=4, pdl=True), dict(row_tiles=2),
               dict(block_pairs=32, small_pairs=8, stages=2, maxnreg=168, row_tiles=4), dict(row_tiles=8),
               dict(warpgroups=2), dict(block_pairs=16, small_pairs=8, stages=2, warpgroups=2),
               dict(block_pairs=64, stages=2, warpgroups=2), dict(block_pairs=32, small_pairs=8, row_tiles=2,
                                                                  warpgroups=2),
               dict(rows=64), dict(rows=64, block_pairs=16, small_pairs=8, stages=2, maxnreg=128),
               dict(rows=64, block_pairs=64, stages=3, row_tiles=2)]
    for sched in scheds:
        assert_bitwise(run_wgmma(x, ids, tw, ww, **sched), ref, str(sched))


@sm90
@pytest.mark.gpu
def test_int4_moe_wgmma_decode_options_agree(kimi_wgmma):
    """One token with direct blocks (no grouping launch) and / or PDL == the same token by the default decode
    schedule == its row in a batch of 64 (the tiered schedule), bitwise, for several tokens."""
    _, ww = kimi_wgmma
    ids, tw = make_routing(64, KIMI["k"], KIMI["E"], device="cuda", seed=12)
    x = torch.randn(64, KIMI["D"], device="cuda").to(torch.bfloat16)
    batch = run_wgmma(x, ids, tw, ww)
    for t in (0, 21, 63):
        one = (x[t:t + 1], ids[t:t + 1], tw[t:t + 1])
        assert_bitwise(run_wgmma(*one, ww)[0], batch[t], f"token {t} alone")
        for sched in (dict(direct=True), dict(pdl=True), dict(direct=True, pdl=True),
                      dict(direct=True, pdl=True, row_tiles=2), dict(row_tiles=4),
                      dict(direct=True, pdl=True, warpgroups=2), dict(warpgroups=2, row_tiles=2),
                      dict(fused=True), dict(fused=True, row_tiles=2), dict(fused=True, stages=3), dict(rows=64),
                      dict(rows=64, direct=False, pdl=False), dict(rows=64, fused=True),
                      dict(rows=64, fused=True, row_tiles=2), dict(w2_combine=True),
                      dict(w2_combine=True, row_tiles=2), dict(w2_combine=True, rows=64),
                      dict(w2_combine=True, pdl=False), dict(w2_combine=True, direct=False)):
            assert_bitwise(run_wgmma(*one, ww, **sched)[0], batch[t], f"token {t}, {sched}")


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("T,direct,w2c", [(1, False, False), (1, True, False), (64, False, False), (1, True, True)])
def test_int4_moe_wgmma_pdl_in_a_cuda_graph(kimi_wgmma, T, direct, w2c):
    """Programmatic dependent launch (w13, w2 and the combine each scheduled while the previous grid ends, each
    waiting for it before it reads its output), eager and replayed from a CUDA graph twice with new inputs: bitwise
    equal to the launches without it, for the decode (T = 1) and the tiered schedule."""
    _, ww = kimi_wgmma
    ids, tw = make_routing(T, KIMI["k"], KIMI["E"], device="cuda", seed=9)
    x = torch.randn(T, KIMI["D"], device="cuda").to(torch.bfloat16)
    kw = dict(pdl=True, direct=direct, w2_combine=w2c)
    assert_bitwise(run_wgmma(x, ids, tw, ww, **kw), run_wgmma(x, ids, tw, ww), "eager")
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        int4_moe_wgmma(x, ids, tw, *ww, out=out, **kw)  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int4_moe_wgmma(x, ids, tw, *ww, out=out, **kw)
    for seed in (10, 11):
        new_ids, new_tw = make_routing(T, KIMI["k"], KIMI["E"], device="cuda", seed=seed)
        x.copy_(torch.randn(T, KIMI["D"], device="cuda").to(torch.bfloat16))
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        out.fill_(float("nan"))
        graph.replay()
        assert_bitwise(out, run_wgmma(x, ids, tw, ww), f"graph replay, inputs {seed}")


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("sched", [dict(fused=True), dict(fused=True, row_tiles=2, stages=3),
                                   dict(fused=True, rows=64), dict(w2_combine=True),
                                   dict(w2_combine=True, row_tiles=2), dict(w2_combine=True, rows=64)])
def test_int4_moe_wgmma_counted_decode_repeats(kimi_wgmma, sched):
    """The fused decode's counters and w2_combine's row-range counts go back to zero after every launch (the last CTA
    zeroes them, the combining program re-arms its count): 40 launches in a row with new tokens and routing, eager,
    then a CUDA graph replayed with new inputs 20 times, each bitwise equal to the separate launches' (an unreset
    counter would let w2 tiles run before their w13 tiles, skip tiles, or combine a range before all its slots)."""
    _, ww = kimi_wgmma
    out = torch.empty(1, KIMI["D"], device="cuda", dtype=torch.bfloat16)

    def fresh(seed):
        ids, tw = make_routing(1, KIMI["k"], KIMI["E"], device="cuda", seed=seed)
        return torch.randn(1, KIMI["D"], device="cuda").to(torch.bfloat16), ids, tw

    for seed in range(40):
        x, ids, tw = fresh(100 + seed)
        assert_bitwise(run_wgmma(x, ids, tw, ww, **sched), run_wgmma(x, ids, tw, ww), f"eager launch {seed}")
    x, ids, tw = fresh(7)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        int4_moe_wgmma(x, ids, tw, *ww, out=out, **sched)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int4_moe_wgmma(x, ids, tw, *ww, out=out, **sched)
    for seed in range(20):
        nx, nids, ntw = fresh(200 + seed)
        x.copy_(nx)
        ids.copy_(nids)
        tw.copy_(ntw)
        out.fill_(float("nan"))
        graph.replay()
        assert_bitwise(out, run_wgmma(x, ids, tw, ww), f"graph replay {seed}")


def test_auto_schedule():
    """Decode: small blocks, a deep ring, direct blocks and PDL; a few tokens: the tiered 16 / 8 schedule at 4 CTAs
    per SM; more: the tiered 32 / 8 schedule under the register cap, no PDL; always options the launcher takes."""
    for p in (1, 8):
        s = auto_schedule(p)
        assert (s["block_pairs"], s["small_pairs"], s["stages"], s["pdl"], s["direct"]) == (8, 0, 4, True, True), p
    for p in (9, 72, 128):
        s = auto_schedule(p)
        assert (s["block_pairs"], s["small_pairs"], s["stages"], s["maxnreg"]) == (16, 8, 2, 128), p
        assert not s["pdl"] and not s["direct"], p
    for p in (129, 1032, 4224, 10**6):
        s = auto_schedule(p)
        assert (s["block_pairs"], s["small_pairs"], s["stages"], s["maxnreg"]) == (32, 8, 2, 168), p
        assert not s["pdl"] and not s["direct"], p
    for p in (1, 9, 129, 10**6):
        assert resolve_schedule(p) == auto_schedule(p), p  # every one runnable


def test_resolve_schedule(monkeypatch):
    """Options given win over DEFAULT_SCHEDULE's, which win over auto_schedule's, or over PLAIN's (one block size,
    no small path, no cap, no PDL) when a block size is among them."""
    import kernels.int4_moe_wgmma as mod

    assert resolve_schedule(72) == auto_schedule(72)
    assert resolve_schedule(72, stages=3, maxnreg=None) == {**auto_schedule(72), "stages": 3}
    assert resolve_schedule(72, block_pairs=16) == {**mod.PLAIN, "block_pairs": 16}
    assert resolve_schedule(1, row_tiles=2) == {**auto_schedule(1), "row_tiles": 2}
    for opt in ("row_tiles", "warpgroups"):  # not measured yet: off
        assert auto_schedule(1)[opt] == auto_schedule(10**6)[opt] == 1, opt
    assert resolve_schedule(1, fused=True) == {**auto_schedule(1), "fused": True}
    assert resolve_schedule(1, rows=64) == {**auto_schedule(1), "rows": 64}
    assert resolve_schedule(1, w2_combine=True) == {**auto_schedule(1), "w2_combine": True}
    assert not auto_schedule(10**6)["fused"]
    assert not auto_schedule(1)["w2_combine"] and not auto_schedule(10**6)["w2_combine"]  # not measured yet: off
    # two warpgroups: auto's caps (sized for 4-warp programs) go unless given
    assert resolve_schedule(72, warpgroups=2) == {**auto_schedule(72), "warpgroups": 2, "maxnreg": None}
    assert resolve_schedule(72, warpgroups=2, maxnreg=96)["maxnreg"] == 96
    monkeypatch.setattr(mod, "DEFAULT_SCHEDULE", dict(pdl=True))
    assert resolve_schedule(1) == {**auto_schedule(1), "pdl": True}
    assert resolve_schedule(1000, pdl=False) == auto_schedule(1000)
    monkeypatch.setattr(mod, "DEFAULT_SCHEDULE", dict(block_pairs=64, small_pairs=16, stages=3))
    assert resolve_schedule(1) == {**mod.PLAIN, **mod.DEFAULT_SCHEDULE}
    assert resolve_schedule(1, small_pairs=8)["small_pairs"] == 8


def test_bad_schedule_is_refused():
    """A schedule the kernels cannot run is a ValueError naming the options (checked before any GPU work)."""
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    if SM90:
        x = x.cuda()
    ids, tw = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    for bad in (dict(block_pairs=12), dict(block_pairs=8, small_pairs=8), dict(block_pairs=8, stages=5),
                dict(block_pairs=32, small_pairs=12), dict(maxnreg=7), dict(pdl="yes"), dict(direct=1),
                dict(row_tiles=3), dict(row_tiles=True), dict(warpgroups=4), dict(warpgroups=True), dict(fused=1),
                dict(rows=32), dict(rows=64, warpgroups=2), dict(w2_combine=1)):
        with pytest.raises(ValueError, match="block_pairs=.*small_pairs=.*stages=.*row_tiles=.*warpgroups="):
            int4_moe_wgmma(x, ids, tw, *(None,) * 4, **bad)
    if not SM90:  # a schedule it takes gets as far as the device check
        with pytest.raises(ValueError, match="sm_90"):
            int4_moe_wgmma(x, ids, tw, *(None,) * 4, block_pairs=32, small_pairs=8)
