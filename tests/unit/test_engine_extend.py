"""Multi-turn sessions: `Engine.extend` continues a persistent session from its cached KV.

The property that matters: in greedy mode a second turn equals a one-shot generation of the
concatenated prompt (turn-1 prompt + turn-1 output + turn-2 tokens), for AR and for DDTree with
an oracle and with the real DFlash drafter. Plus the lifecycle: KV kept between turns, refused
extensions change nothing, release frees everything.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import OracleDrafter
from verifier_service.engine import Engine, EngineConfig
from verifier_service.kv_cache import KVCapacityError
from verifier_service.session import DecodeParams

P1, T2, T3 = [5, 17, 99, 3], [200, 1, 2], [7]
N1, N2, N3 = 10, 12, 6
CFG = EngineConfig(page_size=8, num_pages=64, max_sessions=4)


def one_shot(target, prompt, new):
    return Engine(target, None, (), CFG).generate([prompt], DecodeParams(max_new_tokens=new, budget=0))[0].output


@pytest.fixture(scope="module")
def turns(tiny_target64):
    """AR reference of three turns: outputs of each turn from one-shot generations."""
    o1 = one_shot(tiny_target64, P1, N1)
    o2 = one_shot(tiny_target64, P1 + o1 + T2, N2)
    o3 = one_shot(tiny_target64, P1 + o1 + T2 + o2 + T3, N3)
    return o1, o2, o3


def run_turns(eng, budget, topk=4):
    s = eng.add(P1, DecodeParams(max_new_tokens=N1, budget=budget, topk=topk), sid="a", persistent=True)
    eng.run_until_done()
    outs = [list(s.output)]
    for toks, n in ((T2, N2), (T3, N3)):
        assert s.row >= 0 and s.done  # the finished turn kept its KV
        eng.extend("a", toks, DecodeParams(max_new_tokens=n, budget=budget, topk=topk))
        eng.run_until_done()
        outs.append(list(s.output))
    return s, outs


def test_extend_equals_one_shot_ar(tiny_target64, turns):
    eng = Engine(tiny_target64, None, (), CFG)
    s, outs = run_turns(eng, budget=0)
    assert outs == list(turns)
    assert s.committed == len(P1 + turns[0] + T2 + turns[1] + T3 + turns[2]) - 1  # the last token is the root
    eng.release("a")
    assert eng.kv.used_pages == 0 and "a" not in eng.sessions


def test_extend_equals_one_shot_ddtree_oracle(tiny_target64, turns):
    o1, o2, o3 = turns
    ref = {"a": P1 + o1 + T2 + o2 + T3 + o3}
    oracle = OracleDrafter(ref, tiny_target64.cfg.vocab_size, 8, p_wrong=0.2, seed=3)
    eng = Engine(tiny_target64, oracle, (), CFG)
    s, outs = run_turns(eng, budget=16)
    assert outs == list(turns)
    assert max(s.accepted_per_step) >= 3  # the trees were really accepted deep in the last turn
    assert all(t > 1 for t in s.tree_sizes)
    eng.release("a")
    assert oracle.released == ["a"] and eng.kv.used_pages == 0


def test_extend_equals_one_shot_real_drafter(tiny_dirs, tiny_target64, turns):
    from drafter_service.checkpoint import load_drafter
    from drafter_service.drafter import Drafter

    dmodel = load_drafter(tiny_dirs[1], tiny_target64.cfg, torch.float64)
    drafter = Drafter(dmodel, tiny_target64.model.embed_tokens.weight, tiny_target64.lm_head.weight,
                      max_sessions=4, window=16)
    eng = Engine(tiny_target64, drafter, dmodel.cfg.target_layer_ids, EngineConfig(page_size=8, num_pages=64,
                                                                                    max_sessions=4, draft_window=16))
    _, outs = run_turns(eng, budget=16)
    assert outs == list(turns)
    eng.release("a")
    assert len(drafter.cache._row) == 0


def test_extend_refusals_change_nothing(tiny_target64):
    eng = Engine(tiny_target64, None, (), EngineConfig(page_size=8, num_pages=4, max_sessions=2))
    s = eng.add(P1, DecodeParams(max_new_tokens=3, budget=0), sid="a", persistent=True)
    with pytest.raises(ValueError, match="still generating"):
        eng.extend("a", T2, DecodeParams(max_new_tokens=3, budget=0))
    eng.run_until_done()
    before = (s.committed, s.root, list(s.output), eng.kv.used_pages)
    with pytest.raises(KVCapacityError):
        eng.extend("a", list(range(40)), DecodeParams(max_new_tokens=3, budget=0))  # 4 pages of 8 cannot hold 47
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.extend("a", [10**6], DecodeParams(max_new_tokens=3, budget=0))
    assert (s.committed, s.root, list(s.output), eng.kv.used_pages) == before and s.done
    with pytest.raises(ValueError, match="does not hold"):
        eng.extend("nope", T2, DecodeParams(max_new_tokens=3, budget=0))
    eng.extend("a", T2, DecodeParams(max_new_tokens=3, budget=0))  # still usable after the refusals
    eng.run_until_done()
    assert len(s.output) == 3


def test_non_persistent_session_frees_kv_when_done(tiny_target64):
    eng = Engine(tiny_target64, None, (), CFG)
    s = eng.add(P1, DecodeParams(max_new_tokens=3, budget=0), sid="a")
    eng.run_until_done()
    assert s.row == -1 and eng.kv.used_pages == 0
    with pytest.raises(ValueError, match="does not hold"):
        eng.extend("a", T2, DecodeParams(max_new_tokens=3, budget=0))


def test_extend_with_a_seed_equals_one_shot_sampling(tiny_target64):
    """Sampling noise is keyed by (seed, position): a continued turn samples exactly what a one-shot
    generation of the concatenated prompt samples with the same seed."""
    from verifier_service.sampling_params import SamplingParams

    def params(n):
        return DecodeParams(max_new_tokens=n, budget=0, sampling=SamplingParams(temperature=0.9, top_k=50, seed=5))

    eng = Engine(tiny_target64, None, (), CFG)
    s = eng.add(P1, params(N1), sid="a", persistent=True)
    eng.run_until_done()
    o1 = list(s.output)
    eng.extend("a", T2, params(N2))
    eng.run_until_done()
    one = Engine(tiny_target64, None, (), CFG).generate([P1 + o1 + T2], params(N2))[0].output
    assert s.output == one
    greedy = one_shot(tiny_target64, P1 + o1 + T2, N2)
    assert one != greedy  # the test would prove nothing if sampling fell back to argmax
