"""Evaluate a committed model pair: held-out perplexity, DDTree acceptance by budget, DDTree vs AR tokens/s.

- perplexity: next-token NLL of the exported target (experts dequantized by the reference rule) over
  non-overlapping held-out windows; also bits per byte using the held-out bytes/token;
- acceptance: greedy DDTree through the real engine (`build_local_engine`: serving forward, drafter,
  tree build, verify, commit) on prompts cut from held-out files; mean acceptance length = committed
  tokens per verify step (accepted drafts + the bonus token), and whether every session's output equals
  plain autoregressive decoding token for token;
- throughput: generated tokens / wall time at concurrency C (C sessions decoded together), AR vs DDTree,
  after one identical warm-up run (kernels compiled, CUDA graphs captured); `--cuda-graphs on,off` measures
  it with the verify forward and the draft step replayed from CUDA graphs and eagerly in one run
  (params.cuda_graphs).
Each measurement becomes one JSON line (name, params, device, commit, metrics) appended to --out.

  python -m training.evaluate --pair models/kimi-mini --data runs/data --out bench/results/demo_pair.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from verifier_service.engine import EngineConfig
from verifier_service.local import DTYPES, build_local_engine
from verifier_service.session import DecodeParams


def heldout_prompts(data_dir: str | Path, n: int, prompt_len: int, min_tail: int = 64) -> list[list[int]]:
    """n prompts of prompt_len tokens from the middle of n held-out files spread over the set."""
    toks = np.load(Path(data_dir) / "heldout.npy").astype(np.int64)
    eos = json.loads((Path(data_dir) / "meta.json").read_text())["eos"]
    cuts = np.flatnonzero(toks == eos)
    files = [toks[a + 1 : b] for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]
    files = [f for f in files if len(f) >= prompt_len + min_tail]
    if len(files) < n:
        raise ValueError(f"only {len(files)} held-out files are long enough for {n} prompts")
    pick = [files[int(i * len(files) / n)] for i in range(n)]
    return [f[(len(f) - prompt_len - min_tail) // 2 :][:prompt_len].tolist() for f in pick]


def decode(engine, prompts, budget: int, topk: int, max_new: int):
    params = DecodeParams(max_new_tokens=max_new, budget=budget, topk=topk, ignore_eos=True)
    t0 = time.perf_counter()
    sessions = engine.generate(prompts, params)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return sessions, time.perf_counter() - t0


def acceptance_sweep(engine, prompts, budgets, topk: int, max_new: int) -> dict:
    ar, _ = decode(engine, prompts, 0, topk, max_new)
    ref = [s.output for s in ar]
    out = {}
    for b in budgets:
        sessions, _ = decode(engine, prompts, b, topk, max_new)
        steps = [a for s in sessions for a in s.accepted_per_step]
        out[str(b)] = {"mean_acceptance": round(sum(steps) / len(steps), 4), "steps": len(steps),
                       "exact_vs_ar": all(s.output == r for s, r in zip(sessions, ref))}
    return out


def graph_stats(engine) -> dict:
    """The CUDA-graph runners' counters (replays, captures, padded_eager, eager) and failed captures: the
    verify forward's, then the in-process drafter's with a `draft_` prefix."""
    out = {}
    for prefix, g in (("", getattr(engine, "graphs", None)),
                      ("draft_", getattr(getattr(engine, "drafter", None), "graphs", None))):
        if g is not None:
            out.update({f"{prefix}{k}": v for k, v in
                        {**dict(g.stats), "graphs": len(g.graphs), "failed": len(g.failed)}.items()})
    return out


def throughput(engine, prompts, budget: int, topk: int, max_new: int, concurrency: int) -> dict:
    batch = (prompts * concurrency)[:concurrency]
    decode(engine, batch, budget, topk, max_new)  # warm-up: the same steps (kernels compiled, graphs captured)
    before = graph_stats(engine)
    sessions, dt = decode(engine, batch, budget, topk, max_new)
    n = sum(len(s.output) for s in sessions)
    steps = [a for s in sessions for a in s.accepted_per_step]
    out = {"tokens": n, "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 2),
           "mean_acceptance": round(sum(steps) / len(steps), 3) if budget else 1.0}
    after = graph_stats(engine)
    if after:  # what the measured run itself did
        out["graph"] = {k: v - before.get(k, 0) for k, v in after.items()}
    return out


def graph_modes(arg: str, device: str) -> list[bool]:
    """--cuda-graphs: auto (on for cuda), on, off, or a comma list (e.g. on,off: both, in that order)."""
    if arg == "auto":
        return [device.startswith("cuda")]
    table = {"on": True, "off": False}
    modes = [table.get(x.strip()) for x in arg.split(",")]
    if not modes or None in modes:
        raise ValueError(f"--cuda-graphs must be auto, on, off or a comma list of on/off, got {arg!r}")
    return modes


@torch.no_grad()
def perplexity(target_dir, data_dir, seq: int, device, max_windows: int | None, batch: int = 16) -> dict:
    from training.data import heldout_windows
    from training.export import load_target_dense
    from training.train_target import heldout_nll

    model = load_target_dense(target_dir, torch.float32, device)
    held = heldout_windows(np.load(Path(data_dir) / "heldout.npy"), seq, max_windows)
    nll = heldout_nll(model, held, batch, torch.device(device), qat=False)
    bpt = json.loads((Path(data_dir) / "meta.json").read_text())["heldout_bytes_per_token"]
    return {"heldout_tokens": int(held[:, 1:].numel()), "nll": round(nll, 4), "perplexity": round(math.exp(nll), 3),
            "bits_per_byte": round(nll / math.log(2) / bpt, 4)}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="models/kimi-mini", help="folder with target/ and drafter/")
    ap.add_argument("--data", default="runs/data")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--what", default="ppl,accept,tput")
    ap.add_argument("--budgets", default="4,8,16,32,64")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--tput-budget", type=int, default=16)
    ap.add_argument("--ppl-windows", type=int, default=None)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--name", default="kimi-mini")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1 avoids OpenMP stalls on a busy machine)")
    ap.add_argument("--cuda-graphs", default="auto",
                    help="verify forwards and draft steps through CUDA graphs: auto (on for cuda), on, off, or "
                         "on,off to measure throughput both ways in one run (recorded as params.cuda_graphs)")
    ap.add_argument("--out", default="bench/results/demo_pair.jsonl")
    args = ap.parse_args(argv)
    modes = graph_modes(args.cuda_graphs, args.device)
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    pair = Path(args.pair)
    what = set(args.what.split(","))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    base = {"device": device_name(args.device), "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
            "commit": args.commit or git_commit(), "pair": str(pair)}
    records = []

    def emit(name: str, params: dict, metrics: dict) -> None:
        rec = {"name": f"{args.name}/{name}", "params": params, **base, "metrics": metrics,
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    if "ppl" in what:
        emit("perplexity", {"seq": args.seq, "windows": args.ppl_windows},
             perplexity(pair / "target", args.data, args.seq, args.device, args.ppl_windows))
    if what & {"accept", "tput"}:
        engine = build_local_engine(pair / "target", pair / "drafter", dtype, args.device,
                                    EngineConfig(max_sessions=32, num_pages=1024, draft_window=1024),
                                    cuda_graphs=any(modes))

        def use_graphs(on: bool) -> None:
            for g in (engine.graphs, engine.drafter.graphs):  # verify forward, draft step
                if g is not None:
                    g.enabled = on

        prompts = heldout_prompts(args.data, args.prompts, args.prompt_len)
        common = {"prompts": args.prompts, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new,
                  "topk": args.topk, "block_size": engine.drafter.cfg.block_size, "greedy": True}
        if "accept" in what:
            budgets = [int(b) for b in args.budgets.split(",")]
            use_graphs(modes[0])
            emit("acceptance", {**common, "budgets": budgets, "cuda_graphs": modes[0]},
                 acceptance_sweep(engine, prompts, budgets, args.topk, args.max_new))
        if "tput" in what:
            for c in (int(x) for x in args.concurrency.split(",")):
                for on in modes:
                    use_graphs(on)
                    ar = throughput(engine, prompts, 0, args.topk, args.max_new, c)
                    dd = throughput(engine, prompts, args.tput_budget, args.topk, args.max_new, c)
                    emit("throughput", {**common, "concurrency": c, "budget": args.tput_budget, "cuda_graphs": on,
                                        "warmup": "one identical run"},
                         {"ar": ar, "ddtree": dd, "speedup": round(dd["tokens_per_s"] / ar["tokens_per_s"], 3)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
