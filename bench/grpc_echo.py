"""Peer for the gRPC transport (issue 4): the round trip of a bare bidirectional gRPC stream on loopback.

A grpc.aio server echoes raw bytes on one stream (its own thread and event loop, like the drafter's
server); the client side is built the way `verifier_service.transport_stream` builds its Draft stream
(a sync channel, requests through a queue the call's iterator thread drains, answers through a reader
thread and a queue), and, for comparison, with the caller reading the call itself (`next(call)`, no
reader thread) and as a grpc.aio call driven from the caller's thread (`run_until_complete`). The
measured round trip is what the gRPC transport cannot go below per step, before any tensor is
encoded, checked or copied off a GPU: the rest of `transport` in `bench_transport.py`'s breakdown is ours.

  PYTHONPATH=. python bench/grpc_echo.py [--sizes 1000 20000 80000 300000] [--n 2000] [--out FILE]
                                         [--gap-ms 0 10] [--keepwarm-ms 0 3]

`--gap-ms`: the caller sleeps this long before each round trip, as the verifier's stream is silent for a verify
step between an answer and the next request (a message after ~5 ms of silence is slower on both sides);
`--keepwarm-ms`: the reader_thread client's request iterator sends empty messages (dropped by the server) on the
Draft stream's KeepWarm plan with this period (`verifier_service.keepwarm`: one shortly before the next answer or
request is expected).

One JSON line per (client, size, gap, keep-warm): name grpc_echo, params {client, bytes, n, gap_ms, keepwarm_ms},
ms (median round trip), p90_ms, host facts (cpu count, grpcio, python), commit.
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
from verifier_service.keepwarm import KeepWarmPlan, paced  # noqa: E402

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
                if m:  # empty: a keep-warm message, no answer
                    yield m

        handler = grpc.stream_stream_rpc_method_handler(echo, request_deserializer=_same, response_serializer=_same)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler})])
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    threading.Thread(target=lambda: asyncio.run(serve()), name="echo-server", daemon=True).start()
    return ports.get(timeout=30)


def _sync_call(port: int, plan: KeepWarmPlan | None = None):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    requests: queue.Queue = queue.Queue()
    call = channel.stream_stream(PATH, request_serializer=_same, response_deserializer=_same)(
        paced(requests, b"", plan))
    return channel, requests, call


def rounds_reader_thread(port: int, msg: bytes, n: int, gap_s: float = 0.0, keepwarm_s: float = 0.0) -> list[float]:
    """As verifier_service.draft_call.DraftCall: request queue -> iterator thread; reader thread -> answer queue."""
    plan = KeepWarmPlan(keepwarm_s)
    channel, requests, call = _sync_call(port, plan)
    answers: queue.Queue = queue.Queue()

    def read() -> None:
        for r in call:
            plan.answered()
            answers.put(r)

    reader = threading.Thread(target=read, name="echo-reader", daemon=True)
    reader.start()
    out = []
    for _ in range(n):
        time.sleep(gap_s)
        t = time.perf_counter()
        plan.sent()
        requests.put(msg)
        answers.get(timeout=10)
        out.append(time.perf_counter() - t)
    requests.put(None)  # ends the stream: the server returns, the reader sees the end
    reader.join(10)
    channel.close()
    return out


def rounds_direct(port: int, msg: bytes, n: int, gap_s: float = 0.0) -> list[float]:
    """The caller reads the call itself (no reader thread, no timeout)."""
    channel, requests, call = _sync_call(port)
    out = []
    for _ in range(n):
        time.sleep(gap_s)
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


def rounds_aio(port: int, msg: bytes, n: int, gap_s: float = 0.0) -> list[float]:
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
        time.sleep(gap_s)
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
    ap.add_argument("--gap-ms", type=float, nargs="+", default=[0.0], help="silence before each round trip")
    ap.add_argument("--keepwarm-ms", type=float, nargs="+", default=[0.0],
                    help="reader_thread client: empty messages on the KeepWarm plan with this period (0: none)")
    ap.add_argument("--out", default="bench/results/grpc_echo.jsonl")
    args = ap.parse_args(argv)
    port = start_server()
    host = dict(cpus=os.cpu_count(), grpcio=grpc.__version__, python=platform.python_version())
    records = []
    runs = [(name, fn, gap, kw) for gap in args.gap_ms for name, fn in CLIENTS.items()
            for kw in (args.keepwarm_ms if name == "reader_thread" else [0.0])]
    for size in args.sizes:
        msg = b"x" * size
        for name, fn, gap, kw in runs:
            opts = dict(gap_s=gap / 1e3, **({"keepwarm_s": kw / 1e3} if kw else {}))
            fn(port, msg, max(10, args.n // 10), **opts)  # warm-up
            ts = sorted(fn(port, msg, args.n, **opts))
            med, p90 = ts[len(ts) // 2] * 1e3, ts[int(len(ts) * 0.9)] * 1e3
            rec = dict(name="grpc_echo", params=dict(client=name, bytes=size, n=args.n, gap_ms=gap, keepwarm_ms=kw),
                       ms=med, p90_ms=p90, commit=commit(), **host)
            records.append(rec)
            print(f"{size:>8} B  {name:>16}  gap {gap:4.1f} ms  keep-warm {kw:3.1f} ms  median {med * 1e3:7.1f} us  "
                  f"p90 {p90 * 1e3:7.1f} us", flush=True)
    write_jsonl(args.out, records)
    return records


if __name__ == "__main__":
    main()
