"""The training forwards compute exactly what the serving stack computes (fp64, CPU).

- `training.kimi_forward.causal_forward` (non-absorbed MLA, dense experts fake-quantized to INT4)
  against the serving model's prefill over the paged latent cache, loaded from the exported checkpoint;
- `training.dflash_forward.drafter_blocks` (many masked blocks per sequence) against
  `Drafter.draft_logq` (one block per request over the context cache);
- the export writes the real layout: `load_target` reads it and every routed expert is INT4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter_service.api import DraftRequest
from drafter_service.config import DFlashConfig
from drafter_service.drafter import Drafter
from drafter_service.model import DFlashDrafter
from kernels.int4_pack import dequantize_int4, pack_int4, quantize_int4
from training.dflash_forward import drafter_blocks, sample_starts
from training.export import load_target_dense, write_target
from training.kimi_forward import causal_forward, fake_quant_int4
from training.mini_config import drafter_config, target_config
from training.train_target import TOY_OVERRIDES, build_model, init_weights
from verifier_service.checkpoint import load_target
from verifier_service.forward_batch import ForwardBatch
from verifier_service.kv_cache import KVPool

TAPS = (0, 2)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A toy kimi-mini target with bf16-representable weights, exported and loaded back (fp64)."""
    config = target_config()
    config["text_config"].update(TOY_OVERRIDES)
    model, _ = build_model(config, "cpu")
    init_weights(model, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # so the bf16 export is lossless
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(4, generator=g))
    folder = tmp_path_factory.mktemp("mini") / "target"
    write_target(model, folder, config, max_shard_bytes=300_000)
    return model.double(), folder


def serving_prefill(target, tokens: list[int], taps=TAPS):
    """The engine's prefill forward (one session, causal chain over the paged cache) -> logits, taps."""
    c = target.cfg
    kv = KVPool(c.num_hidden_layers, c.kv_row_dim, 16, 8, 2, 128, torch.float64, "cpu")
    row = kv.open()
    kv.ensure(row, len(tokens))
    pos = torch.arange(len(tokens))
    fb = ForwardBatch(tokens=torch.tensor(tokens), positions=pos,
                      write_slots=kv.slots(torch.tensor([row]), pos[None])[0],
                      cu_q=torch.tensor([0, len(tokens)], dtype=torch.int32),
                      prefix_lens=torch.zeros(1, dtype=torch.int32), block_table=kv.block_table[row : row + 1],
                      page_size=kv.page_size, tree_bits=None)
    hidden, tap = target(fb, kv.kv, taps)
    return target.logits(hidden), tap


def test_fake_quant_is_the_checkpoint_rule():
    w = torch.randn(3, 24, 64, generator=torch.Generator().manual_seed(0))
    fq = fake_quant_int4(w.requires_grad_(), 32)
    for e in range(3):
        q, scale = quantize_int4(w[e].detach(), 32)
        assert torch.equal(fq[e].detach(), dequantize_int4(pack_int4(q), scale))
    fq.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))  # straight-through


def test_export_layout_is_int4(toy):
    _, folder = toy
    target = load_target(folder, torch.float64)
    assert target.cfg.tensor_prefix == "language_model." and target.cfg.quant.group_size == 32
    moe = [layer.mlp for layer in target.model.layers[1:]]
    assert moe and all(m.quantized for m in moe)
    assert all(m.w13_packed.dtype == torch.int32 and int(m.w13_packed.abs().sum()) > 0 for m in moe)


def test_causal_forward_matches_serving_prefill(toy):
    model, folder = toy
    target = load_target(folder, torch.float64)
    gen = torch.Generator().manual_seed(5)
    seqs = torch.randint(0, 4000, (2, 37), generator=gen)
    hidden, tap, routes = causal_forward(model, seqs, TAPS, qat=True)
    logits = model.lm_head(hidden)
    for b in range(2):
        ref_logits, ref_tap = serving_prefill(target, seqs[b].tolist())
        err = (logits[b] - ref_logits).abs().max().item()
        assert err < 1e-9 * ref_logits.abs().max().item(), f"sequence {b}: logits differ by {err}"
        assert (tap[b] - ref_tap).abs().max().item() < 1e-9 * ref_tap.abs().max().item()
    # without fake quantization the function is measurably different: the comparison has teeth
    dense_logits = model.lm_head(causal_forward(model, seqs, qat=False)[0])
    assert (dense_logits - logits).abs().max().item() > 1e-4
    assert set(routes) == {1, 2} and routes[1].shape == (2 * 37, 2)
    # and the dequantized dense reload computes the same function
    dense = load_target_dense(folder, torch.float64)
    assert (dense.lm_head(causal_forward(dense, seqs)[0]) - logits).abs().max().item() < 1e-9


def test_causal_forward_trains_every_part(toy):
    model, _ = toy
    model.zero_grad()
    seqs = torch.randint(0, 4000, (2, 17), generator=torch.Generator().manual_seed(6))
    hidden, _, _ = causal_forward(model, seqs, qat=True)
    model.lm_head(hidden).logsumexp(-1).mean().backward()
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.w13", "model.layers.2.mlp.w2",
                 "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.q_a_proj.weight",
                 "model.layers.2.mlp.shared_experts.down_proj.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    model.zero_grad()


@torch.no_grad()
def test_drafter_blocks_match_serving_draft(toy):
    model, _ = toy
    dcfg_dict = drafter_config(block_size=4)
    dcfg_dict.update({"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "head_dim": 16, "num_target_layers": 3})
    dcfg_dict["dflash_config"]["target_layer_ids"] = list(TAPS)
    dcfg = DFlashConfig.from_dict(dcfg_dict)
    torch.manual_seed(7)
    dr = DFlashDrafter(dcfg, 64).double()
    with torch.no_grad():
        for p in dr.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    S = 30
    seqs = torch.randint(0, 4000, (2, S), generator=torch.Generator().manual_seed(8))
    _, taps, _ = causal_forward(model, seqs, TAPS, qat=True)
    starts = sample_starts(2, 5, S, 4, torch.Generator().manual_seed(9), "cpu")
    out = drafter_blocks(dr, model.model.embed_tokens.weight, taps, seqs, starts)  # [2, 5, 4, D]
    logq = torch.log_softmax(model.lm_head(out[:, :, 1:]), -1)
    serving = Drafter(dr, model.model.embed_tokens.weight, model.lm_head.weight, max_sessions=4, window=64)
    checked = 0
    for b in range(2):
        for k, st in enumerate(starts[b].tolist()):
            sid = f"s{b}-{k}"
            req = DraftRequest(sid, 0, taps[b, :st].detach(), int(seqs[b, st]), st, 4, 2)
            serving.add_context(sid, 0, req.ctx_features)
            ref = serving.draft_logq([req])[0]
            assert np.allclose(logq[b, k].numpy(), ref.double().numpy(), atol=1e-5), (b, k)
            serving.release(sid)
            checked += 1
    assert checked == 10
    # a block must not see context at or after its start: perturbing later taps changes nothing
    taps2 = taps.clone()
    taps2[:, starts[0, 0] :] += 1.0
    out2 = drafter_blocks(dr, model.model.embed_tokens.weight, taps2, seqs, starts)
    assert torch.allclose(out2[0, 0], out[0, 0]) and not torch.allclose(out2[0, 1], out[0, 1])
