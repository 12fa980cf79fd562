"""The OpenAI-compatible HTTP surface of the gateway (aiohttp), on the gateway's event loop.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with `stream`:
`data: {chunk}` lines, an optional usage chunk with `stream_options.include_usage`, then
`data: [DONE]`), GET /v1/models, GET /health (200 when the verifier serves, 503 otherwise),
GET /metrics (Prometheus). Errors are OpenAI-shaped JSON `{"error": {message, type, param, code}}`
with 400 / 401 / 404 / 429 / 503 (`gateway.errors`); an error after a stream started is sent as a
last `data: {"error": ...}` event. /v1/* need the API key when one is configured; /health and
/metrics do not (probes and scrapers). A client that disconnects cancels its handler, which cancels
the verifier call and frees the KV.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing

from aiohttp import web

from gateway.auth import check_api_key
from gateway.core import GatewayCore
from gateway.errors import GatewayError
from gateway.openai_schema import ResponseBuilder, chat_request, completion_request, stream_flags
from gateway.session_api import SessionAPI
from gateway.state import GatewayState
from telemetry.metrics import render_metrics
from telemetry.tracing import extract_http

log = logging.getLogger(__name__)


def _error(e: GatewayError) -> web.Response:
    return web.json_response(e.openai_body(), status=e.http_status)


class OpenAIRoutes:
    def __init__(self, state: GatewayState, core: GatewayCore, sessions: SessionAPI):
        self.state = state
        self.core = core
        self.sessions = sessions

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=16 << 20)
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.metrics)])
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if request.path.startswith("/v1/"):
                check_api_key(self.state.cfg.api_key, request.headers.get("Authorization"))
            return await handler(request)
        except GatewayError as e:
            return _error(e)
        except web.HTTPException as e:  # 404 / 405 from the router: OpenAI-shaped too
            if e.status < 400:
                raise
            return _error(GatewayError({404: "NOT_FOUND", 405: "UNIMPLEMENTED"}.get(e.status, "INVALID_ARGUMENT"),
                                       f"{request.method} {request.path}: {e.reason}"))
        except (ConnectionError, asyncio.CancelledError):
            raise  # the client went away: nothing to answer
        except Exception as e:  # noqa: BLE001 - a bug must still answer in the API's error shape
            log.exception("HTTP %s %s failed", request.method, request.path)
            return _error(GatewayError("INTERNAL", f"internal error: {e!r}"))

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GatewayError("INVALID_ARGUMENT", f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise GatewayError("INVALID_ARGUMENT", "the body must be a JSON object")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return await self._generate(request, body, completion_request(body), chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return await self._generate(request, body, chat_request(body), chat=True)

    async def _generate(self, request: web.Request, body: dict, req, chat: bool) -> web.StreamResponse:
        stream, include_usage = stream_flags(body)
        out = ResponseBuilder(chat, self.state.model_name)
        chunks = self.core.generate(req, None, extract_http(request.headers))
        async with aclosing(chunks):
            if not stream:
                text, usage = [], None
                async for c in chunks:
                    text.append(c.text)
                    usage = c.usage or usage
                return web.json_response(out.full("".join(text), usage))
            first = await anext(chunks)  # errors before the first chunk are plain HTTP errors
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                await self._stream(resp, out, first, chunks, include_usage, chat)
            except GatewayError as e:
                await _send(resp, e.openai_body())
            except (ConnectionResetError, ConnectionError):
                log.info("HTTP client went away mid-stream; the turn is cancelled")
                raise
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

    async def _stream(self, resp, out: ResponseBuilder, first, chunks, include_usage: bool, chat: bool) -> None:
        if chat:
            await _send(resp, out.delta("", None, include_usage, first=True))
        c = first
        while True:
            if c.usage is not None:
                await _send(resp, out.delta(c.text, c.usage.stop_reason, include_usage))
                if include_usage:
                    await _send(resp, out.usage_chunk(c.usage))
                return
            if c.text:
                await _send(resp, out.delta(c.text, None, include_usage))
            c = await anext(chunks)

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": m["id"], "object": "model", "created": m["created"], "owned_by": m["owned_by"],
                 "max_model_len": m["max_context"]} for m in self.sessions.models()]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        st = self.state
        if st.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not st.verifier_ready:
            return web.json_response({"status": "unavailable",
                                      "reason": f"the verifier at {st.cfg.verifier_address} is not serving"},
                                     status=503)
        return web.json_response({"status": "ok", "model": st.model_name})

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = render_metrics(request.headers.get("Accept"), self.state.metrics.registry)
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
