"""The `ddtree.v1.Gateway` gRPC servicer: protobuf in, `GatewayCore` / `GatewayState` calls, protobuf out.

Every RPC checks the API key first (UNAUTHENTICATED). Generate runs under the call's deadline (the
remaining time is passed on to the verifier) and inside the trace context of the call's metadata;
when the client cancels or the deadline passes, grpc.aio cancels this handler and the core's
iterator cancels the verifier call, which frees the turn's KV on the verifier and the drafter.
"""

from __future__ import annotations

import logging
from contextlib import aclosing

import grpc

from gateway.auth import check_api_key
from gateway.core import GatewayCore
from gateway.errors import GatewayError
from gateway.state import GatewayState
from gateway.wire import chunk_to_pb, request_from_pb
from protos.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from telemetry.tracing import extract_metadata

log = logging.getLogger(__name__)
NO_DEADLINE_S = 1e8  # grpc reports "no deadline" as a huge remaining time


def _metadata(context) -> dict[str, str]:
    return {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, state: GatewayState, core: GatewayCore, sessions_api):
        self.state = state
        self.core = core
        self.sessions_api = sessions_api  # gateway.session_api.SessionAPI

    def _auth(self, context) -> None:
        check_api_key(self.state.cfg.api_key, _metadata(context).get("authorization"))

    async def _fail(self, context, e: Exception):
        if isinstance(e, GatewayError):
            await context.abort(grpc.StatusCode[e.code], e.message)
        log.exception("gateway RPC failed")
        await context.abort(grpc.StatusCode.INTERNAL, f"gateway error: {e!r}")

    async def Generate(self, request: gateway_pb2.GenerationRequest, context):
        try:
            self._auth(context)
            req = request_from_pb(request)
            remaining = context.time_remaining()
            timeout = remaining if remaining is not None and remaining < NO_DEADLINE_S else None
            parent = extract_metadata(context.invocation_metadata())
            async with aclosing(self.core.generate(req, timeout, parent)) as chunks:
                async for chunk in chunks:
                    yield chunk_to_pb(chunk)
        except (GatewayError, ValueError, TypeError) as e:
            await self._fail(context, e)

    async def CreateSession(self, request: gateway_pb2.CreateSessionRequest, context):
        try:
            self._auth(context)
            s = self.sessions_api.create(request.model or None)
        except GatewayError as e:
            await self._fail(context, e)
        return gateway_pb2.SessionInfo(session_id=s.id, verifier=s.verifier, model=self.state.model_name,
                                       idle_timeout_s=int(self.state.cfg.session_idle_timeout_s))

    async def CloseSession(self, request: gateway_pb2.CloseSessionRequest, context):
        try:
            self._auth(context)
            cancelled = await self.sessions_api.close(request.session_id)
        except GatewayError as e:
            await self._fail(context, e)
        return gateway_pb2.CloseSessionResponse(cancelled_running_turn=cancelled)

    async def Info(self, request, context):
        try:
            self._auth(context)
        except GatewayError as e:
            await self._fail(context, e)
        st, cfg = self.state, self.state.cfg
        msg = gateway_pb2.GatewayInfo(
            model=st.model_name, vocab_size=st.tokenizer.vocab_size, tokenizer=st.tokenizer.kind,
            has_chat_template=st.template is not None, max_queue=cfg.max_queue, sessions=len(st.sessions),
            max_sessions=cfg.max_sessions, verifier_address=cfg.verifier_address, verifier_ready=st.verifier_ready,
            default_max_tokens=st.defaults.max_tokens, default_draft_budget=st.defaults.draft_budget,
            default_draft_topk=st.defaults.draft_topk)
        if st.limits is not None:
            msg.vocab_size, msg.max_budget, msg.max_session_len = (st.limits.vocab_size, st.limits.max_budget,
                                                                   st.limits.max_session_len)
            msg.eos_token_ids[:] = list(dict.fromkeys([*st.limits.eos_token_ids, *st.tokenizer.eos_token_ids()]))
        if st.admission is not None:
            msg.running, msg.queued, msg.max_concurrency = (st.admission.running, st.admission.queued,
                                                            st.admission.max_running)
        return msg

    async def ListModels(self, request, context):
        try:
            self._auth(context)
        except GatewayError as e:
            await self._fail(context, e)
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelCard(**card) for card in
                                                      self.sessions_api.models()])
