"""Blocking client of the `ddtree.v1.Gateway` service.

    with GatewayClient("127.0.0.1:50050", api_key=...) as c:
        r = c.generate("def f():", max_tokens=32)                 # Result: text, token_ids, usage
        for chunk in c.stream(messages=[{"role": "user", "content": "hi"}], temperature=0.7):
            print(chunk.text, end="")
        s = c.create_session(); c.generate(token_ids=[1, 2], session_id=s.session_id); c.close_session(s.session_id)

Every call takes `timeout` (seconds; the deadline travels to the verifier). Info, ListModels and
CloseSession are idempotent and retried on UNAVAILABLE with exponential backoff; Generate and
CreateSession are never retried (a retry could generate or create twice). Errors raise
`GatewayError(code, details)`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

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


class GenerationStream:
    """Iterate for Chunks; `cancel()` stops the generation (the server frees its KV); `result()` drains
    the rest into a Result. As a context manager it cancels whatever is left on exit."""

    def __init__(self, call):
        self._call = call
        self._collector = Collector()
        self._done = False

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for m in self._call:
                c = chunk_from_pb(m)
                self._collector.add(c)
                yield c
        except grpc.RpcError as e:
            raise GatewayError.from_rpc(e) from None
        self._done = True

    def cancel(self) -> None:
        self._call.cancel()

    def result(self) -> Result:
        for _ in self:
            pass
        return self._collector.result()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        if not self._done:
            self.cancel()


class GatewayClient:
    def __init__(self, address: str, api_key: str | None = None, *, credentials: grpc.ChannelCredentials | None = None,
                 max_retries: int = 3, backoff_s: float = 0.2, options: Sequence[tuple[str, object]] = ()):
        self.address = address
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = (grpc.secure_channel(address, credentials, options=list(options)) if credentials is not None
                         else grpc.insecure_channel(address, options=list(options)))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self.max_retries, self.backoff_s = max_retries, backoff_s

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- generation (never retried) ---------------------------------------------------------------
    def stream(self, text: str | None = None, *, token_ids: Sequence[int] | None = None,
               messages: Sequence[Message | dict] | None = None, session_id: str | None = None,
               model: str | None = None, timeout: float | None = None, sampling: Sampling | None = None,
               **sampling_kw) -> GenerationStream:
        req = request_to_pb(text, token_ids, messages, sampling_of(sampling, sampling_kw), session_id, model)
        return GenerationStream(self._stub.Generate(req, timeout=timeout, metadata=self._metadata))

    def generate(self, text: str | None = None, **kw) -> Result:
        """Like `stream`, collected into one Result."""
        with self.stream(text, **kw) as s:
            return s.result()

    def create_session(self, model: str | None = None, timeout: float = DEFAULT_UNARY_TIMEOUT_S) -> SessionInfo:
        try:
            r = self._stub.CreateSession(gateway_pb2.CreateSessionRequest(model=model or ""), timeout=timeout,
                                         metadata=self._metadata)
        except grpc.RpcError as e:
            raise GatewayError.from_rpc(e) from None
        return SessionInfo(r.session_id, r.verifier, r.model, r.idle_timeout_s)

    # --- idempotent calls (retried on UNAVAILABLE) ------------------------------------------------
    def _retry(self, rpc, request, timeout: float):
        attempt = 0
        while True:
            try:
                return rpc(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.max_retries:
                    raise GatewayError.from_rpc(e, attempts=attempt + 1) from None
            time.sleep(self.backoff_s * 2**attempt)
            attempt += 1

    def close_session(self, session_id: str, timeout: float = DEFAULT_UNARY_TIMEOUT_S) -> bool:
        """-> whether a running turn was cancelled. Closing an unknown session raises NOT_FOUND, except
        after a retry (the first attempt may have closed it)."""
        try:
            r = self._retry(self._stub.CloseSession, gateway_pb2.CloseSessionRequest(session_id=session_id), timeout)
        except GatewayError as e:
            if e.code == grpc.StatusCode.NOT_FOUND and e.attempts > 1:
                return False
            raise
        return r.cancelled_running_turn

    def info(self, timeout: float = DEFAULT_UNARY_TIMEOUT_S) -> ServerInfo:
        return server_info_from_pb(self._retry(self._stub.Info, gateway_pb2.GatewayInfoRequest(), timeout))

    def list_models(self, timeout: float = DEFAULT_UNARY_TIMEOUT_S) -> list[ModelCard]:
        r = self._retry(self._stub.ListModels, gateway_pb2.ListModelsRequest(), timeout)
        return [ModelCard(m.id, m.owned_by, m.created, m.max_context) for m in r.models]
