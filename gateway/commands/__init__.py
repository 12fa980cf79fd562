"""One module per `ddtree` subcommand; each has `add_parser(subparsers)` and `run(args) -> int`."""

from gateway.commands import demo, drafter, generate, init_random, inspect, verifier

COMMANDS = [init_random, generate, demo, inspect, drafter, verifier]
