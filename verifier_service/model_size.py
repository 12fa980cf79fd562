"""Parameter counts, bytes and per-rank GPU memory of a target, from its config alone (`ddtree inspect`).

Everything is summed over `checkpoint_layout.target_layout`, the same list the loader checks, so the
numbers are those of the real files (bf16 weights, INT4 experts with their bf16 scales and int32
weight_shape, the fp32 router bias):
- total_params: logical parameters (an INT4 projection counts out*in, not its packed words).
- active_params: per token: everything except the routed experts, plus num_experts_per_tok of them
  per MoE layer (embeddings and lm_head included, the convention behind DeepSeek-V3's "37B
  activated" and Kimi K2's "32B activated").
- bytes by category: int4_experts (packed + scales + shapes), bf16_experts (bf16 checkpoints),
  embeddings (embed_tokens + lm_head), bf16_rest (attention, norms, dense and shared MLPs, routers).
- kv_bytes_per_token: layers x (kv_lora_rank + qk_rope_head_dim) x 2 (the bf16 latent cache).
- per rank with expert parallelism over N GPUs: the routed experts of the largest rank's range plus
  a full replica of everything else (attention/dense parts are replicated here; tensor-parallel
  attention would divide them further), plus the KV cache of `kv_tokens` tokens.
"""

from __future__ import annotations

from verifier_service.checkpoint_layout import target_layout
from verifier_service.config import KimiConfig
from verifier_service.expert_parallel import max_local_experts

CATEGORIES = ("int4_experts", "bf16_experts", "embeddings", "bf16_rest")


def kv_bytes_per_token(cfg: KimiConfig, dtype_bytes: int = 2) -> int:
    return cfg.num_hidden_layers * cfg.kv_row_dim * dtype_bytes


def size_report(cfg: KimiConfig, ep_size: int = 1, kv_tokens: int = 0) -> dict:
    layout = target_layout(cfg)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    total = sum(t.params for t in layout)
    expert_params = sum(t.params for t in layout if t.expert is not None)
    active = total - expert_params + expert_params * k // E
    by_cat = dict.fromkeys(CATEGORIES, 0)
    for t in layout:
        by_cat[t.category] += t.nbytes
    expert_bytes = by_cat["int4_experts"] + by_cat["bf16_experts"]
    rest = sum(by_cat.values()) - expert_bytes
    local = max_local_experts(E, ep_size) if ep_size > 1 else E
    weights = rest + expert_bytes * local // E
    kv = kv_bytes_per_token(cfg)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return {
        "total_params": total,
        "active_params": active,
        "routed_expert_params": expert_params,
        "bytes": {**by_cat, "total": sum(by_cat.values())},
        "bytes_per_expert": expert_bytes // max(E * moe_layers, 1),
        "kv_bytes_per_token": kv,
        "per_rank": {"ep_size": ep_size, "experts_per_rank": local, "weight_bytes": weights,
                     "kv_tokens": kv_tokens, "kv_bytes": kv * kv_tokens, "total_bytes": weights + kv * kv_tokens},
    }


def config_summary(cfg: KimiConfig) -> dict:
    """The parsed config fields that matter for serving."""
    layout = "kimi_k25 (text_config, language_model. prefix)" if cfg.tensor_prefix else (
        "deepseek_v3 / kimi_k2 (top level, no prefix)")
    q = cfg.quant
    return {
        "layout": layout, "model_type": cfg.raw.get("model_type"), "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "dense_layers": [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)],
        "num_attention_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "quantization": None if q is None else {"format": q.format, "num_bits": q.num_bits,
                                                 "group_size": q.group_size, "ignore": list(q.ignore)},
    }
