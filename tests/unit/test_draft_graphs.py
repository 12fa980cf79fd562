"""The draft step through `drafter_service.cuda_graphs.DraftGraphRunner`: padding is harmless (DESIGN 3.4).

CPU (the runner's padded-eager mode: the same static buffers, pad requests, grouping and merging as the
graphs, run eagerly), fp32: a padded step's real rows equal the unpadded eager draft bitwise (log-probs and
all six tree arrays) with the pad row poisoned with NaN, for R = 1, 3, 5 and mixed context lengths (0 rows,
a wrapped window); bitwise with row-invariant linears (`tests.helpers.row_invariant_linears`, independent of
which GEMM kernel a row count picks), and trees equal / log-probs to fp32 rounding with stock GEMMs. Mixed
(budget, top-k) steps run as groups and merge into what the eager batch builds; a failed capture (drafts
and appends) or the graph cap falls back to eager; the TreeBatch a replay returns stays valid after later
replays (fake graphs that rerun their body at capture and replay); greedy DDTree through the engine with
the padded drafter equals AR token for token (an oracle behind the runner's `logq` hook for deep
acceptance, and the real drafter). (Padded appends: tests/unit/test_drafter_context_batch.py.)
GPU (marked `gpu`; kimi-mini, bf16): graph replays (appends and drafts) == padded eager bitwise, warm-up
captures write only the pad row, greedy DDTree == AR with draft graphs (and verify graphs) on, graphs
really replayed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math

import pytest
import torch

from drafter_service.api import DraftRequest
from drafter_service.cuda_graphs import pow2_buckets
from drafter_service.device_copy import int64_to_device
from drafter_service.drafter import Drafter
from kernels.tree_build import TreeBatch
from tests.helpers import OracleDrafter, random_drafter
from tests.unit.test_cuda_graphs import GPU_TEXTS, PAIR, gpu_test
from tests.unit.test_engine_exact import PROMPTS, ar_reference
from verifier_service.engine import Engine, EngineConfig
from verifier_service.session import DecodeParams

WINDOW = 12
CTX = [0, 1, 5, 30, 13, 7, 2]  # context rows per session (30 wraps the window)


# --- helpers -------------------------------------------------------------------------------------------
def assert_same_trees(a: TreeBatch, b: TreeBatch, what: str = "") -> None:
    assert a.n_nodes == b.n_nodes, what
    for f in TreeBatch._FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.shape == y.shape and x.dtype == y.dtype, (what, f, x.shape, y.shape)
        assert torch.equal(x, y), (what, f, (x != y).nonzero()[:5].tolist())


def requests(n: int, F: int, seed: int, budgets=((16, 4),), ctx=CTX) -> list[DraftRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rows = ctx[i % len(ctx)]
        budget, topk = budgets[i % len(budgets)]
        out.append(DraftRequest(f"s{seed}-{i}", 0, torch.randn(rows, F, generator=g),
                                int(torch.randint(0, 250, (), generator=g)), rows, budget, topk))
    return out


def pair(row_invariant: bool, seed: int = 0, max_sessions: int = 8):
    """(padded-eager drafter, eager drafter) over one random model."""
    model, embed, head = random_drafter(seed=seed, row_invariant=row_invariant)
    padded = Drafter(model, embed, head, max_sessions=max_sessions, window=WINDOW, cuda_graphs=True)
    eager = Drafter(model, embed, head, max_sessions=max_sessions, window=WINDOW, cuda_graphs=False)
    assert padded.graphs is not None and not padded.graphs.capture and eager.graphs is None
    padded.cache.k[:, padded.cache.pad_row] = float("nan")  # a pad request leaking into a real row shows
    padded.cache.v[:, padded.cache.pad_row] = float("nan")
    return padded, eager


def padded_logq(d: Drafter, reqs: list[DraftRequest]) -> torch.Tensor:
    """The log-probs a padded step computes for its real rows (the runner's inputs, the model's logq)."""
    cols = d.graphs._columns(reqs, d.graphs.bucket(len(reqs)))
    return d.logq(*int64_to_device(cols, d.device).unbind(0))[: len(reqs)]


# --- CPU: padded eager ------------------------------------------------------------------------------------
def test_buckets():
    assert pow2_buckets(1) == [1]
    assert pow2_buckets(8) == [1, 2, 4, 8]
    assert pow2_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert pow2_buckets(64)[-2:] == [32, 64]
    with pytest.raises(ValueError):
        pow2_buckets(0)
    padded, _ = pair(row_invariant=False, max_sessions=6)
    assert padded.graphs.buckets == [1, 2, 4, 6] and padded.graphs.row_buckets[-1] == 6 * padded.cfg.block_size


@pytest.mark.parametrize("R", [1, 3, 5])
def test_padded_eager_equals_eager_bitwise(R):
    padded, eager = pair(row_invariant=True)
    F = padded.cfg.num_taps * 64
    reqs = requests(R, F, seed=R)
    got, want = padded.draft(reqs), eager.draft(reqs)
    assert padded.graphs.stats == collections.Counter(padded_eager=1, context_padded_eager=R > 1 or CTX[0] > 0)
    assert_same_trees(got, want, f"R={R}")
    lq = padded_logq(padded, reqs)
    assert torch.isfinite(lq).all()
    assert torch.equal(lq, eager.draft_logq(reqs))
    assert [padded.cache.length(r.session_id) for r in reqs] == [min(r.root_pos, WINDOW) for r in reqs]


@pytest.mark.parametrize("R", [1, 3, 5])
def test_padded_eager_matches_eager_with_stock_gemms(R):
    padded, eager = pair(row_invariant=False, seed=1)
    reqs = requests(R, padded.cfg.num_taps * 64, seed=10 + R)
    got, want = padded.draft(reqs), eager.draft(reqs)
    for f in ("tokens", "parent", "depth", "first_child", "next_sibling"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert torch.allclose(got.logw, want.logw, rtol=1e-5, atol=1e-5)
    assert torch.allclose(padded_logq(padded, reqs), eager.draft_logq(reqs), rtol=1e-5, atol=1e-5)


def test_mixed_budgets_run_as_groups_and_merge():
    """Requests of four (budget, top-k) pairs: one padded run per pair, merged in request order into exactly
    the eager batch's arrays (width = the largest tree, pad values -1 / -inf)."""
    padded, eager = pair(row_invariant=True, seed=2)
    budgets = ((16, 4), (4, 2), (16, 4), (64, 8), (1, 1), (16, 4))
    reqs = requests(7, padded.cfg.num_taps * 64, seed=3, budgets=budgets)
    got, want = padded.draft(reqs), eager.draft(reqs)
    assert padded.graphs.stats["padded_eager"] == 4 and padded.graphs.stats["eager"] == 0
    assert_same_trees(got, want, "mixed")
    assert got.tokens.shape == (7, 65) and got.n_nodes == [17, 5, 17, 65, 2, 17, 17]
    assert torch.isneginf(got.logw[1, 5:]).all() and (got.parent[1, 5:] == -1).all()


class FakeGraph:
    """Graph semantics on the CPU: the body runs at capture (as the side-stream warm-up does) and at every
    replay, which overwrites the same static output tensor."""

    def __init__(self, body):
        self.body, self.out = body, body()

    def replay(self):
        out = self.body()
        if self.out is not None:
            self.out.copy_(out)


def test_replayed_trees_belong_to_the_caller_and_failures_fall_back(caplog):
    padded, eager = pair(row_invariant=True, seed=4, max_sessions=16)
    r = padded.graphs
    r.capture = True  # the graph paths, with fake graphs (CPU)
    entered = []

    def capture(key, body):
        entered.append(key)
        if (key[0] != "context" and key[1] == 4) or key == ("context", 1):  # budget-4 drafts, 1-row appends fail
            r.failed[key] = "RuntimeError: simulated"
            return None
        g = FakeGraph(body)
        r.graphs[key] = (g, g.out)
        r.stats["captures"] += 1
        return r.graphs[key]

    r._capture = capture
    F = padded.cfg.num_taps * 64
    first = requests(3, F, seed=5)
    a = padded.draft(first)
    a_copy = TreeBatch(**{f: getattr(a, f).clone() for f in TreeBatch._FIELDS}, n_nodes=list(a.n_nodes))
    second = requests(4, F, seed=6)  # same bucket (4) and key: the fake graph's output is overwritten
    b = padded.draft(second)
    assert r.stats["replays"] == 2 and r.stats["context_replays"] == 2 and r.stats["captures"] == 3
    assert set(r.graphs) == {(4, 16, 4), ("context", 8), ("context", 32)}  # 0+1+5 and 0+1+5+12 kept rows
    assert_same_trees(a, a_copy, "an earlier TreeBatch changed after a later replay")
    assert_same_trees(a, eager.draft(first), "first")
    assert_same_trees(b, eager.draft(second), "second")

    mixed = requests(5, F, seed=7, budgets=((16, 4), (4, 2)))  # (16, 4) replays; (4, 2) fails, runs eagerly
    assert_same_trees(padded.draft(mixed), eager.draft(mixed), "mixed with a failed key")
    again = requests(2, F, seed=8, budgets=((4, 2),))
    assert_same_trees(padded.draft(again), eager.draft(again), "failed key again")
    assert [k for k in entered if k[0] != "context"] == [(4, 16, 4), (2, 4, 2)]  # a failed key is not retried
    assert r.stats["eager"] == 2 and (2, 4, 2) in r.failed and r.stats["replays"] == 3
    assert ("context", 1) in r.failed and r.stats["context_eager"] == 1  # `again` appends 1 row, eagerly

    r.max_graphs = len([k for k in r.graphs if k[0] != "context"])  # the cap: a new draft key runs eagerly
    with caplog.at_level(logging.WARNING, logger="drafter_service.cuda_graphs"):
        for seed in (9, 10):
            more = requests(1, F, seed=seed, budgets=((8, 3),))
            assert_same_trees(padded.draft(more), eager.draft(more), "over the cap")
    assert sum("draft graphs captured already" in m for m in caplog.messages) == 1
    assert (1, 8, 3) not in r.graphs and r.stats["eager"] == 4


def test_overriding_draft_logq_drafts_eagerly():
    class Other(Drafter):
        def draft_logq(self, requests):
            return super().draft_logq(requests)

    model, embed, head = random_drafter()
    assert Other(model, embed, head, max_sessions=2, window=8, cuda_graphs=True).graphs is None


def test_drafter_serve_flag():
    from gateway.cli import build_parser
    from gateway.commands.drafter import config_from_args

    argv = ["drafter", "serve", "--listen", "127.0.0.1:0", "--target", "t", "--drafter", "d"]
    parser = build_parser("drafter")
    assert config_from_args(parser.parse_args(argv)).cuda_graphs is None
    assert config_from_args(parser.parse_args([*argv, "--no-cuda-graphs"])).cuda_graphs is False


# --- CPU: through the engine ------------------------------------------------------------------------------
class OracleLogqDrafter(Drafter):
    """The oracle's proposals behind the runner: it overrides the device-level `logq` (what a graph
    captures), so every step goes through padding, grouping and merging; pad rows get uniform log-probs."""

    def __init__(self, *a, oracle: OracleDrafter, **kw):
        super().__init__(*a, **kw)
        self.oracle = oracle
        self.pad_rows_seen = 0

    def logq(self, rows, ctx_len, roots, root_pos):
        owner = {row: sid.split("/")[-1] for sid, row in self.cache._row.items()}  # a service keys "<stream>/<sid>"
        L, V = self.depth, self.cfg.vocab_size
        out = torch.full((rows.shape[0], L, V), -math.log(V), dtype=torch.float32)
        for i, (row, root, pos) in enumerate(zip(rows.tolist(), roots.tolist(), root_pos.tolist())):
            if row == self.cache.pad_row:
                self.pad_rows_seen += 1
                continue
            out[i] = self.oracle.draft_logq([DraftRequest(owner[row], 0, torch.zeros(0), root, pos, 1, 1)])[0]
        return out


def test_engine_greedy_ddtree_equals_ar_with_padded_drafter(tiny_dirs, tiny_target64):
    """Deep acceptance, mixed budgets (groups of 3 -> padded to 4, and 1) plus an AR session, fp64."""
    from drafter_service.checkpoint import load_drafter

    target = tiny_target64
    prompts = PROMPTS + [[7, 8, 9]]
    ar = ar_reference(target, prompts, new=32)
    oracle = OracleDrafter({f"r{i}": p + o for i, (p, o) in enumerate(zip(prompts, ar))}, target.cfg.vocab_size,
                           8, p_wrong=0.3, seed=5)
    dmodel = load_drafter(tiny_dirs[1], target.cfg, torch.float64)
    drafter = OracleLogqDrafter(dmodel, target.model.embed_tokens.weight, target.lm_head.weight, max_sessions=8,
                                window=16, cuda_graphs=True, oracle=oracle)
    eng = Engine(target, drafter, dmodel.cfg.target_layer_ids,
                 EngineConfig(page_size=8, num_pages=512, max_sessions=8, draft_window=16))
    params = [DecodeParams(32, 16, 4), DecodeParams(32, 16, 4), DecodeParams(32, 5, 2), DecodeParams(32, 16, 4),
              DecodeParams(32, 0)]
    sessions = [eng.add(p, q, sid=f"r{i}") for i, (p, q) in enumerate(zip(prompts, params))]
    eng.run_until_done()
    assert [s.output for s in sessions] == ar
    assert max(a for s in sessions for a in s.accepted_per_step) >= 5
    st = drafter.graphs.stats
    assert st["padded_eager"] > 0 and st["eager"] == 0, dict(st)
    assert drafter.pad_rows_seen > 0  # the group of three budget-16 sessions ran padded to four
    assert len(drafter.cache._row) == 0  # contexts released


def test_engine_with_real_padded_drafter_equals_ar(tiny_dirs, tiny_target64):
    """build_local_engine's switch reaches the in-process drafter (padded eager on the CPU)."""
    from verifier_service.local import build_local_engine

    eng = build_local_engine(*tiny_dirs, torch.float32, "cpu", EngineConfig(page_size=8, num_pages=256,
                             max_sessions=4, draft_window=16), cuda_graphs=True)
    runner = eng.drafter.graphs
    assert runner is not None and not runner.capture
    prompts = PROMPTS[:3]
    ar = [s.output for s in eng.generate(prompts, DecodeParams(max_new_tokens=16, budget=0))]
    params = [DecodeParams(16, 8, 2), DecodeParams(16, 8, 2), DecodeParams(16, 3, 3)]
    assert [s.output for s in eng.generate(prompts, params)] == ar
    assert runner.stats["padded_eager"] > 0 and runner.stats["eager"] == 0


# --- GPU -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mini_drafters():
    """(graph drafter, padded-eager drafter) over one kimi-mini drafter, bf16 on CUDA."""
    from drafter_service.checkpoint import load_drafter
    from drafter_service.target_head import load_target_head

    tcfg, embed, head = load_target_head(PAIR / "target", torch.bfloat16, "cuda")
    model = load_drafter(PAIR / "drafter", tcfg, torch.bfloat16, "cuda")
    graphs = Drafter(model, embed, head, max_sessions=8, window=64)
    assert graphs.graphs is not None and graphs.graphs.capture  # on by default on CUDA
    plain = Drafter(model, embed, head, max_sessions=8, window=64, cuda_graphs=True)
    plain.graphs.capture = False  # padded eager on the GPU: the same buffers and shapes, no graphs
    return graphs, plain, tcfg.hidden_size


@gpu_test
def test_gpu_draft_graph_replay_equals_padded_eager_bitwise(mini_drafters):
    """Each case: a first step with long contexts (appends of more than 64 rows run eagerly, smaller ones
    replay), then a decode-like step of 3 new rows per session (a replayed append, wrapping full windows);
    trees and the sessions' cache rows bitwise equal to the padded-eager runner's, and an earlier TreeBatch
    unchanged by later replays."""
    graphs, plain, hidden = mini_drafters
    F = graphs.cfg.num_taps * hidden
    ctx = [0, 1, 9, 100, 33, 64, 2, 17]
    cases = [requests(R, F, seed=100 + R, ctx=ctx) for R in (1, 3, 5, 8)]
    cases.append(requests(7, F, seed=99, ctx=ctx, budgets=((16, 8), (4, 2), (64, 8))))  # three groups
    runner, real = graphs.graphs, slice(0, graphs.cache.pad_row)
    g = torch.Generator().manual_seed(0)
    for first in cases:
        nxt = [dataclasses.replace(r, ctx_start=r.root_pos, ctx_features=torch.randn(3, F, generator=g),
                                   root_pos=r.root_pos + 3) for r in first]
        trees = []
        for reqs in (first, nxt):
            reqs = [dataclasses.replace(r, ctx_features=r.ctx_features.to("cuda", torch.bfloat16)) for r in reqs]
            r0, c0 = runner.stats["replays"], runner.stats["context_replays"]
            got, want = graphs.draft(reqs), plain.draft(reqs)
            assert_same_trees(got, want, f"R={len(reqs)}")
            assert torch.equal(graphs.cache.k[:, real], plain.cache.k[:, real]), "append replay != padded eager"
            assert torch.equal(graphs.cache.v[:, real], plain.cache.v[:, real]), "append replay != padded eager"
            assert runner.stats["replays"] - r0 == len({(r.budget, r.topk) for r in reqs}), dict(runner.stats)
            rows = sum(min(r.ctx_features.shape[0], graphs.cache.window) for r in reqs)
            graphed = 0 < rows <= runner.row_buckets[-1]
            assert runner.stats["context_replays"] - c0 == graphed, (rows, dict(runner.stats))
            trees.append((got, TreeBatch(**{f: getattr(got, f).clone() for f in TreeBatch._FIELDS},
                                         n_nodes=list(got.n_nodes))))
        for got, copy in trees:
            assert_same_trees(got, copy, "a replay changed an earlier TreeBatch")
        for r in first:
            graphs.release(r.session_id)
            plain.release(r.session_id)
    assert not runner.failed, runner.failed
    assert runner.stats["context_replays"] >= len(cases)
    print("drafter graphs", sorted(runner.graphs, key=str), dict(runner.stats))


@gpu_test
def test_gpu_draft_warmup_writes_only_the_pad_row(mini_drafters):
    graphs, _, hidden = mini_drafters
    real = slice(0, graphs.cache.pad_row)
    k, v = graphs.cache.k[:, real].clone(), graphs.cache.v[:, real].clone()
    runner = graphs.graphs
    assert graphs.warmup(16, 8) == len(runner.buckets) + len(runner.row_buckets), runner.failed
    assert torch.equal(graphs.cache.k[:, real], k) and torch.equal(graphs.cache.v[:, real], v)


@gpu_test
def test_gpu_ddtree_equals_ar_with_draft_graphs():
    from gateway.tokenizer import Tokenizer
    from verifier_service.local import build_local_engine

    engine = build_local_engine(PAIR / "target", PAIR / "drafter", torch.bfloat16, "cuda",
                                EngineConfig(num_pages=512, max_sessions=8, draft_window=1024))
    runner = engine.drafter.graphs
    assert runner is not None and runner.capture and engine.graphs is not None
    tok = Tokenizer.load(PAIR / "target")
    prompts = [tok.encode(t) for t in GPU_TEXTS]

    def decode(params):
        sessions = [engine.add(p, q, sid=f"g{i}") for i, (p, q) in enumerate(zip(prompts, params))]
        engine.run_until_done()
        for s in sessions:
            engine.release(s.sid)
        return [s.output for s in sessions]

    ar = decode([DecodeParams(max_new_tokens=32, budget=0, ignore_eos=True)] * 3)
    for budgets in ([4] * 3, [16] * 3, [16, 4, 64]):
        for on in (True, False):
            runner.enabled = on
            r0 = runner.stats["replays"]
            out = decode([DecodeParams(max_new_tokens=32, budget=b, topk=8, ignore_eos=True) for b in budgets])
            assert out == ar, f"budgets {budgets}, draft graphs {on}: DDTree diverged from AR"
            assert (runner.stats["replays"] > r0) == on
    runner.enabled = True
    assert not runner.failed, runner.failed


@pytest.mark.skipif(not (PAIR / "drafter" / "config.json").exists(), reason="models/kimi-mini missing")
def test_launches_per_step_do_not_grow_with_sessions():
    """bench/bench_draft_step.py's count (meta device, kimi-mini shapes): the eager step issues the same ops
    at 1 and 32 sessions (the per-session context append is gone), and with graphs the host issues only the
    uploads of features and indices, two replays (append, draft) and the copy out of the trees."""
    from bench.bench_draft_step import count_launches
    from drafter_service.config import DFlashConfig
    from verifier_service.config import KimiConfig

    cfg, tcfg = DFlashConfig.from_file(PAIR / "drafter"), KimiConfig.from_file(PAIR / "target")
    one, many = count_launches(cfg, tcfg.hidden_size, 1), count_launches(cfg, tcfg.hidden_size, 32)
    # + the cat, + the copy of the block's rows 1.. before the lm_head (a view for one request)
    assert many["eager"] - one["eager"] <= 2 and many["graphs"] - one["graphs"] <= 1, (one, many)
    assert many["graphs"] <= 8 < 100 < many["eager"], many  # uploads, two replays, the copy out
