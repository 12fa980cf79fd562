"""`ddtree drafter serve`: the DFlash drafter as a gRPC service (ddtree.v1.Drafter)."""

from __future__ import annotations

from gateway.commands.server_flags import add_server_flags, message_bytes, run_server


def add_parser(sub) -> None:
    p = sub.add_parser("drafter", help="the drafter service")
    verbs = p.add_subparsers(dest="verb", required=True)
    s = verbs.add_parser("serve", help="serve the DFlash drafter over gRPC")
    s.add_argument("--target", required=True, help="target checkpoint folder (its embed_tokens and lm_head are read)")
    s.add_argument("--drafter", required=True, help="DFlash drafter checkpoint folder")
    add_server_flags(s)
    s.add_argument("--max-sessions", type=int, default=64, help="sessions with a context cache, all streams together")
    s.add_argument("--draft-window", type=int, default=2048, help="context rows kept per session")
    s.add_argument("--no-cuda-graphs", action="store_true",
                   help="run draft steps eagerly (default on CUDA: replayed from CUDA graphs)")
    s.set_defaults(func=run)


def config_from_args(args):
    from drafter_service.server import DrafterServerConfig

    return DrafterServerConfig(listen=args.listen, target_dir=args.target, drafter_dir=args.drafter,
                               device=args.device, dtype=args.dtype, max_sessions=args.max_sessions,
                               draft_window=args.draft_window, max_message_bytes=message_bytes(args),
                               grace_s=args.grace_s, metrics_listen=args.metrics_listen,
                               cuda_graphs=False if args.no_cuda_graphs else None,
                               control_spin_ms=args.control_spin_ms, torch_trace=args.torch_trace)


def run(args, make_drafter=None) -> int:
    import functools

    from drafter_service.server import serve

    serve_fn = functools.partial(serve, make_drafter=make_drafter) if make_drafter is not None else serve
    return run_server(serve_fn, config_from_args(args), args.log_level, "ddtree-drafter", args.gil_switch_us)
