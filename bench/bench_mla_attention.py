"""Benchmark: absorbed-MLA tree verify at Kimi K2.6 shapes on one GPU (issue 3).

64 heads, latent 512 + rope 64, bf16 paged cache (page 64, pages shuffled), prefix 1k/4k/32k, tree
9/33/65 nodes (random trees), batch 1 and 16 sessions (`--prefix`/`--tree`/`--batch` pick others, e.g.
prefixes off the 512 grid; `--quick`: 1000/1024/4000/4096, no 32k). Floor = max(bytes / copy bandwidth,
flops / bf16 matmul rate), both measured in the same run; bytes = the sessions' KV rows + q + out,
flops = 2 * 64 * (512 + 576) per (query row, visible KV row), ancestors only for the tree part.
`ms` replays our 1-2 launches from a CUDA graph. Peers, same run (their K/V are handed over
already gathered into contiguous [B, 1, L+n, 576] tensors, a head start ours does not get):
  flex_attention  torch.compile'd FlexAttention with the tree block mask (GQA, Dv = 512)
  sdpa_dense      F.scaled_dot_product_attention with a dense boolean mask (skipped when its math
                  fallback would need more than ~24 GB)
`--chunk-rule balanced legacy` times each case under both KV chunk rules (same inputs, one record
each, params.chunk_rule; params.chunks = KV chunks over all query rows, each one a CTA).
`--block-n 32 64` times each key-tile size (params.block_n; a reduction-order knob like the chunk rule).
`--impl triton gluon gluon_ws gluon_seesaw` times each tile kernel on the same inputs (params.impl; gluon = the sm_90
kernel of `kernels/_mla_gluon.py`, which computes S once per tile; gluon_ws = the experimental warp-specialized one of
`kernels/_mla_gluon_ws.py`; gluon_seesaw = FlashMLA's two-warpgroup schedule, `kernels/_mla_gluon_seesaw.py`; the
choices are `kernels.mla_attention.IMPLS`).
`--persistent on off` times the gluon and gluon_seesaw kernels as one program per SM walking its share of the (query
tile, chunk) items (`kernels/_mla_gluon_persistent.py`, `kernels/_mla_gluon_seesaw_persistent.py`; same bits) and as
one program per item (params.persistent).
`--nch 8 16` times other chunk-count caps (params.config.nch; like the chunk rule, a deployment's reduction order);
`--c-min 512 1024` other base chunk sizes (params.config.c_min: fewer, longer chunks below NCH * C_MIN keys, so less
partial traffic and fixed cost per row at 4k prefixes, and fewer programs for one token; also a reduction order).
`--partials fp32 out` times multi-chunk rows with their partial O in fp32 and in the output's dtype (bf16: half the
partial bytes written and read back; params.partials; another reduction-order knob: it rounds each partial once more).
`--fold off on` times the Triton and gluon tile kernels as one program per (query tile, chunk) + the combine kernel
and as one program per query tile folding its chunks (params.fold; the same bits).
`--layers N` also times each combination as N layers back to back in one CUDA graph (per layer; name
mla_attention_layers, params.layers): every layer its own KV pool, queries and output over the same block table, cu and
trees, as a model's layers run its attention; the one-kernel graph's launch cost (~4.7 us on the H200, `graph_launch_ms`
in the record) is then paid once for N launches, and L2 still starts cold (do_bench clears it before each replay).
`--vsplit 1 2 4 auto` times the seesaw grid kernel with each (query tile, chunk)'s value columns split over that many
programs (params.vsplit; S computed in each, the same bits; auto: the most of 4 and 2 that keeps one program per SM).
`--skip-phantom on off` times the seesaw grid kernel with an odd chunk's phantom tile skipped (neither loaded nor
multiplied) and loaded zero-filled and multiplied as before the forty-eighth session (params.skip_phantom; the same
bits).
`--table-len 0 131072` times each case with the block table as wide as the case needs (0) and as wide as a serving
pool's rows for that many keys (params.table_len): the launch's chunk grid is sized by the table's width (graph
capturable), so in serving a short row's programs past its last chunk exist and return early; the kernel bench's tight
table never shows what they cost.
`--tma on off` times the gluon kernel with and without TMA loads of whole committed tiles (params.tma; same bits;
TMA runs with pages of 16 or 32 rows or a multiple of 64, `--page`, default 64; the serving page size is 16).
Run from the repo root:  PYTHONPATH=. python bench/bench_mla_attention.py [--sweep] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

from bench._common import bench_ms, env_info, graph_launch_ms, graph_ms, measure_ceilings, write_jsonl
from kernels.mla_attention import (
    CHUNK_RULES,
    DEFAULT_BLOCK_N,
    DEFAULT_CHUNK_RULE,
    DEFAULT_FOLD,
    DEFAULT_IMPL,
    DEFAULT_PARTIALS,
    DEFAULT_SKIP_PHANTOM,
    DEFAULT_VSPLIT,
    IMPLS,
    PARTIALS,
    chunk_spans,
    mla_attention_triton,
)
from kernels.tree_mask import ancestor_mask, pack_mask_bits

H, DL, DR, PAGE = 64, 512, 64, 64
SCALE = 192**-0.5 * (0.1 * torch.log(torch.tensor(64.0)).item() + 1) ** 2
PREFIX = (1024, 4096, 32768)
QUICK_PREFIX = (1000, 1024, 4000, 4096)  # on and off the 512-key grid of the legacy chunk rule
TREE = (9, 33, 65)
BATCH = (1, 16)
SWEEP = [  # (block_n, num_warps, num_stages, nch, c_min) beside the default (see kernels.mla_attention)
    (32, 8, 2, 16, 512), (64, 8, 2, 16, 512), (64, 8, 3, 16, 512), (128, 8, 1, 16, 512), (128, 8, 2, 16, 512),
    (64, 8, 2, 32, 256)]
# head dim 576 leaves Inductor's autotuner no valid default config (seen on the H200, 2026-11-30);
# BLOCK_M must hold the whole GQA group of 64 query heads
FLEX_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 16, "num_stages": 1, "num_warps": 4}
FLEX_BUDGET_S = 120.0  # stop compiling FlexAttention for new shapes after this much time


def wide_table(args, table_len, page=PAGE):
    """The case's arguments with its block table widened to table_len keys (a serving pool's row width); the new
    columns hold page 0, which no query reads (they lie past every position)."""
    bt = args[3]
    cols = -(-table_len // page)
    if cols <= bt.shape[1]:
        return args
    wide = torch.zeros(bt.shape[0], cols, dtype=bt.dtype, device=bt.device)
    wide[:, : bt.shape[1]] = bt
    return (*args[:3], wide, *args[4:])


def make_case(B, L, n, gen, cgen, page=PAGE):
    parents = []
    for _ in range(B):
        parents.append([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
    parent = torch.tensor(parents)
    anc = ancestor_mask(parent)  # [B, n, n] bool
    depth = anc.sum(-1) - 1  # [B, n]
    bits = pack_mask_bits(anc).reshape(B * n, -1)
    if bits.shape[1] == 1:
        bits = torch.cat([bits, torch.zeros_like(bits)], 1)
    P = -(-(L + n) // page)
    pages = torch.randperm(B * P, generator=gen)
    bt = pages.view(B, P).int()
    kv = torch.randn(B * P * page, DL + DR, generator=cgen, device="cuda").to(torch.bfloat16)
    q = torch.randn(B * n, H, DL, generator=cgen, device="cuda").to(torch.bfloat16)
    qpe = torch.randn(B * n, H, DR, generator=cgen, device="cuda").to(torch.bfloat16)
    cu = torch.arange(0, B * n + 1, n, dtype=torch.int32)
    pre = torch.full((B,), L, dtype=torch.int32)
    dev = dict(device="cuda")
    args = (q, qpe, kv, bt.to(**dev), page, cu.to(**dev), pre.to(**dev), bits.to(**dev))
    return args, anc.to(**dev), depth


def layer_copies(args, count, cgen):
    """`count` more layers of a case: each its own KV pool, queries and output (random, like the first), sharing the
    block table, cu, prefix lengths and trees (one stacked cache's layers)."""
    q, qpe, kv, *rest = args
    fresh = lambda t: torch.randn(t.shape, generator=cgen, device="cuda").to(t.dtype)  # noqa: E731
    return [(fresh(q), fresh(qpe), fresh(kv), *rest) for _ in range(count)]


def run_all(calls) -> None:
    for call in calls:
        call()


def dense_mask_mod(dense):
    """FlexAttention mask_mod reading a dense [B, n, L+n] visibility tensor."""
    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b, q_idx, kv_idx]
    return mask_mod


def peer_inputs(args, B, L, n):
    q, qpe, kv, bt, page, _, _, _ = args
    idx = torch.arange(L + n, device="cuda")
    slots = bt[:, idx // page].long() * page + idx % page  # [B, L+n]
    k = kv[slots][:, None]  # [B, 1, L+n, 576] contiguous
    qf = torch.cat([q, qpe], -1).view(B, n, H, DL + DR).transpose(1, 2)  # [B, H, n, 576]
    return qf, k, k[..., :DL]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/mla_attention.jsonl")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--flex-budget", type=float, default=FLEX_BUDGET_S, help="seconds of FlexAttention compiles")
    ap.add_argument("--chunk-rule", nargs="+", default=[DEFAULT_CHUNK_RULE], choices=sorted(CHUNK_RULES),
                    help="KV chunk rules to time, each case under each (peers run once per case)")
    ap.add_argument("--block-n", nargs="+", type=int, default=[None], help="key tile sizes (default: the kernel's)")
    ap.add_argument("--impl", nargs="+", default=[DEFAULT_IMPL], choices=IMPLS, help="tile kernels to time")
    ap.add_argument("--batch", nargs="+", type=int, default=list(BATCH))
    ap.add_argument("--prefix", nargs="+", type=int, default=None, help=f"committed lengths (default {PREFIX})")
    ap.add_argument("--tree", nargs="+", type=int, default=list(TREE), help="tree sizes, <= 128 nodes")
    ap.add_argument("--quick", action="store_true", help=f"prefixes {QUICK_PREFIX} (unless --prefix)")
    ap.add_argument("--tma", nargs="+", default=["default"], choices=("default", "on", "off"),
                    help="gluon: TMA loads of whole committed tiles (default: the kernel's GLUON_TMA)")
    ap.add_argument("--layers", type=int, default=0, help="also time each combination as LAYERS layers back to "
                    "back in one graph (per layer, name mla_attention_layers); 0: not")
    ap.add_argument("--page", type=int, default=PAGE, help="KV page size (rows)")
    ap.add_argument("--persistent", nargs="+", default=["default"], choices=("default", "on", "off"),
                    help="gluon: one program per SM over the (query tile, chunk) items, or one per item")
    ap.add_argument("--nch", nargs="+", type=int, default=[None],
                    help="most KV chunks per row (a reduction-order knob like the chunk rule; default the kernel's)")
    ap.add_argument("--c-min", nargs="+", type=int, default=[None],
                    help="base KV chunk size in keys (a reduction-order knob like --nch; default the kernel's)")
    ap.add_argument("--partials", nargs="+", default=["default"], choices=("default", *PARTIALS),
                    help="dtype of a multi-chunk row's partial O (default: the kernel's DEFAULT_PARTIALS)")
    ap.add_argument("--fold", nargs="+", default=["default"], choices=("default", "on", "off", "auto"),
                    help="triton / gluon: one program per query tile folding its chunks (default: DEFAULT_FOLD)")
    ap.add_argument("--skip-phantom", nargs="+", default=["default"], choices=("default", "on", "off"),
                    help="the seesaw grid kernel's skip of an odd chunk's phantom tile, each in turn")
    ap.add_argument("--vsplit", nargs="+", default=["default"], choices=("default", "1", "2", "4", "auto"),
                    help="gluon_seesaw: programs per (query tile, chunk) splitting its value columns, the same bits "
                         "(default: the kernel's DEFAULT_VSPLIT)")
    ap.add_argument("--table-len", nargs="+", type=int, default=[0],
                    help="block-table width in keys (0: what the case needs; e.g. 131072: a 128k serving pool's rows)")
    args_cli = ap.parse_args()
    prefixes = args_cli.prefix or (QUICK_PREFIX if args_cli.quick else PREFIX)
    info = env_info()
    ceil = measure_ceilings()
    print(f"{info['gpu']}  copy {ceil['copy_bw_GBps']:.0f} GB/s  bf16 mm {ceil['mm_tflops']:.0f} TFLOP/s", flush=True)
    flex = None
    flex_spent = 0.0
    if not args_cli.no_peers:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    if args_cli.layers:
        ceil["graph_launch_ms"] = graph_launch_ms()
        print(f"one-kernel graph {ceil['graph_launch_ms'] * 1e3:.1f} us", flush=True)
    gen = torch.Generator().manual_seed(0)
    cgen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'B':>3} {'L':>6} {'n':>3} {'rule':>8} {'chunks':>6} {'ms':>8} {'floor':>8} {'ratio':>6} {'TFLOP/s':>7}"
          "  peers (ms)", flush=True)
    for B in args_cli.batch:
        for L in prefixes:
            for n in args_cli.tree:
                args, anc, depth = make_case(B, L, n, gen, cgen, args_cli.page)
                nbytes = B * (L + n) * (DL + DR) * 2 + B * n * H * (DL + DR) * 2 + B * n * H * DL * 2
                flops = 2 * H * (DL + DR + DL) * float((L + depth + 1).sum())
                floor_ms = max(nbytes / (ceil["copy_bw_GBps"] * 1e9), flops / (ceil["mm_tflops"] * 1e12)) * 1e3
                out = torch.empty_like(args[0])
                more = layer_copies(args, args_cli.layers - 1, cgen) if args_cli.layers > 1 else []
                outs = [torch.empty_like(a[0]) for a in more]
                cfgs = [None] + (SWEEP if args_cli.sweep and n != 33 else [])
                gluon_knobs = [(tm, pm) for tm in args_cli.tma for pm in args_cli.persistent]
                combos = [(r, c, b, i, tm, pm, nch, cm, pa, fo, tl, vs, sp) for r in args_cli.chunk_rule for c in cfgs
                          for b in args_cli.block_n for i in args_cli.impl
                          for tm, pm in (gluon_knobs if i in ("gluon", "gluon_seesaw", "auto")
                                         else [("default", "default")])
                          for nch in args_cli.nch for cm in args_cli.c_min for pa in args_cli.partials
                          for fo in (args_cli.fold if i in ("triton", "gluon", "auto") else ["default"])
                          for tl in args_cli.table_len
                          for vs in (args_cli.vsplit if i in ("gluon_seesaw", "auto") else ["default"])
                          for sp in (args_cli.skip_phantom if i in ("gluon_seesaw", "auto") else ["default"])]
                onoff = {"default": None, "on": True, "off": False}
                for combo in combos:
                    rule, cfg, bn, impl, tm, pm, nch, cm, pa, fo, tl, vs, sp = combo
                    case = wide_table(args, tl, args_cli.page)
                    kw = {} if cfg is None else dict(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2], nch=cfg[3],
                                                     c_min=cfg[4])
                    if bn is not None:
                        kw["block_n"] = bn
                    if nch is not None:
                        kw["nch"] = nch
                    if cm is not None:
                        kw["c_min"] = cm
                    knobs = {k: kw[k] for k in ("block_n", "nch", "c_min") if k in kw}
                    chunks = sum(len(chunk_spans(L + int(d), rule, **knobs)) for d in depth.flatten().tolist())
                    opts = dict(chunk_rule=rule, impl=impl, tma=onoff[tm], persistent=onoff[pm],
                                partials=None if pa == "default" else pa, fold="auto" if fo == "auto" else onoff[fo],
                                **({} if vs == "default" else {"vsplit": vs if vs == "auto" else int(vs)}),
                                **({} if sp == "default" else {"skip_phantom": onoff[sp]}), **kw)
                    fn = functools.partial(mla_attention_triton, *case, SCALE, out=out, **opts)
                    try:
                        ms = graph_ms(fn)
                        eager = bench_ms(fn)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"B={B} L={L} n={n} rule={rule} cfg={cfg}: {exc!r}"[:300], flush=True)
                        continue
                    peers = {"triton_eager": eager}
                    first = combo == combos[0]  # the peers run once per case, beside the first combination
                    if first and not args_cli.no_peers:
                        qf, k, v = peer_inputs(args, B, L, n)
                        dense = torch.ones(B, n, L + n, dtype=torch.bool, device="cuda")
                        dense[:, :, L:] = anc
                        if flex is not None and flex_spent < args_cli.flex_budget:
                            t0 = time.time()
                            try:
                                bm = create_block_mask(dense_mask_mod(dense), B, None, n, L + n, device="cuda")
                                peers["flex_attention"] = bench_ms(functools.partial(
                                    flex, qf, k, v, block_mask=bm, scale=SCALE, enable_gqa=True,
                                    kernel_options=FLEX_OPTIONS))
                            except Exception as exc:  # noqa: BLE001
                                peers["flex_attention_error"] = repr(exc)[:200]
                            flex_spent += time.time() - t0
                        if B * H * n * (L + n) * 4 + B * H * (L + n) * (DL + DR) * 2 * 2 < 24e9:
                            try:
                                peers["sdpa_dense"] = bench_ms(functools.partial(
                                    F.scaled_dot_product_attention, qf, k, v, attn_mask=dense[:, None], scale=SCALE,
                                    enable_gqa=True))
                            except Exception as exc:  # noqa: BLE001
                                peers["sdpa_dense_error"] = repr(exc)[:200]
                        del qf, k, v, dense
                    params = dict(batch=B, prefix=L, tree=n, heads=H, latent=DL, rope=DR, page=args_cli.page,
                                  bytes=nbytes, flops=flops, timing="cuda_graph_replay", config=kw or "default",
                                  chunk_rule=rule, chunks=chunks, block_n=kw.get("block_n", DEFAULT_BLOCK_N), impl=impl,
                                  tma=tm if impl in ("gluon", "gluon_seesaw", "auto") else None,
                                  persistent=pm if impl in ("gluon", "gluon_seesaw", "auto") else None,
                                  partials=DEFAULT_PARTIALS if pa == "default" else pa,
                                  fold=(DEFAULT_FOLD if fo == "default" else "auto" if fo == "auto" else fo == "on")
                                  if impl in ("triton", "gluon", "auto") else None,
                                  table_len=max(tl, args[3].shape[1] * args_cli.page),
                                  vsplit=(DEFAULT_VSPLIT if vs == "default" else vs if vs == "auto" else int(vs))
                                  if impl in ("gluon_seesaw", "auto") else None,
                                  skip_phantom=(DEFAULT_SKIP_PHANTOM if sp == "default" else sp == "on")
                                  if impl in ("gluon_seesaw", "auto") else None)
                    rec = dict(name="mla_attention" if cfg is None else "mla_attention_sweep", params=params,
                               **info, ms=ms, floor_ms=floor_ms, ratio=floor_ms / ms, peers=peers, **ceil)
                    write_jsonl(args_cli.out, [rec])  # one line at a time: a cut-off run keeps what it measured
                    pe = "  ".join(f"{a}={b:.3f}" for a, b in peers.items() if isinstance(b, float))
                    print(f"{B:>3} {L:>6} {n:>3} {rule:>8} {chunks:>6} {ms:8.4f} {floor_ms:8.4f} {floor_ms / ms:6.3f} "
                          f"{flops / ms / 1e9:7.0f}  {impl} tma={tm} persistent={pm} partials={pa} fold={fo} "
                          f"table={params['table_len']} vsplit={vs} skip_phantom={sp}  {pe}  "
                          f"{kw or ''}", flush=True)
                    if more:
                        calls = [fn] + [functools.partial(mla_attention_triton, *wide_table(a, tl, args_cli.page),
                                                          SCALE, out=o, **opts) for a, o in zip(more, outs)]
                        per_layer = graph_ms(functools.partial(run_all, calls)) / args_cli.layers
                        write_jsonl(args_cli.out, [dict(rec, name=rec["name"] + "_layers",
                                                        params=dict(params, layers=args_cli.layers), ms=per_layer,
                                                        ratio=floor_ms / per_layer, peers={"one_layer": ms})])
                        print(f"{'':>35} {per_layer:8.4f} {floor_ms:8.4f} {floor_ms / per_layer:6.3f}  per layer of "
                              f"{args_cli.layers} back to back", flush=True)
                del args, out, more, outs
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
