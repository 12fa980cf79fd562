"""`GrpcServer.set_serving` freezes the start-up heap before it reports SERVING: collections during serving then
walk only what serving allocated, not the model and everything imported (`protos.serving.freeze_startup_heap`)."""

from __future__ import annotations

import asyncio
import gc

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.serving import GrpcServer


def test_set_serving_freezes_the_start_up_heap_then_reports_serving():
    class Loaded:  # an object of the loaded service: alive when the server says it is ready
        pass

    async def main():
        server = GrpcServer("127.0.0.1:0", ["ddtree.v1.Test"], 1 << 20, 0.0)
        address = await server.start()
        loaded = Loaded()
        async with grpc.aio.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            req = health_pb2.HealthCheckRequest(service="ddtree.v1.Test")
            assert (await stub.Check(req)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            gc.unfreeze()
            await server.set_serving()
            frozen = gc.get_freeze_count()
            assert (await stub.Check(req)).status == health_pb2.HealthCheckResponse.SERVING
        await server.drain()
        return loaded, frozen

    try:
        loaded, frozen = asyncio.run(main())
        assert frozen > 1000  # everything imported and built by then (modules, grpc, this test's objects)
        assert gc.is_tracked(loaded) and not any(o is loaded for o in gc.get_objects())  # frozen: never walked
    finally:
        gc.unfreeze()
