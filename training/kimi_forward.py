"""Differentiable causal forward over `verifier_service.model.KimiForCausalLM`'s own modules (training only).

The serving forward works on a flat batch with a paged latent cache and the *absorbed* MLA form; for
training we run the same parameters in the textbook form on a dense [B, S] batch:
  q = q_b(rmsnorm(q_a(x))) -> [nope | rope];  [c_kv | k_pe] = kv_a_proj_with_mqa(x);
  [k_nope | v] = kv_b(rmsnorm(c_kv));  k = [k_nope | rope(k_pe) shared by heads]; causal softmax
  attention with the model's softmax scale (DESIGN 2.1). Same math as W_UK/W_UV absorption.
The MoE uses the model's router (fp32, noaux_tc) and `kernels.int4_moe.moe_dense_ref` over the
dense expert weights `w13`/`w2`, optionally fake-quantized to INT4 g32 with a straight-through
estimator (`fake_quant_int4`, bit-identical to `kernels.int4_pack.quantize_int4` + dequant), so a
QAT finetune trains exactly the function the exported checkpoint computes.
`tests/unit/test_training_forward.py` checks this forward against the engine's prefill logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.int4_moe import moe_dense_ref
from verifier_service.model import KimiForCausalLM
from verifier_service.moe import MoE


def fake_quant_int4(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """[..., out, in] -> dequant(quant(w)) with the checkpoint's rule; gradient passes straight through."""
    shape = w.shape
    g = w.float().reshape(*shape[:-1], shape[-1] // group, group)
    scale = (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-8).to(torch.bfloat16).float()
    wq = (torch.round(g / scale).clamp(-8, 7) * scale).reshape(shape).to(w.dtype)
    return w + (wq - w).detach()


def mla_causal(attn, x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
    """x [B, S, D], positions [B, S] -> attention output [B, S, D] (non-absorbed MLA, causal)."""
    c = attn.cfg
    B, S, _ = x.shape
    H, nope, dr, dv, dl = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                           c.kv_lora_rank)
    pos = positions.reshape(-1)
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))) if c.q_lora_rank else attn.q_proj(x)
    q = q.view(B, S, H, nope + dr)
    q_pe = rope.apply(q[..., nope:].reshape(B * S, H, dr), pos).view(B, S, H, dr)
    kv = attn.kv_a_proj_with_mqa(x)
    k_pe = rope.apply(kv[..., dl:].reshape(B * S, 1, dr), pos).view(B, S, 1, dr)
    kvb = attn.kv_b_proj(attn.kv_a_layernorm(kv[..., :dl])).view(B, S, H, nope + dv)
    q = torch.cat((q[..., :nope], q_pe), -1)
    k = torch.cat((kvb[..., :nope], k_pe.expand(B, S, H, dr).to(kvb.dtype)), -1)
    v = kvb[..., nope:]
    if dv < nope + dr:  # SDPA kernels want one head dim: pad V, slice the output
        v = F.pad(v, (0, nope + dr - dv))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                       is_causal=True, scale=c.softmax_scale)
    return attn.o_proj(o[..., :dv].transpose(1, 2).reshape(B, S, H * dv))


def moe_train(moe: MoE, x: torch.Tensor, qat: bool, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (y [T, D], topk_ids [T, k]); routing in fp32 outside autocast, like the server."""
    with torch.autocast(x.device.type, enabled=False):
        ids, w = moe.gate(x.to(torch.promote_types(x.dtype, torch.float32)))
    if moe.quantized:  # an exported checkpoint loaded for evaluation: the serving MoE itself
        return moe(x), ids
    w13, w2 = (fake_quant_int4(moe.w13, group), fake_quant_int4(moe.w2, group)) if qat else (moe.w13, moe.w2)
    y = moe_dense_ref(x, ids, w, w13, w2).to(x.dtype)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x)
    return y, ids


def causal_forward(model: KimiForCausalLM, tokens: torch.Tensor, tap_layers: tuple[int, ...] = (),
                   qat: bool = False, positions: torch.Tensor | None = None):
    """tokens [B, S] -> (hidden [B, S, D] after the final norm, taps [B, S, len(tap_layers) * D],
    routed expert ids per MoE layer {layer: [B*S, k]})."""
    B, S = tokens.shape
    if positions is None:
        positions = torch.arange(S, device=tokens.device).expand(B, S)
    h = model.model.embed_tokens(tokens)
    taps, routes = {}, {}
    group = model.cfg.quant.group_size if model.cfg.quant else 32
    for i, layer in enumerate(model.model.layers):
        h = h + mla_causal(layer.self_attn, layer.input_layernorm(h), positions, model.rope)
        x = layer.post_attention_layernorm(h)
        if isinstance(layer.mlp, MoE):
            y, routes[i] = moe_train(layer.mlp, x.reshape(B * S, -1), qat, group)
            h = h + y.view(B, S, -1)
        else:
            h = h + layer.mlp(x)
        if i in tap_layers:
            taps[i] = h
    tap = torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else h[..., :0]
    return model.model.norm(h), tap, routes


def lm_logits(model: KimiForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(hidden)


@torch.no_grad()
def update_router_bias(model: KimiForCausalLM, routes: dict[int, torch.Tensor], rate: float) -> None:
    """DeepSeek-V3 auxiliary-loss-free balancing: bias_e += rate * sign(mean load - load_e)."""
    for i, ids in routes.items():
        gate = model.model.layers[i].mlp.gate
        load = torch.bincount(ids.reshape(-1), minlength=gate.e_score_correction_bias.numel()).float()
        gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
