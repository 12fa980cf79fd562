"""The gateway starts its telemetry like the verifier and the drafter: `run_server` (OTEL_* tracing with the
default service name ddtree-gateway), `--metrics-listen` checked up front and served by GrpcServer, and
the gRPC interceptor tracing every RPC but Generate (whose GenAI SERVER span GatewayCore opens)."""

from __future__ import annotations

import pytest

from gateway.cli import build_parser
from gateway.commands import gateway as gateway_cmd
from gateway.state import GatewayConfig

ARGV = ["gateway", "serve", "--listen", "127.0.0.1:0", "--verifier-address", "127.0.0.1:1", "--tokenizer", "t"]


def test_gateway_serve_goes_through_run_server(monkeypatch):
    from gateway.server import serve

    seen = []
    monkeypatch.setattr(gateway_cmd, "run_server", lambda *a: seen.append(a) or 0)
    for extra, want in (([], None), (["--metrics-listen", "0.0.0.0:9400"], "0.0.0.0:9400")):
        args = build_parser().parse_args([*ARGV, *extra, "--log-level", "DEBUG"])
        assert args.func(args) == 0
        fn, cfg, level, name = seen.pop()
        assert (fn, cfg.metrics_listen, level, name) == (serve, want, "DEBUG", "ddtree-gateway")


def test_bad_metrics_listen_is_refused_before_anything_starts():
    for bad in ("9400", "host:port", "127.0.0.1:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            GatewayConfig("127.0.0.1:0", None, "127.0.0.1:1", "t", metrics_listen=bad)


def test_only_generate_is_left_to_the_core():
    from gateway.server import SERVICE_NAME, UNTRACED

    assert f"/{SERVICE_NAME}/Generate" in UNTRACED
    assert not any(f"/{SERVICE_NAME}/{rpc}".startswith(UNTRACED) for rpc in ("CreateSession", "CloseSession", "Info"))
