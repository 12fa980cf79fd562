"""The batch-invariance transform (verifier_service/batch_invariant.py) and the position-aligned
attention (verifier_service/aligned_attention.py), on CPU.

On CPU every swapped op runs its torch reference, so these tests check the plumbing (what is
swapped, that it computes the same function, that it can be undone, that training's autograd
still works) and the aligned attention's math and key order. The bitwise GPU properties live in
tests/kernels/test_matmul.py, test_rmsnorm_kernel.py and tests/unit/test_gpu_exact.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.mla_attention import mla_attention_ref
from kernels.tree_mask import ancestor_mask, pack_mask_bits
from tests.kernels.mla_cases import make_batch
from tests.kernels.test_matmul import assert_close
from verifier_service.aligned_attention import aligned_mla_attention, key_slots
from verifier_service.batch_invariant import is_batch_invariant, make_batch_invariant, remove_batch_invariance
from verifier_service.forward_batch import ForwardBatch
from verifier_service.mla import MLAAttention
from verifier_service.moe import MLP, Router


@pytest.fixture
def target32(tiny_dirs):
    from verifier_service.checkpoint import load_target

    return load_target(tiny_dirs[0], torch.float32, "cpu")  # a private copy: the transform edits in place


def prefill(model, tokens):
    """One causal forward from an empty cache -> (hidden, logits)."""
    c = model.cfg
    P, page = len(tokens), 8
    pages = -(-P // page)
    kv = torch.zeros(c.num_hidden_layers, pages * page, c.kv_row_dim)
    fb = ForwardBatch(tokens=torch.tensor(tokens), positions=torch.arange(P), write_slots=torch.arange(P),
                      cu_q=torch.tensor([0, P], dtype=torch.int32), prefix_lens=torch.tensor([0], dtype=torch.int32),
                      block_table=torch.arange(pages, dtype=torch.int32)[None], page_size=page, tree_bits=None)
    with torch.no_grad():
        hidden, _ = model(fb, kv)
        return hidden, model.logits(hidden)


def test_transform_swaps_every_gemm_and_undoes(target32):
    tokens = [5, 17, 99, 3, 42, 7, 1, 2, 3, 4, 5]
    hidden0, logits0 = prefill(target32, tokens)
    model = make_batch_invariant(target32)
    assert model is target32 and is_batch_invariant(model) == "kernel"
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all("forward" in m.__dict__ for m in linears)
    assert all("score_logits" in m.__dict__ for m in model.modules() if isinstance(m, Router))
    attn = [m for m in model.modules() if isinstance(m, MLAAttention)]
    assert all("absorb_uk" in m.__dict__ and "apply_uv" in m.__dict__ for m in attn)
    assert all("attention" not in m.__dict__ for m in attn)  # "kernel": the class's mla_attention
    assert "logits" in model.__dict__
    for m in attn:  # q_a and kv_a: one buffer, the weights views of its rows
        w = m.stacked_a
        assert w.shape == (m.cfg.q_lora_rank + m.cfg.kv_row_dim, m.cfg.hidden_size) and "project_a" in m.__dict__
        assert m.q_a_proj.weight.data_ptr() == w.data_ptr()
        assert m.kv_a_proj_with_mqa.weight.data_ptr() == w[m.cfg.q_lora_rank:].data_ptr()
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert mlps and all(m.stacked_gate_up.shape[0] == 2 * m.gate_proj.weight.shape[0] for m in mlps)
    assert all(m.up_proj.weight.untyped_storage().data_ptr() == m.stacked_gate_up.untyped_storage().data_ptr()
               for m in mlps)
    hidden1, logits1 = prefill(model, tokens)  # CPU: the references, the same function
    assert_close(hidden1, hidden0, 1e-5, "hidden")
    assert_close(logits1, logits0, 1e-5, "logits")
    assert logits1.dtype == logits0.dtype == torch.float32

    make_batch_invariant(model, attention="aligned")
    assert all(m.__dict__["attention"] is aligned_mla_attention for m in attn)
    _, logits2 = prefill(model, tokens)
    assert_close(logits2, logits0, 1e-5, "aligned attention logits")

    remove_batch_invariance(model)
    assert is_batch_invariant(model) is None
    assert not any(k in m.__dict__ for m in model.modules() for k in ("forward", "score_logits", "absorb_uk"))
    hidden3, logits3 = prefill(model, tokens)
    assert torch.equal(hidden3, hidden0) and torch.equal(logits3, logits0)


def test_stacked_projections_compute_the_separate_ones(target32):
    """`stack_weights` keeps each weight's values (views of one buffer), refuses linears that cannot share a GEMM,
    and the stacked forwards compute what the separate projections do."""
    from verifier_service.batch_invariant import stack_weights

    attn = next(m for m in target32.modules() if isinstance(m, MLAAttention))
    mlp = next(m for m in target32.modules() if isinstance(m, MLP))
    x = torch.randn(5, target32.cfg.hidden_size)
    with torch.no_grad():
        q0, kv0 = attn.project_a(x)
        y0 = mlp(x)
        before = (attn.q_a_proj.weight.clone(), attn.kv_a_proj_with_mqa.weight.clone())
        make_batch_invariant(target32)
        assert torch.equal(attn.q_a_proj.weight, before[0]) and torch.equal(attn.kv_a_proj_with_mqa.weight, before[1])
        q1, kv1 = attn.project_a(x)
        assert_close(q1, q0, 1e-6, "q_a")
        assert_close(kv1, kv0, 1e-6, "kv_a")
        assert_close(mlp(x), y0, 1e-6, "MLP")
        biased = nn.Linear(4, 3)
        assert stack_weights(biased, nn.Linear(4, 2, bias=False)) is None
        assert stack_weights(nn.Linear(4, 3, bias=False), nn.Linear(5, 2, bias=False)) is None


def test_swapped_modules_keep_autograd(target32):
    make_batch_invariant(target32)
    lin = target32.lm_head
    x = torch.randn(3, lin.in_features, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    router = next(m for m in target32.modules() if isinstance(m, Router))
    ids, w = router(torch.randn(4, router.weight.shape[1]))
    assert ids.shape == w.shape == (4, target32.cfg.num_experts_per_tok)
    mlp = next(m for m in target32.modules() if isinstance(m, MLP))  # stacked gate + up: weights still get grads
    mlp(torch.randn(3, mlp.gate_proj.in_features)).sum().backward()
    assert mlp.gate_proj.weight.grad is not None and mlp.up_proj.weight.grad is not None


def test_rejects_unknown_attention_mode(target32):
    with pytest.raises(ValueError, match="attention must be one of"):
        make_batch_invariant(target32, attention="flash")


def test_build_local_engine_applies_it_only_on_cuda(tiny_dirs):
    from verifier_service.local import build_local_engine

    eng = build_local_engine(tiny_dirs[0], None, torch.float32, "cpu")
    assert is_batch_invariant(eng.target) is None  # CPU: torch's kernels, nothing swapped
    eng = build_local_engine(tiny_dirs[0], None, torch.float32, "cpu", batch_invariant="aligned")
    assert is_batch_invariant(eng.target) is None
    with pytest.raises(ValueError, match="batch_invariant must be"):
        build_local_engine(tiny_dirs[0], None, torch.float32, "cpu", batch_invariant="flash")


# --- aligned attention ---------------------------------------------------------------------------
def test_key_slots_order_keys_by_absolute_position():
    """Session 0: prefix 3, tree parent [-1, 0, 0, 1, 3]; session 1: prefix 2, a root alone (AR).
    Node 4 (depth 3) sees prefix rows 0..2, then nodes 0, 1, 3 (its ancestors by depth), then itself."""
    page = 4
    bt = torch.tensor([[2, 0, 5], [1, 3, 4]], dtype=torch.int32)  # shuffled pages
    bits = torch.cat([pack_mask_bits(ancestor_mask(torch.tensor([p])))[0] for p in ([-1, 0, 0, 1, 3], [-1])])
    cu, prefix = torch.tensor([0, 5, 6], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    slots, valid = key_slots(bt, page, cu, prefix, bits)

    def phys(s, logical):
        return [int(bt[s, i // page]) * page + i % page for i in logical]

    assert slots.shape == (6, 7)
    assert slots[4].tolist() == phys(0, [0, 1, 2, 3, 4, 6, 7])  # L + node index 0, 1, 3, 4
    assert slots[2].tolist() == phys(0, [0, 1, 2, 3, 5]) + [-1, -1]  # node 2: root, itself
    assert slots[5].tolist() == phys(1, [0, 1, 2]) + [-1] * 4  # session 1's root
    assert valid.sum(1).tolist() == [4, 5, 5, 6, 7, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tree", [True, False])
@pytest.mark.parametrize("prefix,ns", [([0, 5, 40], [1, 7, 3]), ([17], [65]), ([3, 0, 9], [0, 4, 1])])
def test_aligned_attention_matches_reference(prefix, ns, tree, dtype):
    args = make_batch(prefix, ns, 4, 32, 8, 8, dtype, tree, seed=len(ns) + sum(prefix), device="cpu")
    out = aligned_mla_attention(*args, 0.3)
    assert out.dtype == dtype
    assert_close(out, mla_attention_ref(*args, 0.3), 1e-5 if dtype == torch.float32 else 1e-12,
                 f"prefix {prefix} ns {ns} tree {tree}")


def test_engine_with_aligned_attention_is_exact(tiny_dirs):
    """fp64 on CPU: greedy DDTree (oracle drafter, budget 16) == AR through the aligned attention."""
    from tests.unit.test_engine_exact import PROMPTS, ar_reference, run_oracle
    from verifier_service.checkpoint import load_target

    target = make_batch_invariant(load_target(tiny_dirs[0], torch.float64, "cpu"), attention="aligned")
    ar_out = ar_reference(target, PROMPTS)
    _, _, sessions = run_oracle(target, ar_out, 16, 8, 4, seed=3)
    assert [s.output for s in sessions] == ar_out
    assert max(a for s in sessions for a in s.accepted_per_step) >= 4
