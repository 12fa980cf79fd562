"""Flags shared by the long-running `ddtree ... serve` commands (drafter, verifier), and `run_server`, which
starts them and the gateway the same way (logging, OTEL_* tracing, the event loop)."""

from __future__ import annotations

import asyncio


def add_server_flags(p) -> None:
    p.add_argument("--listen", required=True, help="HOST:PORT to serve gRPC on (port 0 = any free port; the "
                                                   "bound address is printed as a JSON line when serving)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | float64 (default: bf16 on "
                                                 "cuda, fp32 on cpu)")
    p.add_argument("--max-message-mb", type=int, default=64, help="largest gRPC message, MiB")
    p.add_argument("--grace-s", type=float, default=30.0, help="on SIGTERM, seconds in-flight calls get to finish")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--control-spin-ms", type=float, default=0.0,
                   help="co-located streams: how long the control socket's reader polls for the next message "
                        "before it sleeps (keeps its core awake for the hand-over; costs that core while polling)")
    p.add_argument("--gil-switch-us", type=float, default=0.0,
                   help="the interpreter's GIL switch interval, us (0: its default, 5000): how long a thread that "
                        "needs the GIL waits for one that runs Python (gateway.commands.gil_switch)")
    p.add_argument("--torch-trace", default=None, metavar="DIR[:FIRST[:COUNT]]",
                   help="diagnosis: profile steps FIRST.. FIRST+COUNT-1 (default 20, 10) with torch.profiler and write "
                        "a Chrome trace to DIR/<role>-<pid>.json (telemetry.torch_trace); off by default")
    p.add_argument("--metrics-listen", default=None, help="HOST:PORT to serve Prometheus metrics on (port 0 = any "
                                                          "free port; announced as a `metrics_listening` JSON line)")


def message_bytes(args) -> int:
    if args.max_message_mb <= 0:
        raise ValueError(f"--max-message-mb must be positive, got {args.max_message_mb}")
    return args.max_message_mb << 20


def run_server(serve, cfg, log_level: str, service_name: str | None = None, gil_switch_us: float = 0.0) -> int:
    """glibc malloc settings for models on worker threads (`gateway.commands.host_memory`), the GIL switch
    interval (`gateway.commands.gil_switch`), logging, tracing from the OTEL_* environment (nothing is exported when
    unset; `service_name` is the default OTEL service name), then the server until it stops."""
    import os

    from gateway.commands.gil_switch import set_gil_switch
    from gateway.commands.host_memory import tune_glibc_malloc
    from protos.serving import setup_logging

    set_gil_switch(gil_switch_us)
    tune_glibc_malloc()  # before the server's threads exist
    setup_logging(log_level)
    if service_name is not None:
        from telemetry.tracing import configure_tracing

        configure_tracing(os.environ, service_name)
    return asyncio.run(serve(cfg))
