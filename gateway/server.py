"""The gateway process: gRPC `ddtree.v1.Gateway` + OpenAI-compatible HTTP + Prometheus, on one event loop.

Startup: load the tokenizer (and chat template), listen on gRPC (health NOT_SERVING), HTTP and the
metrics port, wait until the verifier serves, learn its limits (Info), then report SERVING. A
watcher keeps `/health` and GatewayInfo.verifier_ready current afterwards; requests while the
verifier is down fail with UNAVAILABLE / 503. Idle sessions are closed by a reaper.
SIGTERM/SIGINT drain: health NOT_SERVING, new requests UNAVAILABLE / 503, in-flight streams get the
grace period, then the sessions' KV on the verifier is released and the process exits.
No torch in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from gateway.core import GatewayCore
from gateway.grpc_service import GatewayService
from gateway.http_api import OpenAIRoutes
from gateway.session_api import SessionAPI
from gateway.state import GatewayConfig, GatewayState
from gateway.text_tokenizer import load_text_tokenizer
from gateway.verifier_client import VerifierClient
from protos.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from protos.serving import GrpcServer, announce, split_host_port
from telemetry.grpc_tracing import DEFAULT_EXCLUDE, TracingServerInterceptor
from telemetry.metrics import process_metrics

log = logging.getLogger(__name__)
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
# Generate opens its own GenAI SERVER span in GatewayCore (shared with the HTTP routes); the interceptor
# traces the other RPCs (sessions, Info, ListModels) the way the verifier and the drafter trace theirs
UNTRACED = (*DEFAULT_EXCLUDE, f"/{SERVICE_NAME}/Generate")
WATCH_PERIOD_S = 2.0


async def _start_http(routes: OpenAIRoutes, listen: str, grace_s: float) -> tuple[web.AppRunner, str]:
    host, port = split_host_port(listen)
    runner = web.AppRunner(routes.app(), handler_cancellation=True, shutdown_timeout=grace_s, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]"), port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, f"{host}:{bound}"


async def _watch_verifier(state: GatewayState) -> None:
    """Keep `state.verifier_ready` current (health checks of the verifier)."""
    while True:
        await asyncio.sleep(WATCH_PERIOD_S)
        ok = await state.verifier.serving(timeout=WATCH_PERIOD_S)
        if ok != state.verifier_ready:
            log.warning("verifier at %s is %s", state.cfg.verifier_address, "serving again" if ok else "not serving")
        state.verifier_ready = ok


async def serve(cfg: GatewayConfig) -> int:
    metrics = process_metrics()
    tokenizer = await asyncio.to_thread(load_text_tokenizer, cfg.tokenizer_dir)
    verifier = VerifierClient(cfg.verifier_address, cfg.max_message_bytes)
    state = GatewayState(cfg, tokenizer, verifier, metrics)
    core, sessions = GatewayCore(state), SessionAPI(state)
    server = GrpcServer(cfg.listen, [SERVICE_NAME], cfg.max_message_bytes, cfg.grace_s,
                        interceptors=[TracingServerInterceptor(exclude_prefixes=UNTRACED)],
                        metrics_listen=cfg.metrics_listen)  # the process registry: the one `metrics` records into
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayService(state, core, sessions), server.server)
    await server.start()
    runner = None
    tasks: list[asyncio.Task] = []
    try:
        if cfg.http_listen:
            runner, http_address = await _start_http(OpenAIRoutes(state, core, sessions), cfg.http_listen, cfg.grace_s)
            announce("http_listening", http_address)
        vmodel = await verifier.wait_ready(server.stop_requested)
        if vmodel is not None:
            state.attach(vmodel)
            log.info("gateway serving %s (tokenizer %s, chat template %s) for the verifier at %s",
                     state.model_name, tokenizer.kind, "yes" if state.template else "no", cfg.verifier_address)
            await server.set_serving()
            tasks = [asyncio.ensure_future(_watch_verifier(state)), asyncio.ensure_future(sessions.reap())]
            await server.stop_requested.wait()
    finally:
        state.draining = True
        for t in tasks:
            t.cancel()
        drains = [server.drain()] + ([runner.cleanup()] if runner is not None else [])
        await asyncio.gather(*drains, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sessions.close_all(), 10)
        await verifier.close()
    return 0
