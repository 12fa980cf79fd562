"""Multi-turn sessions held by the gateway.

A session is pinned to one verifier and remembers everything it holds there: the token history
(prompts and replies, exactly as the verifier saw and generated them), the chat messages when the
conversation is a chat, and the id of the live verifier session whose KV cache holds that history.
A turn sends only its new tokens (`continue_session`); the verifier prefills nothing else.

The verifier cannot shorten a session's KV. A turn that ends early on the gateway's side (a stop
string, the client cancelling, a failure) therefore drops the verifier session, and `verifier_sid`
becomes None: the next turn opens a fresh verifier session with the whole history (a prefill, same
output). The same happens when the verifier no longer knows the session (restarted).

One turn at a time per session (a second one is FAILED_PRECONDITION). Sessions idle longer than the
timeout are closed by `SessionStore.expired()` callers (the server's reaper).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

from gateway.chat import Message
from gateway.errors import GatewayError


@dataclass(eq=False)
class Session:
    id: str
    verifier: str  # address of the verifier it is pinned to
    tokens: list[int] = field(default_factory=list)  # history: everything the session holds
    messages: list[Message] | None = None  # the chat so far (None until a chat turn)
    verifier_sid: str | None = None  # live verifier session holding `tokens` in its KV, or None
    generation: int = 0  # verifier sessions opened so far (their ids are f"{id}.{generation}")
    last_stop_token: int | None = None  # the token that ended the last reply, when one did
    busy: bool = False
    turn_task: asyncio.Task | None = None  # the task generating the running turn (cancelled by close)
    running_vsid: str | None = None  # verifier session of the running turn
    closed: bool = False
    last_used: float = field(default_factory=time.monotonic)

    def next_verifier_sid(self) -> str:
        self.generation += 1
        return f"{self.id}.{self.generation}"


class SessionStore:
    def __init__(self, max_sessions: int, idle_timeout_s: float):
        if max_sessions < 1 or idle_timeout_s <= 0:
            raise ValueError(f"sessions: max_sessions must be >= 1 and the idle timeout > 0, got {max_sessions}, "
                             f"{idle_timeout_s}")
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, verifier: str) -> Session:
        if len(self._sessions) >= self.max_sessions:
            raise GatewayError("RESOURCE_EXHAUSTED", f"the gateway holds its maximum of {self.max_sessions} sessions; "
                                                     "close one or retry later")
        s = Session(id=f"s-{secrets.token_hex(12)}", verifier=verifier)
        self._sessions[s.id] = s
        return s

    def get(self, sid: str) -> Session:
        s = self._sessions.get(sid)
        if s is None:
            raise GatewayError("NOT_FOUND", f"session_id: no session {sid!r} (closed, expired, or never created)",
                               "session_id")
        return s

    def begin_turn(self, sid: str) -> Session:
        s = self.get(sid)
        if s.busy:
            raise GatewayError("FAILED_PRECONDITION", f"session_id: session {sid!r} is still generating its "
                                                      "previous turn", "session_id")
        s.busy = True
        s.turn_task = asyncio.current_task()
        s.last_used = time.monotonic()
        return s

    def end_turn(self, s: Session) -> None:
        s.busy = False
        s.turn_task = s.running_vsid = None
        s.last_used = time.monotonic()

    def pop(self, sid: str) -> Session:
        s = self.get(sid)
        del self._sessions[sid]
        s.closed = True
        return s

    def expired(self, now: float | None = None) -> list[Session]:
        """Idle sessions past the timeout, removed from the store (the caller frees their KV)."""
        now = time.monotonic() if now is None else now
        out = [s for s in self._sessions.values() if not s.busy and now - s.last_used > self.idle_timeout_s]
        for s in out:
            del self._sessions[s.id]
            s.closed = True
        return out

    def all(self) -> list[Session]:
        return list(self._sessions.values())
