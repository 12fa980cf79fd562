"""`ddtree demo`: the committed kimi-mini pair completes a Python prompt, DDTree against plain decoding.

Loads `models/kimi-mini/{target,drafter}` (a Kimi K2.6-architecture target with INT4 experts and its
DFlash drafter, trained on Python standard-library sources; see models/kimi-mini/README.md), runs greedy
autoregressive decoding and greedy DDTree on the same prompt in the embedded engine, and prints the
completion, tokens/s of both, the mean acceptance length (tokens committed per verify step) and whether
the two outputs are identical (they must be: DDTree is lossless). Without models/ (e.g. an installed
wheel) it writes the random `tiny` preset to a cache folder and says so: that shows the mechanics only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = '''import os


def read_lines(path, strip=True):
    """Return the lines of the file at path."""
'''


def default_pair() -> Path:
    return Path(__file__).resolve().parents[2] / "models" / "kimi-mini"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="generate with the committed small model pair: DDTree vs plain decoding")
    p.add_argument("--prompt", default=None, help="text to complete (default: the start of a Python function)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=16, help="DDTree draft nodes per step")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--pair", default=None, help="folder with target/ and drafter/ (default: models/kimi-mini)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: the model is small, and more threads stall on a busy machine)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run verify forwards and draft steps eagerly (default on CUDA: replayed from CUDA graphs)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _fallback_pair() -> Path:
    """The random tiny preset, written once to a cache folder."""
    from drafter_service.checkpoint import write_random_drafter
    from gateway.tokenizer import byte_tokenizer
    from verifier_service import presets
    from verifier_service.random_checkpoint import write_random_target

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddtree" / "tiny-random"
    if not (cache / "drafter" / "config.json").exists():
        tcfg = presets.target_config("tiny")
        write_random_target(cache / "target", tcfg, seed=0)
        byte_tokenizer(presets.TINY_VOCAB, presets.TINY_SPECIALS).write(cache / "target")
        write_random_drafter(cache / "drafter", presets.drafter_config("tiny"), tcfg["text_config"]["hidden_size"])
    return cache


def _decode(engine, prompt: list[int], params) -> tuple[object, float]:
    import torch

    t0 = time.perf_counter()
    s = engine.add(prompt, params)
    engine.run_until_done()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return s, time.perf_counter() - t0


def run(args) -> int:
    import torch

    from gateway.commands.host_memory import tune_glibc_malloc
    from gateway.tokenizer import Tokenizer
    from protos.serving import freeze_startup_heap
    from verifier_service.engine import EngineConfig
    from verifier_service.local import build_local_engine
    from verifier_service.session import DecodeParams

    tune_glibc_malloc()
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.budget < 1:
        raise ValueError(f"--budget must be >= 1 (the demo runs plain decoding and DDTree), got {args.budget}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    pair = Path(args.pair) if args.pair else default_pair()
    note = None
    if not (pair / "target" / "config.json").exists() or not (pair / "drafter" / "config.json").exists():
        if args.pair:
            raise FileNotFoundError(f"{pair}: expected target/ and drafter/ model folders")
        note = f"{pair} not found: using a random tiny pair (acceptance near 1; the mechanics only)"
        pair = _fallback_pair()
        print(f"ddtree demo: {note}", file=sys.stderr)
    tok = Tokenizer.load(pair / "target")
    text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    prompt = tok.encode(text)
    if not prompt:
        raise ValueError("the prompt is empty")
    engine = build_local_engine(pair / "target", pair / "drafter", device=args.device,
                                engine_cfg=EngineConfig(num_pages=512, max_sessions=2, draft_window=2048),
                                cuda_graphs=False if args.no_cuda_graphs else None)
    eos = engine.target.cfg.eos_ids
    _decode(engine, prompt[-8:], DecodeParams(max_new_tokens=2, budget=args.budget, topk=args.topk))  # warm-up
    freeze_startup_heap()  # as the servers do once warmed up: no collection walks the model during the runs
    ar, t_ar = _decode(engine, prompt, DecodeParams(max_new_tokens=args.max_new_tokens, budget=0, eos_ids=eos))
    dd, t_dd = _decode(engine, prompt, DecodeParams(max_new_tokens=args.max_new_tokens, budget=args.budget,
                                                    topk=args.topk, eos_ids=eos))
    steps = len(dd.accepted_per_step)
    result = {
        "text": tok.decode(dd.output), "prompt": text, "pair": str(pair), "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""), "budget": args.budget, "topk": args.topk,
        "block_size": engine.drafter.cfg.block_size, "prompt_tokens": len(prompt), "new_tokens": len(dd.output),
        "tokens_per_s": round(len(dd.output) / t_dd, 2), "ar_tokens_per_s": round(len(ar.output) / t_ar, 2),
        "speedup": round((len(dd.output) / t_dd) / (len(ar.output) / t_ar), 3),
        "mean_acceptance": round(sum(dd.accepted_per_step) / steps, 3) if steps else 0.0, "steps": steps,
        "ar_steps": len(ar.accepted_per_step), "identical_to_ar": dd.output == ar.output, "note": note,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(text + result["text"])
    print(f"\n[ddtree demo] {pair.name} on {result['device']} ({result['dtype']}): {result['new_tokens']} new tokens\n"
          f"  DDTree (budget {args.budget}, block {result['block_size']}): {result['tokens_per_s']:.1f} tok/s, "
          f"{steps} verify steps, mean acceptance {result['mean_acceptance']:.2f} tokens/step\n"
          f"  plain decoding:  {result['ar_tokens_per_s']:.1f} tok/s, {result['ar_steps']} steps\n"
          f"  speedup {result['speedup']:.2f}x; identical to plain decoding: {result['identical_to_ar']}",
          file=sys.stderr)
    return 0
