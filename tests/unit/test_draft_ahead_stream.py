"""Ahead steps over a co-located Draft stream (`verifier_service.ahead_steps`, `DraftStream.stage` and `launch`): CPU,
shared memory regions, the tiny pair in fp64 with the oracle's proposals behind a real drafter service on loopback. The
output equals AR with deep acceptance while sessions finish, join and extend their turns; the drafter's checks of
what an ahead step and its AheadCommitted carry."""

from __future__ import annotations

import grpc
import pytest
import torch

from drafter_service.checkpoint import load_drafter
from drafter_service.draft_stream import DraftStream, ProtocolError
from drafter_service.server import DrafterService
from protos.codec import tensor_to_pb
from protos.ddtree.v1 import drafter_pb2
from tests.helpers import OracleDrafter
from tests.unit.stream_harness import ServerThread, client_for
from tests.unit.test_draft_graphs import OracleLogqDrafter
from tests.unit.test_engine_exact import PROMPTS, ar_reference
from verifier_service.engine import Engine, EngineConfig
from verifier_service.session import DecodeParams


@pytest.fixture(scope="module")
def ar40(tiny_target64):
    return ar_reference(tiny_target64, PROMPTS, new=40)


def oracle_service(tiny_dirs, target, reference, seed=5, p_wrong=0.3):
    dmodel = load_drafter(tiny_dirs[1], target.cfg, torch.float64)
    oracle = OracleDrafter(reference, target.cfg.vocab_size, dmodel.cfg.block_size, p_wrong=p_wrong, seed=seed)
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    service = DrafterService(max_sessions=8, window=64)
    service.attach(OracleLogqDrafter(dmodel, embed, head, max_sessions=8, window=64, cuda_graphs=True, oracle=oracle),
                   "tiny", embed.shape[1])
    return service, dmodel


@pytest.mark.parametrize("ahead,colocated", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["colocated-ahead", "colocated", "grpc-early", "grpc"])
def test_colocated_draft_ahead_equals_ar(tiny_dirs, tiny_target64, ar40, ahead, colocated, monkeypatch):
    """Four sessions of different lengths, a fifth joining after two steps, the first one persistent and extended
    once it has finished: every step after the first goes ahead except where the set grew or a turn was extended,
    nothing falls back, and the output is AR's (against the same run drafting the usual way). Co-located, the
    drafter drafts from the device's values; over gRPC the next step's requests go right after the host read
    (`draft_ahead.ask_early`), for the sessions that go on."""
    from verifier_service import draft_ahead

    early = []
    ask_early = draft_ahead.ask_early
    monkeypatch.setattr(draft_ahead, "ask_early", lambda d, reqs: early.append(len(reqs)) or ask_early(d, reqs))
    target = tiny_target64
    whole = PROMPTS[0] + ar40[0][:20] + [31, 32]
    ar_turn2 = ar_reference(target, [whole], new=10)[0]
    ref = {f"r{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar40))}
    ref["r0"] = whole + ar_turn2
    ref["r4"] = PROMPTS[1] + ar40[1]
    service, dmodel = oracle_service(tiny_dirs, target, ref)
    server = ServerThread(service)
    client = client_for(server.port, colocated=colocated)
    holds = []  # the engine holds its stream for each draft queued ahead (a no-op here: no GPU doorbell)
    hold = client.hold_for_ahead
    monkeypatch.setattr(client, "hold_for_ahead", lambda: holds.append(client._ahead.step_id) or hold())
    try:
        eng = Engine(target, client, dmodel.cfg.target_layer_ids,
                     EngineConfig(page_size=8, num_pages=512, max_sessions=8, draft_window=64, draft_ahead=ahead,
                                  ahead_gpu_wait=True))
        lengths = [20, 33, 21, 40]
        sessions = [eng.add(p, DecodeParams(max_new_tokens=n, budget=8, topk=3), sid=f"r{i}", persistent=i == 0)
                    for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
        eng.step()
        eng.step()
        late = eng.add(PROMPTS[1], DecodeParams(max_new_tokens=30, budget=8, topk=3), sid="r4")
        while not sessions[0].done:
            eng.step()
        eng.extend("r0", [31, 32], DecodeParams(max_new_tokens=10, budget=8, topk=3))
        eng.run_until_done()
        assert sessions[0].output == ar_turn2
        assert [s.output for s in sessions[1:]] == [o[:n] for o, n in zip(ar40[1:], lengths[1:])]
        assert late.output == ar40[1][:30]
        assert max(a for s in sessions for a in s.accepted_per_step) >= 5
        st = client.stats
        assert st["fallback_steps"] == 0 and st["invalid_trees"] == 0 and st["reconnects"] == 0, st
        if ahead and colocated:
            assert st["ahead_steps"] >= 8 and st["steps"] - st["ahead_steps"] >= 3, st  # first, r4 joined, r0 extended
            # once per step finding a draft queued ahead (taken or dropped); the last step's is let go at once
            assert len(holds) == len(set(holds)) == st["ahead_steps"] - 1, (holds, st)
        else:
            assert st["ahead_steps"] == 0 and not holds
        if ahead and not colocated:  # sessions that finish are not asked for: 5, 4, ... 1 going on
            assert len(early) >= 8 and {1, 5} <= set(early), early
            assert st["steps"] - len(early) == 3, (st, early)  # asked the usual way: first, r4 joined, r0 extended
        else:
            assert not early
        assert eng.ahead is None and client._ahead is None  # the last step's draft ahead was let go at once
        eng.release("r0")
    finally:
        client.close()
        server.stop()


def test_hold_for_ahead_queues_one_watched_wait_for_the_ahead_ring():
    """`hold_for_ahead`: a wait for the ahead step's ring on the current stream, armed in the watch with the step's
    deadline (the previous step's watch disarmed first), once per ahead step; nothing without a doorbell value, for a
    broken stream or a stream no longer current. Taking the held step's trees leaves its watch armed."""
    import threading
    from types import SimpleNamespace

    from verifier_service.ahead_steps import AheadStep, AheadSteps

    log = []

    class Client(AheadSteps):  # what the stream client's other mixins give it: the last step's reads
        def _settle(self):
            log.append(("settle",))

        def _collect_verdicts(self):
            log.append(("verdicts",))

    bell = SimpleNamespace(wait=lambda v: log.append(("wait", v)))
    watch = SimpleNamespace(bell=bell, disarm=lambda: log.append(("disarm",)),
                            arm=lambda owner, v, deadline, released: log.append(("arm", owner, v, deadline, released)))
    call = SimpleNamespace(broken=False, released=threading.Event())

    def client(**kw):
        c = Client()
        c._watch, c._stream = watch, call
        c._ahead = AheadStep(call, 3, ["a"], [0], torch.zeros(1, 2, 4), [5], 0, 0.0, 9.5, **kw)
        return c

    c = client(bell_value=7)
    c.hold_for_ahead()
    c.hold_for_ahead()
    assert log == [("settle",), ("verdicts",), ("disarm",), ("wait", 7), ("arm", call, 7, 9.5, call.released)]
    assert c._ahead.held
    log.clear()
    client(bell_value=0).hold_for_ahead()
    other = client(bell_value=7)
    other._stream = SimpleNamespace(broken=False)
    other.hold_for_ahead()
    call.broken = True
    client(bell_value=7).hold_for_ahead()
    assert log == []


@pytest.mark.parametrize("rung", [True, False])
def test_wait_ahead_waits_through_the_bell_and_hands_a_miss_to_the_watch(rung):
    """`wait_ahead` (a benchmark's wait for the draft queued ahead): `wait_host` on the bell until the step's deadline,
    aborted once the stream breaks; a wait that ends unrung is armed in the watch with a deadline passed, so the watch
    releases it (unless rung meanwhile) and drops the stream, as at a step's deadline."""
    import threading
    import time
    from types import SimpleNamespace

    from verifier_service.ahead_steps import AheadStep, AheadSteps

    log = []
    call = SimpleNamespace(broken=False, released=threading.Event())

    def wait_host(value, timeout_s, abort):
        log.append(("wait_host", value, round(timeout_s), abort()))
        return rung

    watch = SimpleNamespace(bell=SimpleNamespace(wait_host=wait_host),
                            arm=lambda owner, v, deadline, released: log.append(("arm", owner, v, released)) or
                            deadline <= time.monotonic() or log.append("a deadline not passed"))
    c = AheadSteps()
    c._watch = watch
    c._ahead = AheadStep(call, 3, ["a"], [0], torch.zeros(1, 2, 4), [5], 0, 0.0, time.monotonic() + 30.0,
                         bell_value=7)
    c.wait_ahead()
    assert log == [("wait_host", 7, 30, False)] + ([] if rung else [("arm", call, 7, call.released)])


# --- the drafter's checks ----------------------------------------------------------------------------------
@pytest.fixture
def stream(parts):
    from drafter_service.drafter import Drafter

    model, embed, head = parts
    drafter = Drafter(model, embed, head, max_sessions=8, window=16, cuda_graphs=True)
    F = len(model.cfg.target_layer_ids) * embed.shape[1]
    st = DraftStream(1, "test", {}, drafter, F, draft_ahead=True)
    return st, F


def usual_step(step_id, sid, start, n, F, root_pos=None):
    step = drafter_pb2.DraftStep(step_id=step_id)
    tensor_to_pb(torch.randn(n, F, dtype=torch.float64), step.ctx_features)
    step.sessions.add(session_id=sid, ctx_start=start, root_token=3, root_pos=start + n if root_pos is None
                      else root_pos, budget=4, topk=2, ctx_rows=n)
    return step


def ahead_step(step_id, sessions, P, F, values=None):
    """sessions: (sid, ctx_start) in order; values: int64 [3, S] (default: counts 2, root 5, positions start + 2)."""
    step = drafter_pb2.DraftStep(step_id=step_id)
    tensor_to_pb(torch.randn(len(sessions) * P, F, dtype=torch.float64), step.ctx_features)
    if values is None:
        values = torch.tensor([[2] * len(sessions), [5] * len(sessions), [s + 2 for _, s in sessions]])
    tensor_to_pb(values, step.ahead_values)
    for sid, start in sessions:
        step.sessions.add(session_id=sid, ctx_start=start, budget=4, topk=2, ctx_rows=P)
    return step


def test_ahead_step_and_its_counts(stream):
    st, F = stream
    work = st.begin(usual_step(1, "a", 0, 6, F))
    assert work.ids == ["a"] and st.sessions["a"] == 6
    st.begin(usual_step(2, "b", 0, 4, F))
    # the rows continue each session's context; counts stay on the device until AheadCommitted
    values = torch.tensor([[3, 1], [7, 8], [9, 5]])
    work = st.begin(ahead_step(3, [("a", 6), ("b", 4)], 4, F, values))
    assert work.ids == ["a", "b"] and not work.errors and work.trees.tokens[:, 0].tolist() == [7, 8]
    a = st.ahead
    assert (a.step_id, a.sids, a.starts, a.rows, a.nodes) == (3, ["a", "b"], [6, 4], 4, {"a": 5, "b": 5})
    with pytest.raises(ProtocolError, match="before the AheadCommitted of step 3"):
        st.begin(usual_step(4, "a", 9, 1, F))
    with pytest.raises(ProtocolError, match="AheadCommitted for step 2"):
        st.ahead_committed(drafter_pb2.AheadCommitted(step_id=2, rows=[3, 1]))
    with pytest.raises(ProtocolError, match="counts in 1..4"):
        st.ahead_committed(drafter_pb2.AheadCommitted(step_id=3, rows=[5, 1]))
    with pytest.raises(ProtocolError, match="traceparents"):
        st.ahead_committed(drafter_pb2.AheadCommitted(step_id=3, rows=[3, 1], traceparents=["x"]))
    st.ahead_committed(drafter_pb2.AheadCommitted(step_id=3, rows=[3, 1]))
    assert st.ahead is None and st.sessions == {"a": 9, "b": 5}
    assert st.drafter.cache.length("1/a") == 9 and st.drafter.cache.length("1/b") == 5


def test_ahead_step_refusals(stream):
    st, F = stream
    st.begin(usual_step(1, "a", 0, 6, F))
    # a session whose rows do not continue its context is refused alone; one the stream does not hold too; the counts
    # still come for every session of the step, the refused one's ignored
    work = st.begin(ahead_step(2, [("x", 0), ("a", 6)], 3, F))
    assert work.ids == ["a"] and [e.session_id for e in work.errors] == ["x"]
    assert work.errors[0].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    st.ahead_committed(drafter_pb2.AheadCommitted(step_id=2, rows=[3, 2]))
    assert st.sessions == {"a": 8} and "1/x" not in st.drafter.cache
    # values out of range are clamped, never used as indices as they are (a root past the vocabulary)
    big = torch.tensor([[99], [10**9], [-5]])
    work = st.begin(ahead_step(3, [("a", 8)], 3, F, big))
    assert work.trees.tokens[0, 0] == st.drafter.cfg.vocab_size - 1
    st.ahead_committed(drafter_pb2.AheadCommitted(step_id=3, rows=[3]))
    for bad, match in ((torch.zeros(2, 1, dtype=torch.int64), r"int64 \[3, 1\]"),
                       (torch.zeros(3, 1, dtype=torch.int32), r"int64 \[3, 1\]")):
        with pytest.raises(ProtocolError, match=match):
            st.begin(ahead_step(4, [("a", 11)], 3, F, bad))
    step = ahead_step(5, [("a", 11)], 3, F)
    step.sessions[0].budget = 5
    step.sessions.add(session_id="b", ctx_start=0, budget=4, topk=2, ctx_rows=3)
    with pytest.raises(ProtocolError):  # rows for two sessions in a step of one session's rows, budgets differ
        st.begin(step)
    st.draft_ahead = False
    with pytest.raises(ProtocolError, match="does not take them"):
        st.begin(ahead_step(6, [("a", 11)], 3, F))


def test_ahead_step_records_draft_spans_under_the_verifying_steps_traceparent(stream):
    """An ahead step's `ddtree.draft` spans are recorded when its AheadCommitted names the traceparents of the steps
    that verify its trees (the draft's own times); a session with none (untraced, or its tree let go) gets none."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from telemetry import tracing

    st, F = stream
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    st.tracer = provider.get_tracer("test")
    st.begin(usual_step(1, "a", 0, 5, F))
    st.begin(usual_step(2, "b", 0, 5, F))
    exporter.clear()
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    st.begin(ahead_step(3, [("a", 5), ("b", 5)], 3, F))
    assert not exporter.get_finished_spans()  # not yet: which step verifies these trees is not known
    st.ahead_committed(drafter_pb2.AheadCommitted(step_id=3, rows=[2, 2], traceparents=[parent, ""]))
    (span,) = exporter.get_finished_spans()
    assert span.name == tracing.SPAN_DRAFT and span.parent.span_id == int("cd" * 8, 16)
    assert span.context.trace_id == int("ab" * 16, 16)
    assert span.attributes[tracing.GEN_AI_CONVERSATION_ID] == "a"


# --- the ahead step staged before the verifier's writes land (DrafterService._step) ---------------------------------
class GateEvent:
    """The verifier's request event as the drafter sees it (`IpcEvent.wait_host`), on the CPU: complete once the test
    opens the gate. (A CUDA IPC event needs a GPU: tests/integration/test_gpu_transport.py runs the real one.)"""

    def __init__(self):
        import threading

        self.gate, self.polling = threading.Event(), threading.Event()

    def wait_host(self, timeout_s, abort=None):
        self.polling.set()
        return self.gate.wait(timeout_s)

    def close(self):
        pass


def two_streams(parts):
    """A drafter service with two streams on one drafter (padded-eager graphs: the ahead steps share the static
    input), each holding sessions of different lengths (a plan made for one is wrong for the other)."""
    from drafter_service.drafter import Drafter

    model, embed, head = parts
    service = DrafterService(max_sessions=8, window=16)
    service.attach(Drafter(model, embed, head, max_sessions=8, window=16, cuda_graphs=True), "tiny", embed.shape[1])
    F = len(model.cfg.target_layer_ids) * embed.shape[1]
    one, two = (DraftStream(n, "test", {}, service.drafter, F, draft_ahead=True) for n in (1, 2))
    torch.manual_seed(0)
    one.begin(usual_step(1, "a", 0, 6, F))
    two.begin(usual_step(1, "b", 0, 3, F))
    two.begin(usual_step(2, "c", 0, 9, F))
    return service, one, two, F


def _step_into(out, service, st, step):
    out.append(service._step(st, step))


def test_ahead_step_is_staged_before_its_event_and_another_stream_drafts_meanwhile(parts, monkeypatch):
    """With a request event, an ahead step's host part (checks, the plan) runs before its event completes, and its
    draft only after; another stream's ahead step of as many rows, staged and drafted while the first one waits (the
    model is free meanwhile), changes nothing: the trees, the answers and the drafter's cache equal the two steps run
    one after the other."""
    import threading

    from drafter_service.drafter import Drafter

    results, staged = [], []
    stage_ahead = Drafter.stage_ahead
    monkeypatch.setattr(Drafter, "stage_ahead", lambda self, *a: staged.append(a[0]) or stage_ahead(self, *a))
    for interleave in (False, True):
        service, one, two, F = two_streams(parts)
        one.request_event = GateEvent()
        staged.clear()
        torch.manual_seed(1)
        mine = ahead_step(3, [("a", 6)], 4, F, torch.tensor([[3], [7], [9]]))
        theirs = ahead_step(3, [("b", 3), ("c", 9)], 4, F, torch.tensor([[4, 2], [8, 9], [7, 11]]))
        answer, others = [], []
        worker = threading.Thread(target=_step_into, args=(answer, service, one, mine))
        worker.start()
        assert one.request_event.polling.wait(10)
        assert staged == [["1/a"]] and not answer  # staged, not drafted: its rows are not there yet
        if interleave:  # takes the model while the first step's event is pending
            second = threading.Thread(target=_step_into, args=(others, service, two, theirs))
            second.start()
            second.join(10)
            waited = second.is_alive()
            one.request_event.gate.set()  # (frees both should the wait have kept the model)
            assert not waited and worker.is_alive() and not answer
        one.request_event.gate.set()
        worker.join(10)
        if not interleave:
            _step_into(others, service, two, theirs)
        (mine_answer,), (other,) = answer, others
        assert not mine_answer.trees.errors and list(mine_answer.trees.session_ids) == ["a"]
        for a in (mine_answer, other):
            a.trees.ClearField("compute_us")  # a time
        results.append((mine_answer.trees.SerializeToString(), other.trees.SerializeToString(),
                        service.drafter.cache.k.clone()))
    assert results[0][0] == results[1][0] and results[0][1] == results[1][1]
    assert torch.equal(results[0][2], results[1][2])


def test_a_step_waiting_for_its_event_when_its_stream_closes_is_not_drafted(parts):
    """The stream closes (its regions with it) while a step waits for the verifier's writes: the step fails with a
    protocol error instead of drafting from unmapped memory."""
    import threading

    service, one, _, F = two_streams(parts)
    one.request_event = GateEvent()
    errors = []

    def run():
        try:
            service._step(one, ahead_step(3, [("a", 6)], 4, F))
        except ProtocolError as e:
            errors.append(str(e))

    gate = one.request_event
    worker = threading.Thread(target=run)
    worker.start()
    assert gate.polling.wait(10)
    service._close(one)
    gate.gate.set()  # the verifier's writes land after all
    worker.join(10)
    assert len(errors) == 1 and "the stream closed" in errors[0], errors


# --- the ahead step queued behind the verifier's request doorbell (DraftStream.queue_request_wait) -----------------
class RecordingWatch:
    """A request doorbell's watch as `DraftStream` uses it, on the CPU: records the waits queued on the stream and the
    arms (a GPU doorbell needs a GPU: tests/integration/test_gpu_transport.py and bench_transport.py run the real
    one)."""

    def __init__(self, log):
        from types import SimpleNamespace

        self.log = log
        self.bell = SimpleNamespace(wait=lambda value: log.append(("wait", value)))
        self.closed = False

    def arm(self, owner, value, deadline, released):
        import time

        self.log.append(("arm", value, round(deadline - time.monotonic())))

    def close(self):
        self.closed = True


def doorbelled(one, log):
    """Give a CPU stream what an ahead step queued behind a GPU wait needs besides the watch: a response region and a
    trees doorbell (recording its rings), so that its answer is handed over without waiting for the GPU."""
    from types import SimpleNamespace

    from protos.shared_region import SharedRegion

    one.regions[2] = SharedRegion.create(2, 1 << 16, "cpu")
    one.regions[2].unlink()  # mapped: no file left behind whatever the test does
    one.doorbell = SimpleNamespace(device=torch.device("cpu"), close=lambda: None,
                                   ring=lambda value, stream=None: log.append(("ring", value)))
    one.request_watch = RecordingWatch(log)


def rung_ahead_step(F, sessions, value, bell=True, region=True):
    step = ahead_step(3, sessions, 4, F, torch.tensor([[3] * len(sessions), [7] * len(sessions), [9] * len(sessions)]))
    if value is not None:
        step.request_doorbell_value = value
    if bell:
        step.doorbell_value = 11
    if region:
        step.response_region_id = 2
    return step


def test_an_ahead_step_with_a_request_ring_launches_behind_a_gpu_wait(parts, monkeypatch):
    """A staged ahead step that carries request_doorbell_value, replays a captured graph and answers in the response
    region behind the trees doorbell: the wait for the ring is queued and watched before its draft launches, and the
    verifier's event is never polled; the same trees as the step launched after its event. Where the draft would not
    replay a graph (a capture, an eager body), the step carries no value, or its answer would wait for the GPU (no
    trees doorbell value, no response region), the event is polled as before."""
    from drafter_service.drafter import AheadStage

    answers = []
    cases = ((True, 7, True, True), (False, 8, True, True), (True, None, True, True), (True, 5, False, True),
             (True, 6, False, False))
    for replays, value, bell, region in cases:
        service, one, _, F = two_streams(parts)
        log = []
        doorbelled(one, log)
        one.request_event = GateEvent()
        one.request_event.gate.set()
        monkeypatch.setattr(AheadStage, "replays", property(lambda self, r=replays: r))
        monkeypatch.setattr(one, "launch", lambda s, log=log, launch=one.launch: log.append("launch") or launch(s))
        torch.manual_seed(1)
        answer = service._step(one, rung_ahead_step(F, [("a", 6)], value, bell, region))
        polled = one.request_event.polling.is_set()
        rung = [("ring", 11)] if bell else []
        if replays and value is not None and bell and region:
            assert log == [("wait", 7), ("arm", 7, 10), "launch", *rung] and not polled, log
            assert service.drafter.graphs.stats["ahead_queued"] == 1
        else:
            assert log == ["launch", *rung] and polled and not service.drafter.graphs.stats["ahead_queued"], log
        answer.trees.ClearField("compute_us")
        if region:  # the trees in the region, and the message (the same where it echoes the same doorbell value)
            msg = answer.trees.SerializeToString() if bell else b""
            answers.append((bytes(one.regions[2].buf[:4096].numpy()), msg))
        service._close(one)
        assert one.request_watch is None
    assert len(answers) == 4 and any(answers[0][0]) and answers[0][1]
    assert all(a[0] == answers[0][0] and a[1] in (answers[0][1], b"") for a in answers), [
        (a[0] == answers[0][0], a[1] == answers[0][1]) for a in answers]
    # a session refused: its refusals are read back on the host, which must not wait behind the ring
    service, one, _, F = two_streams(parts)
    log = []
    doorbelled(one, log)
    monkeypatch.setattr(AheadStage, "replays", property(lambda self: True))
    try:
        answer = service._step(one, rung_ahead_step(F, [("x", 0), ("a", 6)], 9))
        assert log == [("ring", 11)] and [e.session_id for e in answer.trees.errors] == ["x"]
    finally:
        service._close(one)  # its region's file goes with it


def test_request_doorbell_values_where_none_can_be_waited_for_break_the_stream(parts):
    """request_doorbell_value on a stream without a request doorbell, or on a usual step, is a protocol error; a stream
    whose watch found the verifier silent past the deadline ends at its next message."""
    service, one, _, F = two_streams(parts)
    step = ahead_step(3, [("a", 6)], 4, F)
    step.request_doorbell_value = 1
    with pytest.raises(ProtocolError, match="without a request doorbell"):
        service._step(one, step)
    one.request_watch = RecordingWatch([])
    usual = usual_step(4, "a", 6, 2, F)
    usual.request_doorbell_value = 2
    with pytest.raises(ProtocolError, match="on a step not ahead"):
        service._step(one, usual)
    one.request_expired(one)
    with pytest.raises(ProtocolError, match="did not ring its request doorbell"):
        service._handle(one, drafter_pb2.DraftStreamRequest(step=usual_step(5, "a", 6, 2, F)))


def test_the_request_doorbell_is_taken_only_with_the_trees_doorbell_on_a_gpu(parts):
    """OpenStream.request_doorbell_region_id: an id that names no region of the stream fails the open; on the CPU (no
    trees doorbell, no GPU counter) the drafter declines it and polls as before."""
    from protos.shared_region import SharedRegion

    service, one, _, F = two_streams(parts)
    region = SharedRegion.create(4, 4, "cpu")
    region.unlink()
    try:
        msg = drafter_pb2.OpenStream(request_doorbell_region_id=4)
        with pytest.raises(ValueError, match="request doorbell region 4"):
            service._request_watch(msg, {}, one)
        assert service._request_watch(msg, {4: region}, one) is None
        assert service._request_watch(drafter_pb2.OpenStream(), {4: region}, one) is None
    finally:
        region.close()
