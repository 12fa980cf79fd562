"""Multi-head latent attention (DeepSeek-V3 / Kimi K2), absorbed form over the latent cache.

q = q_b(rmsnorm(q_a(x))) -> [T, H, nope + rope];  kv_a_proj_with_mqa(x) -> [c_kv (Dl) | k_pe (Dr)].
The cache keeps only rmsnorm(c_kv) and rope(k_pe) per token per layer. W_UK (from kv_b_proj) is
folded into the query, W_UV is applied to the attention output in latent space (DESIGN 2.1).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.mla_attention import mla_attention
from kernels.rmsnorm import RMSNorm
from kernels.rope import Rope
from verifier_service.config import KimiConfig
from verifier_service.forward_batch import ForwardBatch


class MLAAttention(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        H, D = cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_row_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, D, bias=False)

    # The head-batched products and the attention are attributes, so that a transform
    # (verifier_service.batch_invariant) can swap their kernels without touching the math here.
    attention = staticmethod(mla_attention)

    @staticmethod
    def absorb_uk(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        return torch.einsum("thn,hnl->thl", q_nope, w_uk)  # [T, H, nope] x [H, nope, Dl] -> [T, H, Dl]

    @staticmethod
    def apply_uv(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        return torch.einsum("thl,hvl->thv", o_lat, w_uv)  # [T, H, Dl] x [H, v, Dl] -> [T, H, v]

    def project_a(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The two projections of the layer input: (q_a [T, q_lora] or None without q_lora, kv_a [T, Dl + Dr])."""
        q_a = self.q_a_proj(x) if self.cfg.q_lora_rank else None
        return q_a, self.kv_a_proj_with_mqa(x)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]  # [H, nope, Dl], [H, v, Dl]

    def forward(self, x: torch.Tensor, fb: ForwardBatch, rope: Rope, kv_layer: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, D]; kv_layer [num_slots, Dl + Dr] (written in place at fb.write_slots) -> [T, D]. cos_sin:
        `rope.cos_sin(fb.positions)`, computed once per forward by the caller (None: here)."""
        c = self.cfg
        T = x.shape[0]
        q_a, kv = self.project_a(x)  # kv: [T, Dl + Dr]
        q = self.q_b_proj(self.q_a_layernorm(q_a)) if c.q_lora_rank else self.q_proj(x)
        q = q.view(T, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        if cos_sin is None:
            cos_sin = rope.cos_sin(fb.positions)
        q_pe = rope.apply(q_pe, fb.positions, cos_sin)

        c_kv = self.kv_a_layernorm(kv[:, : c.kv_lora_rank])
        k_pe = rope.apply(kv[:, None, c.kv_lora_rank :], fb.positions, cos_sin)[:, 0]
        kv_layer[fb.write_slots] = torch.cat((c_kv, k_pe), dim=-1).to(kv_layer.dtype)

        w_uk, w_uv = self._w_uk_uv()
        q_lat = self.absorb_uk(q_nope, w_uk)  # absorb W_UK: [T, H, Dl]
        o_lat = self.attention(q_lat, q_pe.contiguous(), kv_layer, fb.block_table, fb.page_size, fb.cu_q,
                               fb.prefix_lens, fb.tree_bits, c.softmax_scale)
        o = self.apply_uv(o_lat, w_uv)  # apply W_UV: [T, H, v]
        return self.o_proj(o.reshape(T, -1))
