"""`ddtree gateway serve`: the gateway as a process (gRPC ddtree.v1.Gateway + OpenAI HTTP + metrics).

    ddtree gateway serve --listen HOST:PORT --http-listen HOST:PORT --verifier-address HOST:PORT
                         --tokenizer DIR [--model-name NAME] [--max-queue N] [--metrics-listen HOST:PORT]

The API key comes from the environment variable DDTREE_API_KEY (unset = no authentication); OTel
tracing from the standard OTEL_* variables. Both are read here and nowhere else.
"""

from __future__ import annotations

import os

from gateway.commands.server_flags import run_server

API_KEY_ENV = "DDTREE_API_KEY"


def add_parser(sub) -> None:
    p = sub.add_parser("gateway", help="the gateway service (sessions, sampling, streaming gRPC, OpenAI HTTP)")
    verbs = p.add_subparsers(dest="verb", required=True)
    s = verbs.add_parser("serve", help="serve the gateway (API key from the env var DDTREE_API_KEY)")
    s.add_argument("--listen", required=True, help="HOST:PORT for gRPC (port 0 = any free port; the bound address "
                                                   "is printed as a JSON line)")
    s.add_argument("--http-listen", default=None, help="HOST:PORT for the OpenAI-compatible HTTP API, /health and "
                                                       "/metrics (default: no HTTP)")
    s.add_argument("--verifier-address", required=True, help="HOST:PORT of `ddtree verifier serve`")
    s.add_argument("--tokenizer", required=True, help="folder with tiktoken.model + tokenizer_config.json (Kimi) "
                                                      "or tokenizer.json (Hugging Face): the target checkpoint")
    s.add_argument("--model-name", default=None, help="model name clients use (default: the verifier's model)")
    s.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot; beyond: "
                                                              "RESOURCE_EXHAUSTED / HTTP 429")
    s.add_argument("--metrics-listen", default=None, help="HOST:PORT for a separate Prometheus endpoint")
    s.add_argument("--max-concurrency", type=int, default=0, help="requests generating at once (default: the "
                                                                  "verifier's max sessions)")
    s.add_argument("--max-sessions", type=int, default=1024, help="multi-turn sessions held at once")
    s.add_argument("--session-idle-timeout-s", type=float, default=900.0, help="close sessions idle this long")
    s.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request sets none")
    s.add_argument("--draft-budget", type=int, default=16, help="default draft-tree nodes per step (0 = AR)")
    s.add_argument("--draft-topk", type=int, default=8, help="default per-depth top-k of the draft tree")
    s.add_argument("--max-message-mb", type=int, default=64, help="largest gRPC message, MiB")
    s.add_argument("--grace-s", type=float, default=30.0, help="on SIGTERM, seconds in-flight streams get")
    s.add_argument("--log-level", default="INFO")
    s.set_defaults(func=run)


def config_from_args(args, env=None):
    from gateway.state import GatewayConfig

    env = os.environ if env is None else env
    if args.max_message_mb <= 0:
        raise ValueError(f"--max-message-mb must be positive, got {args.max_message_mb}")
    return GatewayConfig(
        listen=args.listen, http_listen=args.http_listen, verifier_address=args.verifier_address,
        tokenizer_dir=args.tokenizer, model_name=args.model_name, max_queue=args.max_queue,
        max_concurrency=args.max_concurrency, max_sessions=args.max_sessions,
        session_idle_timeout_s=args.session_idle_timeout_s, default_max_tokens=args.default_max_tokens,
        default_draft_budget=args.draft_budget, default_draft_topk=args.draft_topk,
        metrics_listen=args.metrics_listen, api_key=env.get(API_KEY_ENV) or None,
        max_message_bytes=args.max_message_mb << 20, grace_s=args.grace_s)


def run(args) -> int:
    from gateway.server import serve

    # logging, then tracing from OTEL_* exactly as the verifier and the drafter set it up
    return run_server(serve, config_from_args(args), args.log_level, "ddtree-gateway")
