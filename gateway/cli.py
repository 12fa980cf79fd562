"""The `ddtree` command line. Flags and environment are read here (and in gateway/commands/) only.

  ddtree init-random --preset tiny --out DIR [--seed S]
  ddtree generate --target DIR --drafter DIR (--prompt-ids 1,2,3 | --prompt TEXT) --max-new-tokens N
                  --budget B [--topk K] [--block-size S] [--json]
                  [--temperature T] [--top-p P] [--top-k K] [--seed S]   (default greedy; seed reported)
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from gateway.commands import COMMANDS

    p = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding for Kimi K2.6")
    sub = p.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS:
        cmd.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ddtree {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
