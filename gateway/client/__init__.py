"""Client SDK of the DDTree gateway (`ddtree.v1.Gateway` over gRPC): blocking and asyncio clients with
streaming iterators, deadlines (`timeout=`), retries on UNAVAILABLE for idempotent calls, typed results.

    from gateway.client import GatewayClient
    with GatewayClient("127.0.0.1:50050") as c:
        print(c.generate("def hello():", max_tokens=32).text)

Importing it pulls in grpcio and the generated stubs only (no torch, no server code).
"""

from gateway.client.aio import AsyncGatewayClient, AsyncGenerationStream
from gateway.client.sync import GatewayClient, GenerationStream
from gateway.client.types import (
    Chunk,
    GatewayError,
    Message,
    ModelCard,
    Result,
    Sampling,
    ServerInfo,
    SessionInfo,
    Usage,
)

__all__ = ["AsyncGatewayClient", "AsyncGenerationStream", "Chunk", "GatewayClient", "GatewayError",
           "GenerationStream", "Message", "ModelCard", "Result", "Sampling", "ServerInfo", "SessionInfo", "Usage"]
