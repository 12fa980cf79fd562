"""One module per `ddtree` subcommand; each has `add_parser(subparsers)` and `run(args) -> int`."""

from gateway.commands import demo, generate, init_random

COMMANDS = [init_random, generate, demo]
