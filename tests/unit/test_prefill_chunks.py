"""Cache consistency of the target forward: one prefill == chunked prefill == token-by-token decode,
and a tree verify whose tree is a chain equals a causal prefill (fp64, CPU)."""

from __future__ import annotations

import torch

from kernels.tree_mask import ancestor_mask, pack_mask_bits
from verifier_service.forward_batch import ForwardBatch
from verifier_service.kv_cache import KVPool


def run_chunks(model, tokens, chunks, as_tree=False):
    cfg = model.cfg
    pool = KVPool(cfg.num_hidden_layers, cfg.kv_row_dim, 16, 4, 2, 64, torch.float64, "cpu")
    pool.kv.fill_(float("nan"))
    row = pool.open()
    pool.ensure(row, len(tokens))
    outs, start = [], 0
    for n in chunks:
        idx = torch.arange(start, start + n)
        bits = None
        if as_tree:  # a chain expressed as a tree: node j's parent is j-1
            parent = (torch.arange(n) - 1)[None]
            bits = pack_mask_bits(ancestor_mask(parent))[0]
        fb = ForwardBatch(tokens=torch.tensor(tokens[start:start + n]), positions=idx,
                          write_slots=pool.slots(torch.tensor([row]), idx[None])[0],
                          cu_q=torch.tensor([0, n], dtype=torch.int32),
                          prefix_lens=torch.tensor([start], dtype=torch.int32),
                          block_table=pool.block_table[row:row + 1], page_size=4, tree_bits=bits)
        h, taps = model(fb, pool.kv, (1, 3))
        outs.append((model.logits(h), taps))
        start += n
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def test_prefill_chunking_and_decode_agree(tiny_target64):
    tokens = [7, 100, 3, 250, 9, 9, 31, 42, 200, 1, 5, 66, 77]
    full, taps = run_chunks(tiny_target64, tokens, [len(tokens)])
    for chunks in ([5, 8], [1] * len(tokens), [4, 1, 7, 1]):
        got, got_taps = run_chunks(tiny_target64, tokens, chunks)
        assert torch.allclose(got, full, rtol=1e-9, atol=1e-9), (chunks, (got - full).abs().max())
        assert torch.allclose(got_taps, taps, rtol=1e-9, atol=1e-9)
    tree, _ = run_chunks(tiny_target64, tokens, [6, 7], as_tree=True)
    assert torch.allclose(tree, full, rtol=1e-9, atol=1e-9)
    assert taps.shape == (len(tokens), 2 * tiny_target64.cfg.hidden_size)
