"""EngineConfig.draft_ahead: the next step's draft queued from the device's acceptance before the host reads it
(`verifier_service.draft_ahead`, `Drafter.draft_ahead`). CPU, tiny models in fp64: the device's emitted counts
against `Session.emit`, greedy and sampled output against AR with deep acceptance, sessions that stop mid-path
(EOS, max_new_tokens), join or extend their turn mid-run, and the drafter's context rows against the steps
drafted the usual way."""

from __future__ import annotations

import random

import pytest
import torch

from drafter_service.api import DraftRequest
from drafter_service.checkpoint import load_drafter
from drafter_service.context_projection import ContextProjection
from drafter_service.drafter import Drafter
from kernels.tree_build import build_tree
from tests.helpers import OracleDrafter
from tests.unit.test_cuda_graphs import GPU_TEXTS, PAIR, decode_all, gpu_test
from tests.unit.test_draft_graphs import OracleLogqDrafter
from tests.unit.test_engine_exact import PROMPTS, ar_reference
from verifier_service import draft_ahead
from verifier_service.engine import Engine, EngineConfig
from verifier_service.sampling_params import SamplingParams
from verifier_service.session import DecodeParams, Session


# --- the device's counts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_emitted_counts_match_session_emit(seed):
    """Random accepted paths, bonuses, EOS sets (some ignored) and remaining lengths: the device's counts, roots
    and root positions are what Session.emit leaves on the host, EOS at every depth and as the bonus included."""
    rng = random.Random(seed)
    S, P, V = 23, 1 + rng.choice([3, 7, 15]), 12
    sessions, rows = [], []
    for i in range(S):
        eos = tuple(rng.sample(range(V), rng.choice([0, 1, 2, 3])))
        params = DecodeParams(max_new_tokens=rng.randint(1, 30), budget=4, topk=2, eos_ids=eos,
                              ignore_eos=rng.random() < 0.2)
        s = Session(sid=f"s{i}", row=i, params=params, prompt_len=3, committed=rng.randint(3, 99))
        s.output = [rng.randrange(V) for _ in range(rng.randint(0, params.max_new_tokens - 1))]
        a = rng.randint(0, P - 1)
        path = [rng.randrange(V) for _ in range(a + 1)] + [rng.choice([-1, 5]) for _ in range(P - a - 1)]
        sessions.append(s)
        rows.append((path, a, rng.randrange(V)))
    path_tokens = torch.tensor([r[0] for r in rows])
    accept = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    bonus = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    committed = torch.tensor([s.committed for s in sessions])
    counts, roots, root_pos = draft_ahead.emitted_counts(sessions, path_tokens, accept, bonus, committed)
    for i, (s, (path, a, b)) in enumerate(zip(sessions, rows)):
        new = path[1 : a + 1] + [b]
        emitted = s.emit(new)
        assert counts[i] == len(emitted) >= 1, (i, new, s.params)
        assert roots[i] == emitted[-1]
        assert root_pos[i] == s.committed + len(emitted)


def test_eligible_needs_one_group_of_drafting_sessions():
    def sess(budget, topk=2):
        return Session(sid="x", row=0, params=DecodeParams(budget=budget, topk=topk), prompt_len=1)

    assert draft_ahead.eligible([sess(4), sess(4)], [0, 1])
    assert not draft_ahead.eligible([sess(4), sess(0)], [0])  # an autoregressive session
    assert not draft_ahead.eligible([sess(4), sess(8)], [0, 1])  # two graph groups
    assert not draft_ahead.eligible([sess(4), sess(4, 3)], [0, 1])
    assert not draft_ahead.eligible([], [])


def test_take_only_the_sessions_it_drafted():
    def sess(sid, budget=4, topk=2):
        return Session(sid=sid, row=0, params=DecodeParams(budget=budget, topk=topk), prompt_len=1, root=7,
                       committed=3)

    trees = build_tree(torch.log_softmax(torch.randn(3, 3, 11, dtype=torch.float64), -1).float(),
                       torch.tensor([7, 7, 7]), [4] * 3, [2] * 3)
    got = []
    ahead = draft_ahead.AheadDraft(["a", "b", "c"], [(4, 2)] * 3, lambda reqs: got.append(reqs) or (lambda: trees))
    a, b, c = sess("a"), sess("b"), sess("c")
    assert ahead.take([a, b, c], [0, 1, 2]) is None  # not before the host has read its step (no requests yet)
    ahead.requests = [DraftRequest(x.sid, 0, torch.zeros(0), 7, 3, 4, 2, traceparent="old") for x in (a, b, c)]
    a.traceparent = "tp-a"  # the taking step's (the drafter's spans go there)
    assert ahead.take([a, b, c], [0, 1, 2])() is trees  # the same sessions: as drafted
    assert [(r.session_id, r.traceparent) for r in got[-1]] == [("a", "tp-a"), ("b", ""), ("c", "")]
    sub = ahead.take([a, c], [0, 1])  # b finished: rows 0 and 2, and no span for b's tree
    assert sub is not None and torch.equal(sub().tokens, trees.tokens[[0, 2]])
    assert [r.traceparent for r in got[-1]] == ["tp-a", "", ""]
    ahead.drop()  # nobody verifies them: no spans
    assert [r.traceparent for r in got[-1]] == ["", "", ""]
    assert ahead.take([c, a], [0, 1]) is None  # another order
    assert ahead.take([a, sess("d")], [0, 1]) is None  # a session it did not draft
    assert ahead.take([a, sess("b", budget=8)], [0, 1]) is None  # another budget
    assert ahead.take([a, b], [0]) is not None and ahead.take([a, b], []) is None
    b.pending_ctx = torch.zeros(2, 5)  # an extended turn's rows
    assert ahead.take([a, b], [0, 1]) is None


# --- through the engine -------------------------------------------------------------------------------------
class CountingOracle(OracleLogqDrafter):
    """The oracle's proposals behind a real Drafter (its context cache, its draft_ahead), counting both ways in."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = {"draft": 0, "ahead": 0}
        self.ahead_sids: set[tuple[str, ...]] = set()

    def draft(self, requests):
        self.calls["draft"] += 1
        return super().draft(requests)

    def draft_ahead(self, sids, *a, **kw):
        self.calls["ahead"] += 1
        self.ahead_sids.add(tuple(sids))
        return super().draft_ahead(sids, *a, **kw)


def oracle_engine(tiny_dirs, target, reference, ahead=True, seed=5, p_wrong=0.3, graphs=True, **cfg):
    dmodel = load_drafter(tiny_dirs[1], target.cfg, torch.float64)
    oracle = OracleDrafter(reference, target.cfg.vocab_size, dmodel.cfg.block_size, p_wrong=p_wrong, seed=seed)
    drafter = CountingOracle(dmodel, target.model.embed_tokens.weight, target.lm_head.weight, max_sessions=8,
                             window=16, cuda_graphs=graphs, oracle=oracle)
    eng = Engine(target, drafter, dmodel.cfg.target_layer_ids,
                 EngineConfig(page_size=8, num_pages=512, max_sessions=8, draft_window=16, draft_ahead=ahead, **cfg))
    return eng, drafter


@pytest.fixture(scope="module")
def ar40(tiny_target64):
    return ar_reference(tiny_target64, PROMPTS, new=40)


@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_draft_ahead_equals_ar(tiny_dirs, tiny_target64, ar40, graphs):
    """Deep acceptance; sessions finish at different steps (max_new_tokens 40, 33, 21, 40: the set shrinks and the
    steps take the remaining sessions' trees from the draft queued ahead), through the graph runner's padded path and
    eagerly."""
    ref = {f"r{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar40))}
    eng, drafter = oracle_engine(tiny_dirs, tiny_target64, ref, graphs=graphs)
    lengths = [40, 33, 21, 40]
    sessions = [eng.add(p, DecodeParams(max_new_tokens=n, budget=16, topk=4), sid=f"r{i}")
                for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    eng.run_until_done()
    assert [s.output for s in sessions] == [o[:n] for o, n in zip(ar40, lengths)]
    accepted = [a for s in sessions for a in s.accepted_per_step]
    assert max(accepted) >= 6 and min(accepted) == 1  # deep acceptance and rejection at the root
    assert drafter.calls["ahead"] >= 6, drafter.calls
    assert drafter.calls["draft"] == 1, drafter.calls  # the first step only
    assert len(drafter.cache._row) == 0  # every context released
    if graphs:  # the ahead steps went through the runner's one-graph path (padded on the CPU: 3 sessions -> 4)
        assert drafter.graphs.stats["ahead_padded_eager"] == drafter.calls["ahead"], dict(drafter.graphs.stats)


def test_draft_ahead_with_eos_mid_path_and_an_extended_turn(tiny_dirs, tiny_target64, ar40):
    """A session stops on an EOS inside an accepted path (the device's count cuts its rows there) and, being
    persistent, takes a second turn; another joins mid-run. Output equals AR (the second turn: AR on the whole
    prefix) and the drafter's context length follows the verifier's committed tokens."""
    target = tiny_target64
    out0 = ar40[0]
    eos = out0[12]  # a token the first session emits mid-run
    stop = out0.index(eos) + 1
    turn2 = [31, 32, 33]
    whole = PROMPTS[0] + out0[:stop] + turn2
    ar_turn2 = ar_reference(target, [whole], new=12)[0]
    ref = {"r0": whole + ar_turn2, "r1": PROMPTS[1] + ar40[1], "r3": PROMPTS[3] + ar40[3]}
    eng, drafter = oracle_engine(tiny_dirs, target, ref, p_wrong=0.1)
    s0 = eng.add(PROMPTS[0], DecodeParams(max_new_tokens=40, budget=16, topk=4, eos_ids=(eos,)), sid="r0",
                 persistent=True)
    s1 = eng.add(PROMPTS[1], DecodeParams(max_new_tokens=40, budget=16, topk=4), sid="r1")
    eng.step()
    assert not s0.done
    s3 = eng.add(PROMPTS[3], DecodeParams(max_new_tokens=40, budget=16, topk=4), sid="r3")
    while not s0.done:
        eng.step()
    assert s0.output == out0[:stop] and s0.finish_reason == "stop"
    assert drafter.cache.length("r0") == s0.committed  # the rows of the path past the EOS were not kept
    eng.extend("r0", turn2, DecodeParams(max_new_tokens=12, budget=16, topk=4))
    eng.run_until_done()
    assert s0.output == ar_turn2
    assert s1.output == ar40[1] and s3.output == ar40[3]
    assert drafter.calls["ahead"] >= 4, drafter.calls
    assert drafter.calls["draft"] >= 3, drafter.calls  # the first step, after r3 joined and after r0's new turn


def test_sampled_draft_ahead_equals_sampled_ar(tiny_dirs, tiny_target64):
    """Seeded sampling: the roots queued ahead are the sampled bonuses; the output is seeded AR's."""
    target = tiny_target64
    sp = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i) for i in range(3)]
    ar = Engine(target, None, (), EngineConfig(page_size=8, num_pages=256, max_sessions=8))
    ref_sessions = [ar.add(p, DecodeParams(max_new_tokens=24, budget=0, sampling=q)) for p, q in zip(PROMPTS, sp)]
    ar.run_until_done()
    ref = {f"r{i}": p + s.output for i, (p, s) in enumerate(zip(PROMPTS, ref_sessions))}
    eng, drafter = oracle_engine(tiny_dirs, target, ref, p_wrong=0.2)
    sessions = [eng.add(p, DecodeParams(max_new_tokens=24, budget=8, topk=3, sampling=q), sid=f"r{i}")
                for i, (p, q) in enumerate(zip(PROMPTS, sp))]
    eng.run_until_done()
    assert [s.output for s in sessions] == [s.output for s in ref_sessions]
    assert max(a for s in sessions for a in s.accepted_per_step) >= 4
    assert drafter.calls["ahead"] >= 3, drafter.calls


def test_mixed_budgets_draft_the_usual_way(tiny_dirs, tiny_target64, ar40):
    """Two (budget, top-k) groups draft the usual way; once the one session left is alone, it drafts ahead."""
    ref = {f"r{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar40))}
    eng, drafter = oracle_engine(tiny_dirs, tiny_target64, ref)
    lengths = [40, 10, 10, 10]
    sessions = [eng.add(p, DecodeParams(max_new_tokens=n, budget=8 if i == 0 else 16, topk=4), sid=f"r{i}")
                for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    eng.run_until_done()
    assert [s.output for s in sessions] == [o[:n] for o, n in zip(ar40, lengths)]
    assert drafter.calls["draft"] > 1 and drafter.calls["ahead"] > 0
    assert drafter.ahead_sids == {("r0",)}  # never while the budgets differed


class RecordingDrafter(Drafter):
    """Keeps every tree it drafts (tokens and parents), either way in."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.trees = []

    def _keep(self, trees):
        self.trees.append((trees.tokens.clone(), trees.parent.clone()))
        return trees

    def draft(self, requests):
        return self._keep(super().draft(requests))

    def draft_ahead(self, *a, **kw):
        return self._keep(super().draft_ahead(*a, **kw))


@pytest.mark.parametrize("projected", [False, True], ids=["taps", "projected"])
def test_draft_ahead_appends_the_rows_the_usual_steps_append(tiny_dirs, tiny_target64, projected):
    """A real drafter (its own proposals): two engines, one drafting ahead, stepped in lockstep, hold the same
    context rows in the drafter's cache after every step (the same counts; K and V equal to fp64 rounding), draft
    the same trees for every step (the context lengths, roots and positions too), and both emit AR's tokens; the
    rows go as taps, or projected by the engine (what build_local_engine does)."""
    target = tiny_target64
    ar = ar_reference(target, PROMPTS[:3], new=20)
    engines = []
    for ahead in (False, True):
        dmodel = load_drafter(tiny_dirs[1], target.cfg, torch.float64)
        drafter = RecordingDrafter(dmodel, target.model.embed_tokens.weight, target.lm_head.weight, max_sessions=8,
                                   window=16, cuda_graphs=True)
        eng = Engine(target, drafter, dmodel.cfg.target_layer_ids,
                     EngineConfig(page_size=8, num_pages=512, max_sessions=8, draft_window=16, draft_ahead=ahead),
                     ContextProjection.from_model(dmodel) if projected else None)
        engines.append((eng, [eng.add(p, DecodeParams(max_new_tokens=20, budget=6, topk=2), sid=f"r{i}")
                              for i, p in enumerate(PROMPTS[:3])]))
    (plain, ps), (ahead, qs) = engines
    assert ahead.drafter.drafts_ahead
    steps = compared = 0
    while any(not s.done for s in ps):
        plain.step()
        ahead.step()
        steps += 1
        for p, q in zip(ps, qs):
            assert p.output == q.output
            if p.done:
                continue
            cp, cq = plain.drafter.cache, ahead.drafter.cache
            nq, n_p, W = cq._count[q.sid], cp._count[p.sid], cq.window
            assert nq == q.committed  # the ahead drafter has this step's rows already
            assert n_p < nq  # the usual steps send them with the next request
            # the positions both rings still hold: the same ring slots, the same rows
            slots = [pos % W for pos in range(max(0, nq - W), n_p)]
            rp, rq = cp.row(p.sid), cq.row(q.sid)
            for cache_p, cache_q in ((cp.k, cq.k), (cp.v, cq.v)):
                torch.testing.assert_close(cache_p[:, rp, slots], cache_q[:, rq, slots], rtol=1e-9, atol=1e-12)
            compared += len(slots)
    assert [s.output for s in qs] == ar and steps > 3 and compared > 10 * steps
    tp, tq = plain.drafter.trees, ahead.drafter.trees
    assert len(tq) == len(tp) + 1  # the last step drafted one ahead that nobody took
    for (tok_p, par_p), (tok_q, par_q) in zip(tp, tq):
        assert torch.equal(tok_p, tok_q) and torch.equal(par_p, par_q)


# --- GPU ----------------------------------------------------------------------------------------------------
@gpu_test
def test_gpu_draft_ahead_equals_ar(monkeypatch):
    """kimi-mini, bf16, CUDA graphs on both models: drafting ahead (the graphs fed from device values, the host
    read behind an event) gives AR's tokens at budgets 4 and 16, and the steps took the drafts queued ahead."""
    from gateway.tokenizer import Tokenizer
    from verifier_service.local import build_local_engine

    engine = build_local_engine(PAIR / "target", PAIR / "drafter", torch.bfloat16, "cuda",
                                EngineConfig(num_pages=512, max_sessions=8, draft_window=1024, draft_ahead=True))
    tok = Tokenizer.load(PAIR / "target")
    prompts = [tok.encode(t) for t in GPU_TEXTS]
    calls = []
    real = engine.drafter.draft_ahead
    monkeypatch.setattr(engine.drafter, "draft_ahead", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ar, _ = decode_all(engine, prompts, 0, topk=8, new=48)
    for budget in (4, 16):
        del calls[:]
        out, sessions = decode_all(engine, prompts, budget, topk=8, new=48)
        assert out == ar, f"budget {budget}: drafting ahead diverged from AR"
        steps = max(len(s.accepted_per_step) for s in sessions)
        assert len(calls) >= steps - 1, (len(calls), steps)
        assert max(a for s in sessions for a in s.accepted_per_step) >= 3
    runner = engine.drafter.graphs
    assert runner.stats["ahead_replays"] > 0 and not runner.failed, (dict(runner.stats), runner.failed)
