"""`Engine._trees`: the step's padded [S, M] tokens / parent / depth, whether every session has a tree (the trees'
columns as they are) or some run autoregressively (root-only rows), equal to the layout written out by hand."""

from __future__ import annotations

import types

import pytest
import torch

from kernels.tree_build import build_tree
from verifier_service.engine import Engine, EngineConfig


def _expected(roots, drafting, trees, M):
    S = len(roots)
    out = [torch.full((S, M), -1, dtype=torch.int64) for _ in range(3)]
    out[0][:, 0] = torch.tensor(roots)
    out[2][:, 0] = 0
    for j, i in enumerate(drafting):
        for o, f in zip(out, ("tokens", "parent", "depth")):
            w = min(M, getattr(trees, f).shape[1])
            o[i, :w] = getattr(trees, f)[j, :w].long()
    return out


def _trees_of(roots, budgets, seed):
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(torch.randn(len(roots), 4, 40, generator=g), -1)
    return build_tree(logq, torch.tensor(roots), budgets, [3] * len(roots))


def test_the_padded_trees_are_the_same_with_every_session_drafting_or_some():
    roots = [5, 7, 9, 11]
    fake = types.SimpleNamespace(device=torch.device("cpu"), draft_ns=(0, 0), drafter=types.SimpleNamespace(depth=4))
    active = [types.SimpleNamespace(root=r) for r in roots]
    for drafting, budgets in (([0, 1, 2, 3], [6, 2, 9, 4]), ([1, 3], [5, 8]), ([0, 1, 2, 3], [3, 3, 3, 3])):
        trees = _trees_of([roots[i] for i in drafting], budgets, seed=len(drafting) + sum(budgets))
        tok, parent, depth, n, max_depth = Engine._trees(fake, active, drafting, lambda t=trees: t)
        M = max(n)
        assert n == [trees.n_nodes[drafting.index(i)] if i in drafting else 1 for i in range(4)]
        for got, want in zip((tok, parent, depth), _expected(roots, drafting, trees, M)):
            assert got.dtype == torch.int64 and got.shape == (4, M) and torch.equal(got, want)
        assert max_depth == 4
        if len(drafting) == 4:  # the trees' own tensors are copied, never aliased (the step writes no tree back)
            assert tok.data_ptr() != trees.tokens.data_ptr()


def test_the_engines_kernel_options_are_checked():
    assert EngineConfig().tree_inputs == "auto" and EngineConfig().local_draft == "eager"
    with pytest.raises(ValueError, match="tree_inputs"):
        EngineConfig(tree_inputs="fast")
    with pytest.raises(ValueError, match="local_draft"):
        EngineConfig(local_draft="later")
    assert EngineConfig().tree_accept == "auto" and EngineConfig().commit_moves == "auto"
    for f in ("tree_accept", "commit_moves"):
        with pytest.raises(ValueError, match=f):
            EngineConfig(**{f: "fast"})


def test_the_verifier_serve_command_hands_its_kernel_options_to_its_engine(monkeypatch):
    """`ddtree verifier serve --tree-inputs torch --tree-accept torch` reach the engine's config; auto is the
    default of both."""
    from gateway.cli import build_parser
    from gateway.commands import verifier as cmd
    from verifier_service.server import _engine_config

    seen = []
    monkeypatch.setattr(cmd, "run_server", lambda serve, cfg, *a, **k: seen.append(cfg) or 0)
    base = ["verifier", "serve", "--listen", "127.0.0.1:0", "--target", "t", "--drafter-address", "127.0.0.1:1"]
    for extra in ([], ["--tree-inputs", "torch"], ["--tree-accept", "torch"]):
        args = build_parser().parse_args([*base, *extra])
        assert args.func(args) == 0
    got = [(_engine_config(c, "cpu").tree_inputs, _engine_config(c, "cpu").tree_accept) for c in seen]
    assert got == [("auto", "auto"), ("torch", "auto"), ("auto", "torch")]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--tree-inputs", "triton"])
