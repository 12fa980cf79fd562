"""Benchmark: one whole verify step of the Kimi K2.6 target, N decoder layers on one GPU (issue 3).

The target is `KimiForCausalLM` at K2.6 shapes truncated to `--layers` layers (default 8: layer 0 dense
as in K2.6's first_k_dense_replace = 1, layers 1..7 MoE with 384 INT4 experts, top-8, + shared expert),
with random weights created directly on the device (no checkpoint on disk): the loader's own
`build_empty_target` allocates it, every tensor is filled in place, and each MoE layer is repacked
by `MoE.repack_for_gpu` exactly as `load_target` leaves it on CUDA ("gpu" INT4 g32 layout). Weights
are bf16 elsewhere; embed_tokens and lm_head are included (the lm_head is timed separately).

Cases: prefix lengths x batch sizes (sessions with the same prefix) x step kinds: AR (a 1-node tree,
as the engine runs it) and trees of 9/17/33 nodes per session (a chain of depth <= 7 plus random
branches; parents precede children). The latent KV pool is the serving `KVPool` (page 16, sessions'
pages interleaved, real block tables and write slots) filled with random bf16 rows instead of a
prefill: the content does not change the timing. Each case runs `model(fb, kv)`, the forward the
engine's verify step runs (embedding, N layers, final norm), timed as the median of
`triton.testing.do_bench` around a CUDA-graph replay of that forward (eager time always kept as the
`eager` peer; when the capture fails the record says why and `ms` is eager), with and without
`make_batch_invariant` (the serving default on CUDA; `params.batch_invariant`). `--gemm` times the invariant runs
with variants of the dense GEMMs (`params.gemm`: now = stacked pairs and tiles by M, before = one GEMM per weight and
one tile shape, separate / fixed = one of the two), each on the same inputs in one run.

Reported per layer: ms = forward ms / N. Floor per layer = max(bytes / copy bandwidth, flops /
bf16 matmul rate), both ceilings measured in this run (`bench._common.measure_ceilings`), with
  bytes  = the layer's attention weights and norms + dense MLP, or shared expert + router + the
           packed weights and scales of the routed experts its tokens touched (counted from the
           routing of this very forward) + the latent KV rows read (every session's prefix + its
           tree rows) and written (the tree rows) + activations (4 x tokens x hidden),
  flops  = 2 x tokens x the layer's matrix parameters (routed experts: top-k of them) + the absorbed
           MLA attention, 2 x heads x (576 + 512) per (query row, visible key row),
averaged over the N layers. Both terms are in the record (`bytes_floor_ms`, `flops_floor_ms`).

The target and the step's inputs are built by `bench/verify_step_target.py`, the floor counted by
`bench/verify_step_floor.py`; this file times the cases and writes the records.

Run from the repo root (one H200, ~2.5 min with the defaults; `--quick` ~1.5 min):
  PYTHONPATH=. python bench/bench_verify_step.py [--layers 8] [--prefix 4096] [--batch 1 16]
      [--trees 1 9 17 33] [--invariant both|on|off] [--gemm now before] [--quick] [--out FILE]
CPU smoke run (tiny random config, torch references, a few seconds; what the unit test runs):
  PYTHONPATH=. python bench/bench_verify_step.py --smoke --out /tmp/verify_step.jsonl
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without PYTHONPATH too

from bench._common import bench_ms, commit, env_info, measure_ceilings, write_jsonl  # noqa: E402
from bench.verify_step_floor import lm_head_floor, step_floor, touched_experts  # noqa: E402
from bench.verify_step_target import build_target, make_batch, make_pool  # noqa: E402
from kernels import (  # noqa: E402
    _mla_gluon,
    _mla_gluon_persistent,
    _mla_gluon_seesaw_persistent,
    int4_moe,
    int4_moe_gluon,
    int4_moe_wgmma,
    mla_attention,
)
from kernels import matmul as matmul_mod  # noqa: E402
from kernels import pdl as pdl_mod  # noqa: E402
from verifier_service import moe as moe_mod  # noqa: E402
from verifier_service import presets  # noqa: E402
from verifier_service.batch_invariant import make_batch_invariant, remove_batch_invariance  # noqa: E402
from verifier_service.config import KimiConfig  # noqa: E402
from verifier_service.model_size import size_report  # noqa: E402

NAME = "verify_step"
DEFAULTS = dict(prefix=[4096], batch=[1, 16], trees=[1, 9, 17, 33])
QUICK = dict(prefix=[4096], batch=[1, 16], trees=[1, 33])
SMOKE = dict(prefix=[40], batch=[1, 2], trees=[1, 5, 9], layers=3, page_size=8, max_session_len=64)


# --- timing ------------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _settle() -> None:
    """After a failed case or capture: wait for the GPU and free cached blocks, never raising."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001
        print(f"  (cuda synchronize after a failure: {exc!r:.200})", flush=True)


def once_ms(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn, device: str, est_ms: float, reps: int) -> float:
    """CUDA: triton's do_bench (CUDA events, median) with at least ~`reps` repetitions; CPU: wall clock."""
    if str(device).startswith("cuda"):
        return bench_ms(fn, warmup_ms=max(25, int(2 * est_ms)), rep_ms=max(100, int(reps * est_ms)))
    return statistics.median(once_ms(fn, device) for _ in range(max(1, reps)))


def capture_graph(fn):
    """(graph, outputs) of `fn` captured in a CUDA graph after a warm call on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


def kernel_breakdown(fn, reps: int = 3, top: int = 14) -> list[dict]:
    """GPU time per kernel name over `reps` eager calls of `fn` (torch.profiler), per call, largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            a = agg.setdefault(e.name[:90], [0.0, 0])
            a[0] += e.time_range.elapsed_us() / 1e3 / reps
            a[1] += 1 / reps
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in agg.values())
    out = [dict(kernel=k, ms=round(v[0], 4), calls=round(v[1], 1)) for k, v in rows[:top]]
    out.append(dict(kernel="(all kernels)", ms=round(total, 4), calls=round(sum(v[1] for v in agg.values()), 1)))
    return out


def cpu_ceilings() -> dict:
    """Small CPU stand-ins for `measure_ceilings` (smoke runs only)."""
    src = torch.randn(1 << 22)
    dst = torch.empty_like(src)
    t = statistics.median(once_ms(functools.partial(dst.copy_, src), "cpu") for _ in range(5))
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    tm = statistics.median(once_ms(functools.partial(torch.matmul, a, b), "cpu") for _ in range(5))
    return dict(copy_bw_GBps=2 * src.numel() * 4 / (t * 1e-3) / 1e9, mm_tflops=2 * 256**3 / (tm * 1e-3) / 1e12)


def cpu_info() -> dict:
    import triton

    return dict(gpu=f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)", commit=commit(),
                torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0])


# --- one case --------------------------------------------------------------------------------------------------
GEMMS = ("now", "separate", "fixed", "before")  # --gemm: the invariant dense GEMMs' variants (`_set_gemm`)


def _set_gemm(model, variant: str) -> None:
    """On a batch-invariant model: "now" as make_batch_invariant leaves it (stacked q_a + kv_a and gate + up,
    tiles by M); "separate": one GEMM per weight; "fixed": one tile shape for every M (kernels.matmul.CONFIGS');
    "before": both (the serving code up to the twentieth session)."""
    matmul_mod.TILES_BY_M = _TILES_NOW if variant in ("now", "separate") else (
        (None, matmul_mod.CONFIGS[torch.bfloat16], None),)
    if variant in ("separate", "before"):
        for m in model.modules():
            m.__dict__.pop("project_a", None)  # the class's: q_a and kv_a one after the other
            if isinstance(m, moe_mod.MLP):
                m.__dict__.pop("forward", None)


def run_case(model, pool, cfg, case: dict, invariant: bool, ceil: dict, info: dict, args, state: dict,
             gemm: str = "now") -> dict:
    B, L, n = case["batch"], case["prefix"], case["tree"]
    dev = args.device
    cuda = dev.startswith("cuda")
    (make_batch_invariant if invariant else remove_batch_invariance)(model)
    if invariant:
        _set_gemm(model, gemm)
    fb, shape = make_batch(pool, cfg, B, L, n, torch.Generator().manual_seed(args.seed * 7919 + B * 131 + L + n))
    fn = functools.partial(model, fb, pool.kv)
    first_ms = once_ms(fn, dev)  # compiles the kernels for new shapes
    est = once_ms(fn, dev)
    touched, out = touched_experts(model, fb, pool.kv)
    hidden_ref = out[0].clone()
    finite = bool(torch.isfinite(hidden_ref).all())
    del out
    eager = median_ms(fn, dev, est, args.reps)
    graph_err, graph_same, ms = None, None, eager
    if not cuda:
        graph_err = "not CUDA"
    elif args.no_graph:
        graph_err = "disabled (--no-graph)"
    elif state.get("graph_error"):
        graph_err = "skipped after an earlier failure: " + state["graph_error"]
    else:
        try:
            g, gout = capture_graph(fn)
            g.replay()
            torch.cuda.synchronize()
            graph_same = bool(torch.equal(gout[0], hidden_ref))
            ms = median_ms(g.replay, dev, est, args.reps)
            del g, gout
        except Exception as exc:  # noqa: BLE001 - record why and time eagerly
            graph_err = f"{type(exc).__name__}: {exc}"[:300]
            state["graph_error"] = graph_err
            _settle()
    if args.profile and cuda:
        try:
            breakdown = kernel_breakdown(fn)
        except Exception as exc:  # noqa: BLE001 - the profile is extra; the timing stands without it
            breakdown = [dict(kernel=f"profile failed: {type(exc).__name__}: {exc}"[:200], ms=0.0, calls=0)]
        state.setdefault("breakdowns", []).append((case, invariant, breakdown))
        for row in breakdown:
            print(f"    {row['ms']:8.4f} ms  x{row['calls']:<6} {row['kernel']}", flush=True)
    layout = next((m.layout for m in model.modules() if isinstance(m, moe_mod.MoE)), None)  # as repacked
    lm = {}
    if not args.no_lm_head:
        lm_fn = functools.partial(model.logits, hidden_ref)
        lm_ms = median_ms(lm_fn, dev, once_ms(lm_fn, dev), args.reps)
        lm = dict(lm_head_ms=lm_ms, lm_head_floor_ms=lm_head_floor(model.lm_head.weight, shape["tokens"], ceil))
    N = len(model.model.layers)
    elt = pool.kv.element_size()
    fl = step_floor(model, shape, touched, elt, ceil)
    per_layer = ms / N
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    params = dict(
        layers=N, batch=B, prefix=L, tree=n, tokens=shape["tokens"], batch_invariant=invariant,
        max_session_len=pool.max_session_len,
        graph=graph_err is None, timing="cuda_graph_replay" if graph_err is None else "eager",
        experts_touched_per_layer=statistics.mean(touched) if touched else 0, experts_touched=touched,
        experts_uniform=round(E * (1 - (1 - k / E) ** shape["tokens"]), 1) if touched else 0,
        max_depth=shape["max_depth"], kv_rows_read=shape["kv_rows_read"], visible_rows=shape["visible_rows"],
        page_size=pool.page_size, forward_ms=ms, first_call_ms=first_ms, finite=finite,
        bytes_per_layer=fl["bytes_per_layer"], flops_per_layer=fl["flops_per_layer"],
        bytes_floor_ms=fl["bytes_floor_ms"], flops_floor_ms=fl["flops_floor_ms"],
        dtype=str(pool.kv.dtype).removeprefix("torch."), build_s=state.get("build_s"),
        **({"gemm": gemm} if invariant else {}), mla_impl=mla_attention.DEFAULT_IMPL,
        mla_kernel=mla_attention.resolved_impl(mla_attention.DEFAULT_IMPL, pool.kv.device, cfg.num_attention_heads,
                                               cfg.kv_lora_rank, cfg.qk_rope_head_dim, pool.kv.dtype,
                                               pool.page_size),
        mla_tma=_mla_gluon.GLUON_TMA,
        mla_persistent=_mla_gluon_persistent.GLUON_PERSISTENT,
        mla_seesaw_persistent=_mla_gluon_seesaw_persistent.SEESAW_PERSISTENT,
        mla_partials=mla_attention.DEFAULT_PARTIALS, mla_fold=mla_attention.DEFAULT_FOLD, pdl=pdl_mod.active(pool.kv),
        moe_block_m=int4_moe.DEFAULT_BLOCK_M,
        moe_zp_mma=int4_moe.DEFAULT_ZP_MMA, moe_layout=layout,
        **({"moe_block_pairs": int4_moe_gluon.DEFAULT_BLOCK_PAIRS} if layout == "gluon" else {}),
        **({"moe_schedule": int4_moe_wgmma.resolve_schedule(shape["tokens"] * k)}
           if layout in int4_moe_wgmma.LAYOUTS else {}), **lm)
    if args.profile and cuda:
        params["kernel_breakdown"] = state["breakdowns"][-1][2]
    if graph_err is not None:
        params["graph_error"] = graph_err
    else:
        params["graph_matches_eager"] = graph_same
    rec = dict(name=NAME, params=params, **info, ms=per_layer, floor_ms=fl["floor_ms"],
               ratio=fl["floor_ms"] / per_layer, peers={"eager": eager / N}, **ceil)
    del fb, hidden_ref
    if cuda:
        torch.cuda.empty_cache()
    return rec


def print_row(r: dict) -> None:
    p = r["params"]
    lm = f"{p['lm_head_ms']:8.3f}" if "lm_head_ms" in p else f"{'-':>8}"
    persistent = p["mla_seesaw_persistent" if p["mla_kernel"] == "gluon_seesaw" else "mla_persistent"]
    print(f"{p['batch']:>3} {p['prefix']:>6} {p['tree']:>3} {p['tokens']:>5} {str(p['batch_invariant'])[0]:>3} "
          f"{str(p['graph'])[0]:>5} {p['experts_touched_per_layer']:7.1f} {r['ms']:9.4f} {r['peers']['eager']:9.4f} "
          f"{r['floor_ms']:8.4f} {r['ratio']:6.3f} {p['bytes_per_layer'] / 1e6:8.1f} {lm} {p.get('gemm', '')} "
          f"{'persistent' if persistent else ''} {'pdl' if p['pdl'] else ''}",
          flush=True)


# --- main --------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --smoke 3)")
    ap.add_argument("--prefix", type=int, nargs="+", default=None, help=f"prefix lengths {DEFAULTS['prefix']}")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help=f"sessions per step {DEFAULTS['batch']}")
    ap.add_argument("--trees", type=int, nargs="+", default=None,
                    help=f"nodes per session, 1 = AR {DEFAULTS['trees']}")
    ap.add_argument("--invariant", choices=("both", "on", "off"), default="both",
                    help="time with make_batch_invariant (on), without (off), or both (default)")
    ap.add_argument("--quick", action="store_true", help=f"fewer cases: {QUICK}")
    ap.add_argument("--smoke", action="store_true", help="tiny random config (CPU by default), for tests")
    ap.add_argument("--out", default="bench/results/verify_step.jsonl")
    ap.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    ap.add_argument("--page-size", type=int, default=None, help="KV page size (serving default 16)")
    ap.add_argument("--max-session-len", type=int, default=None,
                    help="block-table width in rows (serving default 8192; sets the MLA split grid)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (about)")
    ap.add_argument("--budget-s", type=float, default=180.0,
                    help="start no new case after this many seconds (records are written as they come)")
    ap.add_argument("--no-graph", action="store_true", help="time eagerly only")
    ap.add_argument("--no-lm-head", action="store_true", help="do not time the lm_head")
    ap.add_argument("--profile", action="store_true",
                    help="also record GPU time per kernel (torch.profiler, eager calls) in params.kernel_breakdown")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moe-block-m", type=int, choices=int4_moe.BLOCK_M_CHOICES, default=None,
                    help="INT4 MoE pairs per expert block (default: kernels.int4_moe.DEFAULT_BLOCK_M)")
    ap.add_argument("--moe-zp-mma", choices=("on", "off"), default=None,
                    help="INT4 MoE zero point by an MMA on group sums (default: kernels.int4_moe.DEFAULT_ZP_MMA)")
    ap.add_argument("--moe-layout", choices=("auto", "gpu", "gluon", *int4_moe_wgmma.LAYOUTS), default=None,
                    help="INT4 MoE kernels (moe.GPU_LAYOUT, default 'auto': wgmma_steps on sm_90, else Triton's 'gpu')")
    ap.add_argument("--moe-block-pairs", type=int, choices=int4_moe_gluon.BLOCK_PAIRS, default=None,
                    help="with --moe-layout gluon: pairs per expert block (default int4_moe_gluon.DEFAULT_BLOCK_PAIRS)")
    ap.add_argument("--moe-wgmma-schedule", type=json.loads, default=None, metavar="JSON",
                    help='with --moe-layout wgmma: int4_moe_wgmma options for every launch (int4_moe_wgmma.'
                    'DEFAULT_SCHEDULE), e.g. \'{"pdl": true}\' over auto_schedule or \'{"block_pairs": 8, "maxnreg": '
                    '128}\' over PLAIN (default: auto_schedule per launch)')
    ap.add_argument("--gemm", choices=GEMMS, nargs="+", default=["now"],
                    help="batch-invariant runs: the dense GEMMs' variants to time (`_set_gemm`; default now)")
    ap.add_argument("--mla-impl", choices=mla_attention.IMPLS, default=None,
                    help=f"MLA tile kernel (default: mla_attention.DEFAULT_IMPL = {mla_attention.DEFAULT_IMPL})")
    ap.add_argument("--mla-tma", choices=("on", "off"), default=None,
                    help="gluon MLA kernel: TMA loads of the query tile and whole committed KV tiles (default: "
                         "_mla_gluon.GLUON_TMA; same bits either way)")
    ap.add_argument("--mla-persistent", choices=("on", "off"), nargs="+", default=None,
                    help="gluon and gluon_seesaw MLA kernels: one program per SM over the (query tile, chunk) items "
                         "(default: _mla_gluon_persistent.GLUON_PERSISTENT and _mla_gluon_seesaw_persistent."
                         "SEESAW_PERSISTENT; same bits either way); several: each case with each, in this order")
    ap.add_argument("--pdl", choices=("on", "off"), nargs="+", default=None,
                    help="programmatic dependent launch of the decode-sized GEMMs and the norms before them "
                         "(kernels.pdl.ENABLED, default on: DDTREE_PDL; same bits); several: each case with each, in "
                         "this order")
    ap.add_argument("--mla-partials", choices=mla_attention.PARTIALS, default=None,
                    help="dtype of a multi-chunk row's partial O (default: mla_attention.DEFAULT_PARTIALS; 'out' "
                         "halves the partial traffic and changes the bits of rows with several KV chunks)")
    ap.add_argument("--mla-fold", choices=("on", "off"), default=None,
                    help="MLA: one program per query tile folding its chunks (default: mla_attention.DEFAULT_FOLD; "
                         "the same bits either way)")
    args = ap.parse_args(argv)
    base = dict(DEFAULTS, layers=8, page_size=16, max_session_len=8192)
    if args.quick:
        base.update(QUICK)
    if args.smoke:
        base.update(SMOKE)
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.reps = args.reps or (3 if args.smoke else 10)
    if min(args.trees) < 1 or max(args.trees) > 128:
        ap.error("--trees: 1..128 nodes (the MLA kernel takes at most 2 bit words)")
    if args.layers < 1 or min(args.batch) < 1 or min(args.prefix) < 0:
        ap.error("--layers and --batch must be positive, --prefix non-negative")
    return args


_TILES_NOW = matmul_mod.TILES_BY_M


def presets_cfg(preset: str, layers: int) -> KimiConfig:
    return KimiConfig.from_dict(presets.target_config(preset, layers=layers))


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.mla_impl is not None:
        mla_attention.DEFAULT_IMPL = args.mla_impl  # read by the launcher at each call
    if args.mla_tma is not None:
        _mla_gluon.GLUON_TMA = args.mla_tma == "on"  # read by the launcher at each call
    if args.mla_partials is not None:
        mla_attention.DEFAULT_PARTIALS = args.mla_partials  # read by the launcher at each call
    if args.mla_fold is not None:
        mla_attention.DEFAULT_FOLD = args.mla_fold == "on"  # read by the launcher at each call
    if args.moe_block_m is not None:
        int4_moe.DEFAULT_BLOCK_M = args.moe_block_m
    if args.moe_zp_mma is not None:
        int4_moe.DEFAULT_ZP_MMA = args.moe_zp_mma == "on"
    if args.moe_layout is not None:
        moe_mod.GPU_LAYOUT = args.moe_layout
    if args.moe_block_pairs is not None:
        int4_moe_gluon.DEFAULT_BLOCK_PAIRS = args.moe_block_pairs
    if args.moe_wgmma_schedule is not None:
        int4_moe_wgmma.DEFAULT_SCHEDULE = dict(args.moe_wgmma_schedule)
        int4_moe_wgmma.check_schedule()  # a schedule the kernels cannot run fails here, not mid-run
    t_start = time.perf_counter()
    dev = args.device
    cuda = dev.startswith("cuda")
    preset = "tiny" if args.smoke else "kimi-k2.6"
    cfg = presets_cfg(preset, args.layers)
    dtype = torch.bfloat16 if cuda else torch.float32
    info = env_info() if cuda else cpu_info()
    ceil = measure_ceilings() if cuda else cpu_ceilings()
    print(f"{info['gpu']}  copy {ceil['copy_bw_GBps']:.0f} GB/s  matmul {ceil['mm_tflops']:.1f} TFLOP/s  "
          f"commit {info['commit']}", flush=True)
    rows = max(args.prefix) + max(args.trees)
    kv_gb = args.layers * max(args.batch) * rows * cfg.kv_row_dim * dtype.itemsize / 1e9
    w_gb = size_report(cfg)["bytes"]["total"] / 1e9
    moe_layers = sum(map(cfg.is_moe_layer, range(args.layers)))
    repack_gb = (w_gb - size_report(presets_cfg(preset, 1))["bytes"]["total"] / 1e9) / max(moe_layers, 1)
    need_gb = w_gb + repack_gb + kv_gb + 3  # + MLA partials and MoE temporaries of the largest case
    print(f"{preset}: {args.layers} layers ({moe_layers} MoE), weights {w_gb:.1f} GB + one layer's repack "
          f"{repack_gb:.1f} GB, KV pool {kv_gb:.2f} GB; building on {dev} ...", flush=True)
    if cuda and need_gb > torch.cuda.get_device_properties(torch.device(dev)).total_memory / 1e9:
        raise SystemExit(f"about {need_gb:.0f} GB needed, more than {dev} holds: use fewer --layers")
    t0 = time.perf_counter()
    model = build_target(cfg, dtype, dev, args.seed)
    pool = make_pool(cfg, args.layers, max(args.batch), rows, args.page_size, args.max_session_len, dtype, dev,
                     args.seed)
    _sync(dev)
    build_s = time.perf_counter() - t0
    mem = f", peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB" if cuda else ""
    print(f"built in {build_s:.1f}s{mem}", flush=True)
    modes = {"both": [True, False], "on": [True], "off": [False]}[args.invariant]
    print(f"{'B':>3} {'L':>6} {'n':>3} {'T':>5} {'inv':>3} {'graph':>5} {'experts':>7} {'ms/layer':>9} "
          f"{'eager':>9} {'floor':>8} {'ratio':>6} {'MB/layer':>8} {'lm_head':>8}", flush=True)
    records, state = [], {"build_s": round(build_s, 1)}
    with torch.no_grad():  # the serving default (batch invariant) first: a cut-off run keeps it
        for inv in modes:
            for L in args.prefix:
                for B in args.batch:
                    for n in args.trees:
                        if time.perf_counter() - t_start > args.budget_s:
                            print(f"budget of {args.budget_s:.0f}s spent: skipping B={B} L={L} n={n} inv={inv}",
                                  flush=True)
                            continue
                        case = dict(batch=B, prefix=L, tree=n)
                        gemms = args.gemm if inv else ["now"]
                        for gemm, pers, pdl in itertools.product(gemms, args.mla_persistent or [None],
                                                                 args.pdl or [None]):
                            if pers is not None:  # read by the launchers at each call (so at each capture)
                                _mla_gluon_persistent.GLUON_PERSISTENT = pers == "on"
                                _mla_gluon_seesaw_persistent.SEESAW_PERSISTENT = pers == "on"
                            if pdl is not None:
                                pdl_mod.ENABLED = pdl == "on"
                            try:
                                rec = run_case(model, pool, cfg, case, inv, ceil, info, args, state, gemm)
                            except Exception as exc:  # noqa: BLE001 - report and go on with the next case
                                print(f"B={B} L={L} n={n} inv={inv} gemm={gemm} persistent={pers} pdl={pdl}: "
                                      f"{type(exc).__name__}: {exc}"[:400], flush=True)
                                if cuda:
                                    _settle()
                                continue
                            if cuda:
                                rec["params"]["peak_mem_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
                            write_jsonl(args.out, [rec])  # one line at a time: a cut-off run keeps what it measured
                            records.append(rec)
                            print_row(rec)
    _set_gemm(model, "now")
    remove_batch_invariance(model)
    print(f"done in {time.perf_counter() - t_start:.0f}s, {len(records)} records -> {args.out}", flush=True)
    return records


if __name__ == "__main__":
    main()
