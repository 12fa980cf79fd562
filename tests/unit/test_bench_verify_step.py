"""bench/bench_verify_step.py on CPU: the smoke run's records, the floor's byte and flop counts against a
hand count at the tiny config, and the verify batch it builds (a tree node sees exactly its path)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import bench_verify_step as bvs
from bench import verify_step_floor as vsf
from bench import verify_step_target as vst
from kernels.tree_mask import unpack_mask_bits
from verifier_service.forward_batch import ForwardBatch
from verifier_service.moe import MoE


@pytest.fixture(scope="module")
def tiny():
    cfg = bvs.presets_cfg("tiny", 3)
    model = vst.build_target(cfg, torch.float32, "cpu", seed=3, log=lambda *a: None)
    return cfg, model


def test_smoke_run_writes_records(tmp_path):
    out = tmp_path / "res" / "verify_step.jsonl"
    recs = bvs.main(["--smoke", "--out", str(out), "--reps", "1"])
    s = bvs.SMOKE
    assert len(recs) == len(s["prefix"]) * len(s["batch"]) * len(s["trees"]) * 2  # both invariance modes
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == json.loads(json.dumps(recs))
    seen = set()
    for r in lines:
        assert r["name"] == "verify_step"
        for k in ("params", "gpu", "commit", "ms", "floor_ms", "ratio", "peers", "copy_bw_GBps", "mm_tflops"):
            assert k in r, k
        p = r["params"]
        for k in ("layers", "batch", "prefix", "tree", "tokens", "experts_touched_per_layer", "batch_invariant",
                  "graph", "bytes_per_layer", "flops_per_layer", "bytes_floor_ms", "flops_floor_ms", "lm_head_ms"):
            assert k in p, k
        assert p["layers"] == 3 and p["tokens"] == p["batch"] * p["tree"]
        assert p["kv_rows_read"] == p["batch"] * (p["prefix"] + p["tree"])
        assert p["finite"] is True
        assert p["graph"] is False and p["timing"] == "eager" and p["graph_error"]
        assert p["pdl"] is False  # what the launches used: no griddepcontrol off sm_90, whatever kernels.pdl says
        assert len(p["experts_touched"]) == 2  # layer 0 dense, 1-2 MoE
        assert all(1 <= e <= min(8, 2 * p["tokens"]) for e in p["experts_touched"])
        assert p["experts_uniform"] == round(8 * (1 - (1 - 2 / 8) ** p["tokens"]), 1)  # 8 experts, top-2
        assert p["max_depth"] == min(p["tree"] - 1, vst.MAX_DEPTH)
        assert r["ms"] > 0 and r["ms"] == pytest.approx(p["forward_ms"] / 3)
        assert r["ratio"] == pytest.approx(r["floor_ms"] / r["ms"])
        assert r["floor_ms"] == pytest.approx(max(p["bytes_floor_ms"], p["flops_floor_ms"]))
        assert p["bytes_floor_ms"] == pytest.approx(p["bytes_per_layer"] / (r["copy_bw_GBps"] * 1e9) * 1e3)
        assert p["flops_floor_ms"] == pytest.approx(p["flops_per_layer"] / (r["mm_tflops"] * 1e12) * 1e3)
        assert set(r["peers"]) == {"eager"} and r["peers"]["eager"] == pytest.approx(r["ms"])
        seen.add((p["batch"], p["tree"], p["batch_invariant"]))
    assert seen == {(b, n, inv) for b in s["batch"] for n in s["trees"] for inv in (True, False)}


def test_layer_bytes_and_flops_hand_count(tiny):
    cfg, model = tiny
    # tiny: D 64, q_lora 32, H 4, nope 16 + rope 8, kv_lora 32, v 16, dense inter 128, 8 experts x inter 32, top-2
    attn = 64 * 32 + 32 * 4 * 24 + 64 * 40 + 32 * 4 * 32 + 4 * 16 * 64  # q_a, q_b, kv_a, kv_b, o_proj
    norms = 32 + 32 + 64 + 64  # q_a/kv_a layernorms, input/post-attention layernorms
    assert attn == 15872
    f32 = 4
    tokens, kv_rows = 5, 100
    kv = (kv_rows + tokens) * 40 * f32
    act = 4 * tokens * 64 * f32

    dense = vsf.layer_bytes(model.model.layers[0], experts_touched=0, tokens=tokens, kv_rows_read=kv_rows, elt=4)
    assert dense == dict(weights=(attn + norms + 3 * 64 * 128) * f32, kv=kv, act=act,
                         total=(attn + norms + 3 * 64 * 128) * f32 + kv + act)

    moe = model.model.layers[1]
    assert isinstance(moe.mlp, MoE) and moe.mlp.layout == "gpu"
    # "gpu" layout: K padded to 256 -> w13 [64 rows, 256/8 words] + scales [1, 8, 64] bf16, w2 the same shape
    per_expert = 2 * (64 * 32 * 4 + 8 * 64 * 2)
    assert per_expert == 18432
    rest = (attn + norms + 3 * 64 * 32 + 8 * 64) * f32 + 8 * 4  # + shared expert, router weight, fp32 bias
    got = vsf.layer_bytes(moe, experts_touched=3, tokens=tokens, kv_rows_read=kv_rows, elt=4)
    assert got == dict(weights=rest + 3 * per_expert, kv=kv, act=act, total=rest + 3 * per_expert + kv + act)

    visible = 77
    fl = vsf.layer_flops(moe, tokens=tokens, visible_rows=visible)
    assert fl["linear"] == 2 * tokens * (attn + 3 * 64 * 32 + 8 * 64) + 2 * tokens * 2 * 3 * 64 * 32
    assert fl["attention"] == 2 * 4 * (32 + 40) * visible
    fl0 = vsf.layer_flops(model.model.layers[0], tokens=tokens, visible_rows=visible)
    assert fl0["total"] == 2 * tokens * (attn + 3 * 64 * 128) + 2 * 4 * 72 * visible


def test_step_floor_averages_layers(tiny):
    cfg, model = tiny
    shape = dict(tokens=4, kv_rows_read=50, visible_rows=60)
    ceil = dict(copy_bw_GBps=1.0, mm_tflops=1e-3)
    fl = vsf.step_floor(model, shape, [2, 5], 4, ceil)
    layers = model.model.layers
    nb = sum(vsf.layer_bytes(layer, experts_touched=k, tokens=4, kv_rows_read=50, elt=4)["total"]
             for layer, k in zip(layers, [0, 2, 5]))
    assert fl["bytes_per_layer"] == pytest.approx(nb / 3)
    assert fl["bytes_floor_ms"] == pytest.approx(nb / 3 / 1e9 * 1e3)
    assert fl["floor_ms"] == max(fl["bytes_floor_ms"], fl["flops_floor_ms"])


def test_random_parents_shape():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 9, 17, 33, 65):
        parent = vst.random_parents(n, vst.MAX_DEPTH, g)
        assert len(parent) == n and parent[0] == -1
        assert all(0 <= p < i for i, p in enumerate(parent) if i)
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parent[i]] + 1
        assert max(depth) == min(n - 1, vst.MAX_DEPTH)


def test_tree_batch_matches_chains(tiny):
    """Every node of the benchmark's tree batch computes what a causal chain over its path computes
    (fp32, CPU): positions, ancestor bits, write slots and block tables are consistent."""
    cfg, model = tiny
    L, n, B = 21, 9, 2
    pool = vst.make_pool(cfg, 3, B, L + n, 8, 64, torch.float32, "cpu", seed=5)
    fb, shape = vst.make_batch(pool, cfg, B, L, n, torch.Generator().manual_seed(1))
    assert shape["tokens"] == B * n and fb.tree_bits.shape == (B * n, 1)
    assert not torch.equal(pool.block_table[0, :4], torch.arange(4, dtype=torch.int32))  # interleaved pages
    with torch.no_grad():
        tree_h, _ = model(fb, pool.kv)
        assert torch.isfinite(tree_h).all()
        anc = unpack_mask_bits(fb.tree_bits, n)
        for s in range(B):
            for i in (0, n - 1, 4):
                path = anc[s * n + i].nonzero().flatten()  # ancestors in index order = root .. node
                d = path.numel()
                assert int(fb.positions[s * n + i]) == L + d - 1
                logical = L + torch.arange(d)
                chain = ForwardBatch(
                    tokens=fb.tokens[s * n + path], positions=logical,
                    write_slots=pool.slots(torch.tensor([s]), logical[None])[0],
                    cu_q=torch.tensor([0, d], dtype=torch.int32), prefix_lens=torch.tensor([L], dtype=torch.int32),
                    block_table=pool.block_table[s : s + 1], page_size=pool.page_size, tree_bits=None)
                chain_h, _ = model(chain, pool.kv)
                torch.testing.assert_close(tree_h[s * n + i], chain_h[-1], rtol=1e-5, atol=1e-5)

