"""asyncio client of the `ddtree.v1.Gateway` service (grpc.aio); same API as `GatewayClient`, awaited.

    async with AsyncGatewayClient("127.0.0.1:50050") as c:
        async for chunk in c.stream("def f():", max_tokens=32):
            ...
        r = await c.generate(token_ids=[1, 2, 3], temperature=0.8, seed=7)

Retries on UNAVAILABLE for the idempotent calls only (Info, ListModels, CloseSession).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from gateway.client.types import (
    DEFAULT_UNARY_TIMEOUT_S,
    Chunk,
    Collector,
    GatewayError,
    Message,
    ModelCard,
    Result,
    Sampling,
    ServerInfo,
    SessionInfo,
    chunk_from_pb,
    request_to_pb,
    sampling_of,
    server_info_from_pb,
)
from protos.ddtree.v1 import gateway_pb2, gateway_pb2_grpc


class AsyncGenerationStream:
    """`async for` Chunks; `cancel()` stops the generation; `await result()` drains into a Result."""

    def __init__(self, call):
        self._call = call
        self._collector = Collector()
        self._done = False

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        try:
            async for m in self._call:
                c = chunk_from_pb(m)
                self._collector.add(c)
                yield c
        except grpc.aio.AioRpcError as e:
            raise GatewayError.from_rpc(e) from None
        self._done = True

    def cancel(self) -> None:
        self._call.cancel()

    async def result(self) -> Result:
        async for _ in self:
            pass
        return self._collector.result()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc) -> None:
        if not self._done:
            self.cancel()


class AsyncGatewayClient:
    def __init__(self, address: str, api_key: str | None = None, *, credentials: grpc.ChannelCredentials | None = None,
                 max_retries: int = 3, backoff_s: float = 0.2, options: Sequence[tuple[str, object]] = ()):
        self.address = address
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = (grpc.aio.secure_channel(address, credentials, options=list(options))
                         if credentials is not None else grpc.aio.insecure_channel(address, options=list(options)))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self.max_retries, self.backoff_s = max_retries, backoff_s

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGatewayClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def stream(self, text: str | None = None, *, token_ids: Sequence[int] | None = None,
               messages: Sequence[Message | dict] | None = None, session_id: str | None = None,
               model: str | None = None, timeout: float | None = None, sampling: Sampling | None = None,
               **sampling_kw) -> AsyncGenerationStream:
        req = request_to_pb(text, token_ids, messages, sampling_of(sampling, sampling_kw), session_id, model)
        return AsyncGenerationStream(self._stub.Generate(req, timeout=timeout, metadata=self._metadata))

    async def generate(self, text: str | None = None, **kw) -> Result:
        async with self.stream(text, **kw) as s:
            return await s.result()

    async def create_session(self, model: str | None = None,
                             timeout: float = DEFAULT_UNARY_TIMEOUT_S) -> SessionInfo:
        try:
            r = await self._stub.CreateSession(gateway_pb2.CreateSessionRequest(model=model or ""), timeout=timeout,
                                               metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise GatewayError.from_rpc(e) from None
        return SessionInfo(r.session_id, r.verifier, r.model, r.idle_timeout_s)

    async def _retry(self, rpc, request, timeout: float):
        attempt = 0
        while True:
            try:
                return await rpc(request, timeout=timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.max_retries:
                    raise GatewayError.from_rpc(e, attempts=attempt + 1) from None
            await asyncio.sleep(self.backoff_s * 2**attempt)
            attempt += 1

    async def close_session(self, session_id: str, timeout: float = DEFAULT_UNARY_TIMEOUT_S) -> bool:
        try:
            r = await self._retry(self._stub.CloseSession, gateway_pb2.CloseSessionRequest(session_id=session_id),
                                  timeout)
        except GatewayError as e:
            if e.code == grpc.StatusCode.NOT_FOUND and e.attempts > 1:
                return False
            raise
        return r.cancelled_running_turn

    async def info(self, timeout: float = DEFAULT_UNARY_TIMEOUT_S) -> ServerInfo:
        return server_info_from_pb(await self._retry(self._stub.Info, gateway_pb2.GatewayInfoRequest(), timeout))

    async def list_models(self, timeout: float = DEFAULT_UNARY_TIMEOUT_S) -> list[ModelCard]:
        r = await self._retry(self._stub.ListModels, gateway_pb2.ListModelsRequest(), timeout)
        return [ModelCard(m.id, m.owned_by, m.created, m.max_context) for m in r.models]
