"""The Gluon INT4 MoE path (kernels/int4_moe_gluon.py, kernels/_int4_moe_gluon.py).

CPU: the gluon layout decodes back to the checkpoint's weights bit for bit at awkward shapes, and both GEMM
kernels compile for sm_90 (no GPU needed) into what the design says: no shared memory, no CTA barrier,
16-byte weight and activation loads, mma.sync m16n8k16, no spills. GPU (marked `gpu`): the kernels against
`int4_moe_ref` at awkward and Kimi K2.6 shapes (outputs poisoned with NaN), batch invariance (a token alone
vs inside a batch of 64, also with its experts crowded), and the same bits for 8- and 16-pair blocks.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels.int4_moe_gluon import BLOCK_PAIRS, gluon_layout_dense, int4_moe_gluon, repack_int4_moe_for_gluon
from kernels.int4_pack import dequantize_int4
from tests.kernels.sm90_compile import run_sm90_script
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

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.parametrize("D,inter", [(544, 96), (512, 32), (1056, 160)])
def test_gluon_layout_decodes_to_the_checkpoint(D, inter):
    """repack -> the kernel's reading of the words and scales (`gluon_layout_dense`) == dequantize_int4, with K
    padded to a multiple of 512 by zero weights (sliced off) and every nibble position exercised."""
    w13, s13, w2, s2 = make_experts(2, D, inter, device="cpu", seed=3)
    for packed, scale in ((w13, s13), (w2, s2)):
        words, sc = repack_int4_moe_for_gluon(packed, scale, packed, scale)[:2]
        in_f = packed.shape[2] * 8
        assert words.shape[2] * 8 % 512 == 0 and sc.shape[2] == words.shape[2] // 4
        ref = torch.stack([dequantize_int4(packed[e], scale[e], torch.float32) for e in range(packed.shape[0])])
        assert torch.equal(gluon_layout_dense(words, sc, in_f), ref)


def test_gluon_layout_moves_every_column():
    """A one-hot weight lands in exactly one (word, nibble) of the repacked row, and decodes to its column."""
    K = 512
    for col in (0, 1, 7, 8, 33, 255, 256, 300, 511):
        q = torch.zeros(1, 1, K, dtype=torch.int64)
        q[0, 0, col] = 5  # u = 13
        u = q + 8
        words = (u.view(1, 1, K // 8, 8) << torch.arange(0, 32, 4)).sum(-1)
        packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        scale = torch.ones(1, 1, K // 32, dtype=torch.bfloat16)
        gw, gs = repack_int4_moe_for_gluon(packed, scale, packed, scale)[:2]
        nib = (gw.long().unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF
        assert int((nib != 8).sum()) == 1, col
        dense = gluon_layout_dense(gw, gs, K)
        assert dense[0, 0, col] == 5 and int((dense != 0).sum()) == 1, col


_SM90_COMPILE = r"""
import json, re, sys
from kernels import _int4_moe_gluon as m
from tests.kernels.sm90_compile import compile_gluon_sm90
out = {}
for gated in (True, False):
    for sub in (1, 4):
        sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16" if gated else "*fp32",
               "pairs_ptr": "*i32", "bexp_ptr": "*i32", "P": "i32", "N_OUT": "i32", "num_kb": "i32"}
        sig.update({n: "i32" for n in ("stride_x", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_o")})
        cst = dict(TOPK=8, EVEN=True, SUB=sub, RT=1 if gated else 2)
        k, ptx, log = compile_gluon_sm90(m._moe_w13_gluon_kernel if gated else m._moe_w2_gluon_kernel, sig, cst,
                                         [n for n in sig if n.endswith("_ptr") or n.startswith("stride")],
                                         num_warps=4)
        regs = re.findall(r"Used (\d+) registers", log)
        out[f"{'w13' if gated else 'w2'}_sub{sub}"] = {
            "shared": k.metadata.shared, "bar_sync": len(re.findall(r"\bbar\.sync\b", ptx)),
            "ld_v4": ptx.count("ld.global.v4"), "ld_shared": ptx.count("ld.shared"),
            "mma": sorted(set(re.findall(r"mma\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            "regs": int(regs[-1]) if regs else None,
            "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))}
print(json.dumps(out))
"""


def test_gluon_moe_kernels_compile_for_sm90(tmp_path):
    """Both GEMMs with 1 and 4 sub-blocks per expert block, compiled for sm_90 (PTX + ptxas -v, no GPU): no shared
    memory and no CTA barrier (the weights go from global memory to the MMA), 16-byte global loads, only m16n8k16
    mma.sync, no spills, and few enough registers for 3 CTAs of 4 warps per SM (w13, one sub-block)."""
    pytest.importorskip("triton.experimental.gluon")
    facts = run_sm90_script(tmp_path, _SM90_COMPILE)
    for name, f in facts.items():
        assert f["shared"] == 0 and f["bar_sync"] == 0 and f["ld_shared"] == 0, (name, f)
        assert f["ld_v4"] >= 8 and f["mma"] == ["m16n8k16"] and f["spill_bytes"] == 0, (name, f)
    assert facts["w13_sub1"]["regs"] <= 168, facts


# --- GPU ----------------------------------------------------------------------------------------------------
run_gluon = functools.partial(run_poisoned, int4_moe_gluon)


OPTIONS = [dict(block_pairs=8), dict(block_pairs=16), dict(block_pairs=32), dict(tiles=(1, 1)),
           dict(tiles=(2, 2), block_pairs=32)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T,k,E,D,inter", [(5, 3, 7, 544, 224), (1, 2, 4, 512, 64), (33, 4, 16, 1024, 160)])
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_int4_moe_gluon_vs_reference(T, k, E, D, inter, opts):
    check_layout_path(int4_moe_gluon, repack_int4_moe_for_gluon, T, k, E, D, inter, **opts)


@pytest.fixture(scope="module")
def kimi_gluon():
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    w = kimi_checkpoint_experts()
    return w, repack_int4_moe_for_gluon(*w)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 9, 64])
def test_int4_moe_gluon_kimi_shapes(kimi_gluon, T):
    check_kimi_path(int4_moe_gluon, *kimi_gluon, T)


@gpu
@pytest.mark.gpu
def test_int4_moe_gluon_batch_invariance(kimi_gluon):
    """Token 37 alone, as row 37 of a batch of 64, and with its experts crowded by other tokens (up to 64 pairs on
    an expert: several full and partly empty blocks), in blocks of 8 / 16 / 32 pairs and with 1 or 2 row tiles
    per warp: bitwise equal (DESIGN 3.5)."""
    _, wg = kimi_gluon
    ids, tw = make_routing(64, KIMI["k"], KIMI["E"], device="cuda", seed=7)
    x = torch.randn(64, KIMI["D"], device="cuda").to(torch.bfloat16)
    alone = run_gluon(x[37:38], ids[37:38], tw[37:38], wg)
    for bp in BLOCK_PAIRS:
        for tiles in ((1, 2), (2, 1)):
            batch = run_gluon(x, ids, tw, wg, block_pairs=bp, tiles=tiles)
            assert_bitwise(batch[37], alone[0], f"batch of 64, {bp} pairs, tiles {tiles}")
    ids2 = ids.clone()
    ids2[:, :4] = ids[37, :4]  # 64 pairs on each of four experts
    ids2[:20, 4] = ids[37, 4]  # 20 on a fifth: a 32-pair block with an empty sub-block
    alone2 = run_gluon(x[37:38], ids2[37:38], tw[37:38], wg)
    for bp in BLOCK_PAIRS:
        batch2 = run_gluon(x, ids2, tw, wg, block_pairs=bp)
        assert_bitwise(batch2[37], alone2[0], f"crowded, {bp} pairs")
        assert_bitwise(batch2, run_gluon(x, ids2, tw, wg), f"crowded, {bp} vs 8 pairs, whole batch")
