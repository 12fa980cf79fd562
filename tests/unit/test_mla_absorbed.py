"""The absorbed MLA over the latent cache equals textbook (non-absorbed) multi-head attention.

The reference below expands K and V per head from the latent with kv_b_proj (as the HF DeepseekV3
module does), uses HF's de-interleaved rope layout, and runs plain causal softmax attention.
"""

from __future__ import annotations

import math

import torch

from kernels.rope import Rope
from verifier_service.config import KimiConfig
from verifier_service.forward_batch import ForwardBatch
from verifier_service.kv_cache import KVPool
from verifier_service.mla import MLAAttention
from verifier_service.presets import TINY_TEXT


def hf_style_rope(x, positions, rope: Rope):
    """HF DeepseekV3 `apply_rotary_pos_emb_interleave`: de-interleave, then rotate_half with cat(freqs, freqs)."""
    d = x.shape[-1]
    x = x.view(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(*x.shape[:-1], d)
    ang = positions.float()[:, None] * rope.inv_freq.float()[None]  # fp32 angles, as HF computes them
    cos = torch.cat((ang.cos(), ang.cos()), -1).double() * rope.amplitude
    sin = torch.cat((ang.sin(), ang.sin()), -1).double() * rope.amplitude
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d,)
    rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)
    return x * cos.view(shape) + rot * sin.view(shape)


def naive_mla(attn: MLAAttention, x, positions, rope):
    c = attn.cfg
    T, H = x.shape[0], c.num_attention_heads
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(T, H, c.qk_head_dim)
    q_nope, q_pe = q[..., : c.qk_nope_head_dim], hf_style_rope(q[..., c.qk_nope_head_dim:], positions, rope)
    kv = attn.kv_a_proj_with_mqa(x)
    c_kv = attn.kv_a_layernorm(kv[:, : c.kv_lora_rank])
    k_pe = hf_style_rope(kv[:, None, c.kv_lora_rank:], positions, rope).expand(T, H, c.qk_rope_head_dim)
    kvb = attn.kv_b_proj(c_kv).view(T, H, c.qk_nope_head_dim + c.v_head_dim)
    k = torch.cat((kvb[..., : c.qk_nope_head_dim], k_pe), -1)
    v = kvb[..., c.qk_nope_head_dim:]
    qf = torch.cat((q_nope, q_pe), -1)
    scores = torch.einsum("thd,shd->hts", qf, k) * c.softmax_scale
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
    return attn.o_proj(o.reshape(T, -1))


def test_absorbed_equals_naive_with_yarn_scale():
    cfg = KimiConfig.from_dict(TINY_TEXT)
    assert abs(cfg.softmax_scale - cfg.qk_head_dim ** -0.5 * (0.1 * math.log(64.0) + 1) ** 2) < 1e-12
    torch.manual_seed(0)
    attn = MLAAttention(cfg).double()
    for p in attn.parameters():
        p.data.normal_(0, 0.3)
    rope = Rope.build(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, "deepseek", True)
    T = 11
    x = torch.randn(T, cfg.hidden_size, dtype=torch.float64)
    positions = torch.arange(T) + 3000  # large positions exercise the YaRN frequencies
    pool = KVPool(1, cfg.kv_row_dim, num_pages=8, page_size=4, max_sessions=2, max_session_len=32,
                  dtype=torch.float64, device="cpu")
    pool.kv.fill_(float("nan"))  # stray reads of unwritten rows would poison the output
    row = pool.open()
    pool.ensure(row, T)
    fb = ForwardBatch(tokens=torch.zeros(T, dtype=torch.int64), positions=positions,
                      write_slots=pool.slots(torch.tensor([row]), torch.arange(T)[None])[0],
                      cu_q=torch.tensor([0, T], dtype=torch.int32), prefix_lens=torch.zeros(1, dtype=torch.int32),
                      block_table=pool.block_table[row:row + 1], page_size=4, tree_bits=None)
    got = attn(x, fb, rope, pool.kv[0])
    ref = naive_mla(attn, x, positions, rope)
    assert torch.allclose(got, ref, rtol=1e-10, atol=1e-10), (got - ref).abs().max()
