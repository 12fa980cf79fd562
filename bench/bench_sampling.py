"""Benchmark: seeded-sampling overhead of one verify step's posterior computation (issue 6).

Shape of a step: S sessions x N nodes rows of fp32 logits over Kimi's 163840-token vocabulary
(default 16 x 65 = 1040 rows, 681 MB; also an AR-like 16 x 1 and a 64 x 17 mix). Logits are
Zipf-like (token at rank i has logit -alpha ln(i), ranks shuffled per row) so the distributions
are peaked like an LLM's; `--alpha` changes it. Cases: the Triton kernel for greedy rows, and
temperature / top-p / top-k settings; `engine_posterior` adds the per-row parameter gathers of
`SamplerTable.posterior`, i.e. exactly what the engine runs per step.

floor_ms = bytes of logits read once / 4.2e12 B/s (H200 measured copy bandwidth, DESIGN 4);
ratio = floor_ms / ms (1.0 = one pass at copy speed; the sampler reads each row 2+ times).
peers: {"greedy_argmax": ms of logits.argmax(-1) on the same logits} — what greedy costs today.
Also recorded: whether the CUDA result equals the CPU reference on a few rows (bitwise tokens),
whether one call ran with no host sync (torch sync-debug mode "error"), whether it can be
captured in a CUDA graph, and the share of rows whose token the filters changed (multi-round).

Run from the repo root on a GPU:  PYTHONPATH=. python bench/bench_sampling.py [--sweep] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools

import torch

from bench._common import bench_ms, env_info, write_jsonl
from kernels.sampling import sample_tokens
from verifier_service.sampler import SamplerTable, sampling_tensors
from verifier_service.sampling_params import SamplingParams

V = 163840
BW = 4.2e12  # B/s
SHAPES = [(16, 65), (16, 1), (64, 17)]  # (sessions, nodes per session)
CASES = {
    "kernel_greedy": SamplingParams(),
    "t0.7": SamplingParams(0.7),
    "t0.7_p0.9": SamplingParams(0.7, top_p=0.9),
    "t1.0_k20": SamplingParams(1.0, top_k=20),
    "t0.7_p0.9_k20": SamplingParams(0.7, top_p=0.9, top_k=20),
    "t1.5_p0.95": SamplingParams(1.5, top_p=0.95),
}
SWEEP = [(512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8), (4096, 16)]  # (block, num_warps)


def zipf_logits(rows: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    base = -alpha * torch.log(torch.arange(1, V + 1, device="cuda", dtype=torch.float32))  # [V]
    out = torch.empty(rows, V, device="cuda", dtype=torch.float32)
    for r in range(rows):  # per-row shuffle of which token holds which rank
        out[r] = base[torch.randperm(V, generator=gen, device="cuda")]
    return out


def step_args(S: int, N: int, params: SamplingParams):
    """Per-row kernel arguments for S sessions of N nodes (distinct seeds; node depth -> position)."""
    R = S * N
    inv, tp, tk, seed = sampling_tensors([params] * R, [1000 + r // N for r in range(R)], "cuda")
    pos = torch.tensor([4096 + (r % N) // 8 + 1 for r in range(R)], dtype=torch.int64, device="cuda")
    return inv, tp, tk, seed, pos


def sync_free(fn) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")


def graph_capturable(fn) -> bool:
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        return True
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        print(f"graph capture failed: {exc!r:.160}", flush=True)
        torch.cuda.synchronize()
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/sampling.jsonl")
    ap.add_argument("--alpha", type=float, default=1.5, help="Zipf exponent of the synthetic logits")
    ap.add_argument("--sweep", action="store_true", help="also time (block, num_warps) configs in SWEEP")
    args = ap.parse_args()
    info = env_info()
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    print(f"{info['gpu']}  vocab {V}  alpha {args.alpha}", flush=True)
    print(f"{'shape':>8} {'case':>16} {'cfg':>10} {'ms':>8} {'floor':>7} {'ratio':>6} {'argmax':>7} "
          f"{'multi%':>6} ref sync graph", flush=True)
    for S, N in SHAPES:
        R = S * N
        logits = zipf_logits(R, args.alpha, gen)
        floor_ms = R * V * 4 / BW * 1e3
        argmax_ms = bench_ms(functools.partial(torch.argmax, logits, -1))
        table = SamplerTable(S, "cuda")
        node_rows = torch.arange(R, device="cuda") // N
        next_pos = step_args(S, N, SamplingParams())[4]
        for name, sp in CASES.items():
            a = step_args(S, N, sp)
            for s in range(S):
                table.set(s, sp, 1000 + s)
            out = sample_tokens(logits, *a)  # compile + warm
            free = sample_tokens(logits, a[0], torch.ones_like(a[1]), torch.zeros_like(a[2]), *a[3:])
            multi = float((free != out).float().mean())
            k = min(R, 6)
            ref_ok = sample_tokens(logits[:k].cpu(), *(t[:k].cpu() for t in a)).tolist() == out[:k].cpu().tolist()
            cfgs = [None] + (SWEEP if args.sweep and (S, N) == SHAPES[0] else [])
            for cfg in cfgs:
                kw = {} if cfg is None else dict(block=cfg[0], num_warps=cfg[1])
                fn = functools.partial(sample_tokens, logits, *a, **kw)
                try:
                    ms = bench_ms(fn)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                    print(f"{name} {kw}: {exc!r:.200}", flush=True)
                    continue
                peers = {"greedy_argmax": argmax_ms}
                extra = {}
                if cfg is None:
                    eng = functools.partial(table.posterior, logits, node_rows, next_pos, True)
                    peers["engine_posterior"] = bench_ms(eng)
                    extra = dict(matches_cpu_reference=ref_ok, sync_free=sync_free(fn), graph_capturable=
                                 graph_capturable(fn), multi_round_frac=multi)
                rec = dict(name="sampling_posterior" if cfg is None else "sampling_posterior_sweep",
                           params=dict(sessions=S, nodes=N, rows=R, vocab=V, dtype="float32", alpha=args.alpha,
                                       case=name, sampling=sp.to_dict(), config=kw or "default",
                                       bytes=R * V * 4),
                           **info, ms=ms, floor_ms=floor_ms, ratio=floor_ms / ms, peers=peers, **extra)
                records.append(rec)
                print(f"{S:>3}x{N:<4} {name:>16} {str(cfg or ''):>10} {ms:8.3f} {floor_ms:7.3f} "
                      f"{floor_ms / ms:6.3f} {argmax_ms:7.3f} {100 * multi:6.1f} {ref_ok!s:>3} "
                      f"{extra.get('sync_free', '')!s:>4} {extra.get('graph_capturable', '')!s:>5}", flush=True)
        del logits
        torch.cuda.empty_cache()
    write_jsonl(args.out, records)
    print(f"wrote {len(records)} records to {args.out}", flush=True)


if __name__ == "__main__":
    main()
