"""One module per `ddtree` subcommand; each has `add_parser(subparsers)` and `run(args) -> int`.

`BY_NAME` maps each subcommand to its module, so `ddtree NAME ...` can build only the parser it runs
(`gateway.cli`): the gateway and the client paths then never import torch.
"""

from gateway.commands import demo, drafter, gateway, generate, init_random, inspect, serve, verifier

COMMANDS = [init_random, generate, demo, inspect, drafter, verifier, gateway, serve]
BY_NAME = {"init-random": init_random, "generate": generate, "demo": demo, "inspect": inspect, "drafter": drafter,
           "verifier": verifier, "gateway": gateway, "serve": serve}
