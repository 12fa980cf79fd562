"""The INT4 MoE benchmark's read peer (bench/expert_read.py) reads exactly the routed experts' bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from bench import expert_read


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("chunk", [16384, 100])
def test_read_experts_folds_every_routed_word(chunk):
    """Four expert-major tensors of awkward sizes (bf16 and int32, slices not a multiple of the chunk): the XOR of
    the programs' words is the XOR of exactly the routed experts' words (one expert routed twice counts once)."""
    g = torch.Generator().manual_seed(3)
    dev = _device()
    tensors = [torch.randint(-2**31, 2**31 - 1, (9, 37, 50), generator=g, dtype=torch.int32).to(dev),
               torch.randn(9, 37, 6, generator=g).to(torch.bfloat16).to(dev),
               torch.randint(-2**31, 2**31 - 1, (9, 61, 14), generator=g, dtype=torch.int32).to(dev),
               torch.randn(9, 61, 2, generator=g).to(torch.bfloat16).to(dev)]
    ids = torch.tensor([[4, 0, 8, 4]], device=dev)
    plan = expert_read.read_plan(tensors, ids, chunk)
    assert plan[1].numel() == 4 * 3 and plan[3] == -(-37 * 50 // chunk)  # 4 tensors x 3 experts; longest slice
    words = expert_read.read_experts(plan, block=64).cpu().numpy()
    assert int(np.bitwise_xor.reduce(words)) == expert_read.read_experts_ref(tensors, ids)
    # another expert set folds to another word (the plan reads what it names)
    other = expert_read.read_plan(tensors, torch.tensor([[1, 2]], device=dev), chunk)
    assert int(np.bitwise_xor.reduce(expert_read.read_experts(other, block=64).cpu().numpy())) == \
        expert_read.read_experts_ref(tensors, torch.tensor([[1, 2]]))
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


def test_read_plan_refuses_what_it_cannot_read():
    t = torch.zeros(4, 3, 3, dtype=torch.bfloat16)  # 9 bf16 per expert: not whole int32 words
    with pytest.raises(ValueError, match="whole int32 words"):
        expert_read.read_plan([t], torch.tensor([[0]]))
