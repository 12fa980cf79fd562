"""`ddtree init-random`: write a random-weight model pair in the real checkpoint layouts.

`--preset kimi-k2.6 --layers L` writes the real K2.6 shapes and names truncated to L target layers
(layer 0 is dense, so L >= 2 holds at least one MoE layer of 384 INT4 experts, ~9.5 GB); tensors are
generated lazily shard by shard, so host memory stays around one 128 MB chunk. The drafter keeps its
layer count and taps the truncated target at the ids that still exist plus its deepest other layers
(`presets.truncated_tap_ids`; one tap per layer when the target has fewer layers than taps). `tiny` has
exactly the same names and packing at toy sizes (and a byte-level tokenizer). `--layout` picks the Kimi
K2.5/K2.6 (default), Kimi K2 or DeepSeek-V3 folder layout.
"""

from __future__ import annotations

import json
import time


def add_parser(sub) -> None:
    from verifier_service.presets import LAYOUTS, PRESETS

    p = sub.add_parser("init-random", help="write a random-weight model pair in the real checkpoint layouts")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--layout", choices=LAYOUTS, default="kimi_k25")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="truncate the target to this many layers")
    p.add_argument("--shard-gb", type=float, default=5.0, help="maximum shard size in GB")
    p.add_argument("--fast-int4", choices=("auto", "yes", "no"), default="auto",
                   help="draw INT4 words and scales directly instead of quantizing random floats "
                        "(auto: yes for experts of >= 4M elements, i.e. kimi-k2.6)")
    p.add_argument("--no-drafter", action="store_true", help="write only the target")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from drafter_service.checkpoint import write_random_drafter
    from gateway.tokenizer import byte_tokenizer
    from verifier_service import presets
    from verifier_service.random_checkpoint import write_random_target

    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    out = Path(args.out)
    t0 = time.perf_counter()
    tcfg = presets.target_config(args.preset, args.layers, args.layout)
    fast = {"auto": None, "yes": True, "no": False}[args.fast_int4]
    shards = write_random_target(out / "target", tcfg, seed=args.seed, max_shard_bytes=int(args.shard_gb * 1e9),
                                 fast_int4=fast)
    result = {"target": str(out / "target"), "preset": args.preset, "layout": args.layout, "shards": len(shards)}
    if not args.no_drafter:
        dcfg = presets.drafter_config(args.preset, args.layers)
        hidden = tcfg.get("text_config", tcfg)["hidden_size"]
        write_random_drafter(out / "drafter", dcfg, hidden, seed=args.seed, max_shard_bytes=int(args.shard_gb * 1e9))
        result["drafter"] = str(out / "drafter")
    if args.preset == "tiny":
        byte_tokenizer(presets.TINY_VOCAB, presets.TINY_SPECIALS).write(out / "target")
    result["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(result))
    return 0
