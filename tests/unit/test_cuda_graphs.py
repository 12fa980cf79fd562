"""The verify forward through `verifier_service.cuda_graphs.GraphRunner`: padding is harmless (DESIGN 3.4).

CPU (the runner's padded-eager mode: the same static buffers, padding and slicing as the graphs, run
eagerly): a padded forward's real rows equal the unpadded forward's, for AR and tree batches with padded
tokens and padded sessions, to 1e-12 in fp64 (not bitwise: torch's CPU GEMMs pick other kernels for
1 or 3 rows than for more, so a row's last bits depend on the row count; with no pad token, only padded
sessions, they are equal bitwise, and a pad token leaking into a real row would show at ~1e-2); the
KV pool changes only at the batch's slots (to the same tolerance) and the scratch page, every other row
bitwise; an engine on the padded path decodes exactly what the plain engine and AR decode.
GPU (marked `gpu`; kimi-mini, bf16, batch invariant): the same forward check on graph replays, greedy
DDTree == AR == the eager engine at budgets 4/16/64 with graphs, and graphs really replayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from kernels.tree_mask import ancestor_mask, pack_mask_bits
from tests.helpers import OracleDrafter
from verifier_service.cuda_graphs import GraphRunner, capture_blockers, token_buckets
from verifier_service.engine import Engine, EngineConfig
from verifier_service.forward_batch import ForwardBatch
from verifier_service.session import DecodeParams

PAIR = Path(__file__).resolve().parents[2] / "models" / "kimi-mini"
CUDA = torch.cuda.is_available()


def gpu_test(fn):
    """Marked `gpu`; skipped without CUDA or without models/kimi-mini."""
    fn = pytest.mark.skipif(not (PAIR / "drafter" / "config.json").exists(), reason="models/kimi-mini missing")(fn)
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(fn))


PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [42], list(range(60, 90))]
# tree sizes per session of successive verify batches on one runner (max_sessions 8); the comments name
# the bucket: pad tokens and empty sessions in every case but noted, rows of a larger batch re-padded
CASES = [
    [65, 3],  # 68 -> 96 tokens, two mask words
    [1, 1, 1],  # AR: 3 -> 4
    [5, 9, 1, 2],  # 17 -> 32
    [8, 8],  # 16: no pad token
    [3, 1, 4, 1, 5, 2, 6, 2],  # every session slot used: 24 -> 32
    [1],  # 1: no pad token
]


# --- helpers -------------------------------------------------------------------------------------------
def open_sessions(engine: Engine, n: int, seed: int = 0) -> list:
    """n AR sessions of different prompt lengths, prefilled (they never finish in these tests)."""
    g = torch.Generator().manual_seed(seed)
    V = engine.target.cfg.vocab_size
    out = []
    for i in range(n):
        L = int(torch.randint(1, 40, (), generator=g))
        prompt = torch.randint(0, V, (L,), generator=g).tolist()
        out.append(engine.add(prompt, DecodeParams(max_new_tokens=1000, budget=0), sid=f"t{i}"))
    return out


def verify_batch(engine: Engine, sessions: list, sizes: list[int], seed: int) -> ForwardBatch:
    """A tree batch as Engine.step builds it: random trees (parents first) of `sizes` nodes after each
    session's committed rows."""
    g = torch.Generator().manual_seed(seed)
    dev, V = engine.device, engine.target.cfg.vocab_size
    S, M = len(sizes), max(sizes)
    tok = torch.randint(0, V, (S, M), generator=g)
    parent = torch.full((S, M), -1, dtype=torch.int64)
    depth = torch.zeros(S, M, dtype=torch.int64)
    for i, n in enumerate(sizes):
        for j in range(1, n):
            parent[i, j] = int(torch.randint(0, j, (), generator=g))
            depth[i, j] = depth[i, parent[i, j]] + 1
    for s, n in zip(sessions, sizes):
        engine.kv.ensure(s.row, s.committed + n)
    gather = torch.tensor([i * M + j for i in range(S) for j in range(sizes[i])])
    rows = torch.tensor([s.row for s in sessions])
    committed = torch.tensor([s.committed for s in sessions])
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    slots = engine.kv.slots(rows.to(dev), (committed[:, None] + torch.arange(M)[None, :]).to(dev))
    return ForwardBatch(
        tokens=tok.view(-1)[gather].to(dev), positions=(committed[:, None] + depth).view(-1)[gather].to(dev),
        write_slots=slots.view(-1)[gather.to(dev)], cu_q=cu.to(dev), prefix_lens=committed.to(torch.int32).to(dev),
        block_table=engine.kv.block_table[rows.to(dev)], page_size=engine.kv.page_size,
        tree_bits=pack_mask_bits(ancestor_mask(parent)).view(S * M, -1)[gather].to(dev))


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if exact or a.dtype != torch.float64:
        return a.shape == b.shape and torch.equal(a, b)
    return a.shape == b.shape and bool(((a - b).abs() <= 1e-12 * (1 + b.abs())).all())


@torch.no_grad()
def check_padded_forward(engine: Engine, sessions: list, cases: list[list[int]], exact: bool) -> None:
    """For each batch: the runner's padded forward (graph replay or padded eager) == the plain forward (bitwise
    when `exact`, else to 1e-12 in fp64) in hidden, taps and logits; the KV pool then differs from before only
    at the batch's write slots (as in the plain run) and, for the padded run, at the scratch slot. The scratch
    slot starts as NaN: a real row that read it would turn NaN; pad tokens overwrite it before they read it."""
    kv, runner = engine.kv, engine.graphs
    for k, sizes in enumerate(cases):
        fb = verify_batch(engine, sessions[: len(sizes)], sizes, seed=k)
        kv.kv[:, kv.scratch_slot] = float("nan")
        before = kv.kv.clone()
        hidden, taps = engine.forward(fb)
        logits = engine.target.logits(hidden)
        kv_eager = kv.kv.clone()
        kv.kv.copy_(before)
        out = runner.run(fb)
        assert out is not None, f"{sizes}: the runner did not take the batch"
        for name, a, b in zip(("hidden", "taps", "logits"), out, (hidden, taps, logits)):
            if a is None:  # logits left out of the graph: the engine computes them from hidden
                continue
            no_pad = runner.bucket(fb.num_tokens) == fb.num_tokens  # only padded sessions: bitwise on the CPU too
            assert same(a, b, exact or no_pad), f"{sizes}: padded {name} differs from the plain forward"
        written = torch.zeros(kv.kv.shape[1], dtype=torch.bool, device=kv.kv.device)
        written[fb.write_slots] = True
        assert same(kv.kv[:, written], kv_eager[:, written], exact), f"{sizes}: the batch's KV rows differ"
        assert not torch.equal(kv.kv[:, written], before[:, written])  # not vacuous: the rows were written
        untouched = ~written
        untouched[kv.scratch_slot] = False
        assert torch.equal(kv.kv[:, untouched], before[:, untouched]), f"{sizes}: padding touched other KV rows"
        assert torch.equal(kv_eager[:, untouched], before[:, untouched])
        assert kv_eager[:, kv.scratch_slot].isnan().all()
        pad_tokens = runner.bucket(fb.num_tokens) > fb.num_tokens
        assert bool(kv.kv[:, kv.scratch_slot].isfinite().all()) == pad_tokens, sizes


# --- CPU -------------------------------------------------------------------------------------------------
def test_token_buckets():
    assert token_buckets(1) == [1]
    assert token_buckets(1000) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert token_buckets(4160)[-3:] == [3072, 4096, 6144]


def test_padded_forward_equals_plain_forward_and_touches_only_its_rows(tiny_target64):
    eng = Engine(tiny_target64, None, (1, 3), EngineConfig(page_size=8, num_pages=256, max_sessions=8,
                                                           cuda_graphs=True))
    assert eng.graphs is not None and not eng.graphs.capture  # CPU: padded eager
    sessions = open_sessions(eng, 8)
    assert len({s.committed for s in sessions}) > 4  # sessions of different lengths
    check_padded_forward(eng, sessions, CASES, exact=False)
    assert eng.graphs.stats["padded_eager"] == len(CASES)
    assert eng.graphs.warmup() == []  # nothing to capture on the CPU


def test_runner_leaves_other_batches_to_the_caller(tiny_target64):
    eng = Engine(tiny_target64, None, (), EngineConfig(page_size=8, num_pages=256, max_sessions=4,
                                                       cuda_graphs=True, cuda_graph_max_tokens=16))
    assert eng.graphs.buckets[-1] == 16
    sessions = open_sessions(eng, 2)
    assert eng.graphs.run(verify_batch(eng, sessions, [9, 8], 0)) is None  # 17 tokens: past the last bucket
    fb = verify_batch(eng, sessions, [2, 3], 0)
    fb.tree_bits = None  # a causal (prefill) batch
    assert eng.graphs.run(fb) is None
    eng.graphs.enabled = False
    assert eng.graphs.run(verify_batch(eng, sessions, [2, 3], 0)) is None
    assert eng.graphs.stats["eager"] == 3 and eng.graphs.stats["padded_eager"] == 0


def test_capture_blockers(tiny_target64):
    from verifier_service.batch_invariant import make_batch_invariant, remove_batch_invariance

    assert capture_blockers(tiny_target64) == []
    try:
        make_batch_invariant(tiny_target64, attention="aligned")
        assert any("aligned" in r for r in capture_blockers(tiny_target64))
    finally:
        remove_batch_invariance(tiny_target64)
    assert capture_blockers(tiny_target64) == []


def test_runner_needs_cuda_for_graphs(tiny_target64):
    eng = Engine(tiny_target64, None, (), EngineConfig(page_size=8, num_pages=64, max_sessions=2))
    assert eng.graphs is None  # an Engine built directly: None = off
    with pytest.raises(ValueError, match="CUDA"):
        GraphRunner(eng.forward, None, eng.kv, 2, 64, capture=True)


def test_build_local_engine_resolves_the_flag(tiny_dirs):
    from verifier_service.local import build_local_engine

    assert build_local_engine(tiny_dirs[0], None, torch.float32, "cpu").graphs is None  # off on the CPU
    eng = build_local_engine(tiny_dirs[0], None, torch.float32, "cpu", EngineConfig(cuda_graphs=True))
    assert eng.graphs is not None and not eng.graphs.capture
    assert build_local_engine(tiny_dirs[0], None, torch.float32, "cpu", EngineConfig(cuda_graphs=True),
                              cuda_graphs=False).graphs is None


class FakeCuda:
    """Stands in for torch.cuda's graph API on the CPU: a "graph" replays by recomputing the runner's body from
    the static buffers into the outputs of its capture (what a real replay does), so the runner's capture,
    replay, fallback and slicing logic runs without a GPU. `fail` = token buckets whose capture raises."""

    def __init__(self, monkeypatch, runner: GraphRunner, fail=()):
        self.runner, self.fail, self.entered = runner, set(fail), []
        fake = self

        class Graph:
            def replay(self):
                key = next(k for k, (g, _) in fake.runner.graphs.items() if g is self)
                for out, new in zip(fake.runner.graphs[key][1], fake.runner._body(*key)):
                    if out is not None:
                        out.copy_(new)

        class Capture:
            def __init__(self, graph, pool=None, capture_error_mode="global"):
                assert pool is not None and capture_error_mode == "thread_local"

            def __enter__(self):
                n = int(fake.runner.cu_q[-1])
                fake.entered.append(n)
                if n in fake.fail:
                    raise RuntimeError("operation not permitted when stream is capturing")

            def __exit__(self, *exc):
                return False

        class Stream:
            def __init__(self, *a):
                pass

            def wait_stream(self, other):
                pass

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        runner.capture = True


def test_capture_logic_with_fake_graphs(tiny_target64, monkeypatch, caplog):
    """The capture path's bookkeeping on the CPU: one capture per (bucket, words), replays for every later step,
    outputs equal the plain engine's; a bucket whose capture fails is recorded, warned about once and runs
    eagerly; warmup captures all-padding batches and touches no session's KV."""
    cfg = EngineConfig(page_size=8, num_pages=512, max_sessions=4, cuda_graphs=True)
    plain = Engine(tiny_target64, None, (), dataclasses.replace(cfg, cuda_graphs=False))
    ar, _ = decode_all(plain, PROMPTS, 0, new=12)
    ref = {f"g{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar))}
    eng = Engine(tiny_target64, OracleDrafter(ref, tiny_target64.cfg.vocab_size, 8, seed=3), (), cfg)
    fake = FakeCuda(monkeypatch, eng.graphs, fail={64})
    with caplog.at_level(logging.WARNING, logger="verifier_service.cuda_graphs"):
        out, sessions = decode_all(eng, PROMPTS, 16, new=12)
        out2, _ = decode_all(eng, PROMPTS, 16, new=12)
    assert out == ar and out2 == ar
    r = eng.graphs
    assert r.stats["captures"] == len(r.graphs) > 0 and (64, 1) in r.failed and (64, 1) not in r.graphs
    assert fake.entered.count(64) == 1  # a failed bucket is not tried again
    assert sum("failed" in m for m in caplog.messages) == 1
    steps = 2 * max(len(s.accepted_per_step) for s in sessions)
    assert r.stats["replays"] + r.stats["eager"] == steps and r.stats["replays"] > r.stats["captures"]
    assert r.stats["eager"] >= 2  # the failed bucket, in both runs
    s = eng.add(PROMPTS[1], DecodeParams(max_new_tokens=4, budget=0), sid="live")
    before = eng.kv.kv.clone()
    assert r.warmup([2, 100], words=2) == [(128, 2), (2, 2)]
    owned = slice(0, eng.kv.scratch_page * eng.kv.page_size)
    assert torch.equal(eng.kv.kv[:, owned], before[:, owned])
    eng.run_until_done()
    assert s.output == ar[1][:4]


def test_flags():
    from gateway.cli import build_parser
    from training.evaluate import graph_modes

    for argv in (["verifier", "serve", "--listen", "127.0.0.1:0", "--target", "t"], ["generate", "--target", "t",
                 "--prompt-ids", "1"], ["demo"]):
        parser = build_parser(argv[0])
        assert parser.parse_args(argv).no_cuda_graphs is False
        assert parser.parse_args([*argv, "--no-cuda-graphs"]).no_cuda_graphs is True
    assert graph_modes("auto", "cpu") == [False] and graph_modes("auto", "cuda:0") == [True]
    assert graph_modes("on,off", "cpu") == [True, False]
    with pytest.raises(ValueError, match="cuda-graphs"):
        graph_modes("yes", "cuda")


def decode_all(engine, prompts, budget, topk=4, new=24):
    params = DecodeParams(max_new_tokens=new, budget=budget, topk=topk, ignore_eos=True)
    sessions = [engine.add(p, params, sid=f"g{i}") for i, p in enumerate(prompts)]
    engine.run_until_done()
    out = [s.output for s in sessions]
    for s in sessions:
        engine.release(s.sid)
    return out, sessions


def test_padded_engine_with_drafter_equals_plain_and_ar(tiny_dirs):
    """The in-process (random) DFlash drafter, fp32: budgets 0, 4, 16 on the padded path decode exactly what
    the plain path (the same engine, runner disabled) decodes, and what AR decodes."""
    from verifier_service.local import build_local_engine

    cfg = EngineConfig(page_size=8, num_pages=256, max_sessions=4, draft_window=256)
    eng = build_local_engine(*tiny_dirs, torch.float32, "cpu", cfg, cuda_graphs=True)
    runner = eng.graphs
    runner.enabled = False
    ar, _ = decode_all(eng, PROMPTS, 0)
    for budget in (0, 4, 16):
        runner.enabled = True
        before = runner.stats["padded_eager"]
        out, sessions = decode_all(eng, PROMPTS, budget)
        assert runner.stats["padded_eager"] - before == max(len(s.accepted_per_step) for s in sessions)
        assert out == ar, f"budget {budget}: the padded engine diverged from AR"
        runner.enabled = False
        if budget:
            assert decode_all(eng, PROMPTS, budget)[0] == out


@pytest.mark.parametrize("budget", [16, 64])
def test_padded_engine_with_deep_acceptance_equals_ar(tiny_target64, budget):
    """The oracle drafter (acceptance deep, rejection at every depth), fp64; budget 64 = two mask words."""
    cfg = EngineConfig(page_size=8, num_pages=512, max_sessions=4, cuda_graphs=True)
    ar, _ = decode_all(Engine(tiny_target64, None, (), cfg), PROMPTS, 0, new=32)
    ref = {f"g{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar))}
    oracle = OracleDrafter(ref, tiny_target64.cfg.vocab_size, 8, p_wrong=0.3, seed=budget)
    eng = Engine(tiny_target64, oracle, (), cfg)
    out, sessions = decode_all(eng, PROMPTS, budget, topk=4 if budget < 64 else 8, new=32)
    assert out == ar
    assert max(a for s in sessions for a in s.accepted_per_step) >= 5
    assert eng.graphs.stats["padded_eager"] > 0 and eng.graphs.stats["eager"] == 0


# --- GPU -------------------------------------------------------------------------------------------------
GPU_TEXTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n',
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description=",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]


@pytest.fixture(scope="module")
def mini():
    from gateway.tokenizer import Tokenizer
    from verifier_service.batch_invariant import is_batch_invariant
    from verifier_service.local import build_local_engine

    engine = build_local_engine(PAIR / "target", PAIR / "drafter", torch.bfloat16, "cuda",
                                EngineConfig(num_pages=512, max_sessions=8, draft_window=1024))
    assert is_batch_invariant(engine.target) == "kernel"
    assert engine.graphs is not None and engine.graphs.capture  # on by default on CUDA
    tok = Tokenizer.load(PAIR / "target")
    return engine, [tok.encode(t) for t in GPU_TEXTS]


@gpu_test
def test_gpu_graph_replay_equals_plain_forward_bitwise(mini):
    engine, _ = mini
    runner = engine.graphs
    sessions = open_sessions(engine, 8, seed=1)
    before = runner.stats["replays"]
    try:
        check_padded_forward(engine, sessions, CASES, exact=True)
    finally:
        for s in sessions:
            engine.release(s.sid)
    assert runner.stats["replays"] - before == len(CASES), dict(runner.stats)
    assert not runner.failed, runner.failed


@gpu_test
def test_gpu_warmup_captures_without_touching_sessions(mini):
    engine, prompts = mini
    runner = engine.graphs
    s = engine.add(prompts[0], DecodeParams(max_new_tokens=8, budget=4, topk=4), sid="warm")
    kv = engine.kv
    before = kv.kv.clone()
    keys = runner.warmup([3, 8, 40], words=1)
    assert keys == [(48, 1), (8, 1), (4, 1)], (keys, runner.failed)
    owned = torch.ones(kv.kv.shape[1], dtype=torch.bool, device=kv.kv.device)
    owned[kv.scratch_page * kv.page_size :] = False
    assert torch.equal(kv.kv[:, owned], before[:, owned]), "warm-up captures wrote outside the scratch page"
    r0 = runner.stats["replays"]
    engine.run_until_done()
    assert s.done and runner.stats["replays"] > r0
    engine.release("warm")
    runner.enabled = False
    try:  # the graphs captured over padding decode what the eager path decodes
        eager = engine.add(prompts[0], DecodeParams(max_new_tokens=8, budget=4, topk=4), sid="warm")
        engine.run_until_done()
        assert eager.output == s.output
        engine.release("warm")
    finally:
        runner.enabled = True


@gpu_test
def test_gpu_graphs_ddtree_equals_ar_and_eager(mini):
    """Greedy, bf16, batch invariant: with graphs DDTree == AR token for token at budgets 4/16/64 (64: two mask
    words), == the eager engine's output, and the steps really replayed graphs."""
    engine, prompts = mini
    runner = engine.graphs
    results = {}
    for on in (True, False):
        runner.enabled = on
        try:
            for budget in (0, 4, 16, 64):
                r0 = runner.stats["replays"]
                out, sessions = decode_all(engine, prompts, budget, topk=8, new=32)
                steps = max(len(s.accepted_per_step) for s in sessions)
                replays = runner.stats["replays"] - r0
                assert replays == (steps if on else 0), (on, budget, replays, steps, runner.failed)
                results[on, budget] = out
        finally:
            runner.enabled = True
    assert not runner.failed, runner.failed
    print("graphs", sorted(runner.graphs), dict(runner.stats))
    for budget in (4, 16, 64):
        assert results[True, budget] == results[True, 0], f"budget {budget}: DDTree with graphs diverged from AR"
        assert results[True, budget] == results[False, budget], f"budget {budget}: graphs != eager"
    assert results[True, 0] == results[False, 0]


@gpu_test
def test_gpu_pdl_gives_the_plain_bits(mini, monkeypatch):
    """`kernels.pdl` on (passed on an H100, thirty-third session): the verify forward with PDL launches gives the plain
    launches' bits eagerly, its graphs captured with PDL replay them (hidden, taps, logits, KV rows), and greedy DDTree
    == AR."""
    from kernels import pdl

    engine, prompts = mini
    runner, kv = engine.graphs, engine.kv
    sessions = open_sessions(engine, 8, seed=3)
    try:
        fbs = [verify_batch(engine, sessions[: len(sz)], sz, seed=50 + k) for k, sz in enumerate(CASES)]
        before = kv.kv.clone()
        plain = []
        for fb in fbs:
            kv.kv.copy_(before)
            plain.append([t.clone() for t in engine.forward(fb)])
        monkeypatch.setattr(pdl, "ENABLED", True)
        runner.reset()  # graphs captured from here on launch with PDL
        for sizes, fb, want in zip(CASES, fbs, plain):
            kv.kv.copy_(before)
            got = engine.forward(fb)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{sizes}: PDL launches changed the forward"
        kv.kv.copy_(before)
        check_padded_forward(engine, sessions, CASES, exact=True)
    finally:
        for s in sessions:
            engine.release(s.sid)
    try:
        ddtree, _ = decode_all(engine, prompts, 16, topk=8, new=24)
    finally:
        monkeypatch.setattr(pdl, "ENABLED", False)
        runner.reset()
    ar, _ = decode_all(engine, prompts, 0, topk=8, new=24)
    assert ddtree == ar, "greedy DDTree with PDL launches diverged from AR"
