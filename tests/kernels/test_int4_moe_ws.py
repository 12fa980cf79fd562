"""The warp-specialized one-token MoE GEMMs (kernels/_int4_moe_ws.py, schedule option `ws` of `int4_moe_wgmma`).

CPU: both GEMMs compiled for sm_90 (no GPU needed) into what the design says: per K step the producer's 8 TMA loads
(4 weight boxes, 4 activation boxes) onto one expect of their bytes, no cp.async at all, and in the consumer's loop
one mbarrier wait, the ring kernels' MMAs and shared loads, and one warpgroup barrier (the release) as the only
barrier; setmaxnreg giving the producer few registers, no spills. GPU (marked `gpu`, sm_90 only): bitwise equal to
the ring kernels' direct decode at Kimi shapes, eager and in a CUDA graph with PDL, and against the reference at
awkward shapes.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from kernels.int4_moe_wgmma import int4_moe_wgmma, repack_int4_moe_for_wgmma_steps, resolve_schedule, ws_runs
from tests.kernels.sm90_compile import run_sm90_script
from tests.kernels.test_int4_moe import KIMI, assert_bitwise, check_layout_path, make_routing, run_poisoned
from tests.kernels.test_int4_moe_wgmma import kimi_wgmma, sm90  # noqa: F401 - kimi_wgmma: kimi_both's
from tests.kernels.test_int4_moe_wgmma_steps import kimi_both  # noqa: F401 - a fixture

_SM90_COMPILE_WS = r"""
import json, re
from kernels import _int4_moe_ws as m
from tests.kernels.sm90_compile import compile_gluon_sm90
out = {}
for gated, rt in ((True, 1), (False, 1), (False, 2)):
    for stages, pdl in ((4, True), (2, False), (3, True)):
        sig = {"out_ptr": "*bf16" if gated else "*fp32", "bexp_ptr": "*i64", "P": "i32", "N_OUT": "i32",
               "num_kb": "i32", "rows_step": "i32", "stride_o": "i32",
               "wdesc": f"tensordesc<i32[64,32],{m._W_WS_LAYOUT!r}>",
               "sdesc": f"tensordesc<bf16[64,8],{m._S_WS_LAYOUT!r}>",
               "xdesc": f"tensordesc<bf16[8,64],{m._X_WS_LAYOUT!r}>"}
        cst = dict(TOPK=8, GATED=gated, STAGES=stages, PDL=pdl, ROW_TILES=rt)
        k, ptx, log = compile_gluon_sm90(m._moe_ws_kernel, sig, cst,
                                         [n for n in sig if n.endswith("_ptr") or n.startswith("stride")],
                                         num_warps=4, maxnreg=m.WS_MAXNREG)
        lines = ptx.splitlines()
        loops = []  # innermost loops: TMA loads, wgmma, CTA-wide barriers, mbarrier waits, expect_tx bytes, mbarrier
        # arrivals, 128-thread (one warpgroup's) barriers
        for i, line in enumerate(lines):
            if "Inner Loop Header" not in line:
                continue
            lab = next(mm for j in range(i, -1, -1) if (mm := re.match(r"^(\$L__BB\d+_\d+):", lines[j])))
            end = next(j for j in range(i + 1, len(lines))
                       if re.search(rf"\bbra(\.uni)?\s+{re.escape(lab.group(1))};", lines[j]))
            body = "\n".join(lines[i:end + 1])
            loops.append([len(re.findall(r"cp\.async\.bulk\.tensor\.2d", body)),
                          len(re.findall(r"wgmma\.mma_async", body)), len(re.findall(r"\bbar\.sync\s+\d+;", body)),
                          body.count("mbarrier.try_wait"),
                          [int(v) for v in re.findall(r"expect_tx\S* _, \[[^]]+\], (\d+)", body)],
                          body.count("mbarrier.arrive"), len(re.findall(r"\bbar\.sync\s+\d+, 128;", body))])
        out[f"{'w13' if gated else 'w2'}_s{stages}" + (f"_rt{rt}" if rt > 1 else "") + ("_pdl" if pdl else "")] = {
            "loops": loops, "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.wait_group"),
            "griddep": ptx.count("griddepcontrol"),
            # TMA loads before the last wait for the previous grid (w2 under PDL: the first steps' weights)
            "tma_before_wait": sum(len(re.findall(r"cp\.async\.bulk\.tensor", ln)) for ln in lines[:max(
                [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln], default=0)]),
            "n_wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "registers": int(re.findall(r"Used (\d+) registers", log)[-1]),
            "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log)),
            "setmaxnreg": sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
            "shared": k.metadata.shared, "warps": k.metadata.num_warps, "ld_shared_v4": ptx.count("ld.shared.v4.b32")}
print(json.dumps(out))
"""


def test_ws_kernels_compile_for_sm90(tmp_path):
    """w13 and w2 (also with 2 row tiles: the consumer's K loop inside a loop over them, the producer's one loop over
    both) of the warp-specialized decode, 2-4 ring slots, with and without PDL: a loop of 8 TMA loads onto one
    expect of 2 x (8 KB + 1 KB) + 4 x 1 KB = 22,528 bytes and no barrier (the producer); a loop of 32 m64n8k16 MMAs
    behind one mbarrier wait, with no CTA-wide barrier: the release's warpgroup barrier before its arrival, and
    with Triton 3.6 one more of the warpgroup's before the wait (the consumer); no cp.async; griddepcontrol only with
    PDL, where w13 loads nothing before its wait and w2 only its first steps' weights; the producer's warpgroup given
    PRODUCER_REGS registers; within WS_MAXNREG, no spills; the ring (STAGES x 22 KB) plus its barriers in shared
    memory."""
    pytest.importorskip("triton.experimental.gluon")
    from kernels._int4_moe_ws import PRODUCER_REGS, WS_MAXNREG

    facts = run_sm90_script(tmp_path, _SM90_COMPILE_WS)
    assert len(facts) == 9, facts
    for name, f in facts.items():
        stages = int(re.search(r"_s(\d)", name).group(1))
        producer = [lp for lp in f["loops"] if lp[0]]
        consumer = [lp for lp in f["loops"] if lp[1]]
        assert len(producer) == 1 and producer[0][0] == 8 and producer[0][4] == [22528], (name, f)
        assert producer[0][1] == producer[0][2] == producer[0][6] == 0, (name, f)  # no MMA, no barrier
        assert len(consumer) == 1 and consumer[0][1] == 32 and consumer[0][0] == 0, (name, f)
        assert consumer[0][2] == 0 and 1 <= consumer[0][6] <= 2, (name, f)  # the warpgroup's barriers only
        assert consumer[0][3] == 1 and consumer[0][5] == 1, (name, f)  # one wait, one release
        assert f["cp_async"] == 0 and f["n_wgmma"] == 32, (name, f)
        assert (f["griddep"] > 0) == name.endswith("_pdl"), (name, f)
        # under PDL w13 loads nothing before its wait; w2 puts its first STAGES steps' weights (4 boxes each) in
        # flight before the producer's wait, and the activations (w13's `a`) after it
        assert f["tma_before_wait"] == (4 * stages if name.startswith("w2") and name.endswith("_pdl") else 0), \
            (name, f)
        assert PRODUCER_REGS in f["setmaxnreg"] and f["registers"] <= WS_MAXNREG and f["spill_bytes"] == 0, (name, f)
        ring = stages * (32 * 64 * 2 + 128 * 32 * 4 + 128 * 8 * 2)
        assert ring + 2 * stages * 8 <= f["shared"] <= ring + 1024, (name, f)
        assert f["ld_shared_v4"] == 12, (name, f)  # a lane's words and scales of both tensors, 16 bytes each


def test_ws_runs_where_it_applies():
    """auto_schedule asks for the ws GEMMs at one token inside a graph capture only, with 2 slots (its ring keeps
    4) and w2's 2 row tiles a program (its ring keeps 1); True asks always; they run only on "wgmma_steps" weights,
    direct blocks, one warpgroup, 128 rows. Other values of ws / ws_stages / ws_row_tiles are refused."""
    one = resolve_schedule(1)
    assert one["ws"] == "graphs" and one["ws_stages"] == 2 and one["stages"] == 4
    assert one["ws_row_tiles"] == 2 and one["row_tiles"] == 1
    assert not resolve_schedule(9)["ws"] and not resolve_schedule(10**4)["ws"]
    assert ws_runs(one, "wgmma_steps", True, capturing=True)
    assert not ws_runs(one, "wgmma_steps", True, capturing=False)
    assert ws_runs(resolve_schedule(1, ws=True), "wgmma_steps", True, capturing=False)
    assert not ws_runs(resolve_schedule(1, ws=False), "wgmma_steps", True, capturing=True)
    assert ws_runs(resolve_schedule(1, row_tiles=2, ws_row_tiles=4), "wgmma_steps", True, capturing=True)
    for layout, direct, opts in (("wgmma", True, {}), ("wgmma_steps", False, {}), ("wgmma_steps", True,
                                 dict(warpgroups=2)), ("wgmma_steps", True, dict(rows=64))):
        assert not ws_runs(resolve_schedule(1, ws=True, **opts), layout, direct, capturing=True), (layout, opts)
    for bad in (dict(ws="always"), dict(ws=1), dict(ws_stages=5), dict(ws_stages=True), dict(ws_row_tiles=3),
                dict(ws_row_tiles=True)):
        with pytest.raises(ValueError, match="ws=.*ws_stages=.*ws_row_tiles="):
            resolve_schedule(1, **bad)


# --- GPU ----------------------------------------------------------------------------------------------------
run_ws = functools.partial(int4_moe_wgmma, layout="wgmma_steps", ws=True)
ring = functools.partial(int4_moe_wgmma, layout="wgmma_steps", ws=False)


def graph_kernels(graph: torch.cuda.CUDAGraph) -> list[str]:
    """The names of the kernels one replay of `graph` runs (the profiler's CUDA activity)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("D,inter,E", [(544, 224, 7), (256, 64, 4), (1056, 160, 9)])
@pytest.mark.parametrize("sched", [{}, dict(ws_stages=4), dict(ws_stages=3, pdl=False), dict(ws_row_tiles=1),
                                   dict(ws_row_tiles=4, ws_stages=3), dict(ws_row_tiles=8, pdl=False)])
def test_ws_vs_reference(D, inter, E, sched):
    """One token, awkward shapes (K padded, the last row tiles past the projection) against the reference."""
    check_layout_path(run_ws, repack_int4_moe_for_wgmma_steps, 1, 3, E, D, inter, **sched)


@sm90
@pytest.mark.gpu
def test_ws_equals_the_ring_decode_bitwise(request):
    """Kimi K2.6 shapes, several tokens: the warp-specialized GEMMs give the ring kernels' decode bits (direct
    blocks, PDL, 4 slots) with 2 (auto_schedule's), 3 and 4 slots, without PDL and with 1 and 4 row tiles in w2
    (auto_schedule's: 2); then 20
    replays of a CUDA graph of them and of one captured with auto_schedule, which runs them there (and the ring
    kernels eagerly)."""
    kimi_steps = request.getfixturevalue("kimi_both")[1]  # (`kimi_wgmma`: skipped without sm_90)
    ids, tw = make_routing(5, KIMI["k"], KIMI["E"], device="cuda", seed=31)
    x = torch.randn(5, KIMI["D"], device="cuda").to(torch.bfloat16)
    for t in range(5):
        one = (x[t:t + 1], ids[t:t + 1], tw[t:t + 1])
        ref = run_poisoned(ring, *one, kimi_steps)
        for sched in ({}, dict(ws_stages=3), dict(ws_stages=4), dict(pdl=False), dict(ws_row_tiles=1),
                      dict(ws_row_tiles=4)):
            assert_bitwise(run_poisoned(run_ws, *one, kimi_steps, **sched), ref, f"token {t}, {sched}")
    one = (x[:1], ids[:1], tw[:1])
    ref = run_poisoned(ring, *one, kimi_steps)
    auto = functools.partial(int4_moe_wgmma, layout="wgmma_steps")
    for name, run in (("ws", run_ws), ("auto", auto)):
        out = torch.full_like(one[0], float("nan"))
        run(*one, *kimi_steps, out=out)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(*one, *kimi_steps, out=out)
        for i in range(20):
            out.fill_(float("nan"))
            graph.replay()
            assert_bitwise(out, ref, f"{name}, replay {i}")
        names = graph_kernels(graph)
        assert sum("_moe_ws_kernel" in n for n in names) == 2, (name, names)  # w13 and w2
        assert not any("wgmma_kernel" in n for n in names), (name, names)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        auto(*one, *kimi_steps)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("_moe_w13_wgmma_kernel" in n for n in names) and not any("_moe_ws_kernel" in n for n in names), names
