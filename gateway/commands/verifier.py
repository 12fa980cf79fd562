"""`ddtree verifier serve`: the target model and its scheduler as a gRPC service (ddtree.v1.Verifier)."""

from __future__ import annotations

from gateway.commands.server_flags import add_server_flags, message_bytes, run_server


def add_parser(sub) -> None:
    from verifier_service.transport import TRANSPORTS

    p = sub.add_parser("verifier", help="the verifier service")
    verbs = p.add_subparsers(dest="verb", required=True)
    s = verbs.add_parser("serve", help="serve the target (sessions, streaming, continuous batching) over gRPC")
    s.add_argument("--target", required=True, help="target checkpoint folder")
    s.add_argument("--drafter-address", default=None, help="HOST:PORT (or unix:PATH) of `ddtree drafter serve`")
    s.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="how trees and context travel: inprocess (needs --drafter), colocated (shared memory / "
                        "CUDA IPC; default when the drafter address is on this host) or grpc (bytes)")
    s.add_argument("--drafter", default=None, help="drafter checkpoint folder, for --transport inprocess")
    add_server_flags(s)
    s.add_argument("--max-sessions", type=int, default=64, help="sessions holding KV at once")
    s.add_argument("--kv-pages", type=int, default=2048, help="KV cache pages")
    s.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    s.add_argument("--max-session-len", type=int, default=8192, help="cache rows per session")
    s.add_argument("--draft-window", type=int, default=2048, help="drafter context rows kept per session")
    s.add_argument("--draft-timeout-s", type=float, default=5.0,
                   help="a draft step slower than this falls back to autoregressive and reconnects")
    s.add_argument("--no-cuda-graphs", action="store_true",
                   help="run verify forwards eagerly (default on CUDA: replayed from CUDA graphs)")
    s.set_defaults(func=run)


def run(args) -> int:
    from verifier_service.server import VerifierServerConfig, serve
    from verifier_service.transport import resolve_transport

    transport = resolve_transport(args.transport, args.drafter_address, args.drafter)
    cfg = VerifierServerConfig(
        listen=args.listen, target_dir=args.target, transport=transport, drafter_address=args.drafter_address,
        drafter_dir=args.drafter, device=args.device, dtype=args.dtype, max_sessions=args.max_sessions,
        kv_pages=args.kv_pages, page_size=args.page_size, max_session_len=args.max_session_len,
        draft_window=args.draft_window, draft_timeout_s=args.draft_timeout_s,
        max_message_bytes=message_bytes(args), grace_s=args.grace_s, metrics_listen=args.metrics_listen,
        cuda_graphs=False if args.no_cuda_graphs else None)
    return run_server(serve, cfg, args.log_level, "ddtree-verifier")
