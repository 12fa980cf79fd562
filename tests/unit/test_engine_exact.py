"""Greedy DDTree must equal autoregressive decoding token for token (DESIGN 3.5), in fp64 on CPU.

Driven by an oracle drafter that proposes the true continuation with controlled corruption, so
acceptance reaches deep and rejection happens at every depth; plus the real (random) DFlash drafter.
"""

from __future__ import annotations

import collections

import pytest
import torch

from tests.helpers import OracleDrafter
from verifier_service.engine import Engine, EngineConfig
from verifier_service.session import DecodeParams

PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [42], list(range(60, 90))]
NEW = 40


def ar_reference(target, prompts, new=NEW):
    eng = Engine(target, None, (), EngineConfig(page_size=8, num_pages=256, max_sessions=8))
    sessions = eng.generate(prompts, DecodeParams(max_new_tokens=new, budget=0))
    assert all(s.accepted_per_step == [1] * (new - 1) for s in sessions)  # AR commits one token per step
    return [s.output for s in sessions]


@pytest.fixture(scope="module")
def ar_out(tiny_target64):
    return ar_reference(tiny_target64, PROMPTS)


def run_oracle(target, ar_out, budget, block, topk, p_wrong=0.3, seed=0, tree_inputs="torch", tree_accept="torch",
               commit_moves="torch"):
    ref = {f"r{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar_out))}
    oracle = OracleDrafter(ref, target.cfg.vocab_size, block, p_wrong=p_wrong, max_rank=3, seed=seed)
    eng = Engine(target, oracle, (), EngineConfig(page_size=8, num_pages=512, max_sessions=8, tree_inputs=tree_inputs,
                                                  tree_accept=tree_accept, commit_moves=commit_moves))
    sessions = [eng.add(p, DecodeParams(max_new_tokens=NEW, budget=budget, topk=topk), sid=f"r{i}")
                for i, p in enumerate(PROMPTS)]
    eng.run_until_done()
    return eng, oracle, sessions


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("budget", [1, 2, 4, 8, 16, 32, 64])
def test_ddtree_equals_ar_with_oracle(tiny_target64, ar_out, budget, block):
    topk = 4 if budget >= 8 else 2
    eng, oracle, sessions = run_oracle(tiny_target64, ar_out, budget, block, topk, seed=budget * 31 + block)
    for s, ref in zip(sessions, ar_out):
        assert s.output == ref, f"budget {budget} block {block}: DDTree diverged from AR"
        assert sum(s.accepted_per_step) + 1 >= len(s.output)  # every emitted token was verified
    # all KV freed on both sides once done
    assert eng.kv.used_pages == 0
    assert sorted(oracle.released) == sorted(f"r{i}" for i in range(len(PROMPTS)))
    if budget >= 8:
        steps = [a for s in sessions for a in s.accepted_per_step]
        assert max(steps) >= 5, f"acceptance never got deep: {steps}"
        assert sum(steps) / len(steps) > 2.0


@pytest.mark.parametrize("budget", [8, 64])
def test_the_tree_inputs_kernel_verifies_what_the_torch_code_does(tiny_target64, ar_out, budget):
    """`EngineConfig.tree_inputs="triton"` (kernels.tree_inputs; the interpreter on CPU): the same tokens and the same
    accepted lengths step for step as the torch code, up to 65-node trees (two words of ancestor bits)."""
    runs = [run_oracle(tiny_target64, ar_out, budget, 8, 4, seed=budget, tree_inputs=t)[2] for t in ("torch", "triton")]
    for s, k, ref in zip(*runs, ar_out):
        assert s.output == k.output == ref and s.accepted_per_step == k.accepted_per_step
    assert max(a for s in runs[1] for a in s.accepted_per_step) >= 5


@pytest.mark.parametrize("budget", [8, 64])
@pytest.mark.parametrize("option", ["tree_accept", "commit_moves"])
def test_the_acceptance_and_commit_kernels_do_what_the_torch_code_does(tiny_target64, ar_out, budget, option):
    """`EngineConfig.tree_accept` / `commit_moves` = "triton" (kernels.tree_accept.accept_tree,
    kernels.kv_compact.commit_moves; the interpreter on CPU): the same tokens and the same accepted lengths step for
    step as the torch code, deep acceptance (and so long moves across 8-row pages) included, up to 65-node trees."""
    runs = [run_oracle(tiny_target64, ar_out, budget, 8, 4, seed=budget + 1, **{option: t})[2]
            for t in ("torch", "triton")]
    for s, k, ref in zip(*runs, ar_out):
        assert s.output == k.output == ref and s.accepted_per_step == k.accepted_per_step
    assert max(a for s in runs[1] for a in s.accepted_per_step) >= 5


def test_an_in_process_draft_is_queued_before_the_layout_unless_lazy(tiny_target64, ar_out):
    """`EngineConfig.local_draft`: "eager" (the default) asks an in-process drafter before the step's layout is
    made (its GPU work then runs while the host lays the batch out), "lazy" after it; the same tokens and the same
    accepted lengths step for step either way, and both equal AR."""
    ref = {f"r{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar_out))}
    runs = {}
    for mode in ("eager", "lazy"):
        oracle = OracleDrafter(ref, tiny_target64.cfg.vocab_size, 8, p_wrong=0.3, max_rank=3, seed=7)
        eng = Engine(tiny_target64, oracle, (), EngineConfig(page_size=8, num_pages=512, max_sessions=8,
                                                             local_draft=mode))
        order = []
        draft, layout = oracle.draft, eng._layout
        oracle.draft = lambda reqs, draft=draft, order=order: order.append("draft") or draft(reqs)
        eng._layout = lambda *a, layout=layout, order=order: order.append("layout") or layout(*a)
        sessions = [eng.add(p, DecodeParams(max_new_tokens=NEW, budget=16, topk=4), sid=f"r{i}")
                    for i, p in enumerate(PROMPTS)]
        eng.step()
        first = order[:]
        eng.run_until_done()
        runs[mode] = sessions
        # a step's first layout is the planned one; a short tree (fewer nodes than planned) makes another after
        assert first[:2] == (["draft", "layout"] if mode == "eager" else ["layout", "draft"]), (mode, first)
    for s, k, out in zip(runs["eager"], runs["lazy"], ar_out):
        assert s.output == k.output == out and s.accepted_per_step == k.accepted_per_step
    assert max(a for s in runs["eager"] for a in s.accepted_per_step) >= 5


def test_acceptance_and_rejection_at_every_depth(tiny_target64, ar_out):
    """Across a run of mixed budgets, trees are accepted to every depth 0..L-1 and rejected at each."""
    seen = collections.Counter()
    for budget, topk, seed in [(8, 2, 1), (16, 4, 2), (32, 4, 3), (64, 8, 4), (4, 1, 5)]:
        _, _, sessions = run_oracle(tiny_target64, ar_out, budget, 8, topk, p_wrong=0.35, seed=seed)
        for s, ref in zip(sessions, ar_out):
            assert s.output == ref
            seen.update(a - 1 for a in s.accepted_per_step[:-1])  # accepted drafts per (non-final) step
    # rejection right after depth d means exactly d drafts accepted: must occur for every d < L
    assert all(seen[d] > 0 for d in range(7)), f"accepted-draft histogram {sorted(seen.items())}"


def test_mixed_budgets_in_one_batch(tiny_target64, ar_out):
    """AR and DDTree sessions of different budgets and top-k caps share every verify step."""
    ref = {f"r{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar_out))}
    oracle = OracleDrafter(ref, tiny_target64.cfg.vocab_size, 8, seed=7)
    eng = Engine(tiny_target64, oracle, (), EngineConfig(page_size=8, num_pages=512, max_sessions=8))
    params = [DecodeParams(NEW, 0), DecodeParams(NEW, 5, 1), DecodeParams(NEW, 64, 8), DecodeParams(NEW, 13, 3)]
    sessions = [eng.add(p, q, sid=f"r{i}") for i, (p, q) in enumerate(zip(PROMPTS, params))]
    eng.run_until_done()
    assert [s.output for s in sessions] == ar_out
    assert all(r.budget > 0 for r in oracle.requests)  # the AR session never asked the drafter


def test_real_dflash_drafter_is_exact_and_streams_context(tiny_dirs, tiny_target64, ar_out):
    from drafter_service.checkpoint import load_drafter
    from drafter_service.drafter import Drafter

    dmodel = load_drafter(tiny_dirs[1], tiny_target64.cfg, torch.float64)
    drafter = Drafter(dmodel, tiny_target64.model.embed_tokens.weight, tiny_target64.lm_head.weight,
                      max_sessions=8, window=16)
    eng = Engine(tiny_target64, drafter, dmodel.cfg.target_layer_ids,
                 EngineConfig(page_size=8, num_pages=512, max_sessions=8, draft_window=16))
    sessions = eng.generate(PROMPTS, DecodeParams(max_new_tokens=NEW, budget=16, topk=4))
    assert [s.output for s in sessions] == ar_out
    assert len(drafter.cache._row) == 0  # contexts released


def test_eos_and_max_new_tokens(tiny_target64, ar_out):
    eos = ar_out[0][7]
    eng = Engine(tiny_target64, None, (), EngineConfig(page_size=8, num_pages=64, max_sessions=2))
    s = eng.add(PROMPTS[0], DecodeParams(max_new_tokens=NEW, budget=0, eos_ids=(eos,)))
    eng.run_until_done()
    assert s.output == ar_out[0][: ar_out[0].index(eos) + 1] and s.finish_reason == "stop"
    ref = {"r0": PROMPTS[0] + ar_out[0]}
    eng = Engine(tiny_target64, OracleDrafter(ref, tiny_target64.cfg.vocab_size, 8, p_wrong=0.0), (),
                 EngineConfig(page_size=8, num_pages=64, max_sessions=2))
    s = eng.add(PROMPTS[0], DecodeParams(max_new_tokens=10, budget=16, topk=2), sid="r0")
    eng.run_until_done()
    assert s.output == ar_out[0][:10] and s.finish_reason == "length"


class _SplitDrafter(OracleDrafter):
    """Like a drafter in another process (`draft_begin`: the engine lays out its batch before the trees come
    back), whose trees differ from what the engine planned for: some sessions get a prefix of their tree
    (fewer nodes than the budget allows), some a tree the device checks refused (token -1 past the root)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.step = 0
        self.cut = self.refused = 0

    def draft_begin(self, requests):
        self.step += 1
        trees = self.draft(requests)

        def trees_of():
            for j in range(len(requests)):
                n = trees.n_nodes[j]
                kind = (self.step + j) % 3
                if kind == 0 and n > 2:  # a valid prefix: parents precede children
                    k = n // 2
                    for f in ("tokens", "parent", "depth", "first_child", "next_sibling"):
                        getattr(trees, f)[j, k:] = -1
                    trees.logw[j, k:] = float("-inf")
                    trees.n_nodes[j] = k
                    self.cut += 1
                elif kind == 1 and n > 1:
                    trees.tokens[j, 1:n], trees.parent[j, 1:n], trees.depth[j, 1:n] = -1, 0, 1
                    self.refused += 1
            return trees

        return trees_of


def test_trees_other_than_planned_are_exact(tiny_target64, ar_out):
    """The engine plans its batch for full trees while the drafter works; smaller trees and refused trees
    (verified as autoregressive steps) make it lay the batch out again, and the output is still AR's."""
    ref = {f"r{i}": p + o for i, (p, o) in enumerate(zip(PROMPTS, ar_out))}
    drafter = _SplitDrafter(ref, tiny_target64.cfg.vocab_size, 8, seed=11)
    eng = Engine(tiny_target64, drafter, (), EngineConfig(page_size=8, num_pages=512, max_sessions=8))
    params = [DecodeParams(NEW, 16, 4), DecodeParams(NEW, 0), DecodeParams(NEW, 8, 2), DecodeParams(NEW, 32, 4)]
    sessions = [eng.add(p, q, sid=f"r{i}") for i, (p, q) in enumerate(zip(PROMPTS, params))]
    eng.run_until_done()
    assert [s.output for s in sessions] == ar_out
    assert drafter.cut > 5 and drafter.refused > 5
    assert max(a for s in sessions for a in s.accepted_per_step) >= 3  # full and cut trees still accepted deep
