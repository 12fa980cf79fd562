"""DFlash block-diffusion drafter (z-lab DFlash), as a pure nn.Module (DESIGN 2.2).

Qwen3-style layers (pre-RMSNorm, GQA with per-head q_norm/k_norm, neox rope, SwiGLU) plus `fc`,
`hidden_norm` and a final `norm`. No embedding and no lm_head: the caller passes the target's
`embed_tokens` output in and applies the target's `lm_head` to `norm(out)`.
Context ("KV injection"): ctx = hidden_norm(fc(concat(taps))); per layer K = rope(k_norm(k_proj(ctx))),
V = v_proj(ctx) (no input_layernorm on ctx). The block's queries attend bidirectionally to
[context window ; block].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafter_service.config import DFlashConfig
from kernels.draft_attention import draft_attention
from kernels.rmsnorm import RMSNorm
from kernels.rope import Rope


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        H, KV, hd, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(D, H * hd, bias=False)
        self.k_proj = nn.Linear(D, KV * hd, bias=False)
        self.v_proj = nn.Linear(D, KV * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
           cos_sin=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> K, V [N, KV, hd] (K normed and rotated; cos_sin: `rope.cos_sin(positions)` if known)."""
        c = self.cfg
        k = self.k_norm(self.k_proj(x).view(-1, c.num_key_value_heads, c.head_dim))
        return rope.apply(k, positions, cos_sin), self.v_proj(x).view(-1, c.num_key_value_heads, c.head_dim)

    def forward(self, x, positions, rope, cos_sin, cache_k, cache_v, rows, ctx_len):
        """x [R, B, D] block; cos_sin: `rope.cos_sin` of the flattened positions; cache_k/cache_v [S, W, KV, hd]
        this layer's context ring cache, request r's rows in cache row rows[r] (ring slot w valid iff
        w < ctx_len[r])."""
        c = self.cfg
        R, B, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(R * B, c.num_attention_heads, c.head_dim))
        q = rope.apply(q, positions.reshape(-1), cos_sin).view(R, B, c.num_attention_heads, c.head_dim)
        k_blk, v_blk = self.kv(x.reshape(R * B, -1), positions.reshape(-1), rope, cos_sin)
        # GQA without copying K/V per query head: the `groups` heads that share KV head j (heads j * groups + g)
        # become groups * B query rows of one attention over KV head j (a row's result only depends on its own
        # query and the keys; the mask is per key). Repeating K/V to H heads copied W+B rows per head and layer.
        KV, groups = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads
        qg = q.view(R, B, KV, groups, c.head_dim).permute(0, 2, 3, 1, 4).reshape(R, KV, groups * B, c.head_dim)
        o = draft_attention(qg, cache_k, cache_v, rows, ctx_len, k_blk.view(R, B, KV, c.head_dim),
                            v_blk.view(R, B, KV, c.head_dim))  # [R, KV, groups * B, hd]
        return self.o_proj(o.view(R, KV, groups, B, c.head_dim).permute(0, 3, 1, 2, 4).reshape(R, B, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        D = cfg.hidden_size
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(D, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(D, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, D, bias=False)

    def forward(self, x, positions, rope, cos_sin, cache_k, cache_v, rows, ctx_len):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, cos_sin, cache_k, cache_v, rows, ctx_len)
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, target_hidden_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * (target_hidden_size or D), D, bias=False)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.rope = Rope.build(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, rule="hf", interleaved=False)

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [N, num_taps * D_target] of committed tokens -> context rows [N, D] (what `context_kv_from` takes;
        `drafter_service.context_projection` runs the same modules on the verifier's side)."""
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [N, num_taps * D_target] of committed tokens -> per layer (K, V) [N, KV, hd]."""
        return self.context_kv_from(self.project(taps), positions)

    def context_kv_from(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Projected context rows [N, D] (`project`) at absolute positions [N] -> per layer (K, V) [N, KV, hd]."""
        cs = self.rope.cos_sin(positions)  # once for every layer's keys
        return [layer.self_attn.kv(ctx, positions, self.rope, cs) for layer in self.layers]

    def forward(self, block_embeds, positions, cache_k, cache_v, rows, ctx_len):
        """block_embeds [R, B, D] (target embeddings of [root, MASK...]); cache_k/cache_v: the context ring cache
        [layers, S, W, KV, hd], request r's in cache row rows[r] with ctx_len[r] valid ring slots -> normed hidden
        [R, B, D] (apply the target lm_head)."""
        x = block_embeds
        cs = self.rope.cos_sin(positions.reshape(-1))  # once for every layer's queries and keys
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rope, cs, cache_k[i], cache_v[i], rows, ctx_len)
        return self.norm(x)
