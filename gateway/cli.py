"""The `ddtree` command line. Flags and environment are read here (and in gateway/commands/) only.

  ddtree init-random --preset tiny --out DIR [--seed S]
  ddtree generate --target DIR --drafter DIR (--prompt-ids 1,2,3 | --prompt TEXT) --max-new-tokens N
                  --budget B [--topk K] [--block-size S] [--json]
                  [--temperature T] [--top-p P] [--top-k K] [--seed S]   (default greedy; seed reported)
  ddtree generate --server HOST:PORT (--prompt-ids ... | --prompt TEXT) ...   (through a running gateway)
  ddtree serve [--target DIR --drafter DIR] [--host H] [--port P] [--http-port Q]   (all three services)
  ddtree gateway serve --listen HOST:PORT --http-listen HOST:PORT --verifier-address HOST:PORT --tokenizer DIR
  ddtree verifier serve ... / ddtree drafter serve ...

`ddtree NAME ...` builds only NAME's parser (the others may import torch); `ddtree --help` builds all.
"""

from __future__ import annotations

import argparse
import sys


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or only subcommand `only` (when it exists)."""
    from gateway.commands import BY_NAME, COMMANDS

    p = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding for Kimi K2.6")
    sub = p.add_subparsers(dest="command", required=True)
    for cmd in [BY_NAME[only]] if only in BY_NAME else COMMANDS:
        cmd.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ddtree {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
