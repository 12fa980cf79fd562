"""The gateway's side of the verifier session API (`ddtree.v1.Verifier`), over grpc.aio.

Protobuf stays here: callers pass token lists and `ResolvedParams`, and get `VerifierModel`,
`VerifierLoad` and `StepEvent` dataclasses back. The channel injects the W3C trace context of the
current span (`telemetry.grpc_tracing`), so a request's trace continues into the verifier. Verifier
errors come back as `GatewayError` with the verifier's status code and message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import GatewayError
from gateway.params import ResolvedParams
from protos.ddtree.v1 import verifier_pb2, verifier_pb2_grpc
from protos.serving import channel_options
from telemetry.grpc_tracing import client_interceptors

log = logging.getLogger(__name__)
VERIFIER_SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


@dataclass(frozen=True)
class VerifierModel:
    """What does not change while the verifier runs."""

    model: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_budget: int
    max_session_len: int
    max_sessions: int
    block_size: int


@dataclass(frozen=True)
class VerifierLoad:
    kv_pages_total: int
    kv_pages_free: int
    open_sessions: int
    running_sessions: int


@dataclass
class StepEvent:
    tokens: list[int]
    accepted_length: int
    tree_size: int
    prefill_tokens: int
    finish_reason: str | None  # "stop" | "length" on the turn's last event


_FINISH = {verifier_pb2.FINISH_REASON_STOP: "stop", verifier_pb2.FINISH_REASON_LENGTH: "length"}


def _error(e: grpc.aio.AioRpcError) -> GatewayError:
    return GatewayError(e.code().name, f"verifier: {e.details()}")


class VerifierTurn:
    """One Generate call on the verifier; iterate for StepEvents, `cancel()` to end it (frees the KV)."""

    def __init__(self, call):
        self._call = call

    async def events(self) -> AsyncIterator[StepEvent]:
        try:
            async for m in self._call:
                yield StepEvent(list(m.tokens), m.stats.accepted_length, m.stats.tree_size, m.stats.prefill_tokens,
                                _FINISH.get(m.finish_reason) if m.HasField("finish_reason") else None)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None

    def cancel(self) -> None:
        self._call.cancel()


class VerifierClient:
    def __init__(self, address: str, max_message_bytes: int = 64 << 20):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes),
                                                 interceptors=client_interceptors())
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def serving(self, timeout: float = 5.0) -> bool:
        try:
            r = await self.health.Check(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    async def model(self, timeout: float = 10.0) -> VerifierModel:
        i = await self._info(timeout)
        return VerifierModel(i.model, i.vocab_size, tuple(i.eos_token_ids), i.max_budget, i.max_session_len,
                             i.max_sessions, i.block_size)

    async def load(self, timeout: float = 10.0) -> VerifierLoad:
        i = await self._info(timeout)
        return VerifierLoad(i.kv_pages_total, i.kv_pages_free, i.open_sessions, i.running_sessions)

    async def _info(self, timeout: float) -> verifier_pb2.VerifierInfo:
        try:
            return await self.stub.Info(verifier_pb2.InfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None

    async def wait_ready(self, stop: asyncio.Event, poll_s: float = 0.5) -> VerifierModel | None:
        """Wait until the verifier reports SERVING (None if `stop` is set first); returns its model."""
        logged = False
        while not stop.is_set():
            if await self.serving():
                return await self.model()
            if not logged:
                log.info("waiting for the verifier at %s to serve", self.address)
                logged = True
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except TimeoutError:
                pass
        return None

    def turn(self, sid: str, tokens: list[int], params: ResolvedParams, max_new_tokens: int,
             stop_ids: tuple[int, ...], *, continue_session: bool, persistent: bool,
             timeout: float | None) -> VerifierTurn:
        """Open (or continue) a verifier session and stream the turn. `stop_ids` are every token id that
        ends it (EOS and the request's stop ids); none = ignore EOS."""
        s = params.sampling
        dp = verifier_pb2.DecodeParams(max_new_tokens=max_new_tokens, budget=params.draft_budget,
                                       topk=params.draft_topk, eos_token_ids=list(stop_ids),
                                       ignore_eos=not stop_ids, temperature=s.temperature, top_p=s.top_p,
                                       top_k=s.top_k)
        if s.seed is not None:
            dp.seed = s.seed
        req = verifier_pb2.GenerateRequest(session_id=sid, tokens=tokens, continue_session=continue_session,
                                           persistent=persistent and not continue_session, params=dp)
        return VerifierTurn(self.stub.Generate(req, timeout=timeout))

    async def release(self, sid: str, timeout: float = 10.0) -> bool | None:
        """Release a verifier session: True if a running turn was cancelled; None if it did not exist."""
        try:
            r = await self.stub.Release(verifier_pb2.ReleaseRequest(session_id=sid), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise _error(e) from None
        return r.cancelled_running_turn
