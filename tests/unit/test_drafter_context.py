"""The drafter's incremental context (taps streamed step by step into a windowed ring) equals a
from-scratch computation over the committed sequence."""

from __future__ import annotations

import pytest
import torch

from drafter_service.api import DraftRequest
from drafter_service.checkpoint import load_drafter
from drafter_service.drafter import Drafter
from tests.unit.test_prefill_chunks import run_chunks
from verifier_service.engine import Engine, EngineConfig
from verifier_service.session import DecodeParams


@pytest.mark.parametrize("ahead", [False, True], ids=["usual", "draft_ahead"])
def test_incremental_context_equals_scratch(tiny_dirs, tiny_target64, ahead):
    """Drafting ahead, the drafter holds the last step's rows already (appended from the device's counts); the usual
    way, they are the session's pending rows, which the next request would carry."""
    target = tiny_target64
    dmodel = load_drafter(tiny_dirs[1], target.cfg, torch.float64)
    window = 12
    drafter = Drafter(dmodel, target.model.embed_tokens.weight, target.lm_head.weight, max_sessions=4, window=window)
    eng = Engine(target, drafter, dmodel.cfg.target_layer_ids,
                 EngineConfig(page_size=8, num_pages=64, max_sessions=4, draft_window=window, draft_ahead=ahead))
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    s = eng.add(prompt, DecodeParams(max_new_tokens=64, budget=8, topk=3), sid="x")
    for _ in range(6):
        eng.step()
    committed = (prompt + s.output)[: s.committed]
    start, feats = s.take_pending()
    if ahead:
        assert feats is None and drafter.cache._count["x"] == s.committed
        feats = torch.zeros(0, 1, dtype=torch.float64)
    else:
        drafter.add_context("x", start, feats)  # what the next draft request would carry
    req = DraftRequest("x", 0, feats[:0], s.root, s.committed, 8, 3)
    got = drafter.draft_logq([req])

    # scratch: taps of every committed token from one causal prefill; the last `window` rows only
    _, taps = run_chunks(target, committed, [len(committed)])
    taps = taps[-window:]
    fresh = Drafter(dmodel, target.model.embed_tokens.weight, target.lm_head.weight, max_sessions=1, window=window)
    fresh.add_context("y", len(committed) - window, taps)
    want = fresh.draft_logq([DraftRequest("y", 0, feats[:0], s.root, s.committed, 8, 3)])
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got - want).abs().max()
    assert drafter.cache.length("x") == window < len(committed)
