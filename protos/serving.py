"""gRPC server plumbing shared by the DDTree services (drafter, verifier, gateway).

`GrpcServer` owns what every service needs the same way: a grpc.aio server with message-size
limits, the standard grpc.health.v1 service (NOT_SERVING until the service says it is loaded and
warmed up), server reflection, one JSON line on stdout per lifecycle event
(`{"event": "listening" | "serving" | "stopped", "address": ...}`), SIGTERM/SIGINT handling and a
graceful drain: health goes NOT_SERVING and stays reachable for a short notice period (so probes
and load balancers see it; servicers refuse new work meanwhile), then the listener closes and
in-flight calls get the rest of `grace_s` seconds to finish before they are cancelled. Optional server
interceptors (trace context: `telemetry.grpc_tracing`) and `serve_metrics` for `--metrics-listen`. No torch.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)
DRAIN_NOTICE_S = 1.0  # NOT_SERVING is visible this long before the listener closes (bounded by grace)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def split_host_port(listen: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); ValueError with the expected form otherwise."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen address {listen!r} must look like HOST:PORT (for example 127.0.0.1:50051)")
    return host, int(port)


class GrpcServer:
    def __init__(self, listen: str, service_names: list[str], max_message_bytes: int, grace_s: float,
                 interceptors: list[grpc.aio.ServerInterceptor] | None = None, metrics_listen: str | None = None):
        if max_message_bytes <= 0 or grace_s < 0:
            raise ValueError("max message size must be positive and the grace period non-negative")
        self.listen = listen
        self.service_names = list(service_names)
        self.grace_s = grace_s
        self.server = grpc.aio.server(options=channel_options(max_message_bytes), interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        self.address = ""
        self.stop_requested = asyncio.Event()
        self.draining = False
        self.metrics_listen = metrics_listen  # served from start() until the end of drain()
        self.metrics_server = None

    async def start(self) -> str:
        """Bind and start; every service reports NOT_SERVING. Returns the bound address."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.listen.startswith("unix:"):
            self.server.add_insecure_port(self.listen)
            self.address = self.listen
        else:
            host, _ = split_host_port(self.listen)
            port = self.server.add_insecure_port(self.listen)
            if port == 0:
                raise OSError(f"cannot listen on {self.listen}")
            self.address = f"{host}:{port}"
        await self.server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        announce("listening", self.address)
        self.metrics_server = serve_metrics(self.metrics_listen)
        return self.address

    async def set_serving(self) -> None:
        """Loaded and warmed up: freeze the start-up heap (`freeze_startup_heap`), then health SERVING."""
        freeze_startup_heap()
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        announce("serving", self.address)

    async def drain(self) -> None:
        """Health NOT_SERVING (servicers check `draining` and refuse new work), a short notice
        period, then stop accepting and give in-flight calls the rest of grace_s."""
        self.draining = True
        await self.health.enter_graceful_shutdown()
        log.info("draining: in-flight calls have %.1f s", self.grace_s)
        notice = min(DRAIN_NOTICE_S, self.grace_s)
        await asyncio.sleep(notice)
        await self.server.stop(self.grace_s - notice)
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        announce("stopped", self.address)


def cancel_quietly(task: asyncio.Future) -> None:
    """Cancel a task whose outcome nobody will read. A task can still end with an exception after cancel() (a
    read of a stream whose RPC has just finished raises UsageError before the cancellation lands); retrieving it
    keeps asyncio from logging "Task exception was never retrieved" when the task is collected."""
    task.cancel()
    task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (modules, the model's modules and parameters, compiled
    kernels and graphs: ~300k objects in a verifier) to the interpreter's permanent generation (gc.freeze).
    Later collections then only walk what serving allocated: a full collection of the start-up heap takes
    ~0.1 s on a 2-core CI box, a pause that would otherwise land inside some step (its p90). Unfrozen at exit,
    so that the interpreter's last collections free it as usual (extensions report leaks otherwise)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this runs
    atexit.register(gc.unfreeze)


def serve_metrics(listen: str | None):
    """Start the Prometheus exposition server of `--metrics-listen HOST:PORT` (port 0 = any free port) on
    the process registry and announce `{"event": "metrics_listening", "address": ...}`; None when unset.
    The caller closes the returned server."""
    if not listen:
        return None
    from telemetry.metrics import parse_hostport, start_metrics_server

    host, port = parse_hostport(listen)
    server = start_metrics_server(host, port)
    announce("metrics_listening", f"{listen.rpartition(':')[0]}:{server.port}")
    return server


def announce(event: str, address: str, **extra) -> None:
    print(json.dumps({"event": event, "address": address, **extra}), flush=True)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
