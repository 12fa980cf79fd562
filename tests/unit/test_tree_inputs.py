"""kernels.tree_inputs: the Triton kernel (TRITON_INTERPRET=1 on CPU, the GPU where there is one) gives the torch
reference's token ids, positions and ancestor bits exactly, for drafter trees of every width up to two bit words,
for root-only and refused rows, and for parent arrays no check would pass (cycles, pointers out of range); the
reference is the engine's former inline code, so the bits are `pack_mask_bits(ancestor_mask(parent))`'s."""

from __future__ import annotations

import pytest
import torch

from kernels.tree_build import build_tree
from kernels.tree_inputs import tree_inputs, tree_inputs_reference
from kernels.tree_mask import unpack_mask_bits

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layout(S, budget, seed, garbage=False):
    """[S, M] int64 tok / parent / depth as the engine lays them out, committed [S], and the flat nodes."""
    g = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, 50, (S,), generator=g)
    budgets = [max(1, budget - 3 * s) for s in range(S)]
    trees = build_tree(torch.log_softmax(torch.randn(S, 7, 50, generator=g), -1), roots, budgets, [4] * S)
    tok, parent, depth = (getattr(trees, f).long() for f in ("tokens", "parent", "depth"))
    n = list(trees.n_nodes)
    if S > 1:  # a refused tree: root, then (token -1, parent 0, depth 1)
        tok[1, 1 : n[1]], parent[1, 1 : n[1]], depth[1, 1 : n[1]] = -1, 0, 1
    if S > 2:  # a root-only row
        n[2] = 1
        tok[2, 1:], parent[2, 1:], depth[2, 1:] = -1, -1, -1
    if garbage:  # parent arrays no check would pass: cycles and pointers out of range
        M = tok.shape[1]
        parent = torch.randint(-3, M + 3, parent.shape, generator=g)
    committed = torch.randint(0, 10_000, (S,), generator=g)
    M = tok.shape[1]
    gather = torch.tensor([s * M + j for s in range(S) for j in range(n[s])])
    return tok, parent, depth, committed, gather


@pytest.mark.parametrize("device", ["cpu"])
@pytest.mark.parametrize("S,budget,garbage", [(1, 1, False), (1, 16, False), (3, 33, False), (4, 64, False),
                                               (2, 70, False), (5, 24, True), (2, 66, True)])
def test_the_kernel_gives_the_references_inputs(device, S, budget, garbage):
    tok, parent, depth, committed, gather = (t.to(device) for t in _layout(S, budget, S * 100 + budget, garbage))
    want = tree_inputs_reference(tok, parent, depth, committed, gather)
    got = tree_inputs(tok, parent, depth, committed, gather, impl="triton")
    for name, w, o in zip(("tokens", "positions", "bits"), want, got):
        assert o.dtype == torch.int64 and o.shape == w.shape and torch.equal(o.cpu(), w.cpu()), name
    M = tok.shape[1]
    if not garbage and M > 1:  # the bits name the root path: a node's ancestors are its depth + 1 columns
        rows = unpack_mask_bits(got[2].cpu(), M)
        assert torch.equal(rows.sum(-1), depth.view(-1)[gather].cpu() + 1)
    assert int(got[0].min()) >= 0  # a refused tree's -1 is embedded as 0


def test_bit_63_and_a_second_word():
    """A chain through column 63 into 64: the sign bit of word 0 and bit 0 of word 1."""
    M = 66
    parent = torch.arange(-1, M - 1)[None, :]  # a chain 0 <- 1 <- ... <- 65
    tok, depth = torch.arange(M)[None, :], torch.arange(M)[None, :]
    gather = torch.tensor([0, 62, 63, 64, 65])
    want = tree_inputs_reference(tok, parent, depth, torch.tensor([5]), gather)
    got = tree_inputs(tok, parent, depth, torch.tensor([5]), gather, impl="triton")
    assert torch.equal(got[2], want[2]) and got[2].shape == (5, 2)
    assert int(got[2][2, 0]) == -1 and int(got[2][2, 1]) == 0  # node 63: columns 0..63, all of word 0
    assert int(got[2][3, 1]) == 1 and int(got[2][4, 1]) == 3


def test_bad_inputs_are_refused_and_no_nodes_is_empty():
    tok, parent, depth, committed, gather = _layout(2, 8, 1)
    with pytest.raises(ValueError, match="int64"):
        tree_inputs(tok.int(), parent, depth, committed, gather)
    with pytest.raises(ValueError, match="shapes"):
        tree_inputs(tok, parent[:1], depth, committed, gather)
    out = tree_inputs(tok, parent, depth, committed, gather[:0], impl="triton")
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0, 1)]


@gpu
@pytest.mark.gpu
def test_gpu_kernel_matches_the_reference_at_64_sessions_with_no_host_wait():
    """On the GPU: 64 sessions of up to 65-node trees, some refused or root-only, and garbage parents; the kernel's
    values equal the torch code's (run on the CPU), and the launch makes no host synchronisation."""
    for garbage in (False, True):
        tok, parent, depth, committed, gather = _layout(64, 70, 7, garbage)
        want = tree_inputs_reference(tok, parent, depth, committed, gather)
        dev = [t.cuda() for t in (tok, parent, depth, committed, gather)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host synchronisation now raises
        try:
            got = tree_inputs(*dev)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for w, o in zip(want, got):
            assert torch.equal(o.cpu(), w)
