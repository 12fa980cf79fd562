"""Expert-parallel loading: a rank allocates and reads only its own contiguous range of routed experts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.ckpt_tools import write_tiny
from verifier_service.checkpoint import load_target
from verifier_service.expert_parallel import expert_range
from verifier_service.safetensors_io import ShardedReader


@given(st.integers(1, 512), st.integers(1, 64))
def test_ranges_partition_the_experts(n, size):
    if size > n:
        with pytest.raises(ValueError, match="exceeds"):
            expert_range(n, 0, size)
        return
    ranges = [expert_range(n, r, size) for r in range(size)]
    assert [e for r in ranges for e in r] == list(range(n))  # contiguous, ordered, disjoint, complete
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_bad_rank():
    with pytest.raises(ValueError, match="ep_rank"):
        expert_range(8, 2, 2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("ep")
    write_tiny(d, "kimi_k25", shard_bytes=40_000)  # many shards: a rank should skip some
    return d


@pytest.fixture(scope="module")
def full(folder):
    return load_target(folder, torch.float32, "cpu")


@pytest.fixture
def reads(monkeypatch):
    seen: dict[str, list] = {"names": [], "files": set()}
    orig = ShardedReader.record

    def record(self, name, info):
        seen["names"].append(name)
        seen["files"].add(info.file.name)
        orig(self, name, info)

    monkeypatch.setattr(ShardedReader, "record", record)
    return seen


@pytest.mark.parametrize("ep_size,ep_rank", [(2, 0), (2, 1), (3, 0), (3, 2)])
def test_rank_reads_only_its_experts(folder, full, reads, ep_size, ep_rank):
    cfg = full.cfg
    rng = expert_range(cfg.n_routed_experts, ep_rank, ep_size)
    model = load_target(folder, torch.float32, "cpu", ep_rank=ep_rank, ep_size=ep_size)
    moe_layers = cfg.num_hidden_layers - 1
    expert_reads = [n for n in reads["names"] if ".mlp.experts." in n]
    # 3 projections x (packed, scale, shape) for each local expert of each MoE layer, each read exactly once
    assert len(expert_reads) == len(set(expert_reads)) == moe_layers * len(rng) * 3 * 3
    assert {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in expert_reads} == set(rng)
    assert len(reads["names"]) == model.load_report.tensors
    full_state = full.state_dict()
    for i in range(1, cfg.num_hidden_layers):
        m = model.model.layers[i].mlp
        assert m.expert_ids == tuple(rng)
        for name in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            t = getattr(m, name)
            assert t.shape[0] == len(rng)
            assert torch.equal(t, full_state[f"model.layers.{i}.mlp.{name}"][rng.start : rng.stop])
    assert torch.equal(model.lm_head.weight, full.lm_head.weight)  # the rest is replicated
    with pytest.raises(RuntimeError, match="expert-parallel slice .* no process group"):
        model.model.layers[1].mlp(torch.zeros(1, cfg.hidden_size))


def test_rank_skips_shards_without_its_tensors(folder, reads):
    import json

    idx = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    load_target(folder, torch.float32, "cpu", ep_rank=0, ep_size=2)
    assert reads["files"] < set(idx.values())


@pytest.mark.parametrize("world", [2, 3])
def test_rank_partial_outputs_sum_to_the_single_process_output_bitwise(full, world):
    """The expert-parallel MoE math without a process group: each rank's pair rows (-0.0 where another rank
    holds the expert), summed in any order, then the combine: bitwise the single-process MoE."""
    from kernels.int4_moe import moe_combine_ref, moe_dense_ref, moe_pairs_ref

    moe = full.model.layers[1].mlp
    T, E = 37, moe.gate.cfg.n_routed_experts
    x = torch.randn(T, full.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ids, w = moe.gate(x)
    w13, w2 = moe._dequantized(x.dtype)
    want = moe_dense_ref(x, ids, w, w13, w2)  # what the single-process MoE adds to its shared expert
    assert torch.equal(moe(x), want + moe.shared_experts(x))
    parts = []
    for r in range(world):
        rng = expert_range(E, r, world)
        parts.append(moe_pairs_ref(x, ids, w, len(rng), lambda e, s=rng.start: (w13[s + e], w2[s + e]), rng))
    for order in (parts, parts[::-1]):  # any reduction order
        total = order[0].clone()
        for p in order[1:]:
            total += p
        assert torch.equal(moe_combine_ref(total, ids, x.dtype).view(torch.int32), want.view(torch.int32))
