"""Peer for the gRPC transport (issue 4): the round trip of a bare bidirectional gRPC stream on loopback.

A grpc.aio server echoes raw bytes on one stream (its own thread and event loop, like the drafter's
server); the client side is built the way `verifier_service.transport_stream` builds its Draft stream
(a sync channel, requests through a queue the call's iterator thread drains, answers through a reader
thread and a queue), and, for comparison, with the caller reading the call itself (`next(call)`, no
reader thread) and as a grpc.aio call driven from the caller's thread (`run_until_complete`). The
measured round trip is what the gRPC transport cannot go below per step, before any tensor is
encoded, checked or copied off a GPU: the rest of `transport` in `bench_transport.py`'s breakdown is ours.

  PYTHONPATH=. python bench/grpc_echo.py [--sizes 1000 20000 80000 300000] [--n 2000] [--out FILE]

One JSON line per (client, size): name grpc_echo, params {client, bytes, n}, ms (median round trip),
p90_ms, host facts (cpu count, grpcio, python), commit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import queue
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import commit, write_jsonl  # noqa: E402

SERVICE, METHOD = "bench.Echo", "Stream"
PATH = f"/{SERVICE}/{METHOD}"


def _same(b: bytes) -> bytes:
    return b


def start_server() -> int:
    """The echo server on its own thread and event loop -> its port."""
    ports: queue.Queue = queue.Queue()

    async def serve() -> None:
        server = grpc.aio.server()

        async def echo(request_iterator, _context):
            async for m in request_iterator:
                yield m

        handler = grpc.stream_stream_rpc_method_handler(echo, request_deserializer=_same, response_serializer=_same)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler})])
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    threading.Thread(target=lambda: asyncio.run(serve()), name="echo-server", daemon=True).start()
    return ports.get(timeout=30)


def _sync_call(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    requests: queue.Queue = queue.Queue()
    call = channel.stream_stream(PATH, request_serializer=_same, response_deserializer=_same)(iter(requests.get, None))
    return channel, requests, call


def rounds_reader_thread(port: int, msg: bytes, n: int) -> list[float]:
    """As verifier_service.draft_call.DraftCall: request queue -> iterator thread; reader thread -> answer queue."""
    channel, requests, call = _sync_call(port)
    answers: queue.Queue = queue.Queue()

    def read() -> None:
        for r in call:
            answers.put(r)

    reader = threading.Thread(target=read, name="echo-reader", daemon=True)
    reader.start()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        requests.put(msg)
        answers.get(timeout=10)
        out.append(time.perf_counter() - t)
    requests.put(None)  # ends the stream: the server returns, the reader sees the end
    reader.join(10)
    channel.close()
    return out


def rounds_direct(port: int, msg: bytes, n: int) -> list[float]:
    """The caller reads the call itself (no reader thread, no timeout)."""
    channel, requests, call = _sync_call(port)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        requests.put(msg)
        next(call)
        out.append(time.perf_counter() - t)
    requests.put(None)
    for _ in call:  # to the end of the stream
        pass
    channel.close()
    return out


_LOOP = None  # grpc.aio binds its completion queue poller to the first event loop it runs on: keep one


def rounds_aio(port: int, msg: bytes, n: int) -> list[float]:
    """A grpc.aio call driven from the caller's thread (its own event loop, run per round trip)."""
    global _LOOP
    loop = _LOOP = _LOOP or asyncio.new_event_loop()

    async def open_call():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return channel, channel.stream_stream(PATH, request_serializer=_same, response_deserializer=_same)()

    channel, call = loop.run_until_complete(open_call())

    async def round_trip():
        await call.write(msg)
        return await call.read()

    out = []
    for _ in range(n):
        t = time.perf_counter()
        loop.run_until_complete(round_trip())
        out.append(time.perf_counter() - t)
    async def close() -> None:
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
        await channel.close()

    loop.run_until_complete(close())
    return out


CLIENTS = {"reader_thread": rounds_reader_thread, "direct": rounds_direct, "aio_caller_loop": rounds_aio}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 20000, 80000, 300000], help="message bytes")
    ap.add_argument("--n", type=int, default=2000, help="timed round trips per (client, size)")
    ap.add_argument("--out", default="bench/results/grpc_echo.jsonl")
    args = ap.parse_args(argv)
    port = start_server()
    host = dict(cpus=os.cpu_count(), grpcio=grpc.__version__, python=platform.python_version())
    records = []
    for size in args.sizes:
        msg = b"x" * size
        for name, fn in CLIENTS.items():
            fn(port, msg, max(10, args.n // 10))  # warm-up
            ts = sorted(fn(port, msg, args.n))
            med, p90 = ts[len(ts) // 2] * 1e3, ts[int(len(ts) * 0.9)] * 1e3
            rec = dict(name="grpc_echo", params=dict(client=name, bytes=size, n=args.n), ms=med, p90_ms=p90,
                       commit=commit(), **host)
            records.append(rec)
            print(f"{size:>8} B  {name:>16}  median {med * 1e3:7.1f} us  p90 {p90 * 1e3:7.1f} us", flush=True)
    write_jsonl(args.out, records)
    return records


if __name__ == "__main__":
    main()
