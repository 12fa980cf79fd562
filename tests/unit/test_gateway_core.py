"""The gateway's request pipeline (gateway.core) against a fake verifier that behaves like the real one
(persistent sessions, continue, cancel drops the session, NOT_FOUND after a restart): what each turn
sends, what sessions remember when a turn ends early, and the spans it records."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.core import GatewayCore, TurnRequest
from gateway.errors import GatewayError
from gateway.params import GenerationParams
from gateway.session_api import SessionAPI
from gateway.state import GatewayConfig, GatewayState
from gateway.text_tokenizer import decode, load_text_tokenizer
from gateway.turns import TurnInput
from gateway.verifier_client import StepEvent, VerifierModel
from telemetry.metrics import Metrics


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context (so continuing == one shot)."""
    h = 17
    for t in context:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % 250 + 1


def reference(context: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(context + out))
    return out


class FakeTurn:
    def __init__(self, v: FakeVerifier, sid: str, tokens, max_new, stop_ids, cont, persistent):
        self.v, self.sid, self.tokens, self.max_new, self.stop_ids = v, sid, list(tokens), max_new, set(stop_ids)
        self.cont, self.persistent, self.cancelled = cont, persistent, False

    async def events(self):
        v = self.v
        if self.cont:
            if self.sid not in v.sessions:
                raise GatewayError("NOT_FOUND", f"verifier: no session {self.sid!r}")
            ctx = v.sessions[self.sid] + self.tokens
        else:
            ctx = self.tokens
        v.sessions[self.sid] = ctx
        out: list[int] = []
        first = True
        while True:
            await asyncio.sleep(0)
            if self.cancelled:
                return
            t = next_token(ctx + out)
            out.append(t)
            stop = t in self.stop_ids
            done = stop or len(out) >= self.max_new
            v.sessions[self.sid] = ctx + out
            if done and not self.persistent:  # the verifier frees a finished one-shot turn on its own
                v.sessions.pop(self.sid, None)
            reason = ("stop" if stop else "length") if done else None
            yield StepEvent([t], 0 if first else 1, 0 if first else 1, len(self.tokens) if first else 0, reason)
            first = False
            if done:
                return

    def cancel(self) -> None:
        self.cancelled = True
        self.v.sessions.pop(self.sid, None)  # like the verifier: a cancelled turn drops its session


class FakeVerifier:
    def __init__(self):
        self.sessions: dict[str, list[int]] = {}
        self.calls: list[tuple[str, bool, list[int]]] = []  # (sid, continue, tokens sent)
        self.timeouts: list[float | None] = []
        self.released: list[str] = []

    def turn(self, sid, tokens, params, max_new, stop_ids, *, continue_session, persistent, timeout):
        self.calls.append((sid, continue_session, list(tokens)))
        self.timeouts.append(timeout)
        return FakeTurn(self, sid, tokens, max_new, stop_ids, continue_session, persistent)

    async def release(self, sid, timeout=10.0):
        self.released.append(sid)
        self.sessions.pop(sid, None)
        return False  # whether a running turn was cancelled: never, in these tests


@pytest.fixture
def env(tiny_dirs):
    cfg = GatewayConfig(listen="x:1", http_listen=None, verifier_address="v:1", tokenizer_dir=str(tiny_dirs[0]))
    fake = FakeVerifier()
    state = GatewayState(cfg, load_text_tokenizer(tiny_dirs[0]), fake, Metrics())
    state.attach(VerifierModel("tiny", 320, (257,), 64, 4096, 8, 8))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return GatewayCore(state, provider), SessionAPI(state), fake, exporter


def gen(core, ids=None, session=None, stop=(), max_tokens=6, limit=None, timeout=None, **kw):
    async def main():
        req = TurnRequest(TurnInput(token_ids=tuple(ids)), GenerationParams(max_tokens=max_tokens, stop=stop,
                                                                            ignore_eos=True, **kw), session)
        chunks = []
        async with aclosing(core.generate(req, timeout)) as it:
            async for c in it:
                chunks.append(c)
                if limit is not None and len(chunks) >= limit:
                    break
        return chunks
    return main()


def run(coro):
    return asyncio.run(coro)


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_one_shot_and_spans(env):
    core, _, fake, exporter = env
    chunks = run(gen(core, [1, 2, 3], max_tokens=5))
    assert tokens(chunks) == reference([1, 2, 3], 5) and fake.sessions == {}
    u = chunks[-1].usage
    assert (u.prompt_tokens, u.completion_tokens, u.steps, u.stop_reason) == (3, 5, 4, "length")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    req = spans["text_completion tiny"]
    assert req.attributes["gen_ai.usage.input_tokens"] == 3 and req.attributes["gen_ai.usage.output_tokens"] == 5
    assert spans["ddtree.queue"].parent.span_id == req.context.span_id


def test_session_continues_and_a_stop_string_makes_the_next_turn_reopen(env, tiny_dirs):
    core, api, fake, _ = env
    s = api.create(None)
    c1 = run(gen(core, [1, 2, 3], s.id))
    assert tokens(c1) == reference([1, 2, 3], 6) and fake.calls[-1][1] is False
    c2 = run(gen(core, [9], s.id))
    h2 = [1, 2, 3, *tokens(c1), 9]
    assert tokens(c2) == reference(h2, 6) and fake.calls[-1] == (s.verifier_sid, True, [9])
    assert c2[-1].usage.cached_tokens == 8  # 9 history tokens; the last one is prefilled again with [9]
    tok = load_text_tokenizer(tiny_dirs[0])
    full = reference([*h2, *tokens(c2), 5], 12)
    text = decode(tok, full)
    stop = next(ch for i, ch in enumerate(text) if i >= 2 and ord(ch) < 128 and text.index(ch) == i)
    k = next(m for m in range(1, 13) if stop in decode(tok, full[:m]))
    c3 = run(gen(core, [5], s.id, stop=(stop,), max_tokens=12))
    assert tokens(c3) == full[:k] and c3[-1].usage.matched_stop == stop
    assert s.verifier_sid is None and fake.sessions == {}  # cancelled on the verifier: dropped
    c4 = run(gen(core, [6], s.id))
    history = [*h2, *tokens(c2), 5, *full[:k], 6]
    assert fake.calls[-1][1] is False and fake.calls[-1][2] == history  # reopened with everything
    assert tokens(c4) == reference(history, 6) and c4[-1].usage.cached_tokens == 0


def test_verifier_restart_is_transparent(env):
    core, api, fake, _ = env
    s = api.create(None)
    c1 = run(gen(core, [4, 4], s.id))
    fake.sessions.clear()  # the verifier restarted
    c2 = run(gen(core, [8], s.id))
    assert tokens(c2) == reference([4, 4, *tokens(c1), 8], 6)
    assert [c[1] for c in fake.calls] == [False, True, False]


def test_client_going_away_keeps_what_it_saw(env):
    core, api, fake, _ = env
    s = api.create(None)
    seen = run(gen(core, [2, 7], s.id, max_tokens=50, limit=3))
    assert len(tokens(seen)) == 3 and fake.sessions == {} and s.verifier_sid is None and not s.busy
    run(gen(core, [1], s.id))
    assert fake.calls[-1][2] == [2, 7, *tokens(seen), 1]


def test_close_session_cancels_the_running_turn(env):
    core, api, fake, _ = env
    s = api.create(None)

    async def main():
        async def consume():
            return [c async for c in core.generate(TurnRequest(TurnInput(token_ids=(3,)), GenerationParams(
                max_tokens=3000, ignore_eos=True), s.id))]
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        assert await api.close(s.id) is True
        with pytest.raises(GatewayError) as e:
            await task
        return e.value

    err = run(main())
    assert err.code == "CANCELLED" and "closed" in err.message
    assert fake.sessions == {} and fake.released
    with pytest.raises(GatewayError, match="NOT_FOUND"):
        run(gen(core, [1], s.id))


def test_one_turn_at_a_time_per_session(env):
    core, api, _, _ = env
    s = api.create(None)

    async def main():
        first = core.generate(TurnRequest(TurnInput(token_ids=(3,)), GenerationParams(max_tokens=100), s.id))
        await anext(first)
        with pytest.raises(GatewayError) as e:
            await anext(core.generate(TurnRequest(TurnInput(token_ids=(3,)), GenerationParams(), s.id)))
        await first.aclose()
        return e.value

    assert run(main()).code == "FAILED_PRECONDITION"


def test_not_ready_and_draining_are_unavailable(env):
    core, _, _, _ = env
    core.state.draining = True
    with pytest.raises(GatewayError, match="UNAVAILABLE: the gateway is shutting down"):
        run(gen(core, [1]))


def test_the_deadline_travels_to_the_verifier(env):
    core, _, fake, _ = env
    run(gen(core, [1], timeout=5.0))
    run(gen(core, [1]))
    assert 4.0 < fake.timeouts[0] <= 5.0 and fake.timeouts[1] is None


def test_idle_sessions_are_reaped_and_their_kv_released(tiny_dirs):
    cfg = GatewayConfig(listen="x:1", http_listen=None, verifier_address="v:1", tokenizer_dir=str(tiny_dirs[0]),
                        session_idle_timeout_s=0.05)
    fake = FakeVerifier()
    state = GatewayState(cfg, load_text_tokenizer(tiny_dirs[0]), fake, Metrics())
    state.attach(VerifierModel("tiny", 320, (257,), 64, 4096, 8, 8))
    core, api = GatewayCore(state), SessionAPI(state)

    async def main():
        s = api.create(None)
        await gen(core, [1, 2], s.id)
        held = s.verifier_sid
        assert fake.sessions and held
        reaper = asyncio.create_task(api.reap(period_s=0.02))
        await asyncio.sleep(0.2)
        reaper.cancel()
        return s, held

    s, held = run(main())
    assert len(state.sessions) == 0 and s.closed and fake.released == [held] and fake.sessions == {}
