"""Benchmark: the batch-invariant GEMMs (kernels/matmul.py) vs cuBLAS at Kimi K2.6 shapes, M = 1..1100.

Every GEMM the transform `verifier_service.batch_invariant` swaps, per layer (q_a, q_b, kv_a, o_proj,
shared-expert gate/up and down, router with fp32 output), the two absorbed-MLA einsums (64 heads)
and lm_head, at M = 1 (AR), 9, 65 (one tree), 260, 1100 (16 trees of 65 + change) rows, in bf16.
ms is CUDA-graph replay time (no launch overhead); peers: {"cublas": ms of the torch op}.
floor_ms = max(bytes of W + x + y / copy bandwidth, flops / bf16 matmul rate), both measured here.

Run from the repo root on a GPU:  PYTHONPATH=. python bench/bench_matmul.py [--out FILE]

--configs '[{...}, ...]' times each op under other constants of kernels/matmul.py, recorded as `params.config`
(records named `matmul_config_sweep`): a 16-bit tile shape for every M (keys block_m, block_n, block_k, warps,
stages, over CONFIGS'; none given: `tile_config` by M as the module has it) and the split-K rule (fill_sms,
max_splits, min_split_tiles; these decide the bits); --ops / --ms pick the cases.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

import kernels.matmul as km
from bench._common import env_info, graph_ms, measure_ceilings, write_jsonl
from kernels.matmul import head_matmul, matmul

LINEARS = {  # name -> (N, K, out_dtype)
    "q_a": (1536, 7168, None), "q_b": (12288, 1536, None), "kv_a": (576, 7168, None), "o_proj": (7168, 8192, None),
    "shared_gate_up": (2048, 7168, None), "shared_down": (7168, 2048, None), "router": (384, 7168, torch.float32),
    "lm_head": (163840, 7168, None),
    # the dense layer (layer 0, intermediate 18432), and weights the model could concatenate at load (one GEMM
    # where it runs two: q_a + kv_a on the same input, the gate and up projections of an MLP)
    "dense_gate": (18432, 7168, None), "dense_down": (7168, 18432, None),
    "q_a_kv_a": (2112, 7168, None), "shared_gate_up_cat": (4096, 7168, None), "dense_gate_up_cat": (36864, 7168, None),
}
HEADS = {"absorb_uk": (128, 512), "apply_uv": (512, 128)}  # (K, N) per head, 64 heads
MS = (1, 9, 65, 260, 1100)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/matmul.jsonl")
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--configs", type=json.loads, default=None, help="a JSON list of config overrides (doc)")
    ap.add_argument("--ops", nargs="+", default=None, help=f"of {sorted({**LINEARS, **HEADS})}")
    ap.add_argument("--ms", nargs="+", type=int, default=list(MS))
    args = ap.parse_args()
    configs = args.configs or [{}]
    base = dict(fill_sms=km.FILL_SMS, max_splits=km.MAX_SPLITS, min_split_tiles=km.MIN_SPLIT_TILES)
    info = env_info()
    ceil = measure_ceilings()
    bw, rate = ceil["copy_bw_GBps"] * 1e9, ceil["mm_tflops"] * 1e12
    print(f"{info['gpu']}  copy {ceil['copy_bw_GBps']:.0f} GB/s  bf16 mm {ceil['mm_tflops']:.0f} TFLOP/s", flush=True)
    print(f"{'op':>15} {'M':>5} {'ours ms':>9} {'cublas':>8} {'x':>5} {'floor':>8} {'ratio':>6}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    cases = []
    for name, (N, K, od) in LINEARS.items():
        w = torch.randn(N, K, device="cuda", generator=g).to(bf)
        acc = od or bf
        ref = (lambda x, w=w: x.float() @ w.float().T) if od else (lambda x, w=w: x @ w.T)  # what the model runs
        cases.append((name, N, K, 1, w, functools.partial(matmul, w=w, out_dtype=od), ref, acc))
    for name, (K, N) in HEADS.items():
        w = torch.randn(64, N, K, device="cuda", generator=g).to(bf)
        ref = functools.partial(lambda x, w: torch.einsum("thk,hnk->thn", x, w), w=w)
        cases.append((name, N, K, 64, w, functools.partial(head_matmul, w=w), ref, bf))
    cases = [c for c in cases if args.ops is None or c[0] in args.ops]
    n_records = 0
    for name, N, K, H, w, ours, ref, acc in cases:
        records = []
        for M in args.ms:
            shape = (M, K) if H == 1 else (M, H, K)
            x = torch.randn(*shape, device="cuda", generator=g).to(bf)
            peer = graph_ms(functools.partial(ref, x), 10, args.rep_ms)
            nbytes = w.numel() * 2 + x.numel() * 2 + M * H * N * torch.finfo(acc).bits // 8
            floor = max(nbytes / bw, 2 * M * H * N * K / rate) * 1e3
            for over in configs:
                config = {**base, **over}
                _apply(config)
                try:
                    ms = graph_ms(functools.partial(ours, x), 10, args.rep_ms)
                except Exception as e:  # noqa: BLE001 - e.g. a tile config that needs more shared memory
                    print(f"{name:>15} {M:>5} {json.dumps(over)}: {e!r:.200}", flush=True)
                    continue
                params = dict(op=name, M=M, N=N, K=K, heads=H, dtype="bfloat16",
                              out_dtype=str(acc).removeprefix("torch."), timing="cuda_graph")
                if args.configs:
                    params.update(config=config, splits=km.split_k(N, K, bf)[0] if H == 1 else 1)
                records.append(dict(name="matmul_config_sweep" if args.configs else "matmul_batch_invariant",
                                    params=params, **info, ms=ms, floor_ms=floor, ratio=floor / ms,
                                    peers={"cublas": peer}, **ceil))
                tag = "" if not args.configs else " " + json.dumps(over, separators=(",", ":"))
                print(f"{name:>15} {M:>5} {ms:9.4f} {peer:8.4f} {ms / peer:5.2f} {floor:8.4f} {floor / ms:6.2f}{tag}",
                      flush=True)
            _apply(base)
        write_jsonl(args.out, records)  # per op, so a run cut short keeps what it measured
        n_records += len(records)
        del w
    print(f"wrote {n_records} records to {args.out}", flush=True)


TILE_KEYS = ("block_m", "block_n", "block_k", "warps", "stages")
_TILES_BY_M = km.TILES_BY_M


def _apply(config: dict) -> None:
    """Set kernels.matmul's 16-bit tiles (read at each call: one shape for every M when `config` names any, else
    the module's own by M) and its split-K rule to `config`."""
    if any(k in config for k in TILE_KEYS):
        tiles = tuple(config.get(k, v) for k, v in zip(TILE_KEYS, km.CONFIGS[torch.bfloat16]))
        km.TILES_BY_M = ((None, tiles, None),)
    else:
        km.TILES_BY_M = _TILES_BY_M
    km.FILL_SMS, km.MAX_SPLITS, km.MIN_SPLIT_TILES = config["fill_sms"], config["max_splits"], config["min_split_tiles"]


if __name__ == "__main__":
    main()
