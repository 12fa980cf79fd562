"""`ddtree generate`: generate and print the result (JSON with --json).

`--target DIR [--drafter DIR]` runs the embedded engine in this process (its JSON output is a stable
contract); `--server HOST:PORT` goes through a running gateway with the client SDK instead (API key
from DDTREE_API_KEY), reporting the same fields plus the gateway's usage.
"""

from __future__ import annotations

import json
import sys
import time


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate in-process (--target) or through a running gateway (--server)")
    where = g.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="target checkpoint folder: generate in this process")
    where.add_argument("--server", help="HOST:PORT of `ddtree gateway serve` (or `ddtree serve`)")
    g.add_argument("--drafter", default=None)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids")
    src.add_argument("--prompt")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--budget", type=int, default=16)
    g.add_argument("--topk", type=int, default=8)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: drawn at random, reported)")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--device", default=None)
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="run verify forwards and draft steps eagerly (default on CUDA: replayed from CUDA "
                        "graphs; --target only)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable; --server only)")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds (--server only)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=run)


def _parse_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {s!r}") from None


def run(args) -> int:
    if args.server is not None:
        return run_remote(args)
    if args.stop or args.timeout is not None:
        raise ValueError("--stop and --timeout apply to --server (the gateway owns stop strings and deadlines)")
    from gateway.commands.host_memory import tune_glibc_malloc
    from gateway.tokenizer import Tokenizer
    from protos.serving import freeze_startup_heap
    from verifier_service.config import KimiConfig
    from verifier_service.local import DTYPES, build_local_engine
    from verifier_service.sampling_params import SamplingParams
    from verifier_service.session import DecodeParams

    # everything a user can get wrong is checked before any weights are read
    if args.block_size is not None and args.block_size < 2:
        raise ValueError(f"--block-size must be >= 2, got {args.block_size}")
    tcfg = KimiConfig.from_file(args.target)
    tok = None
    if args.prompt is not None:
        tok = Tokenizer.load(args.target)
        prompt = tok.encode(args.prompt)
    else:
        prompt = _parse_ids(args.prompt_ids)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    params = DecodeParams(max_new_tokens=args.max_new_tokens, budget=args.budget, topk=args.topk,
                          eos_ids=tcfg.eos_ids, ignore_eos=args.ignore_eos, sampling=sampling)
    if not prompt:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < tcfg.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {tcfg.vocab_size})")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}")
    drafter_dir = args.drafter if args.budget > 0 else None
    if args.budget > 0 and args.drafter is None:
        raise ValueError("--budget > 0 needs --drafter (use --budget 0 for plain autoregressive decoding)")
    engine = build_local_engine(args.target, drafter_dir, DTYPES[args.dtype], args.device,
                                block_size=args.block_size, cuda_graphs=False if args.no_cuda_graphs else None)
    tune_glibc_malloc()
    freeze_startup_heap()  # as the servers do: no collection walks the model during the run
    t0 = time.perf_counter()
    s = engine.add(prompt, params)
    engine.run_until_done()
    dt = time.perf_counter() - t0
    if tok is None:
        try:
            tok = Tokenizer.load(args.target)
        except FileNotFoundError:
            tok = None
    steps = len(s.accepted_per_step)
    result = {
        "mode": "ddtree" if args.budget > 0 else "ar", "tokens": s.output, "text": tok.decode(s.output) if tok else "",
        "steps": steps, "accepted_per_step": s.accepted_per_step,
        "mean_acceptance": (sum(s.accepted_per_step) / steps) if steps else 0.0,
        "budget": args.budget, "topk": args.topk,
        "block_size": engine.drafter.cfg.block_size if engine.drafter else None,
        "prompt_tokens": len(prompt), "finish_reason": s.finish_reason, "seconds": dt,
        "tokens_per_s": len(s.output) / dt if dt > 0 else 0.0, "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "seed": s.seed, "sampling": sampling.to_dict(),  # seed = the one used (drawn when --seed was not given)
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        print(f"[{result['mode']}] {len(s.output)} tokens, {steps} steps, mean acceptance "
              f"{result['mean_acceptance']:.2f}, {result['tokens_per_s']:.1f} tok/s"
              + ("" if sampling.greedy else f", seed {s.seed}"), file=sys.stderr)
    return 0


def run_remote(args) -> int:
    """Through a running gateway (no torch imported)."""
    import os

    from gateway.client import GatewayClient, GatewayError
    from gateway.commands.gateway import API_KEY_ENV

    if args.drafter is not None or args.block_size is not None:
        raise ValueError("--drafter and --block-size describe a local model; the server has its own")
    if args.no_cuda_graphs:
        raise ValueError("--no-cuda-graphs applies to --target (the server's verifier has its own flag)")
    source = {"text": args.prompt} if args.prompt is not None else {"token_ids": _parse_ids(args.prompt_ids)}
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    t0 = time.perf_counter()
    try:
        with GatewayClient(args.server, api_key=os.environ.get(API_KEY_ENV) or None) as client:
            r = client.generate(**source, max_tokens=args.max_new_tokens, draft_budget=args.budget,
                                draft_topk=args.topk, ignore_eos=args.ignore_eos, stop=args.stop,
                                timeout=args.timeout, **sampling)
    except GatewayError as e:
        print(f"ddtree generate: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    u = r.usage
    result = {
        "mode": "server", "server": args.server, "tokens": r.token_ids, "text": r.text, "steps": u.steps,
        "accepted_per_step": r.accepted_per_step, "mean_acceptance": u.mean_accepted_length,
        "budget": args.budget, "topk": args.topk, "prompt_tokens": u.prompt_tokens,
        "finish_reason": u.finish_reason, "seconds": dt, "tokens_per_s": len(r.token_ids) / dt if dt > 0 else 0.0,
        "seed": u.seed, "sampling": {**sampling, "seed": u.seed if u.seed is not None else args.seed},
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(r.text)
        print(f"[server {args.server}] {len(r.token_ids)} tokens, {u.steps} steps, mean acceptance "
              f"{u.mean_accepted_length:.2f}, {result['tokens_per_s']:.1f} tok/s"
              + (f", seed {u.seed}" if u.seed is not None else ""), file=sys.stderr)
    return 0
