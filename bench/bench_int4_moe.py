"""Benchmark: one routed-expert INT4 MoE layer at Kimi K2.6 shapes on one GPU (issue 3).

384 experts, 7168 -> 2048 -> 7168, top-8, uniform random routing, bf16 activations, T = 1, 9, 17, 33,
65, 129 tokens. Floor = bytes that must move (packed weights + scales of the experts touched,
plus x and out) / copy bandwidth measured in the same run. Peers, same run, same routing:
  bf16_loop       plain PyTorch, bf16 experts, one matmul pair per touched expert
  int4pack_loop   torch._weight_int4pack_mm (tinygemm, group 32) per touched expert
  triton_eager    our kernels launched eagerly (the headline `ms` replays them from a CUDA graph,
                  since at T=1 host launch overhead of the 4 launches would dominate)
  read_experts    one launch that only reads the touched experts' bytes (`bench/expert_read.py`), timed by the same
                  harness: what streaming those bytes costs at all from one launch (also without --no-peers)
The header also times a one-kernel graph (`graph_launch_ms`): what this harness adds to any launch. `--layers N`
also times each Gluon variant as N layers back to back in one graph (per layer, records <name>_layers).
Sweep (`--sweep`, records named `int4_moe_sweep`): the configurations in SWEEP, each a dict of overrides of
the default launcher options, timed like the default on the same inputs (`params.variant`, `params.config`).
Run from the repo root:  PYTHONPATH=. python bench/bench_int4_moe.py [--sweep] [--configs NAME ..]
                             [--tokens T ..] [--no-peers] [--out FILE]
Short sweeps of the variants with the default's bits, mostly compile time (~1 / ~2 min on an H200):
  --no-peers --tokens 1 9 33 --configs same_bits_core      (or same_bits: 16 configurations)
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

from bench._common import bench_ms, env_info, graph_launch_ms, graph_ms, measure_ceilings, write_jsonl
from bench.expert_read import CONFIGS, read_experts, read_plan
from kernels.int4_moe import _RESIDENT, int4_moe_triton, tile_int4_moe_weights
from kernels.int4_moe_gluon import int4_moe_gluon
from kernels.int4_moe_wgmma import int4_moe_wgmma, resolve_schedule

E, D, INTER, TOPK, G = 384, 7168, 2048, 8, 32
TOKENS = (1, 9, 17, 33, 65, 129)
SWEEP = {  # name -> overrides of the launcher defaults (block_i 32, block_d 64, 4 warps, 3 stages, PTX dequant,
    # prescale, swap, scale_tile, k_unroll 1, one program per tile); programs_per_sm: num_programs = that x SMs
    "bi16_bd32": dict(block_i=16, block_d=32), "bi32_bd32": dict(block_i=32, block_d=32),
    "bi16_bd64": dict(block_i=16, block_d=64), "stages4": dict(num_stages=4), "exact_q": dict(prescale=False),
    "wgmma": dict(swap=False), "wgmma_exact_q": dict(swap=False, prescale=False),
    "bi64_bd128_w8": dict(block_i=64, block_d=128, num_warps=8), "portable_dequant": dict(use_asm=False),
    # same bits as without these options (other schedule or loads): k_unroll K blocks per iteration; scale_tile:
    # a step's scales as one cp.async-able [rows, 8] load; persistent grid (default: SMs x resident CTAs); r128:
    # maxnreg=128; p1/p2: 1/2 programs per SM
    "k_unroll2": dict(k_unroll=2),
    "k_unroll2_r128": dict(k_unroll=2, maxnreg=128),
    "scale_tile": dict(scale_tile=True),
    "scale_tile_k_unroll2": dict(scale_tile=True, k_unroll=2),
    "persistent": dict(persistent=True),
    "persistent_w2": dict(persistent="w2"),
    "persistent_r128": dict(persistent=True, maxnreg=128),
    "persistent_p1": dict(persistent=True, programs_per_sm=1),
    "persistent_p2": dict(persistent=True, programs_per_sm=2),
    "persistent_k2": dict(persistent=True, k_unroll=2),
    "persistent_k2_r128": dict(persistent=True, k_unroll=2, maxnreg=128),
    "persistent_bd32": dict(persistent=True, block_d=32),  # w2 at T=1: 1792 tiles instead of 896
    "scale_tile_persistent": dict(scale_tile=True, persistent=True),
    "scale_tile_persistent_r128": dict(scale_tile=True, persistent=True, maxnreg=128),
    "scale_tile_persistent_k2": dict(scale_tile=True, persistent=True, k_unroll=2),
    "scale_tile_exact_q": dict(scale_tile=True, prescale=False),
    # against the scale_tile default: the old 2-byte scale loads, and tiles / stages / registers again
    "no_scale_tile": dict(scale_tile=False), "stages2": dict(num_stages=2), "r96": dict(maxnreg=96),
    "stages4_r128": dict(num_stages=4, maxnreg=128),
    # pairs per expert block (same bits; default 16, see `kernels.int4_moe.BLOCK_M_CHOICES`)
    "bm16": dict(block_m=16), "bm32": dict(block_m=32), "bm64": dict(block_m=64),
    # the zero point by an MMA on group sums (other bits): one FMA per two weights less, one launch more
    "zp": dict(zp_mma=True), "zp_r96": dict(zp_mma=True, maxnreg=96), "zp_stages4": dict(zp_mma=True, num_stages=4),
    "zp_stages2": dict(zp_mma=True, num_stages=2), "zp_bm32": dict(zp_mma=True, block_m=32),
    # the tiled weight layout (`tile_int4_moe_weights`, same bits): each program streams one contiguous range
    "tiled": dict(tiled=True), "tiled_stages4": dict(tiled=True, num_stages=4),
    "tiled_stages2": dict(tiled=True, num_stages=2), "tiled_persistent": dict(tiled=True, persistent=True),
    "tiled_zp": dict(tiled=True, zp_mma=True), "tiled_bd128": dict(tiled=(32, 128)),
    "tiled_bi64": dict(tiled=(64, 64)), "tiled_bd32": dict(tiled=(32, 32)),
    # independent MMA accumulator chains per K step (other bits): shorter mma.sync dependency chains
    "chains2": dict(acc_chains=2), "chains4": dict(acc_chains=4), "chains2_r96": dict(acc_chains=2, maxnreg=96),
    "chains4_r96": dict(acc_chains=4, maxnreg=96), "chains2_r128": dict(acc_chains=2, maxnreg=128),
    "chains2_tiled": dict(acc_chains=2, tiled=True), "chains2_stages4": dict(acc_chains=2, num_stages=4),
    "chains2_bd128": dict(acc_chains=2, block_d=128), "chains2_w8": dict(acc_chains=2, block_i=64, block_d=128,
                                                                       num_warps=8),
}
CONFIG_GROUPS = {  # --configs GROUP
    "same_bits": [n for n in SWEEP if n.startswith(("k_unroll", "scale_tile", "persistent"))],
    "tiles": ["no_scale_tile", "stages2", "stages4", "stages4_r128", "r96", "bi16_bd32", "bi32_bd32", "bi16_bd64",
              "bi64_bd128_w8"],
    "block_m": ["bm16", "bm32", "bm64"],
    "zp": ["zp", "zp_r96", "zp_stages4", "zp_stages2", "zp_bm32"],
    "chains": ["chains2", "chains4", "chains2_r96", "chains4_r96", "chains2_tiled", "chains2_stages4",
               "chains2_bd128", "chains2_w8"],
    "tiled": ["tiled", "tiled_stages4", "tiled_stages2", "tiled_persistent", "tiled_zp", "tiled_bd128", "tiled_bi64",
              "tiled_bd32"],
    "same_bits_core": ["scale_tile", "k_unroll2", "scale_tile_k_unroll2", "persistent", "persistent_w2",
                       "persistent_p2", "scale_tile_persistent", "scale_tile_persistent_r128"],
}


def gpu_layout_weights(gen):
    """Random words are valid packings; scales small and positive. Layout of repack_int4_moe_for_gpu."""
    def proj(n_out, n_in):
        packed = torch.randint(-2**31, 2**31 - 1, (E, n_out, n_in // 8), generator=gen, device="cuda",
                               dtype=torch.int32)
        scale = (torch.rand(E, n_in // 256, 8, n_out, generator=gen, device="cuda") * 4e-3 + 1e-3)
        return packed, scale.to(torch.bfloat16)
    return (*proj(2 * INTER, D), *proj(D, INTER))


GLUON_VARIANTS = {  # name -> int4_moe_gluon options (--gluon)
    "gluon_np8": dict(block_pairs=8), "gluon_np16": dict(block_pairs=16), "gluon_np32": dict(block_pairs=32),
    "gluon_t11": dict(tiles=(1, 1)), "gluon_t22_np32": dict(tiles=(2, 2), block_pairs=32),
    # the wgmma path (int4_moe_wgmma; its layout has the same shapes at these K, so the same random words serve)
    "wgmma_auto": dict(path="wgmma"),  # int4_moe_wgmma.auto_schedule
    "wgmma_auto_pdl": dict(path="wgmma", pdl=True),  # the same with programmatic dependent launch
    "wgmma_auto_direct": dict(path="wgmma", direct=True),  # T = 1: no grouping launch
    "wgmma_auto_pdl_direct": dict(path="wgmma", pdl=True, direct=True),
    # w2 with 2 / 4 row tiles per program through one ring (fewer, longer programs; at one token 448 -> 224 / 112)
    "wgmma_auto_rt2": dict(path="wgmma", row_tiles=2), "wgmma_auto_rt4": dict(path="wgmma", row_tiles=4),
    # two warpgroups per program, one weight tensor each (twice the warps per SM at a small grid; 1 token: 256 w13)
    "wgmma_auto_wg2": dict(path="wgmma", warpgroups=2),
    "wgmma_auto_wg2_rt2": dict(path="wgmma", warpgroups=2, row_tiles=2),
    # T = 1: w13, w2 and the combine as one persistent launch (other T: auto_schedule's separate launches)
    "wgmma_fused": dict(path="wgmma", fused=True), "wgmma_fused_rt2": dict(path="wgmma", fused=True, row_tiles=2),
    "wgmma_fused_s3": dict(path="wgmma", fused=True, stages=3),
    "wgmma_fused_s3_rt2": dict(path="wgmma", fused=True, stages=3, row_tiles=2),
    # 64 weight rows a program (one accumulator; twice the programs, 4 per SM at the decode ring)
    "wgmma_r64": dict(path="wgmma", rows=64), "wgmma_r64_rt2": dict(path="wgmma", rows=64, row_tiles=2),
    "wgmma_r64_nopdl": dict(path="wgmma", rows=64, pdl=False),
    "wgmma_fused_r64": dict(path="wgmma", fused=True, rows=64),
    "wgmma_fused_r64_rt2": dict(path="wgmma", fused=True, rows=64, row_tiles=2),
    # T = 1: w2's last program of each row range does the combine (no combine launch; other T: auto_schedule's)
    "wgmma_w2c": dict(path="wgmma", w2_combine=True), "wgmma_w2c_rt2": dict(path="wgmma", w2_combine=True, row_tiles=2),
    **{f"wgmma_np{bp}_s{st}": dict(path="wgmma", block_pairs=bp, stages=st) for bp in (8, 16, 32, 64) for st in (2, 4)},
    "wgmma_np8_s3": dict(path="wgmma", block_pairs=8, stages=3),
    "wgmma_np32_s2_r168": dict(path="wgmma", block_pairs=32, stages=2, maxnreg=168),
    "wgmma_tier32": dict(path="wgmma", block_pairs=32, small_pairs=8, stages=2),  # uncapped: 2 CTAs per SM
    "wgmma_tier32_r168": dict(path="wgmma", block_pairs=32, small_pairs=8, stages=2, maxnreg=168),  # 3 CTAs per SM
    # 4 CTAs per SM (<= 128 registers: 8-32 bytes of spills offline)
    "wgmma_tier16_r128": dict(path="wgmma", block_pairs=16, small_pairs=8, stages=2, maxnreg=128),
    "wgmma_np8_s2_r128": dict(path="wgmma", block_pairs=8, stages=2, maxnreg=128),
    # decode with direct blocks and PDL (auto_schedule's) at shallower rings under register caps: more CTAs per SM
    # (uncapped: 2; 168 registers and <= 3 slots: 3; 128 registers and 2 slots: 4)
    "wgmma_np8_s3_pdl_direct": dict(path="wgmma", block_pairs=8, stages=3, pdl=True, direct=True),
    "wgmma_np8_s3_r168_pdl_direct": dict(path="wgmma", block_pairs=8, stages=3, maxnreg=168, pdl=True, direct=True),
    "wgmma_np8_s2_r128_pdl_direct": dict(path="wgmma", block_pairs=8, stages=2, maxnreg=128, pdl=True, direct=True),
    # the same kernels on the step-major order of the words and scales ("wgmma_steps": a program's rows of a K step
    # contiguous; same shapes, so the same random words serve)
    **{f"wgmma_steps_{n}": dict(path="wgmma", layout="wgmma_steps", **o) for n, o in (
        ("auto", {}), ("w2c", dict(w2_combine=True)), ("fused", dict(fused=True)), ("r64", dict(rows=64)),
        ("auto_rt2", dict(row_tiles=2)), ("auto_wg2", dict(warpgroups=2)))},
    # T = 1: the warp-specialized GEMMs (a producer warp's TMA loads; `_int4_moe_ws`) with 2 (auto_schedule's, in a
    # graph: so wgmma_steps_auto's timed replays run them, its eager peer the ring), 3 and 4 ring slots, eagerly too;
    # and the ring kernels alone (4 slots)
    **{f"wgmma_steps_ws{n}": dict(path="wgmma", layout="wgmma_steps", ws=True, ws_stages=k)
       for n, k in (("", 2), ("_s3", 3), ("_s4", 4))},
    "wgmma_steps_ring": dict(path="wgmma", layout="wgmma_steps", ws=False),
    # and w2's 128-row tiles 1 / 2 (auto_schedule's) / 4 to a program through its ring (at one token 448 / 224 / 112
    # programs of 8 / 16 / 32 steps: 2 programs per SM hold 224 at once)
    **{f"wgmma_steps_ws_rt{k}": dict(path="wgmma", layout="wgmma_steps", ws=True, ws_row_tiles=k) for k in (1, 2, 4)},
}


def gluon_layout_weights(gen):
    """Random words in the gluon layout (`repack_int4_moe_for_gluon`: [E, N, K/8] words, [E, N, K/32] scales)."""
    def proj(n_out, n_in):
        packed = torch.randint(-2**31, 2**31 - 1, (E, n_out, n_in // 8), generator=gen, device="cuda",
                               dtype=torch.int32)
        scale = torch.rand(E, n_out, n_in // G, generator=gen, device="cuda") * 4e-3 + 1e-3
        return packed, scale.to(torch.bfloat16)
    return (*proj(2 * INTER, D), *proj(D, INTER))


def routing(T, gen, pool=0):
    """Uniform top-8 routing over the E experts, or with `pool` over the first `pool` of them only (a verify
    step's tree tokens crowd a few experts)."""
    ids = torch.rand(T, pool or E, generator=gen, device="cuda").topk(TOPK, dim=-1).indices
    w = torch.rand(T, TOPK, generator=gen, device="cuda") + 0.1
    return ids, (w / w.sum(-1, keepdim=True) * 2.827).float()


def per_expert_loop(x, ids, w, expert_fn):
    """Group the (token, expert) pairs by expert on the host, then per touched expert e y = expert_fn(e, x rows of
    its pairs), added into the output with the routing weights (fp32), in the input's dtype."""
    T = x.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        pairs = order[start:start + c]
        start += c
        tok = pairs // TOPK
        out.index_add_(0, tok, expert_fn(e, x[tok]).float() * w.reshape(-1)[pairs, None])
    return out.to(x.dtype)


def bf16_loop(x, ids, w, w13, w2):
    """Plain PyTorch: bf16 matmuls per touched expert."""
    def expert(e, xt):
        h = xt @ w13[e].T
        return (F.silu(h[:, :INTER]) * h[:, INTER:]) @ w2[e].T

    return per_expert_loop(x, ids, w, expert)


def int4pack_loop(x, ids, w, p13, sz13, p2, sz2):
    """torch._weight_int4pack_mm (tinygemm) per touched expert."""
    def expert(e, xt):
        h = torch._weight_int4pack_mm(xt.contiguous(), p13[e], G, sz13[e])
        a = (F.silu(h[:, :INTER]) * h[:, INTER:]).contiguous()
        return torch._weight_int4pack_mm(a, p2[e], G, sz2[e])

    return per_expert_loop(x, ids, w, expert)


def make_int4pack(gen):
    """tinygemm layout per expert (random nibbles; timing only)."""
    def proj(n_out, n_in):
        packed, sz = [], []
        for _ in range(E):
            u8 = torch.randint(0, 256, (n_out, n_in // 2), generator=gen, device="cuda", dtype=torch.uint8)
            packed.append(torch._convert_weight_to_int4pack(u8, 8))
            s = torch.rand(n_in // G, n_out, 1, generator=gen, device="cuda") * 4e-3 + 1e-3
            sz.append(torch.cat([s, torch.zeros_like(s)], -1).to(torch.bfloat16))
        return packed, sz
    return (*proj(2 * INTER, D), *proj(D, INTER))


def sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def launcher_options(overrides: dict) -> dict:
    """SWEEP entry -> int4_moe_triton keywords (programs_per_sm -> num_programs; `tiled` is the weights' business,
    see `weights_for`)."""
    kw = {k: v for k, v in overrides.items() if k != "tiled"}
    if "programs_per_sm" in kw:
        kw["num_programs"] = kw.pop("programs_per_sm") * sm_count()
    return kw


@functools.cache
def _tiled(w, tiles):
    return tile_int4_moe_weights(*w, block_i=tiles[0], block_d=tiles[1])


def weights_for(w, overrides: dict):
    """The "gpu" layout weights, or (SWEEP `tiled`: True = the default tiles, or (block_i, block_d)) the same words
    in the tiled layout, made once per tile shape (another 9.5 GB each)."""
    tiles = overrides.get("tiled")
    if not tiles:
        return w
    return _tiled(w, (32, 64) if tiles is True else tuple(tiles))


def best_read(weights, routings) -> tuple[float, tuple]:
    """(ms, config) of the fastest of expert_read.CONFIGS (chunk, block, warps) at reading the experts of each routing
    in `routings` one after the other, one launch each, replayed from one CUDA graph."""
    best = None
    for chunk, block, warps in CONFIGS:
        calls = []
        for ids in routings:
            plan = read_plan(weights, ids, chunk)
            calls.append(functools.partial(read_experts, plan, read_experts(plan), block=block, warps=warps))
        ms = graph_ms(lambda calls=calls: [c() for c in calls])
        best = min(best or (ms, (chunk, block, warps)), (ms, (chunk, block, warps)))
    return best


def layers_record(args, T, gen, path, opts, wgl, per_expert, ceil, info, gname, config):
    """args.layers layers of T tokens back to back in one CUDA graph, each with its own tokens and routing (so its
    own experts' weights), timed as one replay: the per-layer time and floor (bytes / copy bandwidth, averaged)."""
    run = int4_moe_wgmma if path == "wgmma" else int4_moe_gluon
    calls, reads, nbytes = [], [], 0
    for _ in range(args.layers):
        ids, tw = routing(T, gen, args.pool)
        x = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
        calls.append(functools.partial(run, x, ids, tw, *wgl, out=torch.empty_like(x), **opts))
        reads.append(ids)
        nbytes += int(ids.unique().numel()) * per_expert + 2 * x.numel() * x.element_size() + ids.numel() * 12
    try:
        ms = graph_ms(lambda: [c() for c in calls]) / args.layers
        read_ms = best_read(wgl, reads)[0] / args.layers
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        print(f"T={T} {gname} x {args.layers} layers: {exc!r}"[:600], flush=True)
        return
    floor_ms = nbytes / args.layers / (ceil["copy_bw_GBps"] * 1e9) * 1e3
    params = dict(T=T, E=E, D=D, I=INTER, topk=TOPK, layers=args.layers, bytes=nbytes // args.layers, pool=args.pool,
                  timing="cuda_graph_replay_per_layer", variant=gname, config=config)
    write_jsonl(args.out, [dict(name=f"int4_moe_{path}_layers", params=params, **info, ms=ms, floor_ms=floor_ms,
                                ratio=floor_ms / ms, peers={"read_experts": read_ms}, **ceil)])
    print(f"{T:>4} {'':>7} {ms:8.4f} {floor_ms:8.4f} {floor_ms / ms:6.3f} {nbytes / args.layers / ms / 1e6:6.0f}  "
          f"per layer of {args.layers} back to back (read_experts {read_ms:.4f} ms, {floor_ms / read_ms:.3f})  "
          f"{gname}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/int4_moe.jsonl")
    ap.add_argument("--sweep", action="store_true", help="also time every configuration in SWEEP")
    ap.add_argument("--configs", nargs="+", default=None, choices=sorted([*SWEEP, *CONFIG_GROUPS]), metavar="NAME",
                    help="time these SWEEP configurations (or groups) besides the default (implies --sweep)")
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help=f"token counts (default {TOKENS})")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--pool", type=int, default=0, help="route among the first POOL experts only (default: all)")
    ap.add_argument("--gluon", nargs="*", default=None, choices=sorted(GLUON_VARIANTS), metavar="NAME",
                    help="also time the Gluon paths (int4_moe_gluon, int4_moe_wgmma: the wgmma_* names) in these "
                    "GLUON_VARIANTS (none given: all); records int4_moe_gluon / int4_moe_wgmma with the Triton "
                    "default as a peer")
    ap.add_argument("--layers", type=int, default=0, help="also time each Gluon variant as LAYERS layers back to "
                    "back in one CUDA graph (each its own tokens and routing, so its own experts' weights; as the "
                    "model runs its layers), recorded per layer as <name>_layers; 0: not")
    args = ap.parse_args()
    names = [n for c in args.configs for n in CONFIG_GROUPS.get(c, [c])] if args.configs else []
    if args.sweep and not names:
        names = list(SWEEP)
    info = env_info()
    ceil = measure_ceilings()
    ceil["graph_launch_ms"] = graph_launch_ms()
    print(f"{info['gpu']}  copy {ceil['copy_bw_GBps']:.0f} GB/s  bf16 mm {ceil['mm_tflops']:.0f} TFLOP/s  a one-kernel "
          f"graph {ceil['graph_launch_ms'] * 1e3:.1f} us", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = tuple(gpu_layout_weights(gen))
    per_expert = sum(t[0].numel() * t.element_size() for t in w)
    gluon = (args.gluon or list(GLUON_VARIANTS)) if args.gluon is not None else []
    wgl = tuple(gluon_layout_weights(gen)) if gluon else None
    peers_w = {}
    if not args.no_peers:
        t0 = time.time()
        w13_bf = torch.empty(E, 2 * INTER, D, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
        w2_bf = torch.empty(E, D, INTER, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
        peers_w["bf16"] = (w13_bf, w2_bf)
        try:
            peers_w["int4pack"] = make_int4pack(gen)
        except Exception as exc:  # noqa: BLE001 - record why the peer is missing
            print(f"int4pack peer unavailable: {exc!r}", flush=True)
        print(f"peer weights ready in {time.time() - t0:.1f}s", flush=True)
    print(f"{'T':>4} {'experts':>7} {'ms':>8} {'floor':>8} {'ratio':>6} {'GB/s':>6}  peers (ms)", flush=True)
    for T in args.tokens:
        ids, tw = routing(T, gen, args.pool)
        x = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty_like(x)
        touched = int(ids.unique().numel())
        nbytes = touched * per_expert + 2 * x.numel() * x.element_size() + ids.numel() * 12
        floor_ms = nbytes / (ceil["copy_bw_GBps"] * 1e9) * 1e3
        read_ms, read_cfg = best_read(w, [ids])
        print(f"{T:>4} {touched:>7} {read_ms:8.4f} {floor_ms:8.4f} {floor_ms / read_ms:6.3f} "
              f"{nbytes / read_ms / 1e6:6.0f}  read of the touched experts' bytes (peer read_experts, chunk / block / "
              f"warps {read_cfg})", flush=True)
        default_ms = None
        for name in [None, *names]:
            overrides = {} if name is None else SWEEP[name]
            kw = launcher_options(overrides)
            fn = functools.partial(int4_moe_triton, x, ids, tw, *weights_for(w, overrides), out=out, **kw)
            try:
                ms = graph_ms(fn)
                eager = bench_ms(fn)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                print(f"T={T} {name}: {exc!r}"[:300], flush=True)
                continue
            peers = {"triton_eager": eager, "read_experts": read_ms}
            if name is None:
                default_ms = ms
                if "bf16" in peers_w:
                    peers["bf16_loop"] = bench_ms(functools.partial(bf16_loop, x, ids, tw, *peers_w["bf16"]))
                if "int4pack" in peers_w:
                    peers["int4pack_loop"] = bench_ms(
                        functools.partial(int4pack_loop, x, ids, tw, *peers_w["int4pack"]))
            params = dict(T=T, E=E, D=D, I=INTER, topk=TOPK, experts_touched=touched, bytes=nbytes, pool=args.pool,
                          read_config=read_cfg, timing="cuda_graph_replay", variant=name or "default",
                          config={**kw, **{k: v for k, v in overrides.items() if k == "tiled"}} or "default")
            rec = dict(name="int4_moe" if name is None else "int4_moe_sweep", params=params,
                       **info, ms=ms, floor_ms=floor_ms, ratio=floor_ms / ms, peers=peers, **ceil)
            write_jsonl(args.out, [rec])  # one line at a time: a run cut short keeps what it measured
            pe = "  ".join(f"{k}={v:.3f}" for k, v in peers.items())
            print(f"{T:>4} {touched:>7} {ms:8.4f} {floor_ms:8.4f} {floor_ms / ms:6.3f} {nbytes / ms / 1e6:6.0f}  "
                  f"{pe}  {name or ''}", flush=True)
        for gname in gluon:
            opts = dict(GLUON_VARIANTS[gname])
            path = opts.pop("path", "gluon")
            fn = functools.partial(int4_moe_wgmma if path == "wgmma" else int4_moe_gluon, x, ids, tw, *wgl, out=out,
                                   **opts)
            try:
                ms, eager = graph_ms(fn), bench_ms(fn)
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                print(f"T={T} {gname}: {exc!r}"[:600], flush=True)
                continue
            peers = {"gluon_eager": eager, "read_experts": read_ms,
                     **({"triton_default": default_ms} if default_ms else {})}
            if path == "wgmma":
                config = {**resolve_schedule(ids.numel(), **{k: v for k, v in opts.items() if k != "layout"}),
                          "layout": opts.get("layout", "wgmma")}
            else:
                config = opts or "default"
            params = dict(T=T, E=E, D=D, I=INTER, topk=TOPK, experts_touched=touched, bytes=nbytes, pool=args.pool,
                          read_config=read_cfg, timing="cuda_graph_replay", variant=gname, config=config)
            write_jsonl(args.out, [dict(name=f"int4_moe_{path}", params=params, **info, ms=ms, floor_ms=floor_ms,
                                        ratio=floor_ms / ms, peers=peers, **ceil)])
            pe = "  ".join(f"{k}={v:.3f}" for k, v in peers.items())
            print(f"{T:>4} {touched:>7} {ms:8.4f} {floor_ms:8.4f} {floor_ms / ms:6.3f} {nbytes / ms / 1e6:6.0f}  "
                  f"{pe}  {gname}", flush=True)
            if args.layers:
                layers_record(args, T, gen, path, opts, wgl, per_expert, ceil, info, gname, config)
    for (kernel, _, options), programs in _RESIDENT.items():  # default persistent grids: registers / smem bound
        shown = {k: v for k, v in options if k in ("BLOCK_I", "BLOCK_D", "K_UNROLL", "num_warps", "num_stages",
                                                  "maxnreg", "PRESCALE", "SWAP", "SCALE_TILE")}
        print(f"persistent {kernel} {shown}: {programs} programs ({programs / sm_count():g} per SM)", flush=True)


if __name__ == "__main__":
    main()
