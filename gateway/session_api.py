"""Session lifecycle and the model list, shared by the gRPC and HTTP surfaces.

Closing a session frees everything it holds: a running turn is cancelled (its task, which cancels the
verifier call) and the verifier session holding its KV is released (which also frees the drafter's
context). `reap()` runs in the background and closes sessions idle longer than the timeout, so a
client that forgets CloseSession cannot hold KV forever.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.errors import GatewayError
from gateway.sessions import Session
from gateway.state import GatewayState

log = logging.getLogger(__name__)


class SessionAPI:
    def __init__(self, state: GatewayState):
        self.state = state

    def create(self, model: str | None) -> Session:
        st = self.state
        st.ready_limits()
        st.check_model(model)
        s = st.sessions.create(st.cfg.verifier_address)
        st.update_gauges()
        return s

    async def close(self, sid: str) -> bool:
        """-> whether a running turn was cancelled. NOT_FOUND for an unknown session."""
        s = self.state.sessions.pop(sid)
        self.state.update_gauges()
        return await self._free(s)

    async def _free(self, s: Session) -> bool:
        cancelled = False
        if s.busy and s.turn_task is not None and not s.turn_task.done():
            s.turn_task.cancel()  # the core turns this into CANCELLED "session closed" for its caller
            cancelled = True
        for vsid in dict.fromkeys(v for v in (s.running_vsid, s.verifier_sid) if v):
            try:
                cancelled |= bool(await self.state.verifier.release(vsid))
            except GatewayError as e:
                log.warning("session %s: could not release verifier session %s: %s", s.id, vsid, e)
        return cancelled

    async def reap(self, period_s: float | None = None) -> None:
        """Close idle sessions forever (run as a background task)."""
        timeout = self.state.sessions.idle_timeout_s
        period = period_s if period_s is not None else min(30.0, max(timeout / 4, 0.05))
        while True:
            await asyncio.sleep(period)
            for s in self.state.sessions.expired():
                log.info("session %s idle for more than %.0f s: closed", s.id, timeout)
                await self._free(s)
            self.state.update_gauges()

    async def close_all(self) -> None:
        for s in self.state.sessions.all():
            self.state.sessions.pop(s.id)
            await self._free(s)

    def models(self) -> list[dict]:
        st = self.state
        return [{"id": st.model_name, "owned_by": "ddtree", "created": st.created,
                 "max_context": st.limits.max_session_len if st.limits is not None else 0}]
