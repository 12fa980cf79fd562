"""Kimi K2.x / DeepSeek-V3 text model (the DDTree target), as a pure nn.Module.

Parameter names mirror the Hugging Face checkpoint (`model.layers.{i}.self_attn.q_a_proj.weight`,
...), except that routed experts are stacked per layer (see `moe.py`); `checkpoint.py` maps names.
One forward serves prefill and tree verify (`ForwardBatch`); it writes the new tokens' latent KV
into the cache and returns the final hidden states plus the "taps": the residual stream after each
layer in `tap_layers` (the drafter's target_layer_ids), concatenated per token.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.rmsnorm import RMSNorm
from kernels.rope import Rope
from verifier_service.config import KimiConfig
from verifier_service.forward_batch import ForwardBatch
from verifier_service.mla import MLAAttention
from verifier_service.moe import MLP, MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(i):
            self.mlp = MoE(cfg, quantized=cfg.quant is not None)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, fb, rope, kv_layer, cos_sin=None):
        h = h + self.self_attn(self.input_layernorm(h), fb, rope, kv_layer, cos_sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class KimiTextModel(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiForCausalLM(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        self.model = KimiTextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.build_rope()

    def build_rope(self) -> None:
        c = self.cfg
        self.rope = Rope.build(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, rule="deepseek", interleaved=True)
        self.rope = Rope(self.rope.inv_freq.to(self.lm_head.weight.device), self.rope.amplitude, True)

    def forward(self, fb: ForwardBatch, kv: torch.Tensor, tap_layers: tuple[int, ...] = ()):
        """kv [layers, num_slots, Dl + Dr] (updated in place) -> (hidden [T, D] after the final norm,
        taps [T, len(tap_layers) * D] in tap_layers order)."""
        h = self.model.embed_tokens(fb.tokens)
        taps: dict[int, torch.Tensor] = {}
        cos_sin = self.rope.cos_sin(fb.positions)  # once for every layer's q_pe and k_pe
        for i, layer in enumerate(self.model.layers):
            h = layer(h, fb, self.rope, kv[i], cos_sin)
            if i in tap_layers:
                taps[i] = h
        tap = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else h[:, :0]
        return self.model.norm(h), tap

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, D] -> fp32 (or fp64) logits [T, V]."""
        acc = torch.promote_types(hidden.dtype, torch.float32)
        return (hidden @ self.lm_head.weight.T).to(acc)
