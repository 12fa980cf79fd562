"""`ddtree init-random`: write a random-weight model pair in the real checkpoint layouts."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    from verifier_service.presets import PRESETS

    p = sub.add_parser("init-random", help="write a random-weight model pair in the real checkpoint layouts")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="truncate the target to this many layers")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from drafter_service.checkpoint import write_random_drafter
    from gateway.tokenizer import byte_tokenizer
    from verifier_service import presets
    from verifier_service.random_checkpoint import write_random_target

    out = Path(args.out)
    tcfg = presets.target_config(args.preset, args.layers)
    dcfg = presets.drafter_config(args.preset, args.layers)
    write_random_target(out / "target", tcfg, seed=args.seed)
    write_random_drafter(out / "drafter", dcfg, tcfg["text_config"]["hidden_size"], seed=args.seed)
    if args.preset == "tiny":
        byte_tokenizer(presets.TINY_VOCAB, presets.TINY_SPECIALS).write(out / "target")
    print(json.dumps({"target": str(out / "target"), "drafter": str(out / "drafter"), "preset": args.preset}))
    return 0
